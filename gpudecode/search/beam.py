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
from gpudecode.backend import DEFAULT_HOST_WAIT, HostClock, HostWait, to_host, wait_for
from gpudecode.scorers.base import LaneLayout
from gpudecode.scorers.combine import checked_scores, combine_scores
from gpudecode.search import label_step, label_sync_cpu
from gpudecode.search.nonfinite import folded_group_maxima
from gpudecode.search.options import coerce_ints, option_error
from gpudecode.search.prune import NEG_INF, length_normaliser, normalised, prune
from gpudecode.search.results import Hypothesis, label_lists, nbest_lists
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
      best by the other scorers (None: max(2 × beam_size, 10));
    - ``min_length``: sentence-end gets -inf (before normalisation and pruning) while a hypothesis
      has fewer than this many labels (the prompt not counted: Hugging Face's
      ``min_new_tokens``; its ``min_length``, and GenAI's, count the prompt too);
    - ``finished``: ``"in-beam"`` — a terminated hypothesis keeps its beam slot and competes with
      the open ones (ranked by the normalised score); ``"separate"`` — Hugging Face's beam search
      (``generate`` with ``num_beams``): ``beam_size`` open hypotheses ranked by their score, plus per
      utterance a list of at most ``beam_size`` finished ones ranked by the normalised score (of
      the best ``2 × beam_size`` candidates, those ending with sentence-end — or all of them at
      the label limit — join the list when among the best ``beam_size``; the best
      ``beam_size`` others stay open); the n-best list is the finished list;
      ``"separate-genai"``: the same with ONNX Runtime GenAI's rules where they differ (its stop
      test, and its open hypotheses joining the list at the label limit; see
      :func:`select_separate`);
    - ``early_stopping`` (the separate lists only): True — an utterance stops once ``beam_size``
      hypotheses are finished; False — once they are and the best open score, normalised, is no
      better than the worst finished one; ``"never"`` (Hugging Face only) — as False, but
      normalised at the label limit when ``length_norm_scale`` > 0;
    - ``length_counts``: the length normalised by: ``"labels"`` — labels including
      sentence-end (Hugging Face's generated tokens); ``"prompt-and-labels"`` (the separate
      lists only) — the utterance's prompt (its ``prompt`` input's size) plus the labels without
      sentence-end (ONNX Runtime GenAI's sequence length).
    """

    beam_size: int
    sentence_end: int
    length_norm_scale: float = 0.0
    score_threshold: float | None = None
    max_labels_per_input: float = defaults.MAX_LABELS_PER_INPUT
    max_labels: int = defaults.MAX_LABELS
    nbest: int | None = None
    pre_beam_size: int | None = None
    min_length: int = defaults.MIN_LENGTH
    finished: str = defaults.FINISHED
    early_stopping: bool | str = defaults.EARLY_STOPPING
    length_counts: str = defaults.LENGTH_COUNT

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return option_error(self, name, expected)

        coerce_ints(self, ("beam_size", "sentence_end", "max_labels", "nbest", "pre_beam_size", "min_length"))
        if not isinstance(self.min_length, int) or self.min_length < 0:
            raise bad("min_length", "an int >= 0")
        if self.finished not in defaults.FINISHED_MODES:
            raise bad("finished", f"one of {', '.join(defaults.FINISHED_MODES)}")
        if not any(self.early_stopping is m or (isinstance(m, str) and self.early_stopping == m)
                   for m in defaults.EARLY_STOPPING_MODES):
            raise bad("early_stopping", "True, False or 'never'")
        if self.length_counts not in defaults.LENGTH_COUNTS:
            raise bad("length_counts", f"one of {', '.join(defaults.LENGTH_COUNTS)}")
        if self.length_counts != "labels" and self.finished == "in-beam":
            raise bad("length_counts", "'labels' when finished is 'in-beam' (its ranking normalises every "
                      "candidate by its label count)")
        if self.finished != "in-beam" and self.score_threshold is not None:
            raise bad("score_threshold", "None with the separate finished lists (the peers prune by count only)")
        if self.finished == "separate-genai" and self.early_stopping == "never":
            raise bad("early_stopping", "True or False with finished 'separate-genai' (GenAI has no 'never')")
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
class Finished:
    """Per lane group (utterance) its list of finished hypotheses, ``finished="separate"``: arrays
    [G · B] on ``xp``, row g · B + b the group's b-th best (by ``ranks``)."""

    ranks: object  # [G·B] float32 normalised score; -inf: an empty entry
    scores: object  # [G·B] float32 combined score
    scorer_scores: object  # [S, G·B] float32
    lengths: object  # [G·B] int64, labels including sentence-end
    steps: object  # [G·B] int64, the step of its last label (0: empty)
    lanes: object  # [G·B] int64, the lane (before that step) its last label extends
    labels: object  # [G·B] int64, its last label
    prompt_lengths: object  # [G] int64, the group's prompt size (length_counts "prompt-and-labels")
    hopeful: object  # [G] bool, an open hypothesis may still improve the list (early_stopping)
    done: object  # [G] bool, the group's search is over
    #: the last step's merge: entry g·B + b came from column picked[g, b] of [its B old entries |
    #: the step's C candidates], candidate g·C + c extending lane candidate_lanes[g·C + c] by
    #: candidate_labels[g·C + c] (continuous batching copies label rows by it)
    picked: object = None
    candidate_lanes: object = None
    candidate_labels: object = None

    @classmethod
    def empty(cls, num_groups: int, beam_size: int, num_scorers: int, xp) -> Finished:
        size = num_groups * beam_size
        return cls(ranks=xp.full(size, NEG_INF, dtype=np.float32), scores=xp.full(size, NEG_INF, dtype=np.float32),
                   scorer_scores=xp.zeros((num_scorers, size), dtype=np.float32),
                   lengths=xp.zeros(size, dtype=np.int64), steps=xp.zeros(size, dtype=np.int64),
                   lanes=xp.zeros(size, dtype=np.int64), labels=xp.full(size, -1, dtype=np.int64),
                   prompt_lengths=xp.zeros(num_groups, dtype=np.int64), hopeful=xp.ones(num_groups, dtype=bool),
                   done=xp.zeros(num_groups, dtype=bool))

    def reset(self, groups, lanes, done) -> None:
        """Empties the lists of ``groups`` (device int array; their ``lanes``) in place; ``done``:
        [len(groups)] bool, groups that hold no utterance."""
        self.ranks[lanes] = NEG_INF
        self.scores[lanes] = NEG_INF
        self.scorer_scores[:, lanes] = 0
        self.lengths[lanes] = 0
        self.steps[lanes] = 0
        self.labels[lanes] = -1
        self.prompt_lengths[groups] = 0
        self.hopeful[groups] = True
        self.done[groups] = done


@dataclass
class Beam:
    """The hypotheses of all N lanes, as arrays on ``xp``."""

    scores: object  # [N] float32 combined score; -inf: dead lane
    scorer_scores: object  # [S, N] float32, each scorer's unscaled score
    lengths: object  # [N] int64, labels including sentence-end
    ended: object  # [N] bool, terminated (or dead); finished "separate": the group is done (or dead)
    finished: Finished | None = None  # finished "separate": the finished lists
    #: [S, G] float32: per scorer and lane group the largest score the scorer gave an open lane so
    #: far (NaN or +inf: non-finite scores, :mod:`gpudecode.search.nonfinite`); None: not kept
    score_max: object = None


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
    in_kernel = tuning.fused_label_step and label_step.use_kernel(xp, layout.beam_size, len(entries),
                                                                   options.finished)
    # on numpy only the open lanes are scored (a scorer may run its model on just those rows)
    open_lanes = np.flatnonzero(~beam.ended) if xp is np else None
    log_probs, terms = _scores(entries, contexts, layout, options, vocab_size, keep_float16=in_kernel, stats=stats,
                               lanes=open_lanes)
    score_max = beam.score_max
    if score_max is not None:  # on the device; read back with the search's results
        score_max = folded_group_maxima(score_max, log_probs, layout.num_groups, xp, dead=beam.ended,
                                        row_maxima=_known_row_maxima(entries, log_probs, open_lanes))
    if options.finished != "in-beam":
        if in_kernel:
            fields, finished, parents, labels = label_step.select_separate_kernel(beam, terms, log_probs, deadline,
                                                                                  step, layout, options)
            beam = Beam(**fields, finished=Finished(**finished))
        elif label_sync_cpu.use_compiled(xp, tuning, stats):  # one compiled call on numpy
            fields, finished, parents, labels = label_sync_cpu.select_separate(
                beam, _combined_read_only(terms), log_probs, deadline, step, layout, options)
            beam = Beam(**fields, finished=Finished(**finished))
        else:
            beam, parents, labels = select_separate(beam, _combined(terms), log_probs, deadline, step, layout,
                                                    options, stats)
    elif not in_kernel and label_sync_cpu.use_compiled(xp, tuning, stats):  # one compiled call on numpy
        fields, parents, labels = label_sync_cpu.select_in_beam(beam, _combined_read_only(terms), log_probs,
                                                                deadline, step, layout, options)
        beam = Beam(**fields)
    else:
        norm = candidate_normaliser(beam, options, xp)
        if in_kernel:
            fields, parents, labels = label_step.select_kernel(beam, terms, log_probs, norm, deadline, step,
                                                               layout, options)
            beam = Beam(**fields)
        else:
            beam, parents, labels = select(beam, _combined(terms), log_probs, norm, deadline <= step, layout,
                                           options, stats)
    beam.score_max = score_max
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
    candidates = _candidates(beam, combined, options, xp)
    alive, parents, cand_labels = prune(candidates, beam_size, num_groups, xp, normaliser=norm,
                                        score_threshold=options.score_threshold, stats=stats)
    was_ended = beam.ended[parents]
    labels = xp.where(alive & ~was_ended, cand_labels, -1)
    emitted = labels >= 0
    scores = xp.where(alive, candidates[parents, cand_labels], NEG_INF)
    scorer_scores = _extended_scorer_scores(beam, log_probs, parents, labels, emitted, xp)
    ended = (was_ended | ~alive | (labels == options.sentence_end) | at_limit)
    beam = Beam(scores=scores, scorer_scores=scorer_scores,
                lengths=beam.lengths[parents] + emitted, ended=ended)
    return beam, parents, labels


def _candidates(beam: Beam, combined, options: LabelSyncOptions, xp):
    """Candidates [N, V] of a step: open lanes extend by every label (``combined`` [N, V] added to
    their score); a terminated lane offers only itself (in column 0, mapped to label -1 by the
    selection); dead lanes offer nothing; sentence-end masked below ``min_length``."""
    open_lanes = ~beam.ended
    candidates = xp.where(open_lanes[:, None], beam.scores[:, None] + combined, NEG_INF)
    candidates[:, 0] = xp.where(open_lanes, candidates[:, 0], beam.scores)
    _mask_sentence_end(candidates, beam, options, xp)
    return candidates


def _extended_scorer_scores(beam: Beam, log_probs, parents, labels, emitted, xp):
    """[S, N]: each scorer's score of the new lanes — the parent's plus the emitted label's
    log-prob (``emitted``: ``labels`` >= 0; -1: nothing emitted)."""
    safe_labels = xp.maximum(labels, 0)
    return xp.stack([beam.scorer_scores[s][parents] + xp.where(emitted, logp[parents, safe_labels], np.float32(0))
                     for s, logp in enumerate(log_probs)])


def _mask_sentence_end(candidates, beam: Beam, options: LabelSyncOptions, xp) -> None:
    """``min_length``: sentence-end gets -inf in ``candidates`` [N, V] (in place) for open lanes
    with fewer than ``min_length`` labels."""
    if options.min_length:
        short = ~beam.ended & (beam.lengths < options.min_length)
        end = options.sentence_end
        candidates[:, end] = xp.where(short, NEG_INF, candidates[:, end])


def _counted_lengths(lengths, prompt_lengths, ends_with_end, options: LabelSyncOptions):
    """The lengths the normaliser counts (``length_counts``) of hypotheses of ``lengths`` labels
    (including a sentence-end where ``ends_with_end``)."""
    if options.length_counts == "labels":
        return lengths
    return prompt_lengths + lengths - ends_with_end


def select_separate(beam: Beam, combined, log_probs, deadline, step: int, layout: LaneLayout,
                    options: LabelSyncOptions, stats: SearchStats | None = None) -> tuple[Beam, object, object]:
    """A step of ``finished="separate"`` (Hugging Face's ``_beam_search``, array for array) or
    ``"separate-genai"`` (ONNX Runtime GenAI's ``BeamSearchScorer``): per utterance the best
    ``2 × beam_size`` candidates by score; those ending among the best ``beam_size`` join the
    finished list (normalised by ``length_counts``; the best ``beam_size`` of old and new kept,
    old first on ties), the best ``beam_size`` others are the new open lanes.

    Where they differ: at the label limit, Hugging Face ends every candidate (those among the
    best ``beam_size`` join), GenAI adds its ``beam_size`` open lanes; an utterance stops
    (``early_stopping`` True: once its list is full) when its list is full and the best open
    score (Hugging Face: the best open lane after the step, at its length — or at the label limit
    for ``"never"`` with a length penalty) or the best candidate score (GenAI: of the ``2 ×
    beam_size``, at the length before the step) normalised is no better than the worst entry.
    Lanes of done utterances (and dead ones) are ended and carry themselves."""
    xp = layout.xp
    num_groups, beam_size = layout.num_groups, layout.beam_size
    genai = options.finished == "separate-genai"
    vocab_size = int(combined.shape[1])
    finished = beam.finished
    prompts = finished.prompt_lengths
    open_lanes = ~beam.ended
    candidates = _candidates(beam, combined, options, xp)
    at_limit = deadline <= step
    ranks = candidates.reshape(num_groups, beam_size * vocab_size)
    size = min(2 * beam_size, beam_size * vocab_size)
    observed_top_k(stats, ranks, size)
    chosen = top_k_indices(ranks, size)  # [G, K] by score, lane-major then label on ties
    score = xp.take_along_axis(ranks, chosen, axis=1)
    base = (xp.arange(num_groups, dtype=np.int64) * beam_size)[:, None]
    first = base[:, 0]
    parent = base + chosen // vocab_size
    label = chosen % vocab_size
    ends = label == options.sentence_end
    if not genai:
        ends = ends | at_limit[parent]
    ending = (score > NEG_INF) & open_lanes[parent] & ends

    # the open lanes: the best beam_size candidates that do not end
    open_score = xp.where(ending, NEG_INF, score)
    kept = top_k_indices(open_score, beam_size)  # [G, B]
    scores = xp.take_along_axis(open_score, kept, axis=1).reshape(-1)
    parents = xp.take_along_axis(parent, kept, axis=1).reshape(-1)
    alive = scores > NEG_INF
    open_labels = xp.take_along_axis(label, kept, axis=1).reshape(-1)
    labels = xp.where(alive & open_lanes[parents], open_labels, -1)
    emitted = labels >= 0
    scorer_scores = _extended_scorer_scores(beam, log_probs, parents, labels, emitted, xp)
    lengths = beam.lengths[parents] + emitted

    def counted(lengths, with_end):
        return _counted_lengths(lengths, prompts[:, None], with_end, options)

    def rank(scores, lengths):
        return normalised(scores, length_normaliser(lengths, options.length_norm_scale, xp))

    # the ending candidates among the best beam_size join the finished lists when they rank
    end_parent = parent[:, :beam_size]
    end_label = label[:, :beam_size]
    end_score = score[:, :beam_size]
    end_lengths = beam.lengths[end_parent] + 1
    end_ranks = rank(end_score, counted(end_lengths, end_label == options.sentence_end))
    joins = ending[:, :beam_size] & (finished.hopeful & ~finished.done)[:, None]
    end_ranks = xp.where(joins, end_ranks, NEG_INF)
    old_ranks = finished.ranks.reshape(num_groups, beam_size)

    if genai:  # GenAI: the stop test before the open lanes join at the limit
        after = xp.take_along_axis(
            xp.concatenate([old_ranks, end_ranks], axis=1),
            top_k_indices(xp.concatenate([old_ranks, end_ranks], axis=1), beam_size), axis=1)
        full = (after > NEG_INF).all(axis=1)
        before = _counted_lengths(beam.lengths[parent[:, 0]], prompts, False, options)
        improvable = after.min(axis=1) < rank(score[:, 0], before)
        stops = full & (~improvable if options.early_stopping is False else True) & ~finished.done
        done = finished.done | stops | at_limit[first]
        hopeful = finished.hopeful
        # at the limit, the open lanes of utterances still going join (GenAI's Finalize)
        open_shape = (num_groups, beam_size)
        open_parent, open_label = parents.reshape(open_shape), open_labels.reshape(open_shape)
        open_lengths = lengths.reshape(open_shape)
        open_ranks = rank(scores.reshape(open_shape), counted(open_lengths, False))
        open_joins = (alive.reshape(open_shape) & (at_limit[first] & ~finished.done & ~stops)[:, None])
        open_ranks = xp.where(open_joins, open_ranks, NEG_INF)
        new = dict(ranks=(end_ranks, open_ranks), scores=(end_score, scores.reshape(open_shape)),
                   lengths=(end_lengths, open_lengths), lanes=(end_parent, open_parent),
                   labels=(end_label, open_label))
        scorer_new = [(beam.scorer_scores[s][end_parent] + logp[end_parent, xp.maximum(end_label, 0)],
                       scorer_scores[s].reshape(open_shape)) for s, logp in enumerate(log_probs)]
    else:
        new = dict(ranks=(end_ranks,), scores=(end_score,), lengths=(end_lengths,), lanes=(end_parent,),
                   labels=(end_label,))
        scorer_new = [(beam.scorer_scores[s][end_parent] + logp[end_parent, xp.maximum(end_label, 0)],)
                      for s, logp in enumerate(log_probs)]
    merged = xp.concatenate([old_ranks, *new["ranks"]], axis=1)
    picked = top_k_indices(merged, beam_size)  # [G, B]: old entries first on ties, then in order

    def merge(old, parts):
        both = xp.concatenate([old.reshape(num_groups, beam_size), *parts], axis=1)
        return xp.take_along_axis(both, picked, axis=1).reshape(-1)

    new_ranks = merge(finished.ranks, new["ranks"])
    if not genai:  # HF: the stop test after the step, on the best open lane
        entries = new_ranks.reshape(num_groups, beam_size)
        full = (entries > NEG_INF).all(axis=1)
        open_length = lengths[first]
        if options.early_stopping == "never" and options.length_norm_scale > 0:
            open_length = open_length + deadline[first] - step
        best_open = rank(scores[first], _counted_lengths(open_length, prompts, False, options))
        hopeful = finished.hopeful & (~full | (best_open > entries.min(axis=1)))
        done = finished.done | ~hopeful | at_limit[first]
        if options.early_stopping is True:
            done = done | full
    ended = xp.repeat(done, beam_size) | ~alive
    steps = tuple(xp.full_like(part, step) for part in new["lengths"])
    new_finished = Finished(
        ranks=new_ranks, scores=merge(finished.scores, new["scores"]),
        scorer_scores=xp.stack([merge(old, parts) for old, parts in zip(finished.scorer_scores, scorer_new)]),
        lengths=merge(finished.lengths, new["lengths"]), steps=merge(finished.steps, steps),
        lanes=merge(finished.lanes, new["lanes"]), labels=merge(finished.labels, new["labels"]),
        prompt_lengths=prompts, hopeful=hopeful, done=done, picked=picked,
        candidate_lanes=xp.concatenate(new["lanes"], axis=1).reshape(-1),
        candidate_labels=xp.concatenate(new["labels"], axis=1).reshape(-1))
    beam = Beam(scores=xp.where(alive, scores, NEG_INF), scorer_scores=scorer_scores, lengths=lengths, ended=ended,
                finished=new_finished)
    return beam, parents, labels


def _scores(entries, contexts, layout: LaneLayout, options: LabelSyncOptions, vocab_size: int,
            keep_float16: bool = False, stats: SearchStats | None = None, lanes=None):
    """Each scorer's [N, V] log-probs, and the terms (array, scale) whose Σ scale · array is the
    combined score (:func:`combine_scores`). ``keep_float16``: a full scorer's float16 scores stay
    float16 (the label-step kernel reads them as they are), else every array is float32.
    ``lanes``: [R] host int64, the only lanes whose rows the step reads (full scorers are asked
    with :meth:`LabelScorer.score_lanes`); None: every lane (:meth:`LabelScorer.score`).

    Partial scorers (``scorer.partial_scoring``) score only the ``pre_beam_size`` best labels per
    lane by the full scorers; every other label gets -inf from them (and in the combination).
    """
    xp, num_lanes = layout.xp, layout.num_lanes
    full = [i for i, e in enumerate(entries) if not getattr(e.scorer, "partial_scoring", False)]
    if not full:
        raise ValueError("a partial scorer (scored on pre-beam candidates) needs at least one full scorer")
    if len(full) < len(entries):  # partial scorers pick candidates from every row
        lanes = None
    log_probs = [None] * len(entries)
    for i in full:
        scorer = entries[i].scorer
        raw = scorer.score(contexts[i]) if lanes is None else scorer.score_lanes(contexts[i], lanes)
        log_probs[i] = checked_scores(entries[i], raw, num_lanes, vocab_size, xp, keep_float16=keep_float16)
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
            combined = combined + scattered * np.float32(entry.scale)  # the array's own product (on CuPy no numpy ufunc)
    return log_probs, [(combined, 1.0)]


def _known_row_maxima(entries, log_probs, lanes):
    """Per scorer, the [N] row maxima of its ``log_probs`` that the scorer already knows on the
    ``lanes`` it scored (``row_maxima(scores)``, a host scorer's option), or None; all None unless
    on numpy with a lane subset."""
    if lanes is None:
        return None
    return [row_maxima(scores) if (row_maxima := getattr(e.scorer, "row_maxima", None)) else None
            for e, scores in zip(entries, log_probs)]


def _combined(terms):
    """Σ scale · array of ``_scores``'s terms, as one [N, V] float32 array."""
    return combine_scores([t for t, _ in terms], [scale for _, scale in terms])


def _combined_read_only(terms):
    """:func:`_combined` for a caller that only reads it (the compiled CPU selections): one float32
    term of scale 1 is itself (the values its copy would hold), else the sum."""
    if len(terms) == 1 and terms[0][1] == 1.0 and terms[0][0].dtype == np.float32:
        return terms[0][0]
    return _combined(terms)


def prompt_lengths(utterances) -> np.ndarray:
    """[U] int64 (host): each utterance's prompt size (the size of its ``prompt`` input), else 0."""
    if "prompt" not in utterances.inputs:
        return np.zeros(utterances.num_utterances, dtype=np.int64)
    return np.asarray(to_host(utterances.size_of("prompt")), dtype=np.int64)


def returned_lanes(order: np.ndarray, num_best: int) -> np.ndarray:
    """[G, num_best] host: the lanes of each group's n-best list, best first (row g of ``order``
    [G, B] ranks lanes g·B + order[g])."""
    return np.arange(order.shape[0])[:, None] * order.shape[1] + order[:, :num_best]


def hypotheses(returned, ranks, scores, scorer_scores, lengths, tokens: np.ndarray, entries,
               options: LabelSyncOptions) -> list[list[Hypothesis]]:
    """Per lane group its n-best list (:func:`nbest_lists`): lanes ``returned`` [G, K]
    (:func:`returned_lanes`) with their label rows ``tokens`` [G·K, W] (row-major over
    ``returned``; -1 where nothing was emitted), from host arrays over all lanes: ``ranks``,
    ``scores``, ``lengths`` [G·B] and ``scorer_scores`` [S, G·B]. A hypothesis without a
    sentence-end in its row was force-ended at its label limit: ``truncated``."""
    lanes = returned.ravel()
    truncated = ~(tokens == options.sentence_end).any(axis=1)
    return nbest_lists(ranks[returned], label_lists(tokens, options.sentence_end), scores[lanes],
                       [e.name for e in entries], scorer_scores[:, lanes], lengths[lanes], truncated=truncated)
