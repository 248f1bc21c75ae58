"""What a search returns: n-best hypotheses per utterance."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from itertools import repeat

import numpy as np

from gpudecode.hypothesis import Hypothesis
from gpudecode.sizes import next_power_of_two

__all__ = ["Hypothesis", "int_rows", "label_lists", "nbest_lists", "no_cyclic_gc", "python_ints"]


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Builds n-best lists without CPython's cyclic collector: they are many small acyclic lists,
    dicts and hypotheses, which the collector would otherwise scan again and again while they are
    made (a third of the time for 512 hypotheses of 225 labels)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


MAX_SHARED_INTS = 1 << 20  # larger label values are converted one by one


@lru_cache(maxsize=8)
def _python_ints(size: int) -> np.ndarray:
    return np.array(range(size), dtype=object)


def python_ints(size: int) -> np.ndarray:
    """An object array whose entry i is the Python int i, for i < ``size``: indexing it with a
    label array and calling ``tolist()`` gives lists of ints without making an int object per
    label (thousands of n-best labels per search). Cached for sizes rounded up to a power of 2."""
    return _python_ints(next_power_of_two(size))


def nbest_lists(ranks: np.ndarray, labels: list[list[int]], scores: np.ndarray, names: list[str],
                scorer_scores: np.ndarray, lengths: np.ndarray,
                frames: list[list[int]] | None = None,
                truncated: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """Per group its n-best list from host values of its K returned lanes, best first: ``ranks``
    [G, K] (a -inf rank ends a group's list), and per lane, row-major over [G, K], its ``labels``
    (and ``frames``), ``scores`` and ``lengths`` [G·K], each scorer's score ``scorer_scores``
    [S, G·K] by ``names`` and ``truncated`` [G·K] bool (None: none is). The values are gathered by
    numpy and the objects made by ``map`` (thousands per search: no interpreted loop over them)."""
    num_best = ranks.shape[1]
    finite = np.isfinite(ranks)
    counts = np.where(finite.all(axis=1), num_best, finite.argmin(axis=1)).tolist()  # up to the first -inf
    per_scorer = zip(*scorer_scores.tolist()) if len(names) else repeat(())  # per lane, each scorer's score
    hyps = list(map(Hypothesis.made, labels, scores.tolist(), map(dict, map(zip, repeat(names), per_scorer)),
                    lengths.tolist(), repeat(None) if frames is None else frames,
                    repeat(False) if truncated is None else truncated.tolist()))
    return [hyps[g * num_best:g * num_best + count] for g, count in enumerate(counts)]


def label_lists(tokens: np.ndarray, sentence_end: int | None,
                max_shared_ints: int = MAX_SHARED_INTS) -> list[list[int]]:
    """Per row of ``tokens`` [N, T] (host), its labels in order as a Python list: the entries that
    are >= 0 and not ``sentence_end`` (``max_shared_ints`` as for :func:`int_rows`)."""
    valid = tokens >= 0
    if sentence_end is not None:
        valid &= tokens != sentence_end
    if bool((valid[:, 1:] <= valid[:, :-1]).all()):  # every row's labels come first (the usual case)
        return int_rows(tokens, valid.sum(axis=1), max_shared_ints)
    return [[x for x, keep in zip(row, mask) if keep] for row, mask in zip(tokens.tolist(), valid.tolist())]


def int_rows(values: np.ndarray, counts: np.ndarray, max_shared_ints: int = MAX_SHARED_INTS) -> list[list[int]]:
    """Row n of ``values`` [N, K] (host, non-negative where kept) cut to its first ``counts[n]``
    entries, as a list of Python ints (shared int objects, see :func:`python_ints`, for values
    below ``max_shared_ints``; larger ones are converted one by one)."""
    head = np.maximum(values[:, :int(counts.max(initial=0))], 0)  # (the clipped entries are dropped)
    size = int(head.max(initial=0)) + 1
    rows = (python_ints(size)[head] if size <= max_shared_ints else head).tolist()
    for row, n in zip(rows, counts.tolist()):
        del row[n:]
    return rows
