"""The ``ctc-prefix`` label scorer against brute-force prefix probabilities (every alignment)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from gpudecode.scorers import LaneLayout, UtteranceBatch, create_scorer
from gpudecode.scorers.ctc_prefix import CtcPrefixScorer
from gpudecode.testing._graph import log_softmax
from gpudecode.testing.ctc import ctc_prefix_log_probs, ctc_sequence_log_probs

TOL = 1e-4
BLANK, EOS, VOCAB = 0, 4, 5
LABELS = (1, 2, 3)


def setup(xp=np, seed=0, sizes=(6, 4), num_frames=6, beam=9):
    rng = np.random.default_rng(seed)
    log_probs = log_softmax(rng.normal(size=(len(sizes), num_frames, VOCAB)) * 1.5).astype(np.float32)
    log_probs[1, sizes[1]:] = 50.0  # padding: must never be read
    scorer = CtcPrefixScorer(vocab_size=VOCAB, blank=BLANK, sentence_end=EOS)
    layout = LaneLayout(num_groups=len(sizes), beam_size=beam, xp=xp)
    scorer.begin(layout)
    batch = UtteranceBatch(ids=[str(u) for u in range(len(sizes))], input_lengths=np.array(sizes),
                           inputs={"log-probs": xp.asarray(log_probs)})
    scorer.admit(batch, np.arange(len(sizes)))
    return scorer, layout, log_probs, sizes


def lane_prefixes(beam, depth):
    """Per lane of a group, a different label sequence of length ``depth`` (repeats included)."""
    sequences = list(itertools.product(LABELS, repeat=depth))
    return [sequences[j % len(sequences)] for j in range(beam)]


@functools.lru_cache(maxsize=32)
def _oracles(data: bytes, num_frames: int):
    log_probs = np.frombuffer(data, np.float32).reshape(num_frames, VOCAB)
    return ctc_prefix_log_probs(log_probs, BLANK), ctc_sequence_log_probs(log_probs, BLANK)


def expected_scores(log_probs, size, prefix):
    """[V] brute force: log ψ(prefix + c) − log ψ(prefix); sentence-end: log P(prefix) − log ψ;
    every label -inf after an impossible prefix."""
    prefixes, sequences = _oracles(np.ascontiguousarray(log_probs[:size]).tobytes(), size)
    base = prefixes.get(prefix, -np.inf)
    row = np.full(VOCAB, -np.inf)
    for c in range(VOCAB):
        if c == BLANK or base == -np.inf:
            continue
        total = sequences.get(prefix, -np.inf) if c == EOS else prefixes.get(prefix + (c,), -np.inf)
        row[c] = total - base
    return row


def build_context(scorer, layout, depth, score_first: bool):
    xp = layout.xp
    ctx = scorer.initial_context(np.arange(layout.num_groups))
    prefixes = lane_prefixes(layout.beam_size, depth)
    for step in range(depth):
        if score_first:
            scorer.score(ctx)
        labels = np.tile([p[step] for p in prefixes], layout.num_groups)
        ctx = scorer.extend(ctx, xp.arange(layout.num_lanes), xp.asarray(labels, dtype=np.int64))
    return ctx, prefixes


def check_rows(rows, log_probs, sizes, prefixes, beam):
    rows = np.asarray(rows)
    for g, size in enumerate(sizes):
        for j, prefix in enumerate(prefixes):
            want = expected_scores(log_probs[g], size, prefix)
            got = rows[g * beam + j]
            assert np.array_equal(np.isinf(got), np.isinf(want)), (g, prefix, got, want)
            finite = np.isfinite(want)
            np.testing.assert_allclose(got[finite], want[finite], atol=TOL)


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("score_first", [True, False])
def test_full_scores_equal_brute_force_prefix_probabilities(depth, score_first):
    scorer, layout, log_probs, sizes = setup()
    ctx, prefixes = build_context(scorer, layout, depth, score_first)
    check_rows(scorer.score(ctx), log_probs, sizes, prefixes, layout.beam_size)


@pytest.mark.parametrize("depth", [1, 2])
def test_candidate_scores_equal_brute_force_and_the_full_row(depth):
    scorer, layout, log_probs, sizes = setup(seed=3)
    ctx, prefixes = build_context(scorer, layout, depth, True)
    full = np.asarray(scorer.score(ctx))
    rng = np.random.default_rng(depth)
    candidates = np.stack([rng.permutation(VOCAB)[:3] for _ in range(layout.num_lanes)])
    got = scorer.score_candidates(ctx, candidates)
    np.testing.assert_array_equal(got, np.take_along_axis(full, candidates, axis=1))
    # extending by scored candidates gathers their forward variables; others are recomputed
    candidates[1] = [0, 4, 1]
    got = scorer.score_candidates(ctx, candidates)
    labels = np.array([next((c for c in row if c in LABELS), -1) for row in candidates])
    labels[::4] = -1  # carried lanes
    labels[1] = 3  # not among the candidates: recomputed
    child = scorer.extend(ctx, np.arange(layout.num_lanes), labels)
    child_rows = np.asarray(scorer.score(child))
    for lane, label in enumerate(labels):
        g, j = divmod(lane, layout.beam_size)
        prefix = prefixes[j] if label < 0 else prefixes[j] + (int(label),)
        want = expected_scores(log_probs[g], sizes[g], prefix)
        finite = np.isfinite(want)
        np.testing.assert_allclose(child_rows[lane][finite], want[finite], atol=TOL)


def test_accumulated_increments_give_the_full_sequence_probability():
    scorer, layout, log_probs, sizes = setup(seed=5)
    xp = np
    ctx = scorer.initial_context(np.arange(2))
    sequence = (2, 2, 1)
    total = np.zeros(layout.num_lanes)
    for label in (*sequence, EOS):
        rows = np.asarray(scorer.score(ctx))
        total += rows[:, label]
        ctx = scorer.extend(ctx, xp.arange(layout.num_lanes), xp.full(layout.num_lanes, label))
    for g, size in enumerate(sizes):
        want = ctc_sequence_log_probs(log_probs[g, :size], BLANK)[sequence]
        assert total[g * layout.beam_size] == pytest.approx(want, abs=TOL)


def test_registered_and_bad_input_errors():
    scorer = create_scorer("ctc-prefix", vocab_size=6, sentence_end=5)
    assert isinstance(scorer, CtcPrefixScorer) and scorer.blank == 0
    with pytest.raises(ValueError, match="blank and sentence_end must differ"):
        CtcPrefixScorer(vocab_size=4, sentence_end=0)
    with pytest.raises(ValueError, match="sentence_end 7 is outside"):
        CtcPrefixScorer(vocab_size=4, sentence_end=7)
    scorer = CtcPrefixScorer(vocab_size=4, sentence_end=3)
    scorer.begin(LaneLayout(num_groups=1, beam_size=2))
    with pytest.raises(ValueError, match="no input 'log-probs'"):
        scorer.admit(UtteranceBatch(ids=["a"], input_lengths=[3]), [0])
    with pytest.raises(ValueError, match=r"must be \[U, T, V=4\]"):
        scorer.admit(UtteranceBatch(ids=["a"], input_lengths=[3],
                                    inputs={"log-probs": np.zeros((1, 3, 5), np.float32)}), [0])


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [0, 2, 3])
def test_gpu_scores_equal_cpu(depth):
    import cupy

    cpu, layout, _, _ = setup(seed=7)
    gpu, gpu_layout, _, _ = setup(xp=cupy, seed=7)
    cpu_ctx, _ = build_context(cpu, layout, depth, True)
    gpu_ctx, _ = build_context(gpu, gpu_layout, depth, False)
    np.testing.assert_allclose(cupy.asnumpy(gpu.score(gpu_ctx)), cpu.score(cpu_ctx), atol=TOL)
    candidates = np.tile(np.array([[3, 0, 4, 1]]), (layout.num_lanes, 1))
    np.testing.assert_allclose(cupy.asnumpy(gpu.score_candidates(gpu_ctx, cupy.asarray(candidates))),
                               cpu.score_candidates(cpu_ctx, candidates), atol=TOL)
