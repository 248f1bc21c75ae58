"""The label scorers' cached scores in a time-synchronous search (CTC prefix, transducer).

Per scorer s the search keeps ``cache[s]`` [N, V] (each lane's last score vector), ``lm_scores``
[S, N] (each lane's accumulated scores), ``changed`` [N] (lanes whose scorer context is new) and
``scorer_lane`` [N] (the scorer row each lane reads). Every step it needs two things of them:

- :func:`scorer_terms`: the cache refreshed with the scorers' new vectors where a lane changed, and
  the fused terms the selection ranks with, ``lm_term`` = Σ scale·cache [N, V] and ``lm_total`` =
  Σ scale·lm_scores [N];
- :func:`scorer_moves`: after the selection, the cache rows and accumulated scores of the new
  lanes (their parents', plus the cached score of the label a lane emitted), their changed flags
  and scorer rows.

On CuPy with at most ``MAX_KERNEL_SCORERS`` scorers each is one launch (``kernels/scorer_cache.cu``);
otherwise the array version, which is the kernels' oracle (bit for bit: the same float32 products
and sums in the same order, as :func:`gpudecode.scorers.combine.combine_scores` makes them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpudecode.backend import is_device_array
from gpudecode.scorers.combine import combine_scores

#: scorers one launch of kernels/scorer_cache.cu takes (MAX_SCORERS there)
MAX_KERNEL_SCORERS = 4
_THREADS = 256
_MAX_BLOCKS = 4096


def scorer_terms(xp, cache: list, scales: Sequence[float], lm_scores, new_scores: Sequence | None = None,
                 changed=None, *, kernel: bool = True):
    """(cache, lm_term [N, V], lm_total [N]) float32: with ``new_scores`` (one [N, V] float32 per
    scorer) the cache takes them where ``changed`` [N] bool (None: every lane), in place on CuPy
    (the cache arrays are the search's own); the terms from the refreshed cache."""
    if kernel and _on_kernel(xp, cache):
        return _terms_kernel(xp, cache, scales, lm_scores, new_scores, changed)
    if new_scores is not None:
        cache = refreshed(xp, cache, new_scores, changed)
    return cache, combine_scores(cache, scales), combine_scores(lm_scores, scales)


def refresh(xp, cache: list, scales: Sequence[float], lm_scores, new_scores: Sequence | None, changed, *,
            terms: bool) -> tuple[list, tuple | None]:
    """(cache, (lm_term, lm_total) or None): the cache refreshed with ``new_scores`` (None: no new
    scores this step) where ``changed``; with ``terms`` also the fused terms (:func:`scorer_terms`:
    on CuPy one launch does both)."""
    if terms:
        cache, lm_term, lm_total = scorer_terms(xp, cache, scales, lm_scores, new_scores, changed)
        return cache, (lm_term, lm_total)
    return (cache if new_scores is None else refreshed(xp, cache, new_scores, changed)), None


def refreshed(xp, cache: list, new_scores: Sequence, changed) -> list:
    """The cache with ``new_scores`` where ``changed`` [N] bool (None: the new scores themselves)."""
    return [n if changed is None else xp.where(changed[:, None], n, c) for c, n in zip(cache, new_scores)]


def scorer_moves(xp, cache: list, lm_scores, changed, scorer_lane, parents, labels, *, kernel: bool = True):
    """(cache, lm_scores, changed, scorer rows) of the new lanes: lane i continues ``parents[i]``
    and emitted ``labels[i]`` (-1: none), gaining its parent's cached score of that label;
    ``changed`` None counts as no lane changed."""
    if kernel and _on_kernel(xp, cache):
        return _moves_kernel(xp, cache, lm_scores, changed, scorer_lane, parents, labels)
    emitted = labels >= 0
    safe_labels = xp.maximum(labels, 0)
    lanes = xp.arange(parents.shape[0])
    cache = [c[parents] for c in cache]
    gained = xp.stack([xp.where(emitted, c[lanes, safe_labels], np.float32(0)) for c in cache])
    moved_changed = emitted if changed is None else changed[parents] | emitted
    return cache, lm_scores[:, parents] + gained, moved_changed, scorer_lane[parents]


def _on_kernel(xp, cache) -> bool:
    return xp is not np and 1 <= len(cache) <= MAX_KERNEL_SCORERS and all(is_device_array(c) for c in cache)


def _kernel(xp, name: str):
    from gpudecode.kernels import kernel_function

    return kernel_function("scorer_cache", name, xp.cuda.Device().id)


def _grid(num_elements: int) -> tuple[int]:
    return (max(1, min(-(-num_elements // _THREADS), _MAX_BLOCKS)),)


def _padded(arrays: list, fill) -> list:
    return arrays + [fill] * (MAX_KERNEL_SCORERS - len(arrays))


def _terms_kernel(xp, cache, scales, lm_scores, new_scores, changed):
    num_lanes, vocab_size = (int(d) for d in cache[0].shape)
    cache = [xp.ascontiguousarray(c, dtype=np.float32) for c in cache]
    lm_scores = xp.ascontiguousarray(lm_scores, dtype=np.float32)
    fresh, strides = [np.uint64(0)] * MAX_KERNEL_SCORERS, [np.int64(0)] * MAX_KERNEL_SCORERS
    if new_scores is not None:
        fresh, strides = [], []
        for scores in new_scores:
            scores = scores.astype(np.float32, copy=False)
            if scores.strides == (0, 4):  # one row broadcast to every lane (a length reward): that row
                fresh.append(scores[0])
                strides.append(np.int64(0))
                continue
            scores = xp.ascontiguousarray(scores)
            fresh.append(scores)
            strides.append(np.int64(vocab_size))
        fresh, strides = _padded(fresh, fresh[0]), _padded(strides, strides[0])
    flags = np.uint64(0) if changed is None or new_scores is None else \
        xp.ascontiguousarray(changed, dtype=bool).view(np.uint8)
    lm_term = xp.empty((num_lanes, vocab_size), dtype=np.float32)
    lm_total = xp.empty(num_lanes, dtype=np.float32)
    padded_scales = [np.float32(s) for s in scales] + [np.float32(0)] * (MAX_KERNEL_SCORERS - len(scales))
    _kernel(xp, "scorer_terms")(_grid(num_lanes * vocab_size), (_THREADS,), (
        *_padded(cache, cache[0]), *fresh, *strides, flags, lm_scores, *padded_scales, np.int32(len(cache)),
        np.int64(num_lanes), np.int64(vocab_size), lm_term, lm_total))
    return cache, lm_term, lm_total


def _moves_kernel(xp, cache, lm_scores, changed, scorer_lane, parents, labels):
    num_lanes, vocab_size = (int(d) for d in cache[0].shape)
    cache = [xp.ascontiguousarray(c, dtype=np.float32) for c in cache]
    moved = [xp.empty_like(c) for c in cache]
    lm_out = xp.empty((len(cache), num_lanes), dtype=np.float32)
    changed_out = xp.empty(num_lanes, dtype=bool)
    scorer_parents = xp.empty(num_lanes, dtype=np.int64)
    flags = np.uint64(0) if changed is None else xp.ascontiguousarray(changed, dtype=bool).view(np.uint8)
    _kernel(xp, "scorer_moves")(_grid(num_lanes * vocab_size), (_THREADS,), (
        *_padded(cache, cache[0]), *_padded(moved, moved[0]), xp.ascontiguousarray(parents, dtype=np.int64),
        xp.ascontiguousarray(labels, dtype=np.int64), xp.ascontiguousarray(lm_scores, dtype=np.float32), lm_out,
        flags, changed_out.view(np.uint8), xp.ascontiguousarray(scorer_lane, dtype=np.int64), scorer_parents,
        np.int32(len(cache)), np.int64(num_lanes), np.int64(vocab_size)))
    return moved, lm_out, changed_out, scorer_parents
