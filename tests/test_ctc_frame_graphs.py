"""The scored frames of a CTC prefix search replayed as two alternating CUDA graphs
(``SearchTuning.captured_ctc_frames``, ``gpudecode.search.frame_graphs``): the same n-best lists as
the frames launched one call at a time, bit for bit, for an even and an odd number of replays;
a step that cannot be captured falls back, with a warning, to the launched frames."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from gpudecode.scorers.onnx_decoder import RecurrentLmScorer
from gpudecode.search import CtcPrefixOptions, ctc_prefix_search
from gpudecode.search.frame_graphs import AlternatingGraphs, FrameCaptureFailed, device_arrays, snapshot
from gpudecode.search.stats import SearchStats
from gpudecode.search.tuning import SearchTuning
from gpudecode.session import SessionOptions
from gpudecode.session.graphs import GraphOptions
from gpudecode.states.options import StateManagerOptions
from gpudecode.testing import build_lstm_lm
from tests.test_ctc_search import random_log_probs

_AUTO = GraphOptions(enabled=True, auto=True)


def test_device_arrays_walks_lists_dicts_and_dataclasses_in_order():
    @dataclasses.dataclass
    class Context:
        states: dict
        labels: object
        version: tuple | None = None

    a, b, c, d = (np.full(2, k) for k in range(4))
    tree = ([a, (b, 3)], Context({"y": d, "x": c}, a, (1, 2)), True)
    found = device_arrays(tree, types.SimpleNamespace(ndarray=np.ndarray))
    assert [int(x[0]) for x in found] == [0, 1, 2, 3, 0]


def _lm(reference, cls=RecurrentLmScorer):
    return cls(model=reference.serialized(), vocab_size=reference.vocab_size, start_labels=[0],
               state_manager=StateManagerOptions(type="lstm-cuda"),
               session_options=SessionOptions(device="cuda", use_tf32=False), graphs=_AUTO)


def _nbest(results):
    return [[(tuple(h.labels), tuple(h.frames or ()), h.score, tuple(sorted(h.scores.items()))) for h in n]
            for n in results]


def _search(cupy, lm, num_frames: int, captured: bool, seed: int = 31):
    log_probs = random_log_probs(seed, 4, num_frames, 9, sharpness=2.0, blank_bias=0.5)
    lengths = np.array([num_frames, num_frames - 7, 5, num_frames - 1])
    stats = SearchStats()
    results = ctc_prefix_search(cupy.asarray(log_probs), lengths, CtcPrefixOptions(beam_size=6, sentence_end=2),
                                [("lm", lm, 0.5)], xp=cupy, tuning=SearchTuning(captured_ctc_frames=captured),
                                stats=stats)
    return _nbest(results), stats


@pytest.mark.gpu
@pytest.mark.parametrize("num_frames", [40, 41])
def test_replayed_frames_equal_launched_frames(num_frames):
    cupy = pytest.importorskip("cupy")
    reference = build_lstm_lm(7, vocab_size=9)
    lm = _lm(reference)
    assert lm.capturable
    launched, plain_stats = _search(cupy, lm, num_frames, captured=False)
    replayed, stats = _search(cupy, lm, num_frames, captured=True)
    assert plain_stats.replayed_frames == 0
    assert stats.replayed_frames > 10, "the frames were not replayed (a fallback warns why)"
    assert stats.fused_launches == plain_stats.fused_launches
    assert _first_difference(launched, replayed) is None  # labels, frames and every score, bit for bit
    again, again_stats = _search(cupy, lm, num_frames, captured=True)  # the scorer's buffers reused
    assert again_stats.replayed_frames > 10, "the second search's frames were not replayed"
    assert _first_difference(launched, again) is None


def _first_difference(expected, got):
    """None, or the first utterance whose n-best differs: (index, expected, got), for the message."""
    return next(((u, a, b) for u, (a, b) in enumerate(zip(expected, got)) if a != b),
                None if len(expected) == len(got) else ("count", len(expected), len(got)))


@pytest.mark.gpu
def test_both_graphs_last_give_the_same_lists():
    """Searches whose last replayed frame is graph A and graph B (an odd and an even count)."""
    cupy = pytest.importorskip("cupy")
    lm = _lm(build_lstm_lm(5, vocab_size=9))
    parities = set()
    for num_frames in range(30, 36):
        launched, _ = _search(cupy, lm, num_frames, captured=False, seed=num_frames)
        replayed, stats = _search(cupy, lm, num_frames, captured=True, seed=num_frames)
        assert replayed == launched
        parities.add(stats.replayed_frames % 2)
    assert parities == {0, 1}


def replay_mismatches(cupy) -> list:
    """The n-best lists of replayed frames that differ from launched ones (an LSTM LM, 41 frames;
    also run under compute-sanitizer by ``tests/gpu_sanitize_search.py``)."""
    lm = _lm(build_lstm_lm(7, vocab_size=9))
    launched, _ = _search(cupy, lm, 41, captured=False)
    replayed, stats = _search(cupy, lm, 41, captured=True)
    problems = [] if stats.replayed_frames else ["no frame was replayed"]
    return problems + [(i, a, b) for i, (a, b) in enumerate(zip(launched, replayed)) if a != b]


class _ReadingLm(RecurrentLmScorer):
    """Claims to be capturable but reads its scores back to the host every step."""

    def score(self, ctx):
        scores = super().score(ctx)
        float(scores[0, 0])  # a host read: no capture can hold it
        return scores


@pytest.mark.gpu
def test_a_step_that_cannot_be_captured_falls_back_with_a_warning():
    cupy = pytest.importorskip("cupy")
    reference = build_lstm_lm(7, vocab_size=9)
    launched, _ = _search(cupy, _lm(reference), 40, captured=False)
    reading = _lm(reference, _ReadingLm)
    assert reading.capturable
    with pytest.warns(UserWarning, match="could not be captured"):
        got, stats = _search(cupy, reading, 40, captured=True)
    assert got == launched and stats.replayed_frames == 0


@pytest.mark.gpu
def test_alternating_graphs_copy_the_state_back_and_refuse_a_changed_shape():
    cupy = pytest.importorskip("cupy")
    from gpudecode import backend

    with backend.on_shared_stream(0):
        state = {"a": cupy.arange(4, dtype=np.float32), "b": cupy.ones(3, dtype=np.int64)}

        def get():
            return dict(state)

        def put(value):
            state.update(value)

        def body():
            state["a"] = state["a"] * 2 + 1
            state["b"] = state["b"] + state["a"][:3].astype(np.int64)

        graphs = AlternatingGraphs(cupy, get, put)
        expected_a, expected_b = np.arange(4, dtype=np.float32), np.ones(3, dtype=np.int64)
        for _ in range(5):
            graphs.step(body)
            expected_a = expected_a * 2 + 1
            expected_b = expected_b + expected_a[:3].astype(np.int64)
        graphs.finish()
        assert graphs.launches == 5 and graphs.last == 0
        assert np.array_equal(state["a"].get(), expected_a) and np.array_equal(state["b"].get(), expected_b)

        grows = AlternatingGraphs(cupy, get, put)

        def growing():
            state["a"] = cupy.concatenate([state["a"], state["a"][:1]])

        grows.step(growing)
        with pytest.raises(FrameCaptureFailed, match="changed"):
            grows.step(growing)


def test_a_snapshot_keeps_a_context_that_is_later_changed_in_place():
    @dataclasses.dataclass
    class Context:
        states: dict
        new_states: dict | None = None

    a = np.zeros(2)
    tree = ([Context({"h": a})], 1)
    kept = snapshot(tree)
    tree[0][0].new_states = {"h": np.ones(2)}  # as a scorer's score() fills its context in place
    tree[0][0].states["c"] = a
    assert kept[0][0].new_states is None and list(kept[0][0].states) == ["h"] and kept[0][0].states["h"] is a
