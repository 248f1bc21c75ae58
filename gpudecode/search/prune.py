"""The prune step every beam search shares: rank the candidates, keep the best per utterance,
split the kept ones into parent lane and label.

Candidates are laid out [N = U · B lanes, V labels] (lane-major per utterance, then label); per
utterance its B · V candidates compete, and equal ranks go to the lower lane, then the lower
label (:func:`gpudecode.search.topk.top_k_indices`, identical on numpy and CuPy). A rank may be
length-normalised, ``score / max(length, 1) ** length_norm_scale`` (:func:`length_normaliser`):
the one normaliser of the label-synchronous search, for its candidates and its n-best lists.
Whole-array operations only: no Python loop over utterances, lanes or labels, no host sync.
"""

from __future__ import annotations

import numpy as np

from gpudecode.search.stats import SearchStats, observed_top_k
from gpudecode.search.topk import top_k_indices

NEG_INF = np.float32(-np.inf)


def length_normaliser(lengths, length_norm_scale: float, xp):
    """float32 ``max(length, 1) ** length_norm_scale`` per entry of ``lengths`` (labels counted
    for normalisation, ints), or None when the scale is 0 (rank by the score itself)."""
    scale = np.float32(length_norm_scale)
    if scale == 0:
        return None
    return xp.power(xp.maximum(lengths.astype(np.float32), np.float32(1)), scale)


def normalised(scores, normaliser):
    """``scores`` [N] divided by the ``normaliser`` [N] of :func:`length_normaliser` (None: as
    they are)."""
    return scores if normaliser is None else scores / normaliser


def prune(candidates, beam_size: int, num_groups: int, xp, *, normaliser=None,
          score_threshold: float | None = None, group_base=None, stats: SearchStats | None = None):
    """The best ``beam_size`` of each utterance's candidates ``candidates`` [N, V] float32.

    ``normaliser`` [N]: rank each lane's candidates by ``score / normaliser`` (None: by score);
    ``score_threshold``: drop candidates whose rank is worse than the utterance's best by more
    than this; ``group_base`` [U, 1] int64: each utterance's first lane (computed when None);
    ``stats``: told of the top-k (:func:`gpudecode.search.stats.observed_top_k`).
    Returns (alive [N] bool: a kept candidate with a finite rank, parents [N] int64: the lane it
    extends, labels [N] int64: its column), new lane ``u · B + b`` holding utterance u's b-th best.
    """
    vocab_size = int(candidates.shape[1])
    ranks = candidates if normaliser is None else candidates / normaliser[:, None]
    ranks = ranks.reshape(num_groups, beam_size * vocab_size)
    if score_threshold is not None:
        best = ranks.max(axis=1, keepdims=True)
        ranks = xp.where(ranks >= best - np.float32(score_threshold), ranks, NEG_INF)
    observed_top_k(stats, ranks, beam_size)
    chosen = top_k_indices(ranks, beam_size)  # [U, B], lane-major then label
    alive = (xp.take_along_axis(ranks, chosen, axis=1) > NEG_INF).reshape(-1)
    if group_base is None:
        group_base = (xp.arange(num_groups, dtype=np.int64) * beam_size)[:, None]
    parents = (group_base + chosen // vocab_size).reshape(-1)
    labels = (chosen % vocab_size).reshape(-1)
    return alive, parents, labels


def best_first(ranks, group_size: int, stats: SearchStats | None = None):
    """[G, group_size] int64: per group of ``group_size`` consecutive lanes of ``ranks`` [G · B],
    its lanes best first (the order of its n-best list)."""
    keys = ranks.reshape(-1, group_size)
    observed_top_k(stats, keys, group_size)
    return top_k_indices(keys, group_size)
