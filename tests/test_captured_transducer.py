"""A transducer search with its networks captured (``cuda_graphs`` auto): the joint's runs replayed
per lane count (``FixedShapeGraphs``), the stateful prediction network's and the LM's dense steps
replayed (``DenseStepGraphs``). On the CPU the same buffers run plainly; the n-best is the plain
search's. On CUDA the graphs are captured and the n-best is the CPU's."""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.scorers.onnx_decoder import RecurrentLmScorer
from gpudecode.scorers.transducer import JointNetwork, StatefulPredictionNetwork
from gpudecode.search import TransducerOptions, transducer_search
from gpudecode.session import SessionOptions
from gpudecode.session.graphs import GraphOptions
from gpudecode.states.options import StateManagerOptions
from gpudecode.testing import build_lstm_lm
from tests.test_transducer_search import BLANK, make_models, random_encoder_states

_AUTO = GraphOptions(enabled=True, auto=True)


def _search(device, graphs, xp=np, max_symbols=2):
    models = make_models(12, 8, sharpness=3.0)
    options = SessionOptions(device=device, use_tf32=False)
    kind = f"lstm-{device}"
    dense = True if device == "cpu" and graphs.enabled else None
    prediction = StatefulPredictionNetwork(model=models.prediction_ref.serialized(), blank=BLANK, session_options=options,
                                           state_manager=StateManagerOptions(type=kind, dense_recurrent=dense),
                                           graphs=graphs)
    joint = JointNetwork(model=models.joint_ref.serialized(), session_options=options, graphs=graphs)
    reference = build_lstm_lm(12, vocab_size=8)
    lm = RecurrentLmScorer(model=reference.serialized(), vocab_size=8, start_labels=[0], session_options=options,
                           state_manager=StateManagerOptions(type=kind, dense_recurrent=dense), graphs=graphs)
    states = random_encoder_states(12, 3, 10)
    results = transducer_search(xp.asarray(states), np.array([10, 6, 2]), prediction, joint,
                                TransducerOptions(beam_size=5, max_symbols_per_frame=max_symbols, sentence_end=1),
                                [("lm", lm, 0.4)], xp=xp)
    nbest = [[(tuple(h.labels), tuple(h.frames), h.score) for h in n] for n in results]
    return nbest, joint, prediction, lm


@pytest.mark.parametrize("max_symbols", [1, 2])
def test_the_joint_on_bound_buffers_gives_the_plain_nbest(max_symbols):
    plain = _search("cpu", GraphOptions(), max_symbols=max_symbols)[0]
    nbest, joint, prediction, lm = _search("cpu", _AUTO, max_symbols=max_symbols)
    assert joint.graphs is not None and prediction.decoder.dense_graphs is not None and lm.dense_graphs is not None
    assert joint.graphs.buffers.nbytes > 0  # the runs went through the bound buffers
    assert nbest == plain


@pytest.mark.gpu
def test_the_captured_transducer_on_cuda_gives_the_cpu_nbest():
    cupy = pytest.importorskip("cupy")
    cpu = _search("cpu", GraphOptions())[0]
    nbest, joint, prediction, lm = _search("cuda", _AUTO, xp=cupy)
    assert joint.graphs.captures >= 1 and prediction.decoder.dense_graphs.captures >= 1 and lm.dense_graphs.captures >= 1
    assert [[h[:2] for h in n] for n in nbest] == [[h[:2] for h in n] for n in cpu]
    assert max(abs(a[2] - b[2]) for n, m in zip(nbest, cpu) for a, b in zip(n, m)) < 1e-4
