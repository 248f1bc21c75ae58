"""Time-synchronous CTC decoding over [utterances, beam] lanes, on numpy or CuPy.

**Prefix beam search** (:func:`ctc_prefix_search`). Every lane holds one label sequence (a
*prefix*) with two path scores: ``blank_logp`` (alignments of the prefix that end in blank) and
``label_logp`` (alignments that end in the prefix's last label). Per frame ``t`` with frame
log-probs ``x`` each lane offers

- its own prefix, unchanged ("stay", kept in the candidate column of the blank label):
  ``blank_logp' = logaddexp(blank_logp, label_logp) + x[blank]`` and
  ``label_logp' = label_logp + x[last]`` (the last label repeated: a loop);
- every extension by a label ``c != blank``: ``label_logp' = logaddexp(blank_logp, label_logp)
  + x[c]``, or only ``blank_logp + x[c]`` when ``c`` repeats the last label (a repeated label
  needs a blank in between).

An extension that yields a label sequence already held by another lane of the utterance is
*recombined* into that lane's stay candidate (log-sum-exp of the path scores) before ranking.
Sequences are compared on the device: a rolling hash of the label sequence finds the candidate
pairs, and a collision check confirms each pair by comparing the label histories (the tree of
emitted labels, walked from both ends until the two paths meet). A label's frame (for CTM times)
is the frame at which it entered the prefix, moved to a later frame when an extension merged
there outweighs all the prefix's earlier paths. Per utterance the best
``beam_size`` candidates survive (deterministic top-k, ties to the lower lane, then the lower
label), ranked by ``logaddexp(blank_logp, label_logp) + Σ scale · lm_score``.

**LM fusion**: any label scorer (``(name, scorer, scale)``) is scored on label emission. Scorer
contexts move with :meth:`~gpudecode.scorers.LabelScorer.extend_transitions`: an emitted label
is a ``LABEL`` transition, a stay is ``BLANK`` or ``LOOP`` and carries the context. A context
that did not change keeps its score vector (the cache, ``max_cached_score_vectors``): the search
takes new rows only for the lanes that emitted (on numpy it calls a scorer only on frames after
some lane emitted; on CuPy, where reading that back would stop the GPU, after every full frame).

**Batching**: U utterances × ``beam_size`` lanes; the frame loop has no Python loop over
utterances, lanes or labels. On CuPy (beams up to 32) the frames run in the kernels of
``search/ctc_frame.py`` — a launch per frame with scorers, one for all frames without — with no
device→host transfer per frame. Utterances
shorter than the batch's longest are frozen after their last frame (a frame whose only label is
blank with log-prob 0, which leaves their scores unchanged).

**Greedy** (:func:`ctc_greedy_search`): the best path — argmax per frame, repeats collapsed,
blanks dropped — for all utterances at once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from gpudecode import defaults
from gpudecode.scorers.base import LaneLayout, Transition, UtteranceBatch
from gpudecode.scorers.combine import ScorerEntry, check_scorers, checked_scores, combine_scores
from gpudecode.search.emission_tree import HASH_MULTIPLIER, emission_tree_nbest, same_label_paths
from gpudecode.search.frame_graphs import AlternatingGraphs, FrameCaptureFailed
from gpudecode.search.nonfinite import check_scores, folded_group_maxima, initial_maxima
from gpudecode.search.options import check_frames, check_time_sync_options, on_search_stream, option_error
from gpudecode.search.results import Hypothesis
from gpudecode.search.scorer_cache import refresh, scorer_moves
from gpudecode.search import ctc_cpu, ctc_frame
from gpudecode.search.prune import best_first, prune
from gpudecode.search.stats import SearchStats, read_back
from gpudecode.search.tuning import DEFAULT_TUNING, SearchTuning

_NEG_INF = np.float32(-np.inf)
#: The name of the CTC score in :attr:`Hypothesis.scores`.
CTC_SCORE_NAME = "ctc"
#: The input name under which the search hands the frame log-probs to its scorers' ``admit``.
LOG_PROBS_INPUT = "log-probs"


@dataclass(frozen=True, kw_only=True)
class CtcPrefixOptions:
    """Settings of the CTC prefix beam search.

    - ``beam_size``: prefixes kept per utterance;
    - ``blank``: the blank label index;
    - ``score_threshold``: drop candidates whose score is worse than the utterance's best
      candidate by more than this (kept: score >= best - threshold; None: off). pyctcdecode's
      ``beam_prune_logp`` is its negative, with the same comparison, also after merging and
      before the top beam, but on each ending (blank / label) of a prefix, where a candidate here
      is a prefix with both endings summed;
    - ``token_min_logp``: per-frame label pruning, pyctcdecode's rule (its ``token_min_logp``,
      default -5 there): at each frame only the labels whose log-prob is >= this, and the frame's
      best label (the first maximum), take part — blank, repeat and extension alike; every other
      label counts as log-prob -inf (:func:`prune_labels`). Scores then sum only the kept paths.
      None (default): off. Must be <= 0. Applied before ``blank_skip_threshold_logp``;
    - ``blank_skip_threshold_logp``: a frame whose blank log-prob exceeds this is treated as a pure
      blank frame (no label, no loop: only the blank transition; no scoring, no pruning); None:
      off. Must be <= 0 (log 0.999 ≈ -0.001);
    - ``sentence_end``: where set, each scorer's score of this label is added at the end of the
      utterance (the LM's end-of-sentence probability); None: nothing is added;
    - ``max_cached_score_vectors``: score vectors of unchanged scorer contexts are kept and
      reused when this is at least the number of lanes (utterances × beam); below that (e.g. 0)
      every scorer scores every lane at every frame;
    - ``nbest``: hypotheses returned per utterance (None: ``beam_size``);
    - ``hash_modulus``: modulus of the rolling label-sequence hash (small values force
      collisions, which the collision check resolves; for tests);
    - ``history_compare_steps``: label-history comparisons per frame for pairs whose hashes
      match but whose emission nodes differ; pairs still undecided after that many steps make
      the search run again with the comparison taken to the end (with host synchronisation).
      None: always to the end. The fused CuPy kernel (no scorers) always compares to the end.
    """

    beam_size: int
    blank: int = 0
    score_threshold: float | None = None
    token_min_logp: float | None = None
    blank_skip_threshold_logp: float | None = None
    sentence_end: int | None = None
    max_cached_score_vectors: int = defaults.MAX_CACHED_SCORE_VECTORS
    nbest: int | None = None
    hash_modulus: int = 2**31 - 1
    history_compare_steps: int | None = 2

    def __post_init__(self) -> None:
        check_time_sync_options(self)
        if self.blank_skip_threshold_logp is not None and not (
                math.isfinite(self.blank_skip_threshold_logp) and self.blank_skip_threshold_logp <= 0):
            raise option_error(self, "blank_skip_threshold_logp", "None or a log-probability <= 0")
        if self.token_min_logp is not None:
            value = self.token_min_logp
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                    math.isfinite(value) and value <= 0):
                raise option_error(self, "token_min_logp", "None or a finite log-probability <= 0 "
                                   "(pyctcdecode's default: -5)")
            object.__setattr__(self, "token_min_logp", float(value))

    @property
    def num_best(self) -> int:
        return self.beam_size if self.nbest is None else self.nbest


def prune_labels(log_probs, token_min_logp: float, xp: ModuleType = np):
    """``log_probs`` [..., V] with pyctcdecode's per-frame label pruning: each entry below
    ``token_min_logp`` (compared in float32) that is not its row's best label (``argmax``, the first
    maximum) set to -inf. A NaN is dropped unless it is the argmax (numpy's argmax takes the first
    NaN), so a NaN row keeps one NaN and the search's non-finite check still sees it."""
    vocab_size = log_probs.shape[-1]
    best = log_probs.argmax(axis=-1)[..., None]
    keep = (log_probs >= np.float32(token_min_logp)) | (xp.arange(vocab_size) == best)
    pruned = log_probs.copy()
    xp.copyto(pruned, _NEG_INF, where=~keep)
    return pruned


def _check_log_probs(log_probs, lengths, xp, read) -> tuple[object, np.ndarray]:
    (lengths,) = read(lengths)
    lengths = check_frames(log_probs, lengths, xp, "log_probs", "V")
    return log_probs.astype(np.float32, copy=False), lengths


# --- greedy ----------------------------------------------------------------------------------
def ctc_greedy_search(log_probs, lengths, *, blank: int = 0, xp: ModuleType = np, ids: Sequence[str] | None = None,
                      tuning: SearchTuning = DEFAULT_TUNING, stats: SearchStats | None = None
                      ) -> list[list[Hypothesis]]:
    """Best-path decoding of all utterances at once; per utterance a one-entry n-best list.

    ``log_probs`` [U, T, V] float on ``xp``, ``lengths`` [U] valid frames. The hypothesis is the
    argmax label per frame with repeats collapsed and blanks dropped; its score (and
    ``scores["ctc"]``) is the best path's log-probability (the sum of the frame maxima), and
    ``frames`` holds the first frame of each emitted label. Equal maxima go to the lower label.
    ``tuning`` and ``stats`` as for :func:`ctc_prefix_search`.
    """
    read = functools.partial(read_back, tuning, stats)
    log_probs, lengths = _check_log_probs(log_probs, lengths, xp, read)
    num_utts, num_frames, vocab_size = log_probs.shape
    if not 0 <= blank < vocab_size:
        raise ValueError(f"blank {blank} is outside the vocabulary [0, {vocab_size})")
    if num_utts == 0:
        return []
    ids = [str(u) for u in range(num_utts)] if ids is None else list(ids)

    def run():
        best = log_probs.argmax(axis=2)  # [U, T]; numpy and CuPy both take the first maximum
        best_logp = xp.take_along_axis(log_probs, best[:, :, None], axis=2)[:, :, 0]
        valid = xp.arange(num_frames)[None, :] < xp.asarray(lengths)[:, None]
        previous = xp.concatenate([xp.full((num_utts, 1), -1, dtype=best.dtype), best[:, :-1]], axis=1)
        emitted = valid & (best != blank) & (best != previous)
        score = xp.where(valid, best_logp, np.float32(0)).sum(axis=1, dtype=np.float32)
        return read(best, emitted, score)

    best, emitted, score = on_search_stream(xp, run)
    check_scores(ids, CTC_SCORE_NAME, score)  # NaN or +inf: a frame log-prob was
    results = []
    for u in range(num_utts):
        frames = np.flatnonzero(emitted[u])
        results.append([Hypothesis(labels=best[u, frames].tolist(), score=float(score[u]),
                                   scores={CTC_SCORE_NAME: float(score[u])}, length=len(frames),
                                   frames=frames.tolist())])
    return results


# --- prefix beam search ----------------------------------------------------------------------
def ctc_prefix_search(log_probs, lengths, options: CtcPrefixOptions, lm_scorers: Sequence = (),
                      xp: ModuleType = np, *, ids: Sequence[str] | None = None,
                      tuning: SearchTuning = DEFAULT_TUNING, stats: SearchStats | None = None
                      ) -> list[list[Hypothesis]]:
    """CTC prefix beam search of all utterances at once; per utterance the n-best, best first.

    ``log_probs`` [U, T, V] float frame log-probabilities on ``xp``; ``lengths`` [U] valid frames
    per utterance; ``lm_scorers``: (name, scorer, scale) triples fused on label emission (their
    ``vocab_size`` must be V; the name ``"ctc"`` is taken). The scorers are begun with the lane
    layout, admitted (``UtteranceBatch.inputs["log-probs"]`` holds ``log_probs``) and released
    here. ``ids``: utterance ids handed to the scorers (default ``"0"``, ``"1"``, ...).

    Each hypothesis has ``score`` = CTC log-prob + Σ scale · scorer score, ``scores["ctc"]`` and
    each scorer's unscaled score, and ``frames``: the frame at which each label was emitted.

    ``tuning``: how the search runs (:class:`gpudecode.search.tuning.SearchTuning`; never changes
    the results); ``stats``: a :class:`gpudecode.search.stats.SearchStats` to add the run's counts
    to (None: nothing counted).
    """
    read = functools.partial(read_back, tuning, stats)
    log_probs, lengths = _check_log_probs(log_probs, lengths, xp, read)
    num_utts, _, vocab_size = log_probs.shape
    if options.blank >= vocab_size:
        raise ValueError(f"CtcPrefixOptions.blank {options.blank} is outside the vocabulary "
                         f"[0, {vocab_size})")
    if options.sentence_end is not None and options.sentence_end >= vocab_size:
        raise ValueError(f"CtcPrefixOptions.sentence_end {options.sentence_end} is outside the "
                         f"vocabulary [0, {vocab_size})")
    entries = check_scorers(lm_scorers) if len(lm_scorers) else ()
    for entry in entries:
        if entry.name == CTC_SCORE_NAME:
            raise ValueError(f"scorer name {CTC_SCORE_NAME!r} is taken by the CTC score; rename "
                             "the scorer")
        if int(entry.scorer.vocab_size) != vocab_size:
            raise ValueError(f"scorer {entry.name!r}: vocab_size {entry.scorer.vocab_size} does not "
                             f"match the log-probs' V={vocab_size}")
    if num_utts == 0:
        return []
    ids = [str(u) for u in range(num_utts)] if ids is None else list(ids)
    if len(ids) != num_utts:
        raise ValueError(f"ids: {len(ids)} ids for {num_utts} utterances")
    layout = LaneLayout(num_groups=num_utts, beam_size=options.beam_size, xp=xp)
    utterances = UtteranceBatch(ids=ids, input_lengths=lengths, inputs={LOG_PROBS_INPUT: log_probs})

    def search(tuning: SearchTuning, exact: bool):
        return _PrefixSearch(log_probs, lengths, options, entries, layout, tuning, stats).run(utterances, exact=exact)

    def run():
        nonlocal tuning
        try:
            result = search(tuning, options.history_compare_steps is None)
        except FrameCaptureFailed as exc:  # the frames as launches, from the start
            warnings.warn(f"{exc}; the search runs its frames without CUDA graphs "
                          "(search.tuning.captured_ctc_frames: false avoids the attempt)", stacklevel=2)
            tuning = dataclasses.replace(tuning, captured_ctc_frames=False)
            result = search(tuning, options.history_compare_steps is None)
        if result is None:  # a pair stayed undecided within history_compare_steps: compare fully
            result = search(tuning, True)
        return result

    return on_search_stream(xp, run)


class _PrefixSearch:
    """One run of the prefix beam search; lane state as arrays on ``xp`` (N = U × beam lanes).

    Emission nodes: every emitted label becomes node ``1 + k * N + lane`` (k: the index of the
    frame among the frames that are searched in full), with its parent node and label in
    ``node_parent`` / ``node_label``; node 0 is the empty prefix. A lane's node is its prefix's
    last emission; the tree gives the collision check and the final label sequences.
    """

    def __init__(self, log_probs, lengths: np.ndarray, options: CtcPrefixOptions,
                 entries: Sequence[ScorerEntry], layout: LaneLayout, tuning: SearchTuning = DEFAULT_TUNING,
                 stats: SearchStats | None = None) -> None:
        self.log_probs, self.lengths, self.options = log_probs, lengths, options
        self.entries, self.layout = tuple(entries), layout
        self.xp = layout.xp
        self.scales = [e.scale for e in self.entries]
        self.tuning, self.stats = tuning, stats
        self.read = functools.partial(read_back, tuning, stats)

    # --- the frame loop ----------------------------------------------------------------------
    def run(self, utterances: UtteranceBatch, *, exact: bool):
        """The n-best lists, or None when ``exact`` is False and a comparison stayed undecided."""
        xp, layout, options = self.xp, self.layout, self.options
        num_utts, beam, num_lanes = layout.num_groups, layout.beam_size, layout.num_lanes
        vocab_size, blank = self.log_probs.shape[2], options.blank
        in_kernel = self.tuning.fused_ctc_frames and ctc_frame.use_kernel(xp, beam)
        fused = in_kernel and not self.entries  # every frame in one launch
        in_loop = not in_kernel and ctc_cpu.use_loop(xp, self.tuning, self.stats)
        compiled = in_loop and not self.entries  # every frame in one compiled call
        self.lengths_dev = xp.asarray(self.lengths)
        # per utterance the largest frame log-prob (NaN or +inf: non-finite scores), before pruning
        self.input_max = _frame_maxima(self.log_probs, self.lengths_dev, xp)
        # label pruning: the compiled loops prune each frame themselves; the others search pruned log-probs
        self.prune_in_loop = in_loop and options.token_min_logp is not None
        if options.token_min_logp is not None and not in_loop:
            self.log_probs = prune_labels(self.log_probs, options.token_min_logp, xp)
        frame_kinds = self._frame_kinds()  # host [T]: 0 idle, 1 blank only, 2 full
        num_full = int((frame_kinds == 2).sum())

        groups = np.arange(num_utts, dtype=np.int64)
        blank_logp = np.full(num_lanes, _NEG_INF, dtype=np.float32)
        blank_logp[::beam] = 0  # each utterance starts from one lane: the empty prefix
        self.blank_logp = xp.asarray(blank_logp)
        self.label_logp = xp.full(num_lanes, _NEG_INF, dtype=np.float32)
        self.last = xp.full(num_lanes, -1, dtype=np.int64)
        self.length = xp.zeros(num_lanes, dtype=np.int64)
        self.hash = xp.zeros(num_lanes, dtype=np.int64)
        self.prev_hash = xp.zeros(num_lanes, dtype=np.int64)
        self.node = xp.zeros(num_lanes, dtype=np.int64)
        self.node_parent = xp.zeros(1 + num_full * num_lanes, dtype=np.int64)
        self.node_label = xp.full(1 + num_full * num_lanes, -1, dtype=np.int64)
        self.node_frames: list[int] = []  # per full frame k: its frame index t
        self.unresolved = xp.zeros((), dtype=bool)
        self.lm_scores = xp.zeros((len(self.entries), num_lanes), dtype=np.float32)
        self.ids = list(utterances.ids)
        self.lm_max = initial_maxima(len(self.entries), num_utts, xp)  # per utterance the largest scorer score
        if fused or compiled:
            loop = functools.partial(ctc_frame.search_kernel, prefilter=self.tuning.ctc_prefilter) if fused \
                else functools.partial(ctc_cpu.search_frames, threads=self.tuning.cpu_threads)
            state, self.node_frames, self.unresolved = loop(
                self.log_probs, self.lengths_dev, getattr(self, "skip", None), frame_kinds,
                (self.blank_logp, self.label_logp, self.last, self.length, self.hash, self.prev_hash, self.node),
                self.node_parent, self.node_label, options, beam)
            self.blank_logp, self.label_logp, self.last, self.length, self.hash, self.prev_hash, self.node = state
            if self.stats is not None and fused:
                self.stats.fused_launches += 1
            return self._nbest(exact)
        lanes = xp.arange(num_lanes, dtype=np.int64)
        self.lane_group = lanes // beam
        self.group_base = (xp.arange(num_utts, dtype=np.int64) * beam)[:, None]
        self.blank_column = xp.arange(vocab_size) == blank

        begun: list[ScorerEntry] = []
        try:
            for entry in self.entries:
                entry.scorer.begin(layout)
                begun.append(entry)
                entry.scorer.admit(utterances, groups)
            self.contexts = [e.scorer.initial_context(groups) for e in self.entries]
            # contexts[s] covers the lanes of the frame at which it was made; scorer_lane maps
            # each current lane to its lane there (identity right after an extension)
            self.scorer_lane = lanes.copy()
            self.cache_enabled = options.max_cached_score_vectors >= num_lanes
            self.cache = [xp.zeros((num_lanes, vocab_size), dtype=np.float32) for _ in self.entries]
            self.changed = xp.ones(num_lanes, dtype=bool)  # lanes whose scorer context is new
            self.rescore = bool(self.entries)  # host: some lane's context is new

            frames = (self.log_probs, self.lengths_dev, getattr(self, "skip", None), frame_kinds, options, beam)
            if in_kernel:  # a launch per full frame, the scorers run between them
                self._kernel_frames(frame_kinds, ctc_frame.FrameLauncher(
                    *frames, prefilter=self.tuning.ctc_prefilter, with_scorers=True), sync=False)
            elif in_loop:  # a compiled call per full frame
                self._kernel_frames(frame_kinds, ctc_cpu.ScoredFrameLoop(*frames, threads=self.tuning.cpu_threads),
                                    sync=True)
            else:
                for t, kind in enumerate(frame_kinds.tolist()):
                    if kind == 1:
                        self._blank_frame(t)
                    elif kind == 2:
                        self._full_frame(t, exact)
            if options.sentence_end is not None and self.entries:
                self._score_contexts(self.lengths_dev[self.lane_group])
                end = xp.stack([c[:, options.sentence_end] for c in self.cache])  # [S, N]
                self.lm_scores = self.lm_scores + end
            return self._nbest(exact)
        finally:
            for entry in begun:
                entry.scorer.release(groups)

    def _frame_kinds(self) -> np.ndarray:
        """Host [T] int8: 0 no utterance has the frame, 1 every utterance that has it skips it
        (blank only), 2 searched in full. One transfer, before the frame loop."""
        xp, lp = self.xp, self.log_probs
        num_frames = lp.shape[1]
        active = np.arange(num_frames)[None, :] < self.lengths[:, None]  # [U, T] host
        threshold = self.options.blank_skip_threshold_logp
        if threshold is None:
            full = active.any(axis=0)
            return np.where(full, 2, 0).astype(np.int8)
        blank_column = lp[:, :, self.options.blank]
        if self.prune_in_loop:  # the blank as the loop will see it
            blank_column = prune_labels(lp, self.options.token_min_logp, xp)[:, :, self.options.blank]
        (skip,) = self.read(blank_column > np.float32(threshold))
        self.skip = xp.asarray(skip)
        full = (active & ~skip).any(axis=0)
        return np.where(full, 2, np.where(active.any(axis=0), 1, 0)).astype(np.int8)

    def _frame_log_probs(self, t: int):
        """[U, V]: frame t's log-probs; utterances past their end see a blank of log-prob 0,
        skipped frames only their blank."""
        xp, lp, blank = self.xp, self.log_probs, self.options.blank
        x = lp[:, t, :]
        active = t < self.lengths_dev  # [U]
        keep = active
        if self.options.blank_skip_threshold_logp is not None:
            keep = active & ~self.skip[:, t]
        blank_value = xp.where(active, x[:, blank], np.float32(0))
        only_blank = xp.where(self.blank_column[None, :], blank_value[:, None], _NEG_INF)
        return xp.where(keep[:, None], x, only_blank)

    def _blank_frame(self, t: int) -> None:
        """A frame every active utterance skips: only the blank transition, lanes keep order."""
        xp, blank = self.xp, self.options.blank
        active = t < self.lengths_dev
        blank_logp = xp.where(active, self.log_probs[:, t, blank], np.float32(0))[self.lane_group]
        total = xp.logaddexp(self.blank_logp, self.label_logp)
        self.blank_logp = total + blank_logp
        self.label_logp = xp.full_like(self.label_logp, _NEG_INF)

    def _full_frame(self, t: int, exact: bool) -> None:
        xp, options = self.xp, self.options
        layout = self.layout
        num_utts, beam, num_lanes = layout.num_groups, layout.beam_size, layout.num_lanes
        vocab_size, blank = self.log_probs.shape[2], options.blank
        x = self._frame_log_probs(t)  # [U, V]
        if self.rescore:
            self._score_contexts(xp.full(num_lanes, t, dtype=np.int64))

        # candidates [N, V]: extensions by every label; the stay candidate in the blank column
        blank_logp, label_logp = self.blank_logp, self.label_logp
        total = xp.logaddexp(blank_logp, label_logp)
        has_last = self.last >= 0
        safe_last = xp.maximum(self.last, 0)
        x_last = x[self.lane_group, safe_last]
        emit = (total.reshape(num_utts, beam, 1) + x.reshape(num_utts, 1, vocab_size)).reshape(
            num_lanes, vocab_size)
        lanes = xp.arange(num_lanes)
        emit[lanes, safe_last] = xp.where(has_last, blank_logp + x_last, emit[lanes, safe_last])
        emit[:, blank] = _NEG_INF
        stay_blank = total + x[self.lane_group, blank]
        stay_label = xp.where(has_last, label_logp + x_last, _NEG_INF)

        # recombination: the extension of lane i by lane j's last label that spells j's prefix
        match_lane, matched = self._recombination(total > _NEG_INF, exact)
        merged = emit[match_lane, safe_last]
        # the last label is re-timed to this frame when the new emission outweighs its old paths
        retime = matched & (merged > xp.logaddexp(stay_blank, stay_label))
        stay_label = xp.where(matched, xp.logaddexp(stay_label, merged), stay_label)
        emit[match_lane, xp.where(matched, safe_last, blank)] = _NEG_INF

        fused = None
        if self.entries:
            fused = combine_scores(self.lm_scores, self.scales)  # [N]
            lm_term = combine_scores(self.cache, self.scales)  # [N, V]
            candidates = emit + fused[:, None] + lm_term
            stay_rank = xp.logaddexp(stay_blank, stay_label) + fused
        else:
            candidates = emit.copy()
            stay_rank = xp.logaddexp(stay_blank, stay_label)
        candidates[:, blank] = stay_rank
        alive, parents, labels = prune(candidates, beam, num_utts, xp, score_threshold=options.score_threshold,
                                       group_base=self.group_base, stats=self.stats)
        stay = (labels == blank) | ~alive
        emitted = ~stay

        # the new lanes
        k = len(self.node_frames)
        self.node_frames.append(t)
        base = 1 + k * num_lanes
        new_hash = (self.hash[parents] * HASH_MULTIPLIER + labels + 1) % options.hash_modulus
        retimed = stay & alive & retime[parents]  # a new node: same label and parent, this frame
        parent_node = self.node[parents]
        self.node_parent[base:base + num_lanes] = xp.where(retimed, self.node_parent[parent_node],
                                                           parent_node)
        self.node_label[base:base + num_lanes] = xp.where(retimed, self.last[parents], labels)
        parent_stay_blank, parent_stay_label = stay_blank[parents], stay_label[parents]
        self.blank_logp = xp.where(stay & alive, parent_stay_blank, _NEG_INF)
        self.label_logp = xp.where(stay, xp.where(alive, parent_stay_label, _NEG_INF),
                                   emit[parents, labels])
        self.node = xp.where(stay & ~retimed, parent_node, base + lanes)
        self.prev_hash = xp.where(stay, self.prev_hash[parents], self.hash[parents])
        self.hash = xp.where(stay, self.hash[parents], new_hash)
        self.last = xp.where(stay, self.last[parents], labels)
        self.length = self.length[parents] + emitted

        if self.entries:
            safe_labels = xp.where(stay, 0, labels)
            self.cache = [c[parents] for c in self.cache]
            gained = xp.stack([xp.where(stay, np.float32(0), c[lanes, safe_labels]) for c in self.cache])
            self.lm_scores = self.lm_scores[:, parents] + gained
            transitions = xp.where(emitted, int(Transition.LABEL),
                                   xp.where(parent_stay_label > parent_stay_blank,
                                            int(Transition.LOOP), int(Transition.BLANK)))
            self._extend_contexts(parents, xp.where(emitted, labels, -1), transitions, emitted)

    def _kernel_frames(self, frame_kinds: np.ndarray, launcher, sync: bool) -> None:
        """The frame loop with scorers as calls of ``launcher`` (``ctc_frame.FrameLauncher``: the
        CUDA kernel ``ctc_prefix_frames_scored_<K>``; ``ctc_cpu.ScoredFrameLoop``: its compiled CPU
        loop): each runs the frames up to and including the next full frame (ranked with the
        scorers' cached terms) and reports its moves; between calls the scorer contexts move and
        the lanes that emitted are scored. ``sync`` False (CuPy): the contexts are extended after
        every full frame, without reading back whether any lane emitted; where the scorers allow
        it (``SearchTuning.captured_ctc_frames``) the frames after the first few are replayed as
        CUDA graphs (:class:`_FrameReplays`)."""
        xp = self.xp
        state = tuple(xp.ascontiguousarray(getattr(self, name)) for name in ctc_frame.LANE_STATE)
        full_frames = np.flatnonzero(frame_kinds == 2).tolist()
        replays = None
        if not sync and _FrameReplays.applies(self, launcher, len(full_frames)):
            replays = _FrameReplays(self, launcher, state, full_frames)
        begin = 0
        for k, t in enumerate(full_frames):
            if replays is not None and k >= _EAGER_FRAMES:
                replays.run(k)
                if self.stats is not None:
                    self.stats.replayed_frames += 1
            else:
                self._scored_frame(launcher, state, begin, t, k, sync)
            if self.stats is not None and isinstance(launcher, ctc_frame.FrameLauncher):
                self.stats.fused_launches += 1
            self.node_frames.append(t)
            begin = t + 1
        if replays is not None:
            replays.finish()
            # the state is now arrays of the captures' memory pool (AlternatingGraphs.finish): the
            # pool is held as long as this search
            self.frame_replays = replays
        if begin < launcher.num_frames:  # blank-only frames after the last full one
            launcher.launch(state, self.node_parent, self.node_label, begin, launcher.num_frames,
                            len(self.node_frames))
        for name, array in zip(ctc_frame.LANE_STATE, state):
            setattr(self, name, array)

    def _scored_frame(self, launcher, state, begin: int, t: int, k: int, sync: bool, *, step=None,
                      frames=None) -> None:
        """Frames [begin, t] through ``launcher`` (t the k-th full frame) and the scorer moves after
        it; ``step`` and ``frames`` (device arrays: [begin, t + 1, k] and t per lane) where a CUDA
        graph replays the frame (the host values are then not read)."""
        xp, num_lanes = self.xp, self.layout.num_lanes
        if frames is None:
            frames = xp.full(num_lanes, t, dtype=np.int64)
        lm_term, lm_total = self._score_contexts(frames, terms=True)
        replayed = {} if step is None else {"step": step}  # only the CUDA kernel replays
        launcher.launch(state, self.node_parent, self.node_label, begin, t + 1, k,
                        xp.ascontiguousarray(lm_term), xp.ascontiguousarray(lm_total), **replayed)
        parents, labels = launcher.parents, launcher.labels
        self.cache, self.lm_scores, moved_changed, scorer_parents = scorer_moves(
            xp, self.cache, self.lm_scores, self.changed, self.scorer_lane, parents, labels)
        self._extend_contexts(parents, labels, launcher.transitions, labels >= 0, sync=sync,
                              moved=(scorer_parents, moved_changed))

    def _frame_state(self) -> tuple:
        """What a scored frame replaces (:class:`_FrameReplays`)."""
        return (self.cache, self.lm_scores, self.changed, self.scorer_lane, self.lm_max, self.contexts,
                self.rescore)

    def _set_frame_state(self, state: tuple) -> None:
        (self.cache, self.lm_scores, self.changed, self.scorer_lane, self.lm_max, self.contexts,
         self.rescore) = state

    # --- recombination and the collision check -------------------------------------------------
    def _recombination(self, alive, exact: bool):
        """Per lane j: the lane i of its utterance whose prefix + j's last label is j's prefix.

        Returns (i [N] int64, matched [N] bool). Hash pairs are confirmed by the emission tree:
        equal when j's parent node is i's node, else by walking both label paths back.
        """
        xp, layout = self.xp, self.layout
        num_utts, beam = layout.num_groups, layout.beam_size
        shape = (num_utts, beam, beam)  # [u, j, i]
        hash_i = self.hash.reshape(num_utts, 1, beam)
        length_i = self.length.reshape(num_utts, 1, beam)
        alive_i = alive.reshape(num_utts, 1, beam)
        prev_hash_j = self.prev_hash.reshape(num_utts, beam, 1)
        length_j = self.length.reshape(num_utts, beam, 1)
        alive_j = alive.reshape(num_utts, beam, 1)
        candidate = ((hash_i == prev_hash_j) & (length_i + 1 == length_j) & alive_i & alive_j)
        node_i = xp.broadcast_to(self.node.reshape(num_utts, 1, beam), shape)
        node_j = xp.broadcast_to(self.node_parent[self.node].reshape(num_utts, beam, 1), shape)
        equal, unresolved = same_label_paths(candidate, node_i, node_j, self.node_label, self.node_parent,
                                             None if exact else self.options.history_compare_steps, self.read)
        if unresolved is not None:
            self.unresolved = self.unresolved | unresolved
        matched = equal.any(axis=2).reshape(-1)
        match_lane = (self.group_base + equal.astype(np.int8).argmax(axis=2)).reshape(-1)
        return match_lane, matched

    # --- scorers ---------------------------------------------------------------------------------
    def _score_contexts(self, frames, terms: bool = False):
        """New score vectors for the lanes whose context changed (all lanes without the cache);
        with ``terms`` returns (lm_term [N, V], lm_total [N]) of the refreshed cache
        (:func:`gpudecode.search.scorer_cache.scorer_terms`)."""
        xp, num_lanes = self.xp, self.layout.num_lanes
        scores = None
        if self.rescore:
            vocab_size = self.log_probs.shape[2]
            live = (self.blank_logp > _NEG_INF) | (self.label_logp > _NEG_INF)
            scores = [checked_scores(entry, entry.scorer.score(entry.scorer.at_frames(ctx, frames)), num_lanes,
                                     vocab_size, xp) for entry, ctx in zip(self.entries, self.contexts)]
            self.lm_max = folded_group_maxima(self.lm_max, scores, self.layout.num_groups, xp, live=live)
        self.cache, result = refresh(xp, self.cache, self.scales, self.lm_scores, scores,
                                     self.changed if self.cache_enabled else None, terms=terms)
        if scores is not None:
            self.rescore = False
            self.changed = xp.zeros(num_lanes, dtype=bool)
        return result

    def _extend_contexts(self, parents, labels, transitions, emitted, sync: bool = True, moved=None) -> None:
        """Scorer contexts of the new lanes: extended where a lane emitted (the cache decides
        whether unchanged lanes only move their mapping; ``sync`` False: extended always, without
        reading whether any lane emitted). ``moved``: (the scorer rows, the changed flags) of the
        new lanes where :func:`~gpudecode.search.scorer_cache.scorer_moves` made them."""
        xp = self.xp
        scorer_parents = self.scorer_lane[parents] if moved is None else moved[0]
        if self.cache_enabled:
            if sync:
                (any_emitted,) = self.read(emitted.any())
                if not any_emitted:
                    self.scorer_lane = scorer_parents
                    return
            self.changed = self.changed[parents] | emitted if moved is None else moved[1]
        self.contexts = [e.scorer.extend_transitions(c, scorer_parents, labels, transitions)
                         for e, c in zip(self.entries, self.contexts)]
        self.scorer_lane = xp.arange(self.layout.num_lanes, dtype=np.int64)
        self.rescore = True

    # --- results ---------------------------------------------------------------------------------
    def _nbest(self, exact: bool):
        xp, layout, options = self.xp, self.layout, self.options
        beam = layout.beam_size
        ctc = xp.logaddexp(self.blank_logp, self.label_logp)
        ranks = ctc + combine_scores(self.lm_scores, self.scales) if self.entries else ctc
        order = best_first(ranks, beam, self.stats)
        return emission_tree_nbest(order, ranks, {CTC_SCORE_NAME: ctc}, self.lm_scores, self.entries, self.node,
                                   self.node_parent, self.node_label, self.node_frames, options.num_best,
                                   self.read, unresolved=None if exact else self.unresolved,
                                   maxima=xp.concatenate([self.input_max[None, :], self.lm_max]), ids=self.ids)


#: full frames a scored search runs without graphs before it captures them (the kernels, CuPy's
#: and ONNX Runtime's, then exist and ONNX Runtime's memory arena holds what a step needs)
_EAGER_FRAMES = 2


class _FrameReplays:
    """The scored frames of a CuPy prefix search after the first :data:`_EAGER_FRAMES`, replayed as
    two alternating CUDA graphs (:class:`gpudecode.search.frame_graphs.AlternatingGraphs`): the
    frame kernel reads its frame range from ``step``, which each replay first takes from a table of
    every full frame's [begin, t + 1, k] at a device counter, and advances the counter last."""

    def __init__(self, search: _PrefixSearch, launcher, state: tuple, full_frames: list[int]):
        xp = search.xp
        self.search, self.launcher, self.state = search, launcher, state
        begins = [0] + [t + 1 for t in full_frames[:-1]]
        self.table = xp.asarray(np.array([[b, t + 1, k] for k, (b, t) in enumerate(zip(begins, full_frames))],
                                         dtype=np.int64).reshape(-1, 3))
        self.index = xp.zeros(1, dtype=np.int64)
        self.step = xp.zeros(3, dtype=np.int64)
        self.frames = xp.zeros(search.layout.num_lanes, dtype=np.int64)
        self.graphs = AlternatingGraphs(xp, search._frame_state, search._set_frame_state)

    @staticmethod
    def applies(search: _PrefixSearch, launcher, num_full: int) -> bool:
        """On CuPy with the frame kernel, ``captured_ctc_frames`` on, every scorer capturable
        (``LabelScorer.capturable``), the cache on, on the stream ONNX Runtime runs on, and frames
        enough to replay."""
        from gpudecode import backend

        xp = search.xp
        return (search.tuning.captured_ctc_frames and isinstance(launcher, ctc_frame.FrameLauncher)
                and search.cache_enabled and bool(search.entries)
                and all(entry.scorer.capturable for entry in search.entries)
                and num_full >= _EAGER_FRAMES + 4
                and xp.cuda.get_current_stream().ptr == backend.shared_stream(xp.cuda.Device().id).ptr)

    def run(self, k: int) -> None:
        """The k-th full frame as a graph launch (the first two capture the graphs)."""
        if self.graphs.last is None:
            self.index[...] = k
            self._select()  # run once outside the capture: CuPy compiles its kernels here
        self.graphs.step(self._frame)

    def finish(self) -> None:
        """The search's state as the last replayed frame left it."""
        self.graphs.finish()

    def _select(self) -> None:
        self.step[...] = self.table[self.index[0]]
        self.frames[...] = self.step[1] - 1

    def _frame(self) -> None:
        self._select()
        self.search._scored_frame(self.launcher, self.state, 0, 0, 0, False, step=self.step, frames=self.frames)
        self.index += 1


def _frame_maxima(log_probs, lengths, xp):
    """[U] float32: per utterance the largest log-prob of its valid frames (NaN if one is NaN)."""
    valid = xp.arange(log_probs.shape[1])[None, :] < lengths[:, None]
    return xp.where(valid, log_probs.max(axis=2), _NEG_INF).max(axis=1).astype(np.float32, copy=False)
