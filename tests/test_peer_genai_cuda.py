"""Parity with ONNX Runtime GenAI on the GPU: its builder's float16 CUDA export, decoded by both on CUDA.

GenAI's CUDA export differs from its CPU one (``tests/test_peer_genai.py``) in what runs on a GPU:
GroupQueryAttention in float16 and past and present sharing one buffer. The fixture
``tests/fixtures/peers/genai-cuda/`` (``tools/peer-fixtures/genai.py --target cuda``: the same
random-initialised Llama's weights, exported with ``-p fp16 -e cuda``; ``expected.json`` from GenAI's
own CUDA ``Generator``, one prompt per generator) is the oracle; under ``-m peers`` GenAI runs live
on the same GPU and must still give the fixture's sequences.

The toolkit decodes all prompts in one batch (prompts of different lengths), statically and with
continuous batching, with CUDA graphs on and off: greedy and beam-4 sequences must equal GenAI's,
the greedy scores within float16's reach of the sum of GenAI's token log-probabilities.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session import SessionOptions
from gpudecode.session.graphs import GraphOptions
from gpudecode.states.options import StateManagerOptions
from tests.hf_generate import prompt_batch

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "peers" / "genai-cuda"
DOCUMENT = json.loads((FIXTURE / "expected.json").read_text())
PROMPTS: list[list[int]] = DOCUMENT["prompts"]
EOS, MAX_LENGTH = DOCUMENT["eos"], DOCUMENT["max_length"]
#: float16 logits (GenAI's and the toolkit's runs batch rows differently): per-sequence score tolerance
FLOAT16_TOL = 2e-2


def test_fixture_is_the_cuda_float16_form():
    """The export GenAI's builder writes for CUDA: float16 states, past and present in one buffer;
    GenAI's CUDA decodes end with EOS and at the length limit, and its beams differ from greedy."""
    import onnx

    config = json.loads((FIXTURE / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True
    assert "cuda" in config["model"]["decoder"]["session_options"]["provider_options"][0]
    model = onnx.load(str(FIXTURE / "model.onnx"), load_external_data=False)
    pasts = [i for i in model.graph.input if i.name.startswith("past_key_values")]
    assert pasts and all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for i in pasts)
    assert "GroupQueryAttention" in {n.op_type for n in model.graph.node}
    assert DOCUMENT["versions"]["onnxruntime-genai"]
    greedy = DOCUMENT["greedy"]["sequences"]
    assert {len(s) < MAX_LENGTH for s in greedy} == {True, False}
    assert [b[0] for b in DOCUMENT["beam_at_max_length_20"]["sequences"]] != greedy


def prompts_up_to(max_length: int) -> UtteranceBatch:
    """``PROMPTS`` in one batch; each may grow to ``max_length`` (prompt + generated labels)."""
    return prompt_batch(PROMPTS, max_length - np.array([len(p) for p in PROMPTS]))


#: CUDA graphs off, on (the presents sharing their pasts' buffers: GroupQueryAttention appends in
#: place), and on with each present in a buffer of its own
GRAPHS = {"no-graphs": GraphOptions(enabled=False), "graphs": GraphOptions(enabled=True),
          "graphs-unshared": GraphOptions(enabled=True, shared_presents=False)}


def scorer(graphs: str) -> PrefixLmScorer:
    """The GenAI model folder as it is, on CUDA, with the graph options ``GRAPHS[graphs]``."""
    lm = PrefixLmScorer(model=str(FIXTURE), vocab_size=128, scores_kind="logits",
                        state_manager=StateManagerOptions(type="transformer-cuda"),
                        session_options=SessionOptions(device="cuda"), graphs=GRAPHS[graphs])
    assert lm.self_prefill and lm.spec.history_alignment == "left"
    assert lm.runner.shares_presents == (graphs == "graphs")
    return lm


def search(lm: PrefixLmScorer, options: LabelSyncOptions, max_length: int, continuous: int | None):
    import cupy

    return label_sync_search([("genai", lm, 1.0)], prompts_up_to(max_length), options, xp=cupy,
                             max_active_utterances=continuous)


@pytest.mark.gpu
@pytest.mark.parametrize("continuous", [None, 2], ids=["one-batch", "continuous"])
@pytest.mark.parametrize("graphs", list(GRAPHS))
def test_greedy_on_cuda_equals_genai_on_cuda(graphs, continuous):
    expected = DOCUMENT["greedy"]
    options = LabelSyncOptions(beam_size=1, sentence_end=EOS, max_labels_per_input=1.0)
    nbest = search(scorer(graphs), options, MAX_LENGTH, continuous)
    for prompt, hyps, sequence, log_probs in zip(PROMPTS, nbest, expected["sequences"], expected["token_log_probs"]):
        hyp = hyps[0]
        assert [*prompt, *hyp.labels] == sequence  # GenAI's sequences leave out the final EOS
        assert (hyp.length == len(hyp.labels) + 1) == (len(log_probs) > len(hyp.labels))
        assert hyp.score == pytest.approx(sum(log_probs), abs=FLOAT16_TOL)
    assert any(len(s) < MAX_LENGTH for s in expected["sequences"])  # EOS occurs...
    assert any(len(s) == MAX_LENGTH for s in expected["sequences"])  # ...and the length limit too


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["beam", "beam_at_max_length_20"])
@pytest.mark.parametrize("continuous", [None, 2], ids=["one-batch", "continuous"])
@pytest.mark.parametrize("graphs", list(GRAPHS))
def test_beam_search_on_cuda_equals_genai_on_cuda(graphs, continuous, case):
    beam = DOCUMENT[case]
    options = LabelSyncOptions(  # GenAI's search options: genai_config.json's early_stopping, length_penalty
        beam_size=beam["num_beams"], sentence_end=EOS, max_labels_per_input=1.0, max_labels=beam["max_length"],
        finished="separate-genai", early_stopping=True, length_norm_scale=1.0,
        length_counts="prompt-and-labels", nbest=beam["num_beams"])
    nbest = search(scorer(graphs), options, beam["max_length"], continuous)
    for prompt, hyps, sequences in zip(PROMPTS, nbest, beam["sequences"]):
        assert [[*prompt, *h.labels] for h in hyps] == sequences
        assert all(np.isfinite(h.score) for h in hyps)


def live_genai():
    """``tools/peer-fixtures/genai.py`` (its ``generate`` runs GenAI as the fixture was made)."""
    pytest.importorskip("onnxruntime_genai", reason="the peer onnxruntime-genai-cuda is not installed")
    spec = importlib.util.spec_from_file_location("genai_fixture", ROOT / "tools" / "peer-fixtures" / "genai.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.gpu
@pytest.mark.peers
def test_fixture_equals_genai_on_cuda_now():
    """GenAI's CUDA decodes of the export, run now, are the fixture's (greedy tokens and scores, beams)."""
    script = live_genai()
    greedy = [script.generate(FIXTURE, [p], 1, with_scores=True) for p in PROMPTS]
    assert [g[0][0] for g in greedy] == DOCUMENT["greedy"]["sequences"]
    for (_, scores), expected in zip(greedy, DOCUMENT["greedy"]["token_log_probs"]):
        np.testing.assert_allclose(scores[0], expected, atol=1e-6)
    for case in ("beam", "beam_at_max_length_20"):
        beam = DOCUMENT[case]
        live = [script.generate(FIXTURE, [p], beam["num_beams"], with_scores=False, max_length=beam["max_length"])[0]
                for p in PROMPTS]
        assert live == beam["sequences"], case
