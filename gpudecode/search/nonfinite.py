"""Non-finite scores: a scorer that gives NaN or +inf is caught and its utterances named.

Every search keeps, on its device, the largest score each scorer gave each utterance's live
hypotheses (:func:`folded_group_maxima`, one launch per step on CuPy): a maximum is NaN when any score was NaN
(``max`` propagates NaN), +inf when one was +inf, and -inf stays what it is — a legitimate
"impossible" score (a pruned or masked label). The maxima come to the host with the search's
final transfer (no synchronisation of their own); :func:`check_finite` then raises
:class:`NonFiniteScores` for utterances whose scores were NaN or +inf, or whose every hypothesis
scored -inf (an empty n-best list would otherwise pass for a decoded utterance).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpudecode.io.errors import InputError

_NEG_INF = np.float32(-np.inf)
#: score arrays one launch of ``kernels/score_maxima.cu`` folds in (scores0 .. scores3), and its threads
_KERNEL_ARRAYS, _KERNEL_THREADS = 4, 256
#: Utterance ids a message names before "and N more".
_NAMED = 10


class NonFiniteScores(InputError):
    """Scores of some utterances were NaN or +inf (or every hypothesis scored -inf).

    ``utterance_ids``: the utterances; ``scorers``: the names of the scorers whose scores were
    non-finite (empty when none was, but no hypothesis kept a finite score); ``what``: the
    problem, without the utterances."""

    def __init__(self, utterance_ids: Sequence[str], scorers: Sequence[str]):
        self.utterance_ids = list(utterance_ids)
        self.scorers = list(scorers)
        named = ", ".join(repr(u) for u in self.utterance_ids[:_NAMED])
        more = len(self.utterance_ids) - _NAMED
        where = f"{len(self.utterance_ids)} utterance(s): {named}" + (f" and {more} more" if more > 0 else "")
        if self.scorers:
            self.what = f"non-finite scores (NaN or +inf) from scorer(s) {', '.join(map(repr, self.scorers))}"
        else:
            self.what = "no hypothesis with a finite score (every hypothesis scored -inf)"
        super().__init__(f"{self.what} for {where}; their transcripts would be empty or wrong "
                         "(io.on_bad_input: skip skips such utterances and decodes the others)")


def row_maxima(scores, live, xp):
    """[N] float32: per row of ``scores`` [N, V] its largest value (NaN if any is NaN), -inf for
    rows not ``live`` ([N] bool, or None: every row)."""
    maxima = scores.max(axis=1).astype(np.float32, copy=False)
    return maxima if live is None else xp.where(live, maxima, _NEG_INF)


def group_maxima(score_arrays, live, num_groups: int, xp):
    """[S, G] float32: per array of ``score_arrays`` (S arrays [N, V], N = G · B lanes) and lane
    group, the largest score of its ``live`` lanes (:func:`row_maxima`)."""
    rows = xp.stack([row_maxima(scores, live, xp) for scores in score_arrays])
    return rows.reshape(len(score_arrays), num_groups, -1).max(axis=2)


def folded_group_maxima(previous, score_arrays, num_groups: int, xp, *, live=None, dead=None, row_maxima=None):
    """[S, G] float32: ``previous`` (the maxima so far) folded with :func:`group_maxima` of this
    step's ``score_arrays``; lanes are live where ``live`` [N] bool is true, or where ``dead`` [N]
    bool is false (both None: every lane). On CuPy one launch (``kernels/score_maxima.cu``) for up
    to four arrays; else the array version.

    ``row_maxima`` (numpy only): per array, its [N] float32 row maxima where already known (exactly
    ``scores.max(axis=1)`` on the live lanes; other lanes are not read), or None."""
    if xp is not np and 1 <= len(score_arrays) <= _KERNEL_ARRAYS:
        return _folded_on_device(xp, previous, score_arrays, num_groups, live, dead)
    if xp is np and score_arrays:
        return _folded_on_host(previous, score_arrays, num_groups, live, dead, row_maxima)
    if live is None and dead is not None:
        live = ~dead
    return xp.maximum(previous, group_maxima(score_arrays, live, num_groups, xp))


def _folded_on_host(previous, score_arrays, num_groups: int, live, dead, row_maxima=None):
    """:func:`folded_group_maxima` on numpy with fewer temporaries than the array version (the
    reference): each array's row maxima (``row_maxima``'s where given) written into one [S, N]
    float32 array, the lanes that are not live set to -inf there."""
    maxima = np.empty((len(score_arrays), score_arrays[0].shape[0]), np.float32)
    for s, scores in enumerate(score_arrays):  # a few scorers
        known = None if row_maxima is None else row_maxima[s]
        maxima[s] = scores.max(axis=1) if known is None else known
    if dead is not None and live is None:
        maxima[:, dead] = _NEG_INF
    elif live is not None:
        maxima[:, ~live] = _NEG_INF
    return np.maximum(previous, maxima.reshape(len(score_arrays), num_groups, -1).max(axis=2))


def _folded_on_device(cupy, previous, score_arrays, num_groups: int, live, dead):
    from gpudecode.kernels import kernel_function

    arrays = [cupy.ascontiguousarray(a, dtype=None if a.dtype == np.float16 else np.float32) for a in score_arrays]
    num_lanes, vocab_size = arrays[0].shape
    half = np.int32(sum(1 << s for s, a in enumerate(arrays) if a.dtype == np.float16))
    skip = live if live is not None else dead
    skip = np.uint64(0) if skip is None else cupy.ascontiguousarray(skip, dtype=bool).view(np.uint8)
    previous = cupy.ascontiguousarray(previous, dtype=np.float32)
    out = cupy.empty_like(previous)
    pointers = arrays + [arrays[0]] * (_KERNEL_ARRAYS - len(arrays))
    kernel = kernel_function("score_maxima", "group_maxima", arrays[0].device.id)
    kernel((num_groups, len(arrays)), (_KERNEL_THREADS,), (
        *pointers, half, np.int32(len(arrays)), np.int64(num_lanes // num_groups), np.int64(vocab_size),
        skip, np.int32(live is not None), previous, out))
    return out


def initial_maxima(num_scorers: int, num_groups: int, xp):
    """[S, G] float32 -inf: nothing scored yet."""
    return xp.full((num_scorers, num_groups), _NEG_INF, dtype=np.float32)


def bad_groups(maxima: np.ndarray, best: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Host values: (groups [G] bool whose scores were non-finite or whose ``best`` [G] rank is
    not finite, scorers [S, G] bool whose maxima were NaN or +inf)."""
    flagged = ~(maxima < np.inf)  # NaN or +inf
    bad = flagged.any(axis=0)
    if best is not None:
        bad = bad | ~np.isfinite(best)
    return bad, flagged


def check_scores(ids: Sequence[str], name: str, scores: np.ndarray) -> None:
    """Raises :class:`NonFiniteScores` for the utterances ``ids`` whose one hypothesis's score
    (``scores`` [U], host; a greedy search's, the sum of its steps' scores by ``name``) is not finite."""
    bad = ~np.isfinite(scores)
    if bad.any():
        raise NonFiniteScores([ids[u] for u in np.flatnonzero(bad).tolist()],
                              [name] if (~(scores[bad] < np.inf)).any() else [])


def check_finite(ids: Sequence[str], names: Sequence[str], maxima: np.ndarray,
                 best: np.ndarray | None = None) -> None:
    """Raises :class:`NonFiniteScores` for the groups (utterances ``ids``) that
    :func:`bad_groups` finds in the host arrays ``maxima`` [S, G] (scorers ``names``) and
    ``best`` [G] (each group's best rank, or None)."""
    bad, flagged = bad_groups(maxima, best)
    if bad.any():
        raise NonFiniteScores([ids[g] for g in np.flatnonzero(bad).tolist()],
                              [names[s] for s in np.flatnonzero(flagged[:, bad].any(axis=1)).tolist()])
