"""The scorers' cache bookkeeping of the time-synchronous searches (``gpudecode.search.scorer_cache``):
the kernels (``kernels/scorer_cache.cu``) equal the array version bit for bit, and the array version
does what the searches did step by step."""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.scorers.combine import combine_scores
from gpudecode.search.scorer_cache import scorer_moves, scorer_terms
from tests.test_ctc_prefix_kernel import assert_none_in_emulation, needs_gxx

_CASES = [  # (scorers, scales, lanes, vocabulary, changed given, new scores given)
    (1, [0.5], 6, 7, True, True), (2, [1.2, 1.0], 10, 12, True, True), (3, [0.3, 0.0, 2.5], 8, 5, False, True),
    (4, [1.0, 0.7, 0.0, 0.1], 12, 9, True, True), (2, [0.0, 0.0], 4, 3, True, True), (2, [0.9, 0.4], 16, 33, True, False),
]


def _inputs(rng, scorers, lanes, vocab):
    cache = [rng.standard_normal((lanes, vocab)).astype(np.float32) for _ in range(scorers)]
    cache[0][0, 1] = -np.inf
    new = [rng.standard_normal((lanes, vocab)).astype(np.float32) for _ in range(scorers)]
    if scorers > 1:  # a scorer whose rows are one row broadcast (a length reward)
        new[1] = np.broadcast_to(rng.standard_normal(vocab).astype(np.float32), (lanes, vocab))
    lm_scores = rng.standard_normal((scorers, lanes)).astype(np.float32)
    changed = rng.random(lanes) < 0.5
    parents = rng.integers(0, lanes, lanes).astype(np.int64)
    labels = np.where(rng.random(lanes) < 0.6, rng.integers(0, vocab, lanes), -1).astype(np.int64)
    scorer_lane = rng.permutation(lanes).astype(np.int64)
    return cache, new, lm_scores, changed, parents, labels, scorer_lane


def test_the_array_version_refreshes_changed_lanes_and_moves_with_the_parents():
    rng = np.random.default_rng(0)
    cache, new, lm_scores, changed, parents, labels, scorer_lane = _inputs(rng, 2, 6, 5)
    refreshed, lm_term, lm_total = scorer_terms(np, cache, [0.5, 2.0], lm_scores, new, changed)
    for s in range(2):
        np.testing.assert_array_equal(refreshed[s][changed], new[s][changed])
        np.testing.assert_array_equal(refreshed[s][~changed], cache[s][~changed])
    np.testing.assert_array_equal(lm_term, combine_scores(refreshed, [0.5, 2.0]))
    np.testing.assert_array_equal(lm_total, 0.5 * lm_scores[0] + 2.0 * lm_scores[1])
    moved, lm_moved, moved_changed, rows = scorer_moves(np, refreshed, lm_scores, changed, scorer_lane, parents, labels)
    for lane, (p, label) in enumerate(zip(parents, labels)):
        for s in range(2):
            np.testing.assert_array_equal(moved[s][lane], refreshed[s][p])
            gained = refreshed[s][p, label] if label >= 0 else 0.0
            assert lm_moved[s, lane] == np.float32(lm_scores[s, p] + np.float32(gained))
        assert moved_changed[lane] == (changed[p] or label >= 0) and rows[lane] == scorer_lane[p]


def scorer_cache_mismatches(cupy) -> list:
    """Kernel against array version, every output bit for bit, over :data:`_CASES`."""
    bad = []
    rng = np.random.default_rng(3)
    for case in _CASES:
        scorers, scales, lanes, vocab, with_changed, with_new = case
        cache, new, lm_scores, changed, parents, labels, scorer_lane = _inputs(rng, scorers, lanes, vocab)
        host = scorer_terms(np, [c.copy() for c in cache], scales, lm_scores, new if with_new else None,
                            changed if with_changed else None)
        device_new = [cupy.asarray(np.ascontiguousarray(n)) for n in new]
        if scorers > 1:  # the broadcast row stays a broadcast view on the device
            device_new[1] = cupy.broadcast_to(cupy.asarray(new[1][0]), (lanes, vocab))
        device = scorer_terms(cupy, [cupy.asarray(c) for c in cache], scales, cupy.asarray(lm_scores),
                              device_new if with_new else None, cupy.asarray(changed) if with_changed else None)
        for name, h, d in [("cache", host[0], device[0]), ("lm_term", [host[1]], [device[1]]),
                           ("lm_total", [host[2]], [device[2]])]:
            if any(cupy.asnumpy(y).tobytes() != np.asarray(x).tobytes() for x, y in zip(h, d)):
                bad.append((case, name))
        moves_host = scorer_moves(np, host[0], lm_scores, changed if with_changed else None, scorer_lane, parents,
                                  labels)
        moves_device = scorer_moves(cupy, device[0], cupy.asarray(lm_scores),
                                    cupy.asarray(changed) if with_changed else None, cupy.asarray(scorer_lane),
                                    cupy.asarray(parents), cupy.asarray(labels))
        for name, h, d in zip(("cache", "lm_scores", "changed", "scorer rows"),
                              (moves_host[0], *([x] for x in moves_host[1:])),
                              (moves_device[0], *([x] for x in moves_device[1:]))):
            if any(cupy.asnumpy(y).tobytes() != np.asarray(x).tobytes() for x, y in zip(h, d)):
                bad.append((case, "moves " + name))
    return bad


@needs_gxx
def test_the_kernels_equal_the_array_version_in_emulation():
    assert_none_in_emulation("tests.test_scorer_cache", "scorer_cache_mismatches")


@pytest.mark.gpu
def test_the_kernels_equal_the_array_version_on_cuda():
    assert scorer_cache_mismatches(pytest.importorskip("cupy")) == []
