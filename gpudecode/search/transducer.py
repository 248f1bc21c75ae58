"""Time-synchronous transducer (RNN-T) decoding over [utterances, beam] lanes, on numpy or CuPy.

**Topology.** Per encoder frame a hypothesis emits at most ``max_symbols_per_frame`` labels; a
blank leaves the frame (adding the blank's log-prob), and so does the last allowed label, without
a blank. With 1 this is k2's modified beam search (a label consumes its frame); with more it is
standard RNN-T with expansions within a frame, capped the way k2's and NeMo's greedy decoders cap
them.

**Models.** A *prediction network* (:class:`PredictionNetwork`) turns each lane's label history
into a vector [N, P]: :class:`StatefulPredictionNetwork` drives a stateful ONNX step model (an LSTM
with (h, c) state variables) through the ``lstm-cpu`` / ``lstm-cuda`` state managers, exactly like
an LSTM LM scorer; :class:`StatelessPredictionNetwork` feeds the last k labels. The *joint*
(:class:`JointNetwork`, or any callable ``(encoder_frames [N, E], prediction [N, P]) -> [N, V]``
log-probs including blank) is **one** batched call over all lanes per (frame, symbol) step. The
prediction network runs only after a step in which some lane emitted; lanes that did not emit keep
their prediction vector (the same cache idea as the LM score cache).

**Beam search** (:func:`transducer_search`). Per frame the lanes start *active*; per symbol step
every active lane offers its blank (the lane becomes *done* for this frame; kept in the candidate
column of the blank label) and every label extension (active again, or done at the step's last
allowed symbol); done lanes offer themselves unchanged. Per utterance the best ``beam_size``
candidates survive (deterministic top-k: lower lane, then lower label), ranked by transducer score +
Σ scale · LM score. Done hypotheses and still-active ones compete for the same beam. The frame
ends when no lane is active.

**Recombination** of identical label sequences among done candidates, by log-sum-exp
(``recombination="sum"``) or max (``"max"``, the Viterbi score): a blank of an active lane whose
sequence equals a done lane's, and (at the last allowed symbol) an extension that spells an
existing lane's sequence. Sequences are compared on the device as in the CTC prefix search: a
rolling hash finds candidate pairs, the tree of emitted labels confirms them. A label's frame
(``Hypothesis.frames``) is the frame at which the higher-scoring branch of each merge emitted it:
with ``"max"`` exactly the best (Viterbi) alignment's frames.

**LM fusion**: (name, scorer, scale) triples scored on label emission — ``LABEL`` transitions
extend a scorer's context, ``BLANK`` carries it; unchanged contexts keep their score vectors
(``max_cached_score_vectors``). **Greedy** (:func:`transducer_greedy_search`): argmax per step,
batched over utterances.

No Python loop over utterances, lanes or labels in the frame/step loops; one device→host transfer
per symbol step (did any lane emit, is any lane still active), except on CuPy for a frame's last
symbol step (the frame ends there anyway; the models run as if some lane emitted), so that with
one symbol per frame the GPU never waits for the host.
"""

from __future__ import annotations

import functools

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from gpudecode import defaults
from gpudecode.backend import to_host
from gpudecode.scorers.base import LaneLayout, Transition, UtteranceBatch
from gpudecode.scorers.combine import ScorerEntry, check_scorers, checked_scores, combine_scores
from gpudecode.search import transducer_cpu, transducer_step
from gpudecode.search.emission_tree import HASH_MULTIPLIER, emission_tree_nbest, same_label_paths
from gpudecode.search.options import (
    check_frames,
    check_time_sync_options,
    coerce_ints,
    on_search_stream,
    option_error,
)
from gpudecode.scorers.transducer import PredictionNetwork
from gpudecode.search.nonfinite import check_scores, folded_group_maxima, initial_maxima
from gpudecode.search.scorer_cache import refresh, scorer_moves
from gpudecode.search.results import Hypothesis
from gpudecode.search.prune import best_first, prune
from gpudecode.search.stats import SearchStats, read_back
from gpudecode.search.tuning import DEFAULT_TUNING, SearchTuning

_NEG_INF = np.float32(-np.inf)
#: The name of the transducer score in :attr:`Hypothesis.scores`.
TRANSDUCER_SCORE_NAME = "transducer"
#: The input name under which the search hands the encoder states to its scorers' ``admit``.
ENCODER_STATES_INPUT = "encoder-states"
RECOMBINATIONS = ("sum", "max")


@dataclass(frozen=True, kw_only=True)
class TransducerOptions:
    """Settings of the transducer beam search.

    - ``beam_size``: hypotheses kept per utterance;
    - ``blank``: the blank label index;
    - ``max_symbols_per_frame``: labels a hypothesis may emit per frame (1: k2's modified beam
      search; the frame is left without a blank after the last allowed label);
    - ``recombination``: ``"sum"`` (log-sum-exp of the merged alignments) or ``"max"``;
    - ``score_threshold``: drop candidates worse than the utterance's best candidate of the same
      step by more than this (None: off);
    - ``sentence_end``: where set, each LM scorer's score of this label is added at the end;
    - ``max_cached_score_vectors``: LM score vectors of unchanged contexts are reused when this is
      at least the number of lanes; below, every LM scores every lane at every step;
    - ``nbest``: hypotheses returned per utterance (None: ``beam_size``);
    - ``hash_modulus``, ``history_compare_steps``: as in
      :class:`~gpudecode.search.CtcPrefixOptions` (hash collisions are resolved by the label
      tree; pairs undecided after that many steps make the search run again comparing fully).
    """

    beam_size: int
    blank: int = 0
    max_symbols_per_frame: int = defaults.MAX_SYMBOLS_PER_FRAME
    recombination: str = "sum"
    score_threshold: float | None = None
    sentence_end: int | None = None
    max_cached_score_vectors: int = defaults.MAX_CACHED_SCORE_VECTORS
    nbest: int | None = None
    hash_modulus: int = 2**31 - 1
    history_compare_steps: int | None = 2

    def __post_init__(self) -> None:
        check_time_sync_options(self)
        coerce_ints(self, ("max_symbols_per_frame",))
        if not isinstance(self.max_symbols_per_frame, int) or self.max_symbols_per_frame < 1:
            raise option_error(self, "max_symbols_per_frame", "an int >= 1")
        if self.recombination not in RECOMBINATIONS:
            raise option_error(self, "recombination", f"one of {', '.join(RECOMBINATIONS)}")

    @property
    def num_best(self) -> int:
        return self.beam_size if self.nbest is None else self.nbest


def _on_xp(xp, array):
    """``array`` on the run's array module (uploaded or downloaded when a model ran elsewhere)."""
    return to_host(array) if xp is np else xp.asarray(array)


# --- input checks -----------------------------------------------------------------------------------
def _check_encoder_states(encoder_states, lengths, xp, read) -> tuple[Any, np.ndarray]:
    (lengths,) = read(lengths)
    return encoder_states, check_frames(encoder_states, lengths, xp, "encoder_states", "E")


def _joint_log_probs(joint, encoder_frames, prediction, xp, num_lanes: int):
    logp = _on_xp(xp, joint(encoder_frames, prediction))
    if logp.ndim != 2 or logp.shape[0] != num_lanes:
        raise ValueError(f"joint: returned shape {tuple(logp.shape)}, expected [N={num_lanes}, V]")
    return logp.astype(np.float32, copy=False)


# --- greedy ---------------------------------------------------------------------------------------
def transducer_greedy_search(encoder_states, lengths, prediction: PredictionNetwork, joint, *, blank: int = 0,
                             max_symbols_per_frame: int = defaults.MAX_SYMBOLS_PER_FRAME,
                             xp: ModuleType = np, ids: Sequence[str] | None = None,
                             tuning: SearchTuning = DEFAULT_TUNING, stats: SearchStats | None = None
                             ) -> list[list[Hypothesis]]:
    """Greedy transducer decoding of all utterances at once; per utterance a one-entry n-best list.

    ``encoder_states`` [U, T, E] on ``xp``, ``lengths`` [U]. Per (frame, symbol) step the joint
    runs once over all utterances; the argmax (equal maxima: the lower label) is emitted unless it
    is blank, which leaves the frame (as does the ``max_symbols_per_frame``-th label). ``score``
    (and ``scores["transducer"]``) is the path's log-probability; ``frames`` each label's frame.
    ``tuning`` and ``stats`` as for :func:`transducer_search`.
    """
    read = functools.partial(read_back, tuning, stats)
    encoder_states, lengths = _check_encoder_states(encoder_states, lengths, xp, read)
    if not isinstance(max_symbols_per_frame, int) or max_symbols_per_frame < 1:
        raise ValueError(f"max_symbols_per_frame: expected an int >= 1, got {max_symbols_per_frame!r}")
    num_utts = encoder_states.shape[0]
    if num_utts == 0:
        return []
    ids = [str(u) for u in range(num_utts)] if ids is None else list(ids)
    layout = LaneLayout(num_groups=num_utts, beam_size=1, xp=xp)
    utterances = UtteranceBatch(ids=ids, input_lengths=lengths, inputs={ENCODER_STATES_INPUT: encoder_states})
    groups = np.arange(num_utts, dtype=np.int64)

    def run():
        prediction.begin(layout)
        prediction.admit(utterances, groups)
        try:
            ctx = prediction.initial_context(groups)
            pred_out = _on_xp(xp, prediction.output(ctx)).astype(np.float32, copy=True)  # kept across calls
            lanes = xp.arange(num_utts, dtype=np.int64)
            lengths_dev = xp.asarray(lengths)
            score = xp.zeros(num_utts, dtype=np.float32)
            cut = xp.zeros(num_utts, dtype=bool)  # cut by max_symbols_per_frame (see _cut_short)
            steps, step_frames = [], []
            for t in range(int(lengths.max(initial=0))):
                active = t < lengths_dev
                frames_t = encoder_states[:, t]
                for s in range(max_symbols_per_frame):
                    logp = _joint_log_probs(joint, frames_t, pred_out, xp, num_utts)
                    if blank >= logp.shape[1]:
                        raise ValueError(f"blank {blank} is outside the joint's vocabulary [0, {logp.shape[1]})")
                    best = logp.argmax(axis=1)
                    score = score + xp.where(active, logp[lanes, best], np.float32(0))
                    emitted = active & (best != blank)
                    labels = xp.where(emitted, best, -1)
                    steps.append(labels)
                    step_frames.append(t)
                    if xp is np or s < max_symbols_per_frame - 1:  # on CuPy the last step reads nothing back
                        (any_emitted,) = read(emitted.any())
                        if not any_emitted:
                            break
                    ctx = prediction.extend(ctx, lanes, labels)
                    new_out = _on_xp(xp, prediction.output(ctx)).astype(np.float32, copy=False)
                    pred_out = xp.where(emitted[:, None], new_out, pred_out)
                    active = emitted
                    if s == max_symbols_per_frame - 1 > 0:  # the frame's symbol limit
                        cut = cut | _cut_short(joint, frames_t, pred_out, emitted, blank, xp)
            table = xp.stack(steps) if steps else xp.zeros((0, num_utts), dtype=np.int64)
            return (*read(table, score, cut), np.asarray(step_frames, dtype=np.int64))
        finally:
            prediction.release(groups)

    table, score, cut, frames_of_step = on_search_stream(xp, run)
    check_scores(ids, TRANSDUCER_SCORE_NAME, score)  # NaN or +inf: a joint log-prob on the path was
    results = []
    for u in range(num_utts):
        kept = table[:, u] >= 0
        labels = table[kept, u].tolist()
        results.append([Hypothesis(labels=labels, score=float(score[u]), scores={TRANSDUCER_SCORE_NAME: float(score[u])},
                                   length=len(labels), frames=frames_of_step[kept].tolist(),
                                   truncated=bool(cut[u]))])
    return results

# --- beam search ------------------------------------------------------------------------------------
def transducer_search(encoder_states, lengths, prediction: PredictionNetwork, joint, options: TransducerOptions,
                      lm_scorers: Sequence = (), xp: ModuleType = np, *, ids: Sequence[str] | None = None,
                      tuning: SearchTuning = DEFAULT_TUNING, stats: SearchStats | None = None
                      ) -> list[list[Hypothesis]]:
    """Transducer beam search of all utterances at once; per utterance the n-best, best first.

    ``encoder_states`` [U, T, E] float on ``xp``; ``lengths`` [U] valid frames; ``prediction`` a
    :class:`PredictionNetwork`; ``joint`` a :class:`JointNetwork` or any callable
    ``(encoder_frames [N, E], prediction [N, P]) -> [N, V]`` log-probs; ``lm_scorers``: (name,
    scorer, scale) triples fused on label emission (``vocab_size`` V; the name ``"transducer"`` is
    taken). The prediction network and the scorers are begun, admitted
    (``UtteranceBatch.inputs["encoder-states"]``) and released here.

    Each hypothesis has ``score`` = transducer log-prob + Σ scale · scorer score,
    ``scores["transducer"]`` and each scorer's unscaled score, and ``frames``.

    ``tuning``: how the search runs (:class:`gpudecode.search.tuning.SearchTuning`; never changes
    the results); ``stats``: a :class:`gpudecode.search.stats.SearchStats` to add the run's counts
    to (None: nothing counted).
    """
    read = functools.partial(read_back, tuning, stats)
    encoder_states, lengths = _check_encoder_states(encoder_states, lengths, xp, read)
    num_utts = encoder_states.shape[0]
    entries = check_scorers(lm_scorers) if len(lm_scorers) else ()
    for entry in entries:
        if entry.name == TRANSDUCER_SCORE_NAME:
            raise ValueError(f"scorer name {TRANSDUCER_SCORE_NAME!r} is taken by the transducer score; rename "
                             "the scorer")
    if num_utts == 0:
        return []
    ids = [str(u) for u in range(num_utts)] if ids is None else list(ids)
    if len(ids) != num_utts:
        raise ValueError(f"ids: {len(ids)} ids for {num_utts} utterances")
    layout = LaneLayout(num_groups=num_utts, beam_size=options.beam_size, xp=xp)
    utterances = UtteranceBatch(ids=ids, input_lengths=lengths, inputs={ENCODER_STATES_INPUT: encoder_states})

    def run():
        search = _TransducerSearch(encoder_states, lengths, prediction, joint, options, entries, layout, tuning, stats)
        result = search.run(utterances, exact=options.history_compare_steps is None)
        if result is None:  # a pair stayed undecided within history_compare_steps: compare fully
            search = _TransducerSearch(encoder_states, lengths, prediction, joint, options, entries, layout, tuning,
                                       stats)
            result = search.run(utterances, exact=True)
        return result

    return on_search_stream(xp, run)


class _TransducerSearch:
    """One run of the beam search; lane state as arrays on ``xp`` (N = U × beam lanes).

    Emission nodes: the lanes of symbol step k own nodes ``1 + k * N + lane`` (``node_parent``,
    ``node_label``; frame ``node_frames[k]``); node 0 is the empty sequence. A lane's node is the
    last emission of its sequence (of the best merged alignment). The node arrays grow by doubling.
    """

    def __init__(self, encoder_states, lengths: np.ndarray, prediction: PredictionNetwork, joint,
                 options: TransducerOptions, entries: Sequence[ScorerEntry], layout: LaneLayout,
                 tuning: SearchTuning = DEFAULT_TUNING, stats: SearchStats | None = None) -> None:
        self.encoder_states, self.lengths, self.options = encoder_states, lengths, options
        self.prediction, self.joint = prediction, joint
        self.entries, self.layout = tuple(entries), layout
        self.xp = layout.xp
        self.scales = [e.scale for e in self.entries]
        self.combine = layout.xp.logaddexp if options.recombination == "sum" else layout.xp.maximum
        self.tuning, self.stats = tuning, stats
        self.read = functools.partial(read_back, tuning, stats)

    # --- the frame loop ------------------------------------------------------------------------
    def run(self, utterances: UtteranceBatch, *, exact: bool):
        """The n-best lists, or None when ``exact`` is False and a comparison stayed undecided."""
        xp, layout, options = self.xp, self.layout, self.options
        num_utts, beam, num_lanes = layout.num_groups, layout.beam_size, layout.num_lanes
        groups = np.arange(num_utts, dtype=np.int64)
        lanes = self.lanes = xp.arange(num_lanes, dtype=np.int64)
        self.lane_group = lanes // beam
        self.group_base = (xp.arange(num_utts, dtype=np.int64) * beam)[:, None]
        self.score = xp.where((lanes % beam) == 0, np.float32(0), _NEG_INF).astype(np.float32)
        self.done = xp.zeros(num_lanes, dtype=bool)
        self.last = xp.full(num_lanes, -1, dtype=np.int64)
        self.length = xp.zeros(num_lanes, dtype=np.int64)
        self.hash = xp.zeros(num_lanes, dtype=np.int64)
        self.prev_hash = xp.zeros(num_lanes, dtype=np.int64)
        self.node = xp.zeros(num_lanes, dtype=np.int64)
        self.node_parent = xp.zeros(1 + 4 * num_lanes, dtype=np.int64)
        self.node_label = xp.full(1 + 4 * num_lanes, -1, dtype=np.int64)
        self.node_frames: list[int] = []  # per symbol step k: its frame
        self.unresolved = xp.zeros((), dtype=bool)
        self.lm_scores = xp.zeros((len(self.entries), num_lanes), dtype=np.float32)
        lengths_dev = xp.asarray(self.lengths)
        self.ids = list(utterances.ids)
        # per utterance the largest joint and scorer score (NaN or +inf: non-finite scores)
        self.joint_max = xp.full(num_lanes, _NEG_INF, dtype=np.float32)  # per lane, reduced per utterance at the end
        self.lm_max = initial_maxima(len(self.entries), num_utts, xp)
        # lanes cut by max_symbols_per_frame (a frame left after its last allowed label while the
        # joint's best continuation there was a label); with 1 a label always consumes its frame
        self.cut = xp.zeros(num_lanes, dtype=bool) if options.max_symbols_per_frame > 1 else None

        prediction_begun, begun = False, []
        try:
            self.prediction.begin(layout)
            prediction_begun = True
            self.prediction.admit(utterances, groups)
            for entry in self.entries:
                entry.scorer.begin(layout)
                begun.append(entry)
                entry.scorer.admit(utterances, groups)
            self.pred_ctx = self.prediction.initial_context(groups)
            self.pred_out = _on_xp(xp, self.prediction.output(self.pred_ctx)).astype(np.float32, copy=True)
            self.pred_lane = lanes.copy()
            self.contexts = [e.scorer.initial_context(groups) for e in self.entries]
            self.scorer_lane = lanes.copy()
            self.cache_enabled = options.max_cached_score_vectors >= num_lanes
            self.cache = [None for _ in self.entries]
            self.changed = xp.ones(num_lanes, dtype=bool)
            self.rescore = bool(self.entries)

            for t in range(int(self.lengths.max(initial=0))):
                self.done = (t >= lengths_dev)[self.lane_group]  # finished utterances stay as they are
                self.in_frame = ~self.done  # lanes of utterances that have frame t (the joint's checked rows)
                frames_t = self.encoder_states[:, t][self.lane_group]  # [N, E]
                for s in range(options.max_symbols_per_frame):
                    if not self._step(t, s, frames_t, exact):
                        break
            if options.sentence_end is not None and self.entries:
                self._score_contexts(lengths_dev[self.lane_group])
                self.lm_scores = self.lm_scores + xp.stack([c[:, options.sentence_end] for c in self.cache])
            return self._nbest(exact)
        finally:
            for entry in begun:
                entry.scorer.release(groups)
            if prediction_begun:
                self.prediction.release(groups)

    def _step(self, t: int, s: int, frames_t, exact: bool) -> bool:
        """One symbol step of frame ``t``; returns whether some lane is still active (host)."""
        xp, options, num_lanes, lanes = self.xp, self.options, self.layout.num_lanes, self.lanes
        forced = s == options.max_symbols_per_frame - 1  # labels leave the frame
        logp = _joint_log_probs(self.joint, frames_t, self.pred_out, xp, num_lanes)
        vocab_size = logp.shape[1]
        if t == 0 and s == 0:
            self._check_vocabulary(vocab_size)
        beam = self.layout.beam_size
        fused = self.tuning.fused_transducer_step and transducer_step.use_kernel(xp, beam)
        # the kernel ranks with the scorers' terms (the compiled loop runs without scorers)
        terms = self._score_contexts(xp.full(num_lanes, t, dtype=np.int64), terms=fused and bool(self.entries))
        # every lane's joint row is a real hypothesis's (dead lanes hold copies): checked in frame
        self.joint_max = folded_group_maxima(self.joint_max[None], [logp], logp.shape[0], xp, live=self.in_frame)[0]

        if fused or transducer_cpu.use_loop(xp, len(self.entries), self.tuning):  # one launch, or one compiled call
            base = self._new_nodes(t)
            select = transducer_step.select_kernel if fused else transducer_cpu.select
            terms = {} if terms is None else dict(zip(("lm_term", "lm_total"), terms))  # the kernel's only
            state, self.unresolved, (parents, labels, alive_new, emitted) = select(
                logp, (self.score, self.done, self.node, self.last, self.length, self.hash, self.prev_hash),
                self.node_parent, self.node_label, base, self.unresolved, options, beam, symbol=s, forced=forced,
                **terms)
            self.score, self.done, self.node, self.last, self.length, self.hash, self.prev_hash = state
            if self.stats is not None and fused:
                self.stats.fused_launches += 1
        else:
            parents, labels, alive_new, emitted = self._select(t, s, forced, logp, exact)
        if xp is not np and s == options.max_symbols_per_frame - 1:
            # the frame's last symbol step: the frame ends whatever is active, and the models are run
            # as if some lane emitted (lanes that did not carry their vectors), so the GPU never waits
            any_emitted, any_active = True, False
        else:
            (flags,) = self.read(xp.stack([emitted.any(), (alive_new & ~self.done).any()]))  # one small transfer
            any_emitted, any_active = bool(flags[0]), bool(flags[1])
        step_labels = xp.where(emitted, labels, -1)

        # the prediction network: new vectors for the lanes that emitted
        if any_emitted:
            self.pred_ctx = self.prediction.extend(self.pred_ctx, self.pred_lane[parents], step_labels)
            self.pred_lane = lanes.copy()
            new_out = _on_xp(xp, self.prediction.output(self.pred_ctx)).astype(np.float32, copy=False)
            self.pred_out = xp.where(emitted[:, None], new_out, self.pred_out[parents])
        else:
            self.pred_lane = self.pred_lane[parents]
            self.pred_out = self.pred_out[parents]
        if self.cut is not None:
            self.cut = self.cut[parents]
            if forced and any_emitted:  # the frame's symbol limit: would the lanes that emitted go on?
                self.cut = self.cut | _cut_short(self.joint, frames_t, self.pred_out, emitted, options.blank, xp)

        if self.entries:
            self.cache, self.lm_scores, moved_changed, scorer_parents = scorer_moves(
                xp, self.cache, self.lm_scores, self.changed, self.scorer_lane, parents, step_labels)
            if self.cache_enabled and not any_emitted:
                self.scorer_lane = scorer_parents
            else:
                if self.cache_enabled:
                    self.changed = moved_changed
                transitions = xp.where(emitted, int(Transition.LABEL), int(Transition.BLANK))
                self.contexts = [e.scorer.extend_transitions(c, scorer_parents, step_labels, transitions)
                                 for e, c in zip(self.entries, self.contexts)]
                self.scorer_lane = lanes.copy()
                self.rescore = True
        return any_active

    def _select(self, t: int, s: int, forced: bool, logp, exact: bool):
        """The candidates of one symbol step (stays, emissions, recombination), the best ``beam``
        per utterance and the new lane state; returns (parents, labels, alive, emitted) [N]."""
        xp, options, layout = self.xp, self.options, self.layout
        num_utts, beam, num_lanes = layout.num_groups, layout.beam_size, layout.num_lanes
        blank, lanes = options.blank, self.lanes
        alive = self.score > _NEG_INF
        active = alive & ~self.done
        # stay candidates (one per lane, done afterwards): blank of active lanes, done lanes as they are
        stay = xp.where(active, self.score + logp[:, blank], self.score)
        stay_node = self.node
        stay_new = xp.zeros(num_lanes, dtype=bool)  # the stay's best alignment ends in a new emission
        stay_node_parent = xp.zeros(num_lanes, dtype=np.int64)
        safe_last = xp.maximum(self.last, 0)
        emit = xp.where(active[:, None], self.score[:, None] + logp, _NEG_INF)
        emit[:, blank] = _NEG_INF

        if s > 0:  # a done lane and an active lane may spell the same sequence: merge their stays
            shape = (num_utts, beam, beam)  # [u, i, j]
            candidate = ((self.hash.reshape(num_utts, beam, 1) == self.hash.reshape(num_utts, 1, beam))
                         & (self.length.reshape(num_utts, beam, 1) == self.length.reshape(num_utts, 1, beam))
                         & alive.reshape(num_utts, beam, 1) & alive.reshape(num_utts, 1, beam)
                         & (xp.arange(beam)[:, None] < xp.arange(beam)[None, :]))
            equal = self._same_sequences(candidate, xp.broadcast_to(self.node.reshape(num_utts, beam, 1), shape),
                                         xp.broadcast_to(self.node.reshape(num_utts, 1, beam), shape), exact)
            absorbs = equal.any(axis=2).reshape(-1)  # lane i takes in a later lane j
            absorbed = equal.any(axis=1).reshape(-1)
            partner = (self.group_base + equal.astype(np.int8).argmax(axis=2)).reshape(-1)
            partner_stay = stay[partner]
            better = absorbs & (partner_stay > stay)
            stay_node = xp.where(better, self.node[partner], stay_node)
            stay = xp.where(absorbs, self.combine(stay, partner_stay), stay)
            stay = xp.where(absorbed, _NEG_INF, stay)

        if forced:  # an extension that spells an existing lane's sequence joins that lane's stay
            shape = (num_utts, beam, beam)  # [u, j, i]: lane j's sequence = lane i's + j's last label
            candidate = ((self.hash.reshape(num_utts, 1, beam) == self.prev_hash.reshape(num_utts, beam, 1))
                         & (self.length.reshape(num_utts, 1, beam) + 1 == self.length.reshape(num_utts, beam, 1))
                         & active.reshape(num_utts, 1, beam) & (stay > _NEG_INF).reshape(num_utts, beam, 1))
            node_i = xp.broadcast_to(self.node.reshape(num_utts, 1, beam), shape)
            node_j = xp.broadcast_to(self.node_parent[self.node].reshape(num_utts, beam, 1), shape)
            equal = self._same_sequences(candidate, node_i, node_j, exact)
            matched = equal.any(axis=2).reshape(-1)
            match_lane = (self.group_base + equal.astype(np.int8).argmax(axis=2)).reshape(-1)
            merged = emit[match_lane, safe_last]
            won = matched & (merged > stay)
            stay_new = won
            stay_node_parent = self.node[match_lane]
            stay = xp.where(matched, self.combine(stay, merged), stay)
            emit[match_lane, xp.where(matched, safe_last, blank)] = _NEG_INF

        if self.entries:
            fused = combine_scores(self.lm_scores, self.scales)
            candidates = emit + fused[:, None] + combine_scores(self.cache, self.scales)
            candidates[:, blank] = stay + fused
        else:
            candidates = emit.copy()
            candidates[:, blank] = stay
        alive_new, parents, labels = prune(candidates, beam, num_utts, xp, score_threshold=options.score_threshold,
                                           group_base=self.group_base, stats=self.stats)
        is_stay = (labels == blank) | ~alive_new
        emitted = ~is_stay

        # the new lanes
        base = self._new_nodes(t)
        fresh = emitted | (is_stay & alive_new & stay_new[parents])
        parent_node = self.node[parents]
        self.node_parent[base:base + num_lanes] = xp.where(emitted, parent_node, stay_node_parent[parents])
        self.node_label[base:base + num_lanes] = xp.where(emitted, labels, safe_last[parents])
        self.node = xp.where(fresh, base + lanes, stay_node[parents])
        self.score = xp.where(is_stay, xp.where(alive_new, stay[parents], _NEG_INF), emit[parents, labels])
        self.done = is_stay | forced
        self.prev_hash = xp.where(is_stay, self.prev_hash[parents], self.hash[parents])
        self.hash = xp.where(is_stay, self.hash[parents],
                             (self.hash[parents] * HASH_MULTIPLIER + labels + 1) % options.hash_modulus)
        self.last = xp.where(is_stay, self.last[parents], labels)
        self.length = self.length[parents] + emitted
        return parents, labels, alive_new, emitted

    def _check_vocabulary(self, vocab_size: int) -> None:
        options = self.options
        if options.blank >= vocab_size:
            raise ValueError(f"TransducerOptions.blank {options.blank} is outside the joint's vocabulary "
                             f"[0, {vocab_size})")
        if options.sentence_end is not None and options.sentence_end >= vocab_size:
            raise ValueError(f"TransducerOptions.sentence_end {options.sentence_end} is outside the joint's "
                             f"vocabulary [0, {vocab_size})")
        for entry in self.entries:
            if int(entry.scorer.vocab_size) != vocab_size:
                raise ValueError(f"scorer {entry.name!r}: vocab_size {entry.scorer.vocab_size} does not match "
                                 f"the joint's V={vocab_size}")

    def _new_nodes(self, t: int) -> int:
        """The first node of a new symbol step at frame ``t`` (node arrays grown as needed)."""
        xp, num_lanes = self.xp, self.layout.num_lanes
        k = len(self.node_frames)
        self.node_frames.append(t)
        base = 1 + k * num_lanes
        if base + num_lanes > self.node_parent.shape[0]:
            size = 1 + 2 * (k + 1) * num_lanes
            parent = xp.zeros(size, dtype=np.int64)
            label = xp.full(size, -1, dtype=np.int64)
            parent[:base] = self.node_parent[:base]
            label[:base] = self.node_label[:base]
            self.node_parent, self.node_label = parent, label
        return base

    # --- sequence comparison (the collision check) ---------------------------------------------
    def _same_sequences(self, candidate, node_a, node_b, exact: bool):
        """Of the ``candidate`` pairs (equal hash and length), those whose nodes spell the same
        label sequence: both label paths walked back until they meet."""
        steps = None if exact else self.options.history_compare_steps
        equal, unresolved = same_label_paths(candidate, node_a, node_b, self.node_label, self.node_parent, steps,
                                             self.read)
        if unresolved is not None:
            self.unresolved = self.unresolved | unresolved
        return self.xp.asarray(equal)

    # --- scorers ---------------------------------------------------------------------------------
    def _score_contexts(self, frames, terms: bool = False):
        """New score vectors for the lanes whose context changed (all lanes without the cache);
        with ``terms`` returns (lm_term [N, V], lm_total [N]) of the refreshed cache
        (:func:`gpudecode.search.scorer_cache.scorer_terms`: on CuPy one launch)."""
        xp, num_lanes = self.xp, self.layout.num_lanes
        scores = None
        if self.rescore:
            live = self.score > _NEG_INF
            scores = [checked_scores(entry, entry.scorer.score(entry.scorer.at_frames(ctx, frames)),
                                     num_lanes, int(entry.scorer.vocab_size), xp)
                      for entry, ctx in zip(self.entries, self.contexts)]
            self.lm_max = folded_group_maxima(self.lm_max, scores, self.layout.num_groups, xp, live=live)
            # the first scores: a cache of zeros refreshed on every lane (changed starts all set)
            self.cache = [xp.zeros(n.shape, dtype=np.float32) if c is None else c for c, n in zip(self.cache, scores)]
        self.cache, result = refresh(xp, self.cache, self.scales, self.lm_scores, scores,
                                     self.changed if self.cache_enabled else None, terms=terms)
        if scores is not None:
            self.rescore = False
            self.changed = xp.zeros(num_lanes, dtype=bool)
        return result

    # --- results ---------------------------------------------------------------------------------
    def _nbest(self, exact: bool):
        layout, options = self.layout, self.options
        beam = layout.beam_size
        ranks = self.score + combine_scores(self.lm_scores, self.scales) if self.entries else self.score
        order = best_first(ranks, beam, self.stats)
        joint_max = self.joint_max.reshape(1, layout.num_groups, beam).max(axis=2)
        return emission_tree_nbest(order, ranks, {TRANSDUCER_SCORE_NAME: self.score}, self.lm_scores, self.entries,
                                   self.node, self.node_parent, self.node_label, self.node_frames, options.num_best,
                                   self.read, unresolved=None if exact else self.unresolved, truncated=self.cut,
                                   maxima=self.xp.concatenate([joint_max, self.lm_max]), ids=self.ids)


def _cut_short(joint, encoder_frames, prediction, emitted, blank: int, xp):
    """[N] bool: lanes that ``emitted`` the last label a frame allows and whose best continuation
    in that frame (the joint on their new prediction vector) is a label, not blank."""
    logp = _joint_log_probs(joint, encoder_frames, prediction, xp, int(prediction.shape[0]))
    return emitted & (logp.argmax(axis=1) != blank)
