"""The label-synchronous search's lanes and its step, shared by the static search
(:mod:`gpudecode.search.label_sync`) and continuous batching (:mod:`gpudecode.search.batching`).

Its options (:class:`LabelSyncOptions`), the beam arrays (:class:`Beam`), one search step over all
lanes (:func:`expand`: score, combine, prune per utterance, extend the scorers' contexts), lagged
small reads (:class:`LaggedReads`) and the n-best lists of finished lanes (:func:`hypotheses`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from gpudecode import defaults
from gpudecode.backend import DEFAULT_HOST_WAIT, HostClock, HostWait, wait_for
from gpudecode.scorers.base import LaneLayout
from gpudecode.scorers.combine import checked_scores, combine_scores
from gpudecode.search import label_step
from gpudecode.search.options import coerce_ints, option_error
from gpudecode.search.prune import NEG_INF, length_normaliser, prune
from gpudecode.search.results import Hypothesis, nbest_lists
from gpudecode.search.stats import SearchStats, observed_top_k
from gpudecode.search.topk import top_k_indices
from gpudecode.search.tuning import DEFAULT_TUNING, SearchTuning


@dataclass(frozen=True, kw_only=True)
class LabelSyncOptions:
    """Settings of the label-synchronous search.

    - ``beam_size``: hypotheses kept per utterance;
    - ``sentence_end``: the label index that terminates a hypothesis;
    - ``length_norm_scale``: rank by ``score / length ** length_norm_scale`` (length counts
      labels including sentence-end); 0 ranks by the score itself;
    - ``score_threshold``: drop candidates whose ranking score is worse than the utterance's
      best candidate by more than this (None: off);
    - ``max_labels_per_input``: at most ``floor(max_labels_per_input × input length)`` labels
      per utterance (at least 1), and never more than ``max_labels``;
    - ``nbest``: hypotheses returned per utterance (None: ``beam_size``);
    - ``pre_beam_size``: labels per lane that partial scorers (e.g. ``ctc-prefix``) score, the
      best by the other scorers (None: max(2 × beam_size, 10)).
    """

    beam_size: int
    sentence_end: int
    length_norm_scale: float = 0.0
    score_threshold: float | None = None
    max_labels_per_input: float = defaults.MAX_LABELS_PER_INPUT
    max_labels: int = defaults.MAX_LABELS
    nbest: int | None = None
    pre_beam_size: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return option_error(self, name, expected)

        coerce_ints(self, ("beam_size", "sentence_end", "max_labels", "nbest", "pre_beam_size"))
        if self.pre_beam_size is not None and not (isinstance(self.pre_beam_size, int) and self.pre_beam_size >= 1):
            raise bad("pre_beam_size", "None or an int >= 1")
        if not isinstance(self.beam_size, int) or self.beam_size < 1:
            raise bad("beam_size", "an int >= 1")
        if not isinstance(self.sentence_end, int) or self.sentence_end < 0:
            raise bad("sentence_end", "a label index >= 0")
        if not (math.isfinite(self.length_norm_scale) and self.length_norm_scale >= 0):
            raise bad("length_norm_scale", "a finite number >= 0")
        if self.score_threshold is not None and not self.score_threshold > 0:
            raise bad("score_threshold", "None or a number > 0")
        if not (math.isfinite(self.max_labels_per_input) and self.max_labels_per_input > 0):
            raise bad("max_labels_per_input", "a finite number > 0")
        if not isinstance(self.max_labels, int) or self.max_labels < 1:
            raise bad("max_labels", "an int >= 1")
        if self.nbest is not None and not (isinstance(self.nbest, int)
                                           and 1 <= self.nbest <= self.beam_size):
            raise bad("nbest", f"None or an int in [1, beam_size={self.beam_size}]")

    @property
    def num_best(self) -> int:
        return self.beam_size if self.nbest is None else self.nbest

    def label_limits(self, input_lengths) -> np.ndarray:
        """[U] int64: the most labels (search steps) per utterance."""
        lengths = np.asarray(input_lengths, dtype=np.float64)
        # round first so that e.g. 0.29 * 100 = 28.999999999999996 counts as 29
        limits = np.floor(np.round(self.max_labels_per_input * lengths, 6)).astype(np.int64)
        return np.clip(limits, 1, self.max_labels)


class LaggedReads:
    """Small bool arrays ([size]) sent to the host ``lag`` steps behind the search.

    :meth:`post` queues an array's copy (on CuPy an asynchronous copy into pinned memory behind
    the work queued so far); :meth:`previous` waits for the array posted ``lag`` posts before it.
    ``lag + 1`` pinned buffers take turns, and the host waits on their events through
    :func:`gpudecode.backend.wait_for` (``wait``, napping by default; the waits' time added to
    ``clock`` unless None) instead of spinning."""

    def __init__(self, xp: ModuleType, size: int = 1, lag: int = 1, wait: HostWait = DEFAULT_HOST_WAIT,
                 clock: HostClock | None = None) -> None:
        self._cupy = None if xp is np else xp
        self._wait, self._clock = wait, clock
        self._size, self._lag = size, lag
        self._posted: list = []  # (event or None, slot or values)
        if self._cupy is not None:
            self._pinned = self._cupy.cuda.alloc_pinned_memory((lag + 1) * size)
            self._host = np.frombuffer(self._pinned, np.bool_, (lag + 1) * size).reshape(lag + 1, size)
            self._events = [self._cupy.cuda.Event(block=True, disable_timing=True) for _ in range(lag + 1)]
        self._slot = 0

    def post(self, values) -> None:
        if self._cupy is None:
            self._posted.append((None, np.array(values, dtype=bool).reshape(self._size)))
            return
        cupy, slot = self._cupy, self._slot
        self._slot = (slot + 1) % (self._lag + 1)  # its last copy was read by the previous() before
        stream = cupy.cuda.get_current_stream()
        values = cupy.ascontiguousarray(values, dtype=bool)
        cupy.cuda.runtime.memcpyAsync(self._host[slot].ctypes.data, values.data.ptr, self._size,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self._events[slot].record(stream)
        self._posted.append((self._events[slot], slot))

    def previous(self) -> np.ndarray | None:
        """The array posted ``lag`` posts before the latest one (None: none yet)."""
        if len(self._posted) <= self._lag:
            return None
        event, value = self._posted.pop(0)
        if event is None:
            return value
        wait_for(event, self._wait, self._clock)
        return self._host[value].copy()

    def drain(self) -> None:
        """Waits for every posted copy (the pinned buffers outlive no copy in flight)."""
        for event, _ in self._posted:
            if event is not None:
                wait_for(event, self._wait, self._clock)
        self._posted.clear()


@dataclass
class Beam:
    """The hypotheses of all N lanes, as arrays on ``xp``."""

    scores: object  # [N] float32 combined score; -inf: dead lane
    scorer_scores: object  # [S, N] float32, each scorer's unscaled score
    lengths: object  # [N] int64, labels including sentence-end
    ended: object  # [N] bool, terminated (or dead)


def expand(entries, contexts, beam: Beam, layout: LaneLayout, options: LabelSyncOptions,
           deadline, step: int, tuning: SearchTuning = DEFAULT_TUNING,
           stats: SearchStats | None = None) -> tuple[Beam, object, object, list]:
    """One search step over all N lanes: score, combine, prune per utterance, extend contexts.

    ``deadline``: [N] int64, a lane reaches its utterance's label limit with this step when
    ``deadline <= step``. Returns the new beam, parents [N] and labels [N] (-1: carried) and the
    new contexts.
    """
    xp = layout.xp
    vocab_size = int(entries[0].scorer.vocab_size)
    in_kernel = tuning.fused_label_step and label_step.use_kernel(xp, layout.beam_size, len(entries))
    log_probs, terms = _scores(entries, contexts, layout, options, vocab_size, keep_float16=in_kernel, stats=stats)
    norm = candidate_normaliser(beam, options, xp)
    if in_kernel:
        fields, parents, labels = label_step.select_kernel(beam, terms, log_probs, norm, deadline, step,
                                                           layout, options)
        beam = Beam(**fields)
    else:
        beam, parents, labels = select(beam, _combined(terms), log_probs, norm, deadline <= step, layout, options,
                                       stats)
    contexts = [e.scorer.extend(c, parents, labels) for e, c in zip(entries, contexts)]
    return beam, parents, labels, contexts


def candidate_normaliser(beam: Beam, options: LabelSyncOptions, xp):
    """[N] float32: the length normaliser of each lane's candidates (an open lane's candidates are
    one label longer; :func:`gpudecode.search.prune.length_normaliser`), or None when
    ``length_norm_scale`` is 0."""
    return length_normaliser(beam.lengths + ~beam.ended, options.length_norm_scale, xp)


def select(beam: Beam, combined, log_probs, norm, at_limit, layout: LaneLayout,
           options: LabelSyncOptions, stats: SearchStats | None = None) -> tuple[Beam, object, object]:
    """The best ``beam_size`` candidates per utterance and the new lanes (the array version of
    ``kernels/label_step.cu``). ``norm``: [N] length normalisers (None: 1); ``at_limit``: [N]
    bool, lanes that reach their label limit with this step."""
    xp = layout.xp
    num_groups, beam_size = layout.num_groups, layout.beam_size

    # Candidates [N, V]: open lanes extend by every label; a terminated lane offers only
    # itself (in column 0, mapped to label -1 below); dead lanes offer nothing.
    open_lanes = ~beam.ended
    candidates = xp.where(open_lanes[:, None], beam.scores[:, None] + combined, NEG_INF)
    candidates[:, 0] = xp.where(open_lanes, candidates[:, 0], beam.scores)
    alive, parents, cand_labels = prune(candidates, beam_size, num_groups, xp, normaliser=norm,
                                        score_threshold=options.score_threshold, stats=stats)
    was_ended = beam.ended[parents]
    labels = xp.where(alive & ~was_ended, cand_labels, -1)
    emitted = labels >= 0
    safe_labels = xp.maximum(labels, 0)

    scores = xp.where(alive, candidates[parents, cand_labels], NEG_INF)
    scorer_scores = xp.stack([
        beam.scorer_scores[s][parents]
        + xp.where(emitted, logp[parents, safe_labels], np.float32(0))
        for s, logp in enumerate(log_probs)])
    ended = (was_ended | ~alive | (labels == options.sentence_end) | at_limit)
    beam = Beam(scores=scores, scorer_scores=scorer_scores,
                lengths=beam.lengths[parents] + emitted, ended=ended)
    return beam, parents, labels


def _scores(entries, contexts, layout: LaneLayout, options: LabelSyncOptions, vocab_size: int,
            keep_float16: bool = False, stats: SearchStats | None = None):
    """Each scorer's [N, V] log-probs, and the terms (array, scale) whose Σ scale · array is the
    combined score (:func:`combine_scores`). ``keep_float16``: a full scorer's float16 scores stay
    float16 (the label-step kernel reads them as they are), else every array is float32.

    Partial scorers (``scorer.partial_scoring``) score only the ``pre_beam_size`` best labels per
    lane by the full scorers; every other label gets -inf from them (and in the combination).
    """
    xp, num_lanes = layout.xp, layout.num_lanes
    full = [i for i, e in enumerate(entries) if not getattr(e.scorer, "partial_scoring", False)]
    if not full:
        raise ValueError("a partial scorer (scored on pre-beam candidates) needs at least one full scorer")
    log_probs = [None] * len(entries)
    for i in full:
        log_probs[i] = checked_scores(entries[i], entries[i].scorer.score(contexts[i]), num_lanes, vocab_size, xp,
                                      keep_float16=keep_float16)
    terms = [(log_probs[i], entries[i].scale) for i in full]
    partial = [i for i in range(len(entries)) if i not in full]
    if not partial:
        return log_probs, terms
    combined = _combined(terms)
    size = min(options.pre_beam_size or max(2 * layout.beam_size, 10), vocab_size)
    observed_top_k(stats, combined, size)
    candidates = top_k_indices(combined, size)  # [N, K] labels, best first
    rows = xp.arange(num_lanes)[:, None]
    kept = xp.full((num_lanes, vocab_size), NEG_INF, dtype=np.float32)
    kept[rows, candidates] = combined[rows, candidates]
    combined = kept
    for i in partial:
        entry = entries[i]
        part = entry.scorer.score_candidates(contexts[i], candidates).astype(np.float32, copy=False)
        if tuple(part.shape) != tuple(candidates.shape):
            raise ValueError(f"scorer {entry.name!r}: score_candidates() returned shape {tuple(part.shape)}, "
                             f"expected [N={num_lanes}, K={size}]")
        scattered = xp.full((num_lanes, vocab_size), NEG_INF, dtype=np.float32)
        scattered[rows, candidates] = part
        log_probs[i] = scattered
        if entry.scale != 0:
            combined = combined + np.float32(entry.scale) * scattered
    return log_probs, [(combined, 1.0)]


def _combined(terms):
    """Σ scale · array of ``_scores``'s terms, as one [N, V] float32 array."""
    return combine_scores([t for t, _ in terms], [scale for _, scale in terms])


def returned_lanes(order: np.ndarray, num_best: int) -> np.ndarray:
    """[G, num_best] host: the lanes of each group's n-best list, best first (row g of ``order``
    [G, B] ranks lanes g·B + order[g])."""
    return np.arange(order.shape[0])[:, None] * order.shape[1] + order[:, :num_best]


def hypotheses(returned, ranks, scores, scorer_scores, lengths, labels: list[list[int]],
                entries) -> list[list[Hypothesis]]:
    """Per lane group its n-best list (:func:`nbest_lists`): lanes ``returned`` [G, K]
    (:func:`returned_lanes`) with their ``labels`` (row-major over ``returned``), from host arrays
    over all lanes: ``ranks``, ``scores``, ``lengths`` [G·B] and ``scorer_scores`` [S, G·B]."""
    lanes = returned.ravel()
    return nbest_lists(ranks[returned], labels, scores[lanes], [e.name for e in entries], scorer_scores[:, lanes],
                       lengths[lanes])
