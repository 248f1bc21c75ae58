"""Recurrent states kept dense per lane (``gpudecode.states.dense``): the same n-best as the slot
pool for an LSTM LM (CTC, transducer and label-synchronous searches) and a stateful prediction
network. On CUDA the scorers take this path by themselves; on the CPU ``dense_recurrent=True``
switches it on."""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.scorers.onnx_decoder import DenseContext, RecurrentLmScorer
from gpudecode.search import CtcPrefixOptions, TransducerOptions, ctc_prefix_search, transducer_search
from gpudecode.search.label_sync import LabelSyncOptions, label_sync_search
from gpudecode.scorers.base import UtteranceBatch
from gpudecode.session import SessionOptions
from gpudecode.session.graphs import GraphOptions
from gpudecode.states.dense import DenseRecurrentStates, dense_states_apply
from gpudecode.states.options import StateManagerOptions
from gpudecode.scorers.transducer import StatefulPredictionNetwork
from gpudecode.testing import build_lstm_lm
from tests.test_ctc_prefix_kernel import assert_none_in_emulation, needs_gxx
from tests.test_ctc_search import random_log_probs
from tests.test_transducer_search import make_models, random_encoder_states


def _lm(reference, device="cpu", dense=None, **kw):
    return RecurrentLmScorer(model=reference.serialized(), vocab_size=reference.vocab_size, start_labels=[0],
                             state_manager=StateManagerOptions(type=f"lstm-{device}", dense_recurrent=dense),
                             session_options=SessionOptions(device=device, use_tf32=False), **kw)


def _nbest(results):
    return [[(tuple(h.labels), tuple(h.frames or ()), h.score, tuple(sorted(h.scores.items()))) for h in n]
            for n in results]


def _ctc(lm):
    log_probs = random_log_probs(31, 4, 25, 9, sharpness=2.0, blank_bias=1.0)
    return ctc_prefix_search(log_probs, np.array([25, 19, 3, 25]), CtcPrefixOptions(beam_size=6, sentence_end=2),
                             [("lm", lm, 0.5)])


def _children_case(xp, dtype=np.float32, width=3, lanes=4):
    """Dense states of two variables ([2, N, width] and [N, width]) over ``lanes`` lanes, on ``xp``."""
    from gpudecode.spec import StateVariable
    from gpudecode.states.layout import VariableLayout

    stacked = VariableLayout.of(StateVariable(input_name="h", output_name="new-h", dtype=dtype, shape=(2, None, width),
                                              batch_axis=1), dtype)
    flat = VariableLayout.of(StateVariable(input_name="c", output_name="new-c", dtype=dtype, shape=(None, width)), dtype)
    return DenseRecurrentStates([stacked, flat], xp)


def test_children_take_the_new_state_where_a_label_was_fed():
    dense = _children_case(np)
    states = dense.zeros(4)
    assert states["h"].shape == (2, 4, 3) and states["c"].shape == (4, 3) and not states["h"].any()
    states = {"h": np.arange(24, dtype=np.float32).reshape(2, 4, 3), "c": np.arange(12, dtype=np.float32).reshape(4, 3)}
    new = {"h": -states["h"], "c": -states["c"]}
    parents, labels = np.array([2, 2, 0, 3]), np.array([5, -1, 7, -1])
    next_labels = np.array([10, 11, 12, 13])
    children, following = dense.children(states, new, parents, labels, next_labels)
    assert following.tolist() == [5, 12, 7, 13]
    for lane, (p, fed) in enumerate(zip(parents, labels >= 0)):
        source = new if fed else states
        np.testing.assert_array_equal(children["h"][:, lane], source["h"][:, p])
        np.testing.assert_array_equal(children["c"][lane], source["c"][p])
    reset = dense.reset(children, np.array([1, 3]))
    assert not reset["h"][:, [1, 3]].any() and not reset["c"][[1, 3]].any()
    np.testing.assert_array_equal(reset["c"][[0, 2]], children["c"][[0, 2]])
    assert children["c"][1].any()  # reset copied: the children are unchanged


def children_mismatches(cupy) -> list:
    """The children kernel (``kernels/dense_states.cu``) against the numpy version on ``cupy``,
    bit for bit, over dtypes and row widths that take every copy unit (16, 8, 4, 2 and 1 bytes)."""
    bad = []
    rng = np.random.default_rng(5)
    for dtype, width, lanes in [(np.float32, 8, 12), (np.float32, 3, 7), (np.float16, 3, 5), (np.float16, 4, 9),
                                (np.float32, 2, 6), (np.float64, 5, 4), (np.uint8, 3, 6), (np.float32, 64, 33)]:
        host, device = _children_case(np, dtype, width, lanes), _children_case(cupy, dtype, width, lanes)
        states = {"h": rng.standard_normal((2, lanes, width)).astype(dtype),
                  "c": rng.standard_normal((lanes, width)).astype(dtype)}
        new = {k: rng.standard_normal(v.shape).astype(dtype) for k, v in states.items()}
        parents = rng.integers(0, lanes, lanes).astype(np.int64)
        labels = np.where(rng.random(lanes) < 0.5, rng.integers(0, 50, lanes), -1).astype(np.int64)
        next_labels = rng.integers(0, 50, lanes).astype(np.int64)
        expected, expected_next = host.children(states, new, parents, labels, next_labels)
        got, got_next = device.children({k: cupy.asarray(v) for k, v in states.items()},
                                        {k: cupy.asarray(v) for k, v in new.items()}, cupy.asarray(parents),
                                        cupy.asarray(labels), cupy.asarray(next_labels))
        if cupy.asnumpy(got_next).tolist() != expected_next.tolist():
            bad.append((str(np.dtype(dtype)), width, "next labels"))
        for name in states:
            if cupy.asnumpy(got[name]).tobytes() != expected[name].tobytes():
                bad.append((str(np.dtype(dtype)), width, name))
    return bad


@needs_gxx
def test_the_children_kernel_equals_the_numpy_version_in_emulation():
    assert_none_in_emulation("tests.test_dense_states", "children_mismatches")


@pytest.mark.gpu
def test_the_children_kernel_equals_the_numpy_version_on_cuda():
    assert children_mismatches(pytest.importorskip("cupy")) == []


def test_only_an_lstm_manager_on_cuda_keeps_dense_states():
    lm = _lm(build_lstm_lm(3, vocab_size=9))
    assert lm.dense is None  # the CPU: the pool (and its subset runs)
    assert not dense_states_apply(lm.states, lm.spec, graphs=False, max_batch_size=None)


def test_ctc_search_with_dense_lm_states_equals_the_pool():
    reference = build_lstm_lm(7, vocab_size=9)
    pool = _nbest(_ctc(_lm(reference)))
    lm = _lm(reference, dense=True)
    assert lm.dense is not None
    assert _nbest(_ctc(lm)) == pool
    assert isinstance(lm._ctx, DenseContext) and lm.states.statistics().live_slots == 0


@pytest.mark.parametrize("stateless", [False, True])
def test_transducer_search_with_dense_states_equals_the_pool(stateless):
    models = make_models(12, 8, stateless=stateless, sharpness=3.0)
    states = random_encoder_states(12, 3, 10)
    lengths = np.array([10, 6, 2])
    reference = build_lstm_lm(12, vocab_size=8)
    options = TransducerOptions(beam_size=5, max_symbols_per_frame=2, sentence_end=1)

    def search(dense):
        prediction = models.prediction()
        if not stateless:  # the prediction network's own states dense too
            prediction = StatefulPredictionNetwork(
                model=models.prediction_ref.serialized(), blank=0,
                state_manager=StateManagerOptions(type="lstm-cpu", dense_recurrent=dense),
                session_options=SessionOptions(device="cpu", use_tf32=False))
            assert (prediction.decoder.dense is not None) == bool(dense)
        return _nbest(transducer_search(states, lengths, prediction, models.joint(), options,
                                        [("lm", _lm(reference, dense=dense), 0.4)]))

    assert search(True) == search(None)


def test_label_sync_search_with_dense_lm_states_equals_the_pool():
    reference = build_lstm_lm(4, vocab_size=11)
    batch = UtteranceBatch(ids=["a", "b", "c"], input_lengths=np.array([6, 6, 6]))
    options = LabelSyncOptions(beam_size=4, sentence_end=1, max_labels=7, nbest=3)

    def search(dense):
        return _nbest(label_sync_search([("lm", _lm(reference, dense=dense), 1.0)], batch, options))

    assert search(True) == search(None)


def test_dense_recurrent_false_keeps_the_pool():
    lm = _lm(build_lstm_lm(3, vocab_size=9), dense=False)
    assert lm.dense is None


@pytest.mark.gpu
def test_dense_states_on_cuda_equal_the_pool_on_cuda_and_the_cpu():
    cupy = pytest.importorskip("cupy")
    reference = build_lstm_lm(7, vocab_size=9)
    cpu = _nbest(_ctc(_lm(reference)))
    log_probs = random_log_probs(31, 4, 25, 9, sharpness=2.0, blank_bias=1.0)
    options = CtcPrefixOptions(beam_size=6, sentence_end=2)
    dense = _lm(reference, "cuda")
    assert dense.dense is not None
    pool = _lm(reference, "cuda", dense=False)
    assert pool.dense is None
    results = [_nbest(ctc_prefix_search(cupy.asarray(log_probs), np.array([25, 19, 3, 25]), options,
                                        [("lm", lm, 0.5)], xp=cupy)) for lm in (dense, pool)]
    for got in results:
        assert [[h[:2] for h in n] for n in got] == [[h[:2] for h in n] for n in cpu]
        assert max(abs(a[2] - b[2]) for n, m in zip(got, cpu) for a, b in zip(n, m)) < 1e-4


def test_graphs_auto_is_marked_so_that_dense_states_may_take_over():
    from gpudecode.config import CudaGraphsConfig

    auto = CudaGraphsConfig(enabled="auto").to_options(device="cuda")
    assert auto.enabled and auto.auto
    assert not CudaGraphsConfig(enabled=True).to_options(device="cuda").auto
    assert not CudaGraphsConfig(enabled="auto").to_options(True, device="cuda").auto  # a scorer's own switch
    assert not CudaGraphsConfig(enabled="auto").to_options(device="cpu").enabled


@pytest.mark.gpu
def test_on_cuda_graphs_auto_gives_way_to_dense_states_and_explicit_graphs_do_not():
    from gpudecode.session.graphs import GraphOptions

    reference = build_lstm_lm(7, vocab_size=9)
    auto = _lm(reference, "cuda", graphs=GraphOptions(enabled=True, auto=True))
    assert auto.dense is not None and auto.runner.graphs is None and auto.dense_graphs is not None
    explicit = _lm(reference, "cuda", graphs=GraphOptions(enabled=True))
    assert explicit.dense is None and explicit.runner.graphs is not None


_AUTO = GraphOptions(enabled=True, auto=True)


def test_ctc_search_with_captured_dense_steps_equals_the_pool():
    """Graphs "auto": the dense steps run on the two ping-pong input sets (plain runs on the CPU,
    replayed graphs on CUDA); the children are written straight into the other set."""
    reference = build_lstm_lm(7, vocab_size=9)
    pool = _nbest(_ctc(_lm(reference)))
    lm = _lm(reference, dense=True, graphs=_AUTO)
    assert lm.dense is not None and lm.dense_graphs is not None and lm.runner.graphs is None
    assert _nbest(_ctc(lm)) == pool
    placed = lm.dense_graphs._sets[lm._ctx.version[0]]
    assert lm._ctx.version is not None and all(lm._ctx.states[name] is placed[name] for name in lm._ctx.states)


@pytest.mark.parametrize("stateless", [False, True])
def test_transducer_search_with_captured_dense_steps_equals_the_pool(stateless):
    models = make_models(12, 8, stateless=stateless, sharpness=3.0)
    states = random_encoder_states(12, 3, 10)
    lengths = np.array([10, 6, 2])
    reference = build_lstm_lm(12, vocab_size=8)
    options = TransducerOptions(beam_size=5, max_symbols_per_frame=2, sentence_end=1)

    def search(dense, graphs):
        prediction = models.prediction()
        if not stateless:
            prediction = StatefulPredictionNetwork(
                model=models.prediction_ref.serialized(), blank=0,
                state_manager=StateManagerOptions(type="lstm-cpu", dense_recurrent=dense),
                session_options=SessionOptions(device="cpu", use_tf32=False), graphs=graphs)
            assert (prediction.decoder.dense_graphs is not None) == bool(dense)
        return _nbest(transducer_search(states, lengths, prediction, models.joint(), options,
                                        [("lm", _lm(reference, dense=dense, graphs=graphs), 0.4)]))

    assert search(True, _AUTO) == search(None, GraphOptions())


def test_label_sync_search_with_captured_dense_steps_equals_the_pool():
    reference = build_lstm_lm(4, vocab_size=11)
    batch = UtteranceBatch(ids=["a", "b", "c"], input_lengths=np.array([6, 6, 6]))
    options = LabelSyncOptions(beam_size=4, sentence_end=1, max_labels=7, nbest=3)

    def search(**kw):
        return _nbest(label_sync_search([("lm", _lm(reference, **kw), 1.0)], batch, options))

    assert search(dense=True, graphs=_AUTO) == search()


def test_a_dense_context_fed_after_its_buffers_were_written_again_is_refused():
    from gpudecode.scorers.base import LaneLayout
    from gpudecode.session.dense_graphs import StaleDenseStates

    lm = _lm(build_lstm_lm(3, vocab_size=9), dense=True, graphs=_AUTO)
    lm.begin(LaneLayout(num_groups=2, beam_size=2))
    start = lm.initial_context(np.arange(2))
    lm.score(start)
    first = lm.extend(start, np.arange(4), np.array([3, -1, 4, 5]))
    lm.score(first)
    again = lm.extend(start, np.arange(4), np.array([6, 6, 6, 6]))  # a second child of the start: same set
    lm.score(again)
    with pytest.raises(StaleDenseStates, match="written again"):
        lm.score(first)


@pytest.mark.gpu
def test_captured_dense_steps_on_cuda_equal_the_cpu():
    """The dense steps replayed as CUDA graphs (graphs "auto"): the CPU's n-best, graphs captured."""
    cupy = pytest.importorskip("cupy")
    reference = build_lstm_lm(7, vocab_size=9)
    cpu = _nbest(_ctc(_lm(reference)))
    lm = _lm(reference, "cuda", graphs=_AUTO)
    assert lm.dense_graphs is not None and lm.session.cuda_graphs
    log_probs = random_log_probs(31, 4, 25, 9, sharpness=2.0, blank_bias=1.0)
    got = _nbest(ctc_prefix_search(cupy.asarray(log_probs), np.array([25, 19, 3, 25]),
                                   CtcPrefixOptions(beam_size=6, sentence_end=2), [("lm", lm, 0.5)], xp=cupy))
    assert lm.dense_graphs.captures == 2  # one graph per input set
    assert [[h[:2] for h in n] for n in got] == [[h[:2] for h in n] for n in cpu]
    assert max(abs(a[2] - b[2]) for n, m in zip(got, cpu) for a, b in zip(n, m)) < 1e-4
