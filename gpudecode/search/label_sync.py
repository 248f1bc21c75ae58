"""Label-synchronous beam search over [utterances, beam] lanes, on numpy or CuPy.

Per step, every live hypothesis is extended by every label: the scorers score all N lanes at
once ([N, V] each), the combined score Σ scale · score is added to the hypothesis scores, and per
utterance the best ``beam_size`` of its ``beam_size × V`` candidates survive (deterministic
top-k: equal ranking scores go to the lower lane, then the lower label). A hypothesis that
emits sentence-end is terminated: it stays in the beam as one candidate (itself, unchanged
score and length, label -1 to the scorers) and competes with the open ones. Candidates are
ranked by ``score / length ** length_norm_scale``. The search stops when every surviving
hypothesis of every utterance is terminated, or after ``max_labels_per_input × input length``
steps for an utterance (capped by ``max_labels``; open hypotheses are then force-ended without
a sentence-end score).

Hypotheses are device arrays (scores, per-scorer scores, lengths, parents, labels); the step has
no Python loop over hypotheses, labels or utterances, and one small device→host transfer (the
stop test). The label sequences are traced back once at the end.

``LabelSyncOptions.finished="separate"`` (``"separate-genai"``) runs a peer's semantics instead
(Hugging Face's, ONNX Runtime GenAI's beam search): ``beam_size`` open hypotheses per utterance,
ranked by score, and a separate list of finished ones, which is the n-best list
(:func:`gpudecode.search.beam.select_separate`); ``min_length`` masks sentence-end in every mode.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from gpudecode.backend import on_shared_stream
from gpudecode.scorers.base import LaneLayout, UtteranceBatch
from gpudecode.scorers.combine import ScorerEntry, check_scorers
from gpudecode.search.batching import ADMISSION_ORDERS, continuous_search
from gpudecode.search.beam import (
    NEG_INF,
    Beam,
    Finished,
    LabelSyncOptions,
    LaggedReads,
    expand,
    hypotheses,
    prompt_lengths,
    returned_lanes,
)
from gpudecode.search.nonfinite import check_finite, initial_maxima
from gpudecode.search.prune import best_first, length_normaliser, normalised
from gpudecode.search.results import Hypothesis, no_cyclic_gc
from gpudecode.search.stats import SearchStats, read_back
from gpudecode.search.tuning import DEFAULT_TUNING, SearchTuning

__all__ = ["LabelSyncOptions", "label_sync_search"]


def _all_ended(ended, tuning: SearchTuning, stats: SearchStats | None) -> bool:
    """The per-step stop test: one small transfer (a single bool; none on numpy without stats)."""
    if stats is None and type(ended) is np.ndarray:
        return bool(ended.all())
    (flag,) = read_back(tuning, stats, ended.all())
    return bool(flag)


def label_sync_search(scorers: Sequence, utterances: UtteranceBatch, options: LabelSyncOptions,
                      xp: ModuleType = np, *, max_active_utterances: int | None = None,
                      admission_order: str = "longest-first", tuning: SearchTuning = DEFAULT_TUNING,
                      stats: SearchStats | None = None) -> list[list[Hypothesis]]:
    """Decode ``utterances`` together; per utterance the n-best list, best first.

    ``scorers``: (name, scorer, scale) triples; the combined score is Σ scale · score. The
    scorers are begun, admitted and released here (each utterance gets lane group = its index).
    ``xp``: the array module of the run (numpy or cupy); the scorers' scores must live there.

    ``max_active_utterances`` K (opt-in continuous batching, :mod:`gpudecode.search.batching`):
    at most K utterances are decoded at once; when one finishes, its lanes are released and the
    next waiting utterance (in ``admission_order``: ``longest-first``, ``shortest-first`` or
    ``input``) is admitted into them while the others go on. Results are the same as decoding
    each utterance alone (up to float rounding) and come back in input order.

    ``tuning``: how the search runs (:class:`gpudecode.search.tuning.SearchTuning`; never changes
    the results); ``stats``: a :class:`gpudecode.search.stats.SearchStats` to add the run's
    timings and counts to (None: nothing measured).
    """
    entries = check_scorers(scorers)
    vocab_size = int(entries[0].scorer.vocab_size)
    if options.sentence_end >= vocab_size:
        raise ValueError(f"LabelSyncOptions.sentence_end {options.sentence_end} is outside the "
                         f"vocabulary [0, {vocab_size})")
    num_utts = utterances.num_utterances
    if max_active_utterances is not None:
        if isinstance(max_active_utterances, bool) or not isinstance(max_active_utterances, int) \
                or max_active_utterances < 1:
            raise ValueError(f"max_active_utterances: expected None or an int >= 1, got "
                             f"{max_active_utterances!r}")
        if admission_order not in ADMISSION_ORDERS:
            raise ValueError(f"admission_order: expected one of {', '.join(ADMISSION_ORDERS)}, "
                             f"got {admission_order!r}")
    if num_utts == 0:
        return []
    if max_active_utterances is None:
        layout = LaneLayout(num_groups=num_utts, beam_size=options.beam_size, xp=xp)

        def search():
            return _search(entries, utterances, options, layout, tuning, stats)
    else:
        layout = LaneLayout(num_groups=min(max_active_utterances, num_utts),
                            beam_size=options.beam_size, xp=xp)

        def search():
            return continuous_search(entries, utterances, options, layout, admission_order, tuning, stats)

    if xp is np:
        return search()
    # On CuPy, all work runs on the stream shared with ONNX Runtime (and with to_host), after
    # whatever the caller queued on its own stream (e.g. uploading the inputs).
    with on_shared_stream(xp.cuda.Device().id):
        return search()


def _search(entries, utterances: UtteranceBatch, options: LabelSyncOptions, layout: LaneLayout,
            tuning: SearchTuning, stats: SearchStats | None) -> list[list[Hypothesis]]:
    groups = np.arange(layout.num_groups, dtype=np.int64)
    limits = options.label_limits(utterances.input_lengths)
    begun: list[ScorerEntry] = []
    try:
        for entry in entries:
            entry.scorer.begin(layout)
            begun.append(entry)
            entry.scorer.admit(utterances, groups)
        contexts = [e.scorer.initial_context(groups) for e in entries]
        beam, steps = _run(entries, contexts, layout, limits, options, tuning, stats,
                           prompt_lengths(utterances))
    finally:
        for entry in begun:
            entry.scorer.release(groups)
    return _nbest(entries, beam, steps, layout, options, tuning, stats, list(utterances.ids))


def _run(entries, contexts, layout: LaneLayout, limits: np.ndarray, options: LabelSyncOptions,
         tuning: SearchTuning, stats: SearchStats | None,
         prompts: np.ndarray | None = None) -> tuple[Beam, list[tuple[object, object]]]:
    xp = layout.xp
    beam_size = layout.beam_size
    num_lanes = layout.num_lanes

    first_lane = (xp.arange(num_lanes) % beam_size) == 0
    finished = None
    if options.finished != "in-beam":
        finished = Finished.empty(layout.num_groups, beam_size, len(entries), xp)
        if prompts is not None:
            finished.prompt_lengths[...] = xp.asarray(prompts)
    beam = Beam(scores=xp.where(first_lane, np.float32(0), NEG_INF).astype(np.float32),
                 scorer_scores=xp.zeros((len(entries), num_lanes), dtype=np.float32),
                 lengths=xp.zeros(num_lanes, dtype=np.int64),
                 ended=~first_lane, finished=finished, score_max=initial_maxima(len(entries), layout.num_groups, xp))
    lane_limit = xp.asarray(np.repeat(limits, beam_size))
    steps: list[tuple[object, object]] = []  # (parents [N], labels [N]) per step

    max_steps = int(limits.max())
    flags = None
    if tuning.lagged(tuning.lagged_stop_test, xp):
        flags = LaggedReads(xp, lag=tuning.stop_test_lag, wait=tuning.host_wait,
                            clock=None if stats is None else stats.host_waits)
    every = tuning.stop_test_every
    cpu, wall = time.thread_time(), time.perf_counter()
    for step in range(1, max_steps + 1):
        beam, parents, labels, contexts = expand(entries, contexts, beam, layout, options, lane_limit, step,
                                                  tuning, stats)
        steps.append((parents, labels))
        if step == max_steps:
            break
        if flags is None:
            if _all_ended(beam.ended, tuning, stats):
                break
            continue
        if step % every:
            continue
        flags.post(beam.ended.all().reshape(1))
        previous = flags.previous()
        if previous is not None and previous[0]:
            break  # every lane had ended before the last stop_test_lag steps, which only carried them
    if flags is not None:
        flags.drain()
    if stats is not None:
        stats.step_loop.add(time.thread_time() - cpu, time.perf_counter() - wall, len(steps))
    return beam, steps


def _nbest(entries, beam: Beam, steps, layout: LaneLayout, options: LabelSyncOptions,
           tuning: SearchTuning, stats: SearchStats | None, ids: list[str]) -> list[list[Hypothesis]]:
    if beam.finished is not None:
        return _finished_nbest(entries, beam, steps, layout, options, tuning, stats, ids)
    xp, beam_size = layout.xp, layout.beam_size
    ranks = normalised(beam.scores, length_normaliser(beam.lengths, options.length_norm_scale, xp))
    order = best_first(ranks, beam_size, stats)  # [U, B]
    parents = xp.stack([p for p, _ in steps])  # [T, N]
    labels = xp.stack([lab for _, lab in steps])  # [T, N]
    (order, ranks, scores, scorer_scores, lengths, parents, labels, score_max) = read_back(
        tuning, stats, order, ranks, beam.scores, beam.scorer_scores, beam.lengths, parents, labels, beam.score_max)

    # Backtrace of the returned lanes only: one vectorised gather per step.
    returned = returned_lanes(order, options.num_best)
    check_finite(ids, [e.name for e in entries], score_max, ranks[returned[:, 0]])
    num_steps = labels.shape[0]
    lane = returned.ravel()
    traced = np.empty((num_steps, lane.size), labels.dtype)  # traced[t, j]: step t's label of returned lane j
    for t in range(num_steps - 1, -1, -1):
        traced[t] = labels[t, lane]
        lane = parents[t, lane]

    with no_cyclic_gc():
        return hypotheses(returned, ranks, scores, scorer_scores, lengths, traced.T, entries, options)


def _finished_nbest(entries, beam: Beam, steps, layout: LaneLayout, options: LabelSyncOptions,
                    tuning: SearchTuning, stats: SearchStats | None, ids: list[str]) -> list[list[Hypothesis]]:
    """``finished="separate"``: the n-best lists are the finished lists; each entry is traced back
    from the lane its last label extended, at the step it ended."""
    xp, finished = layout.xp, beam.finished
    order = best_first(finished.ranks, layout.beam_size, stats)
    parents = xp.stack([p for p, _ in steps])  # [T, N]
    labels = xp.stack([lab for _, lab in steps])  # [T, N]
    (order, ranks, scores, scorer_scores, lengths, ends, lanes, last, parents, labels, score_max) = read_back(
        tuning, stats, order, finished.ranks, finished.scores, finished.scorer_scores, finished.lengths,
        finished.steps, finished.lanes, finished.labels, parents, labels, beam.score_max)
    returned = returned_lanes(order, options.num_best)
    check_finite(ids, [e.name for e in entries], score_max, ranks[returned[:, 0]])
    entry = returned.ravel()
    end, lane, label = ends[entry] - 1, lanes[entry], last[entry]  # end: the step's row in steps
    num_steps = labels.shape[0]
    traced = np.full((num_steps, entry.size), -1, labels.dtype)
    for t in range(num_steps - 1, -1, -1):
        before = t < end
        traced[t] = np.where(t == end, label, np.where(before, labels[t, lane], -1))
        lane = np.where(before, parents[t, lane], lane)
    with no_cyclic_gc():
        return hypotheses(returned, ranks, scores, scorer_scores, lengths, traced.T, entries, options)
