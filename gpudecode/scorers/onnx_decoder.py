"""``onnx-decoder`` and ``recurrent-lm``: a stateful ONNX step model behind a state manager.

One scorer runs an attention decoder (per-utterance inputs such as precomputed cross-attention
keys/values, written once at admission into lane buffers: per lane, or once per utterance when the
model declares ``PER_UTTERANCE_ROWS=utterance``), a decoder-only transformer LM or an LSTM LM, in
the RASR or the Hugging Face convention. Per step the :class:`StepModelRunner` merges the lanes'
histories into the model's state inputs, runs the model once (or once per ``max_batch_size``
chunk) and splits the new token states into the pool; ``extend`` chains them onto the surviving
lanes and frees everything else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gpudecode import defaults
from gpudecode.backend import array_module, to_host
from gpudecode.scorers.base import Context, LabelScorer, LaneLayout, UtteranceBatch
from gpudecode.scorers.lanes import LaneInputs
from gpudecode.scorers.registry import register_scorer
from gpudecode.session import OnnxSession, SessionOptions
from gpudecode.session.conventions import load_step_model_spec, resolve_model_path
from gpudecode.session.dense_graphs import DenseStepGraphs
from gpudecode.session.graphs import GraphOptions
from gpudecode.session.pairs import check_state_kind
from gpudecode.session.step_model import ResidentRows, StepModelRunner
from gpudecode.states.dense import DenseRecurrentStates, dense_states_apply
from gpudecode.states.factory import create_state_manager
from gpudecode.states.history import StateHistory
from gpudecode.states.options import StateManagerOptions


@dataclass
class DecoderContext:
    """Per lane: the state history, the label to feed next, and (after ``score``) its new slots.
    Greedy steps whose states stay in the step's inputs (``resident``) have no pool histories."""

    histories: StateHistory | None
    next_labels: Any  # [N] int64
    new_slots: Any = None  # [N, 1] int32, set by score()
    #: [N] bool on the states' array module, or None: lanes whose history already holds their
    #: whole prompt (a prefill) and whose first scores come from elsewhere; their children do not
    #: append the step's new token state (see ``prefix-lm``).
    fresh: Any = None
    all_fresh: bool = False  # every lane is fresh: the step model need not run
    #: the lanes' states in the bucketed step's own inputs (greedy steps; ``histories`` then None)
    resident: ResidentRows | None = None
    new_resident: ResidentRows | None = None  # set by score(): the rows holding the step's new states


_SOFTMAX_THREADS = 256  # SOFTMAX_THREADS of kernels/log_softmax.cu


def log_softmax(xp, x):
    """Log-softmax over the last axis of ``x`` (numpy or CuPy): on CuPy, a C-contiguous float32 or
    float16 [R, V] array in one launch (:func:`log_softmax_rows`), as float32."""
    if xp is not np and x.ndim == 2 and x.dtype in (np.float32, np.float16) and x.flags.c_contiguous and x.size:
        return log_softmax_rows(xp, x)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))


def log_softmax_rows(cupy, x):
    """Log-softmax of the rows of ``x`` [R, V] (float32 or float16, C-contiguous) in one launch
    (``kernels/log_softmax.cu``): a new float32 [R, V] array, the array version's values to within
    float32 rounding (its sum runs in another order)."""
    from gpudecode.kernels import kernel_function

    rows, vocab = x.shape
    out = cupy.empty((rows, vocab), dtype=np.float32)
    kernel_function("log_softmax", "log_softmax_rows", x.device.id)((rows,), (_SOFTMAX_THREADS,), (
        x, np.int32(x.dtype == np.float16), np.int64(vocab), out))
    return out


def log_softmax_in_place(x: np.ndarray, scratch: np.ndarray | None = None, maxima: np.ndarray | None = None) -> np.ndarray:
    """:func:`log_softmax` of the C-contiguous float32 numpy ``x`` [R, V] written over ``x`` (the
    same operations, so the same values); ``scratch``: a float32 array of at least R·V values for
    the exponentials (else a temporary). Returns ``x``.

    ``maxima``: a float32 [R] array that gets each result row's maximum, ``0 - log Σ exp`` (the
    row's shifted maximum is exactly +0 and rounding is monotone; NaN where the row held NaN, +inf
    or only -inf, as then every value of the result row is NaN)."""
    shift = x.max(axis=-1, keepdims=True)
    np.subtract(x, shift, out=x)
    exps = np.exp(x) if scratch is None else np.exp(x, out=scratch[:x.size].reshape(x.shape))
    logs = np.log(exps.sum(axis=-1, keepdims=True))
    np.subtract(x, logs, out=x)
    if maxima is not None:
        np.subtract(np.float32(0), logs[:, 0], out=maxima)
    return x


def converted_scores(xp, scores, kind: str):
    """``scores`` of ``kind`` (one of ``defaults.SCORES_KINDS``) as log-probabilities."""
    if kind == "neg-log-probs":
        return -scores
    if kind == "logits":
        return log_softmax(xp, scores)
    return scores


@dataclass
class DenseContext:
    """Per lane (dense states, ``gpudecode.states.dense``): the state arrays by input name, the
    label to feed next, and (after ``score``) the model's new states."""

    states: dict
    next_labels: Any  # [N] int64
    new_states: dict | None = None
    #: with captured dense steps: (input set, serial) of the buffers ``states`` are, or (a start
    #: or reset) of the context they were made from (``gpudecode.session.dense_graphs``)
    version: tuple | None = None


@register_scorer("onnx-decoder")
class OnnxDecoderScorer(LabelScorer):
    """A stateful ONNX step model as a label scorer.

    ``model``: path, serialized bytes or an :class:`OnnxSession`; ``start_labels``: fed before the
    first scored label (usually just sentence-begin); ``scores_kind``: what the model outputs
    (log-probabilities, negative log-probabilities, or logits that get a log-softmax);
    ``graphs``: capture the step in CUDA graphs, one per (rows, history length) bucket;
    ``fixed_frames``: the encoder gives every utterance the same frames (Whisper), so per-utterance
    inputs need no mask.
    """

    _uses_start_labels = True
    _resident_steps = False  # greedy steps keep their states in the step's inputs (set by begin)
    _wanted = None  # during score_lanes: the lanes asked for ([R] int64 host)
    _lane_scores = None  # [N, V] host scores of a lane subset (rows of lanes not run keep old ones)
    _exp_scratch = None  # float32 host scratch of the in-place log-softmax
    #: (the [N, V] scores score() returned, [N] float32 row maxima of its rows that were run), or None
    _row_maxima = None

    def __init__(
        self,
        *,
        model,
        vocab_size: int,
        start_labels: Sequence[int],
        state_manager: StateManagerOptions = StateManagerOptions(),
        session_options: SessionOptions = SessionOptions(),
        io_map: Mapping[str, str] | None = None,
        scores_kind: str = defaults.SCORES_KIND,
        max_batch_size: int | None = None,
        state_patterns: Sequence[tuple[str, str]] = (),
        utterance_patterns: Sequence[str] = (),
        graphs: GraphOptions = GraphOptions(),
        fixed_frames: bool = False,
    ) -> None:
        if scores_kind not in defaults.SCORES_KINDS:
            raise ValueError(f"scores_kind: expected one of {', '.join(defaults.SCORES_KINDS)}, got {scores_kind!r}")
        if self._uses_start_labels and not start_labels:
            raise ValueError("start_labels: at least one label (e.g. sentence-begin) is needed")
        if graphs.enabled and not isinstance(model, OnnxSession):
            session_options = replace(session_options, cuda_graphs=True)
        # a GenAI model folder or genai_config.json stands for its decoder file
        self.session = model if isinstance(model, OnnxSession) else OnnxSession(resolve_model_path(model),
                                                                                session_options)
        # discovered with the model's hints (genai_config.json); a Hugging Face decoder's history
        # alignment is proven by a parity probe, or the model is refused
        self.spec = load_step_model_spec(
            self.session, io_map=io_map, state_patterns=state_patterns,
            utterance_patterns=utterance_patterns, vocab_size=vocab_size, fixed_frames=fixed_frames,
        )
        self.vocab_size = int(vocab_size)
        self.start_labels = [int(label) for label in start_labels]
        self.scores_kind = scores_kind
        self.max_batch_size = max_batch_size
        self.io_map = dict(io_map or {})
        check_state_kind(self.spec, state_manager.type, state_manager.family)  # before the manager's own refusal
        self.states = create_state_manager(
            replace(state_manager, history_alignment=self.spec.history_alignment), self.spec.state_variables,
            execution_provider=self.session.provider,
        )
        dense = dense_states_apply(self.states, self.spec, graphs=False, max_batch_size=max_batch_size)
        # graphs "auto": dense states, their steps captured, instead of captured pool steps
        captured_dense = dense and graphs.enabled and graphs.auto
        if captured_dense:
            graphs = replace(graphs, enabled=False)
        self.graph_options = graphs
        self.runner = StepModelRunner(self.session, self.spec, self.states, graphs)
        #: recurrent states kept per lane as dense arrays (no pool), where they can be
        self.dense = DenseRecurrentStates(self.states.layouts, self.states.xp) if (
            dense and self.runner.graphs is None) else None
        #: the dense steps in CUDA graphs on two ping-pong input sets (plain runs where not captured)
        self.dense_graphs = DenseStepGraphs(self.session, self.spec, self.states.layouts, self.states.xp,
                                            self.runner.label_name, self.runner.label_dtype) if (
            self.dense is not None and captured_dense) else None
        # one row per utterance: the model attends each group of beam rows to its utterance's row
        grouped = self.spec.utterance_rows == "utterance" and bool(self.spec.utterance_inputs)
        self.lanes = LaneInputs(self.spec, array_module(self.session.provider), grouped=grouped, io_map=self.io_map)

    # --- lifecycle -----------------------------------------------------------------------------
    def begin(self, layout: LaneLayout) -> None:
        super().begin(layout)
        self._ctx = None  # the latest context, whose histories hold the live slots
        self._lane_scores = None
        # host upper bound of each group's history length: the table is trimmed to their max, so
        # merges never pad to the width of groups that have left (continuous batching)
        self._group_bound = np.zeros(layout.num_groups, dtype=np.int64)
        # lane inputs hold rows for the largest padded chunk (CUDA graphs bind whole buckets)
        lane_rows = layout.num_lanes
        graphs = self.runner.graphs
        if graphs is not None:
            group_size = layout.beam_size if self.lanes.grouped else 1
            lane_rows = max(rows.start + graphs.rows(rows.stop - rows.start, group_size) for rows in self._chunks())
        if self.lanes.grouped:
            lane_rows //= layout.beam_size
        self.lanes.resize(layout, lane_rows)
        #: greedy steps keep their states in the step's inputs (``ResidentRows``): one lane per
        #: utterance (each lane continues only itself), the lanes in one bucketed call
        self._resident_steps = (self.graph_options.resident_greedy and layout.beam_size == 1 and self.dense is None
                                and self.runner.resident_capable and len(self._chunks()) == 1)

    def admit(self, utterances: UtteranceBatch, groups) -> None:
        """Writes the utterances' per-utterance inputs into their groups' lanes (once)."""
        self._leave_resident()
        self.lanes.write_utterances(utterances, groups)
        self._maybe_warm_up()

    def _leave_resident(self, released=None) -> None:
        """Before anything writes the step's buffers or asks for pool histories (admitting or
        releasing utterances, warming up): the resident lanes' states go into the pool — none where
        ``released`` (groups) takes every lane, as at the end of a search."""
        ctx = self._ctx
        if (released is not None and isinstance(ctx, DecoderContext) and ctx.resident is not None
                and ctx.resident.materialized is None
                and np.unique(np.asarray(released)).size >= self.layout.num_groups):
            self._check_latest(ctx.resident)
            ctx.resident.materialized = self.states.initial_histories(self.layout.num_lanes)
        self._ctx = self._pool_context(ctx)

    def _pool_context(self, ctx):
        """``ctx`` with pool histories: a resident context's states split into the pool
        (``StepModelRunner.materialize``, once per resident rows: the search's own context object
        and this scorer's latest one get the same histories)."""
        if not isinstance(ctx, DecoderContext) or ctx.resident is None:
            return ctx
        if ctx.resident.materialized is None:
            self._check_latest(ctx.resident)
        return replace(ctx, histories=self.runner.materialize(ctx.resident, self.lanes), resident=None,
                       new_resident=None)

    def _check_latest(self, rows: ResidentRows) -> None:
        """Resident rows live in buffers every step overwrites: only the latest ones can be read."""
        if rows is not self._latest_rows:
            raise AssertionError("a resident greedy context used after a newer one: its states were overwritten "
                                 "(runtime.cuda_graphs.resident_greedy: false keeps every context readable)")

    _latest_rows: ResidentRows | None = None  # the rows of the latest resident extend

    def _maybe_warm_up(self) -> None:
        graphs = self.runner.graphs
        if graphs is not None and graphs.wants_warm_up:
            self.warm_up(self.graph_options.warm_up_time)

    def release(self, groups) -> None:
        """Frees the state slots of the lanes of ``groups``."""
        self._leave_resident(groups)
        ctx = self._ctx
        if ctx is None or isinstance(ctx, DenseContext):  # dense states hold no slots
            return
        xp = self.states.xp
        lanes = xp.asarray(self.layout.lanes_of(groups))
        lengths = ctx.histories.lengths.copy()
        lengths[lanes] = 0
        kept = StateHistory(table=ctx.histories.table, lengths=lengths)
        self.states.retain(kept)
        self._ctx = DecoderContext(kept, ctx.next_labels)
        self._group_bound[np.asarray(groups, dtype=np.int64)] = 0

    # --- scoring -------------------------------------------------------------------------------
    def initial_context(self, groups, ctx: Context | None = None) -> DecoderContext:
        """Lanes of ``groups`` restart from ``start_labels``; the other lanes keep ``ctx``."""
        xp, num_lanes = self.states.xp, self.layout.num_lanes
        ctx = self._pool_context(ctx)
        self._group_bound[np.asarray(groups, dtype=np.int64)] = 0
        if self.dense is not None:
            context = self._dense_initial_context(groups, ctx)
            reset = None if ctx is None else xp.zeros(num_lanes, dtype=bool)
            if reset is not None:
                reset[xp.asarray(self.layout.lanes_of(groups))] = True
        elif ctx is None:
            context = self._ctx = DecoderContext(self.states.initial_histories(num_lanes),
                                                 xp.full(num_lanes, self.start_labels[0], dtype=np.int64))
            reset = None
        else:
            lanes = xp.asarray(self.layout.lanes_of(groups))
            table, lengths = ctx.histories.table.copy(), ctx.histories.lengths.copy()
            lengths[lanes] = 0
            if table.shape[1]:
                table[lanes] = -1
            next_labels = ctx.next_labels.copy()
            next_labels[lanes] = self.start_labels[0]
            # No retain here: the reset lanes' old slots are freed by release() or, at the latest,
            # by the next extend's retain (nothing references them any more).
            context = self._ctx = DecoderContext(StateHistory(table=table, lengths=lengths), next_labels)
            reset = xp.zeros(num_lanes, dtype=bool)
            reset[lanes] = True
        for label in self.start_labels[1:]:  # a few fixed prompt labels, fed to the reset lanes
            self.score(context)
            labels = xp.full(num_lanes, label, dtype=np.int64)
            if reset is not None:  # other lanes carry their context unchanged
                labels = xp.where(reset, labels, -1)
            context = self.extend(context, xp.arange(num_lanes), labels)
        return context

    def _dense_initial_context(self, groups, ctx) -> DenseContext:
        """The dense states' start: every lane (``ctx`` None) or the lanes of ``groups``."""
        xp, num_lanes = self.states.xp, self.layout.num_lanes
        if ctx is None:
            context = DenseContext(self.dense.zeros(num_lanes), xp.full(num_lanes, self.start_labels[0], dtype=np.int64))
        else:
            lanes = xp.asarray(self.layout.lanes_of(groups))
            next_labels = ctx.next_labels.copy()
            next_labels[lanes] = self.start_labels[0]
            context = DenseContext(self.dense.reset(ctx.states, lanes), next_labels, version=ctx.version)
        self._ctx = context
        return context

    def _chunks(self) -> list[slice]:
        """The rows of the model calls of one step: a few, never one per hypothesis. With one
        input row per utterance a chunk holds whole utterances (``max_batch_size`` rounded down
        to a multiple of the beam, at least one utterance)."""
        num_lanes, beam = self.layout.num_lanes, self.layout.beam_size
        chunk = self.max_batch_size or num_lanes
        if self.lanes.grouped:
            chunk = max(beam, chunk // beam * beam)
        return [slice(start, min(start + chunk, num_lanes)) for start in range(0, num_lanes, chunk)]

    def score(self, ctx: DecoderContext):
        """[N, V] log-probabilities of the next label for every lane: float32, or float16 as a
        float16 model outputs log-probabilities (the label-step kernel reads them as they are).

        With CUDA graphs and one chunk, a view of the graphs' shared output buffer: the next
        ``score()`` overwrites it (the base class's contract)."""
        self._row_maxima = None
        if isinstance(ctx, DenseContext):
            if self.dense_graphs is not None:
                raw, ctx.new_states, ctx.version, ctx.states = self.dense_graphs.run(ctx.states, ctx.next_labels,
                                                                                     ctx.version)
            else:
                raw, ctx.new_states = self.runner.run_dense(ctx.states, ctx.next_labels)
            return self._log_probs(raw, copy=False)
        if ctx.resident is not None or (self._resident_steps and self.runner.resident_capable):
            if ctx.resident is not None:
                self._check_latest(ctx.resident)
            raw, ctx.new_resident, ctx.new_slots = self.runner.run_resident(
                ctx.histories if ctx.resident is None else ctx.resident, ctx.next_labels, self.lanes)
            return self._log_probs(raw, copy=False)
        lanes = self._subset()
        if lanes is not None:
            return self._score_subset(ctx, lanes)
        scores, slots = [], []
        chunks = self._chunks()
        copy = self.runner.graphs is not None and len(chunks) > 1  # else the run's own array
        for rows, time_size in zip(chunks, self.runner.time_sizes(ctx.histories, chunks)):
            raw, new_slots = self.runner.run(ctx.histories, ctx.next_labels, rows, self.lanes, time_size)
            scores.append(self._log_probs(raw, copy=copy))
            slots.append(new_slots)
        xp = self.states.xp
        ctx.new_slots = slots[0] if len(slots) == 1 else xp.concatenate(slots)
        out_xp = self.layout.xp
        return scores[0] if len(scores) == 1 else out_xp.concatenate(scores)

    def score_lanes(self, ctx: DecoderContext, lanes):
        """:meth:`score` of the rows ``lanes`` only (the base class's contract): on the CPU the model
        runs on those rows alone (:meth:`StepModelRunner.run_lanes`); the other lanes get no new
        token state (their children carry them) and their rows keep what this scorer's buffer held
        (finite). Elsewhere — CuPy, CUDA graphs, one input row per utterance, more rows than
        ``max_batch_size`` — every row. Runs through :meth:`score` (subclasses add to it there)."""
        self._wanted = np.asarray(lanes, dtype=np.int64)
        try:
            return self.score(ctx)
        finally:
            self._wanted = None

    def _subset(self):
        """The lanes :meth:`score_lanes` asked for, when only those rows are run (else None)."""
        lanes, layout = self._wanted, self.layout
        if (lanes is None or layout.xp is not np or not self.runner.runs_lane_subsets or self.lanes.grouped
                or lanes.size == layout.num_lanes or (self.max_batch_size or lanes.size) < lanes.size):
            return None
        return lanes

    def _score_subset(self, ctx: DecoderContext, lanes: np.ndarray):
        """[N, V] host scores with the rows ``lanes`` computed by the model (the others as the
        buffer held them); lanes not run get no new slot."""
        num_lanes = self.layout.num_lanes
        slots = np.full((num_lanes, 1), -1, dtype=np.int32)
        out = self._lane_scores
        if lanes.size:
            raw, new_slots, lanes = self.runner.run_lanes(ctx.histories, ctx.next_labels, lanes, self.lanes,
                                                          any_order=True)  # rows for these lanes
            maxima = self._lane_maxima_buffer(num_lanes, raw.shape[0])
            scores = self._host_log_probs(raw, maxima)
            if out is None or out.dtype != scores.dtype:
                out = self._lane_scores = np.zeros((num_lanes, scores.shape[1]), dtype=scores.dtype)
            out[lanes] = scores
            slots[lanes] = new_slots
            if self._maxima_written:
                self._lane_maxima[lanes] = maxima
                self._row_maxima = (out, self._lane_maxima)
        elif out is None:
            out = self._lane_scores = np.zeros((num_lanes, self.vocab_size), dtype=np.float32)
        ctx.new_slots = slots
        return out

    def _lane_maxima_buffer(self, num_lanes: int, rows: int) -> np.ndarray:
        """A float32 [rows] view of the kept row-maxima scratch (and the [N] array they go to)."""
        kept = self._lane_maxima
        if kept is None or kept.shape[0] != num_lanes:
            kept = self._lane_maxima = np.full(num_lanes, -np.inf, np.float32)
            self._maxima_scratch = np.empty(num_lanes, np.float32)
        return self._maxima_scratch[:rows]

    def row_maxima(self, scores):
        """[N] float32 host: the row maxima of ``scores`` — the array the latest :meth:`score` /
        :meth:`score_lanes` returned — on the rows that call ran (others: stale values), exactly
        ``scores.max(axis=1)`` there; None when not known (then the caller takes the maxima)."""
        known = self._row_maxima
        return known[1] if known is not None and known[0] is scores else None

    _lane_maxima = None  # [N] float32 host row maxima of the lane-subset scores
    _maxima_scratch = None  # [N] float32 host scratch: one run's row maxima
    _maxima_written = False  # the latest _host_log_probs wrote its row maxima

    def _host_log_probs(self, raw: np.ndarray, maxima: np.ndarray | None = None):
        """:meth:`_log_probs` of a host run's own scores ``raw`` (nobody else reads them): logits
        in float32 get their log-softmax written over them (:func:`log_softmax_in_place`, the
        exponentials in a scratch buffer kept between steps; its row maxima into ``maxima``)."""
        self._maxima_written = False
        if not (self.scores_kind == "logits" and raw.dtype == np.float32 and raw.flags.c_contiguous
                and raw.ndim >= 2 and raw.size == raw.shape[0] * raw.shape[-1]):
            return self._log_probs(raw, copy=False)
        scores = raw.reshape(raw.shape[0], raw.shape[-1])
        if self._exp_scratch is None or self._exp_scratch.size < scores.size:
            self._exp_scratch = np.empty(2 * scores.size, np.float32)
        self._maxima_written = maxima is not None
        return log_softmax_in_place(scores, self._exp_scratch, maxima)

    def _log_probs(self, raw, copy: bool):
        """``raw`` scores as [N, V] log-probabilities (``copy``: never a view of ``raw``); float16
        log-probabilities stay float16, everything else becomes float32."""
        xp = self.layout.xp
        scores = xp.asarray(raw)
        scores = scores.reshape(scores.shape[0], -1, scores.shape[-1])[:, -1, :]
        if (self.scores_kind == "logits" and xp is not np and scores.dtype in (np.float16, np.float32)
                and scores.flags.c_contiguous and scores.size):
            return log_softmax_rows(xp, scores)  # float16 read as it is; a new float32 array either way
        kept = np.float16 if scores.dtype == np.float16 and self.scores_kind == "log-probs" else np.float32
        return converted_scores(xp, scores.astype(kept, copy=copy), self.scores_kind)

    @property
    def capturable(self) -> bool:
        """Dense states stepped in CUDA graphs: a step is device work on fixed buffers
        (:class:`gpudecode.session.dense_graphs.DenseStepGraphs`, plain runs inside a capture)."""
        return self.dense_graphs is not None and self.dense_graphs.bound

    @property
    def captured_graphs(self) -> int:
        """CUDA graphs captured so far (0 without graphs, or where the model cannot be captured)."""
        return self.runner.graphs.captures if self.runner.graphs is not None else 0

    def warm_up(self, max_time: int) -> int:
        """Captures the step's graphs for every history bucket up to ``max_time`` (the current
        layout's chunks); returns the number of graphs. Runs on empty histories; the slots it
        allocates belong to no history and are freed by the next ``extend``."""
        return self.runner.warm_up(max_time, self._chunks(), self.lanes)

    def extend(self, ctx: DecoderContext, parents, labels) -> DecoderContext:
        """Children continue their parents' histories with the parents' new token states."""
        xp = self.states.xp
        if isinstance(ctx, DenseContext):
            return self._dense_extend(ctx, parents, labels)
        if ctx.new_slots is None and ctx.new_resident is None:
            raise AssertionError("extend() before score(): the parents' new token states are unknown")
        labels = self._on_states(labels).astype(np.int64, copy=False)
        append = labels >= 0
        if ctx.new_resident is not None:  # one lane per utterance: each lane is its own parent
            next_labels = xp.where(append, labels, ctx.next_labels)
            if ctx.fresh is not None:
                append &= ~self._on_states(ctx.fresh)
            self._group_bound += 1
            if ctx.resident is None:  # the pool's slots of these lanes are no longer read
                self.states.retain(*self._held_histories())
            self._latest_rows = ctx.new_resident.extended(append)
            self._ctx = DecoderContext(None, next_labels, resident=self._latest_rows)
            return self._ctx
        parents = self._on_states(parents).astype(np.int64, copy=False)
        next_labels = xp.where(append, labels, ctx.next_labels[parents])
        if ctx.fresh is not None:  # a fresh parent's history already ends with its whole prompt
            append &= ~self._on_states(ctx.fresh)[parents]
        self._group_bound += 1  # the tables are cut to the longest possible history (a host bound; no sync)
        histories = self.states.extend_retained(ctx.histories, ctx.new_slots, parents, append=append,
                                                width=int(self._group_bound.max()))
        self._ctx = DecoderContext(histories, next_labels)
        return self._ctx

    def _held_histories(self) -> list[StateHistory]:
        """Pool histories this scorer holds besides its lanes' (none here; a prefix LM's pending prompts)."""
        return []

    def _dense_extend(self, ctx: DenseContext, parents, labels) -> DenseContext:
        """Children of dense states: the parent's new state where a label was fed, else its own."""
        xp = self.states.xp
        if ctx.new_states is None:
            raise AssertionError("extend() before score(): the parents' new states are unknown")
        parents = xp.ascontiguousarray(xp.asarray(parents), dtype=np.int64)
        labels = xp.ascontiguousarray(xp.asarray(labels), dtype=np.int64)
        out = next_out = version = None
        if self.dense_graphs is not None:  # written into the other input set of the captured steps
            out, next_out, version = self.dense_graphs.targets(ctx.version)
        states, next_labels = self.dense.children(ctx.states, ctx.new_states, parents, labels, ctx.next_labels,
                                                  out=out, next_out=next_out)
        self._ctx = DenseContext(states, next_labels, version=version)
        return self._ctx

    def _on_states(self, array):
        """``array`` where the state manager keeps its histories (host or device)."""
        if self.states.device == "cpu":
            return array if type(array) is np.ndarray else to_host(array)
        return self.states.xp.asarray(array)

    def close(self) -> None:
        """Returns the state pool's and the graph buffers' memory."""
        self.states.close()
        self.runner.close()
        if self.dense_graphs is not None:
            self.dense_graphs.close()


@register_scorer("recurrent-lm")
class RecurrentLmScorer(OnnxDecoderScorer):
    """A transformer or LSTM language model for shallow fusion (no per-utterance inputs)."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        if self.spec.utterance_inputs:
            raise ValueError(
                f"{self.spec.source}: a recurrent LM takes no per-utterance inputs, but the model has "
                f"{[u.name for u in self.spec.utterance_inputs]}; use the 'onnx-decoder' scorer type"
            )
