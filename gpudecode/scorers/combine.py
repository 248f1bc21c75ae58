"""Combining scorers: the search's scorers are (name, scorer, scale) and the combined score is
Σ scale · score. Names key the per-scorer scores in the outputs; nothing branches on them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from gpudecode.backend import get_array_module, is_device_array
from gpudecode.scorers.base import LabelScorer, ScorerContractError, describe_scorer


class ScorerEntry(NamedTuple):
    """One scorer of a search: its output name, the scorer, and its scale in the sum."""

    name: str
    scorer: LabelScorer
    scale: float


def check_scorers(scorers: Iterable) -> tuple[ScorerEntry, ...]:
    """The (name, scorer, scale) triples as :class:`ScorerEntry`, checked.

    Raises ``ValueError`` for no scorers, a duplicate or empty name, a non-finite scale, or
    scorers that disagree on ``vocab_size``.
    """
    entries = []
    for i, item in enumerate(scorers):
        try:
            name, scorer, scale = item
        except (TypeError, ValueError):
            raise ValueError(f"scorers[{i}]: expected a (name, scorer, scale) triple, got "
                             f"{item!r}") from None
        if not isinstance(name, str) or not name:
            raise ValueError(f"scorers[{i}]: the name must be a non-empty string, got {name!r}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scorer {name!r}: scale must be finite, got {scale!r}")
        entries.append(ScorerEntry(name, scorer, float(scale)))
    if not entries:
        raise ValueError("a search needs at least one scorer")
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if entry.name in seen:
            raise ValueError(f"duplicate scorer name {entry.name!r} (scorers[{seen[entry.name]}] "
                             f"and scorers[{i}]); give each scorer a distinct name")
        seen[entry.name] = i
    vocab = {e.name: int(e.scorer.vocab_size) for e in entries}
    if len(set(vocab.values())) != 1:
        raise ValueError(f"scorers disagree on vocab_size: {vocab}")
    return tuple(entries)


def combine_scores(log_probs: Sequence, scales: Sequence[float]):
    """Σ scale · log_probs[i] as float32 [N, V]; scorers with scale 0 are left out (so a -inf
    of a scorer that only reports never turns into NaN)."""
    total = None
    for logp, scale in zip(log_probs, scales, strict=True):
        if scale == 0.0:
            continue
        logp = logp.astype(np.float32, copy=False)
        term = logp if scale == 1.0 else logp * np.float32(scale)
        if total is None:
            total = term.copy() if term is logp else term  # never a scorer's own array
        else:
            total = total + term
    if total is None:  # every scale is 0: the combined score is 0 everywhere
        total = get_array_module(log_probs[0]).zeros(log_probs[0].shape, dtype=np.float32)
    return total


def checked_scores(entry: ScorerEntry, log_probs, num_lanes: int, vocab_size: int, xp, keep_float16: bool = False):
    """``log_probs`` as float32 (``keep_float16``: float16 stays float16) after checking it is
    [N, V] on the search's array module; the error names the scorer."""
    if tuple(getattr(log_probs, "shape", ())) != (num_lanes, vocab_size):
        raise ScorerContractError(f"{describe_scorer(entry.scorer, entry.name)}: score() returned shape "
                                  f"{tuple(getattr(log_probs, 'shape', ()))}, expected [N={num_lanes}, V={vocab_size}]")
    if log_probs.dtype.kind != "f":
        raise ScorerContractError(f"{describe_scorer(entry.scorer, entry.name)}: score() returned dtype "
                                  f"{log_probs.dtype}, expected float32 (or float16) log-probabilities")
    if is_device_array(log_probs) != (xp is not np):
        raise ScorerContractError(f"{describe_scorer(entry.scorer, entry.name)}: score() returned a "
                                  f"{type(log_probs).__module__} array, but the search runs on "
                                  f"{xp.__name__}")
    if keep_float16 and log_probs.dtype == np.float16:
        return log_probs
    return log_probs.astype(np.float32, copy=False)
