"""``onnx-decoder`` and ``recurrent-lm``: a stateful ONNX step model behind a state manager.

One scorer runs an attention decoder (per-utterance inputs such as precomputed cross-attention
keys/values, written once at admission: per lane, or once per utterance when the model declares
``PER_UTTERANCE_ROWS=utterance``), a decoder-only transformer LM or an LSTM LM, in the RASR or the
Hugging Face convention. Per step: merge the lanes' histories into the model's
state inputs, run the model once (or once per ``max_batch_size`` chunk), split the new token states
into the pool; ``extend`` chains them onto the surviving lanes and frees everything else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gpudecode.backend import array_module, to_host
from gpudecode.scorers.base import Context, LabelScorer, LaneLayout, UtteranceBatch
from gpudecode.scorers.registry import register_scorer
from gpudecode.session import OnnxSession, SessionOptions, discover_step_model, hf_attention_inputs
from gpudecode.session.graphs import (
    GraphBuffers,
    GraphOptions,
    PaddedRuns,
    StepGraphs,
    bucket_rows,
    bucket_time,
    time_buckets,
)
from gpudecode.states.factory import create_state_manager
from gpudecode.states.history import StateHistory
from gpudecode.states.options import StateManagerOptions

SCORES_KINDS = ("log-probs", "neg-log-probs", "logits")


@dataclass
class DecoderContext:
    """Per lane: the state history, the label to feed next, and (after ``score``) its new slots."""

    histories: StateHistory
    next_labels: Any  # [N] int64
    new_slots: Any = None  # [N, 1] int32, set by score()
    #: [N] bool on the states' array module, or None: lanes whose history already holds their
    #: whole prompt (a prefill) and whose first scores come from elsewhere; their children do not
    #: append the step's new token state (see ``prefix-lm``).
    fresh: Any = None
    all_fresh: bool = False  # every lane is fresh: the step model need not run


def _log_softmax(xp, x):
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))


def _rows(array, axis: int, count: int):
    """The first ``count`` rows of ``array`` along its batch ``axis`` (a view)."""
    index = [slice(None)] * array.ndim
    index[axis] = slice(0, count)
    return array[tuple(index)]


def _round_up(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass
class _StaticInputs:
    """One bucket's static model inputs (views that stay valid while the buffers do)."""

    key: tuple  # the graph's key: bucket and lane buffers
    feeds: dict  # every input by name
    states: dict  # the merge's out buffers
    prefix: Any  # int32 prefix lengths (the merge writes them)
    prefix_converted: Any  # the model's prefix-length when it is not int32, else None
    labels: Any


@register_scorer("onnx-decoder")
class OnnxDecoderScorer(LabelScorer):
    """A stateful ONNX step model as a label scorer.

    ``model``: path, serialized bytes or an :class:`OnnxSession`; ``start_labels``: fed before the
    first scored label (usually just sentence-begin); ``scores_kind``: what the model outputs
    (log-probabilities, negative log-probabilities, or logits that get a log-softmax);
    ``graphs``: capture the step in CUDA graphs, one per (rows, history length) bucket.
    """

    _uses_start_labels = True

    def __init__(
        self,
        *,
        model,
        vocab_size: int,
        start_labels: Sequence[int],
        state_manager: StateManagerOptions = StateManagerOptions(),
        session_options: SessionOptions = SessionOptions(),
        io_map: Mapping[str, str] | None = None,
        scores_kind: str = "log-probs",
        max_batch_size: int | None = None,
        state_patterns: Sequence[tuple[str, str]] = (),
        utterance_patterns: Sequence[str] = (),
        graphs: GraphOptions = GraphOptions(),
    ) -> None:
        if scores_kind not in SCORES_KINDS:
            raise ValueError(f"scores_kind: expected one of {', '.join(SCORES_KINDS)}, got {scores_kind!r}")
        if self._uses_start_labels and not start_labels:
            raise ValueError("start_labels: at least one label (e.g. sentence-begin) is needed")
        if graphs.enabled and not isinstance(model, OnnxSession):
            session_options = replace(session_options, cuda_graphs=True)
        self.session = model if isinstance(model, OnnxSession) else OnnxSession(model, session_options)
        self.spec = discover_step_model(
            self.session.tensors, io_map=io_map, state_patterns=state_patterns,
            utterance_patterns=utterance_patterns, vocab_size=vocab_size,
        )
        self.vocab_size = int(vocab_size)
        self.start_labels = [int(label) for label in start_labels]
        self.scores_kind = scores_kind
        self.max_batch_size = max_batch_size
        self.io_map = dict(io_map or {})
        self.states = create_state_manager(
            replace(state_manager, history_alignment=self.spec.history_alignment), self.spec.state_variables,
            execution_provider=self.session.provider,
        )
        self._label_dtype = self.session.tensors.input(self.spec.hypothesis_inputs[
            "token" if self.spec.convention == "rasr" else "input_ids"]).dtype
        self._lane_inputs: dict[str, Any] = {}  # per-utterance inputs, a row per lane (or utterance)
        self._filled: dict[str, np.ndarray] = {}  # host: frames written in each row of a lane input
        # one row per utterance: the model attends each group of beam rows to its utterance's row
        self._grouped = self.spec.utterance_rows == "utterance" and bool(self.spec.utterance_inputs)
        self._xp = array_module(self.session.provider)  # where the model's inputs live
        self.graph_options = graphs
        self._graphs = None
        self._static: dict = {}  # (bucket, buffer generation, lane buffers) -> _StaticInputs
        if graphs.enabled and self.states.device != self.session.provider:
            raise ValueError(
                f"{self.spec.source}: cuda_graphs needs the state manager where the model runs "
                f"({self.session.provider}), got a {self.states.device} state manager"
            )
        if graphs.enabled:
            buffers = GraphBuffers(self.session.provider, self.session.options.device_id, shared=graphs.shared_buffers)
            runs = StepGraphs if self.session.cuda_graphs else PaddedRuns
            self._graphs = runs(self.session, buffers)
        names = self.spec.hypothesis_inputs
        # left padding of the history is exact only when the model masks it
        self._pad_time = self.states.family == "transformer" and (
            "prefix-length" in names or "attention_mask" in names)
        # state outputs sliced to their first rows stay contiguous when the batch axis is outermost
        self._rows_outermost = all(layout.pre == 1 for layout in self.states.layouts)

    # --- lifecycle -----------------------------------------------------------------------------
    def begin(self, layout: LaneLayout) -> None:
        super().begin(layout)
        self._ctx = None  # the latest context, whose histories hold the live slots
        # host upper bound of each group's history length: the table is trimmed to their max, so
        # merges never pad to the width of groups that have left (continuous batching)
        self._group_bound = np.zeros(layout.num_groups, dtype=np.int64)
        # lane inputs hold rows for the largest padded chunk (CUDA graphs bind whole buckets)
        lane_rows = layout.num_lanes
        if self._graphs is not None:
            lane_rows = max(start + self._padded_rows(rows.stop - rows.start) for start, rows in self._chunks())
        if self._grouped:
            lane_rows //= layout.beam_size
        if lane_rows != getattr(self, "_lane_rows", None):
            self._lane_inputs = {}
            self._static = {}  # its views would keep the old lane buffers alive
        # else the lane buffers stay (admissions overwrite their lanes), and with them the
        # addresses the captured graphs are bound to
        self._lane_rows = lane_rows

    def admit(self, utterances: UtteranceBatch, groups) -> None:
        """Writes the utterances' per-utterance inputs into their groups' lanes (once)."""
        self._write_utterance_inputs(utterances, groups)
        self._maybe_warm_up()

    def _maybe_warm_up(self) -> None:
        if self._graphs is not None and self.graph_options.warm_up_time and not self._graphs.num_graphs:
            self.warm_up(self.graph_options.warm_up_time)

    def _write_utterance_inputs(self, utterances: UtteranceBatch, groups, produced=None, sizes=None) -> None:
        """Per-utterance inputs of ``utterances`` -> the lanes of ``groups``.

        Each input comes from ``produced`` (e.g. an initializer's outputs, [U, ...]) when it holds
        the input's source, else from ``utterances.inputs``. ``encoder_attention_mask`` is built
        from the sizes when nobody brings it; ``encoder-states-size`` always is.
        """
        produced = produced or {}
        # the buffer rows of the groups: one per utterance, or each of its lanes
        host_rows = np.asarray(groups, dtype=np.int64) if self._grouped else self.layout.lanes_of(groups)
        rows = self._xp.asarray(host_rows)
        size_name = self.io_map.get("encoder-states-size", "encoder-states-size")
        sizes_source, mask_input, time_size = None, None, None
        for u in self.spec.utterance_inputs:
            if u.name == size_name:
                continue
            source = self._source_of(u, produced)
            if source in produced:
                data = produced[source]
            elif source in utterances.inputs:
                data = utterances.inputs[source]
                sizes_source = source
            elif u.name == "encoder_attention_mask":
                mask_input = u
                continue
            else:
                raise ValueError(
                    f"{self.spec.source}: per-utterance input '{u.name}' needs '{source}' from the encoder, "
                    f"but the utterances bring {sorted(utterances.inputs)}"
                    + (f" and the initializer {sorted(produced)}" if produced else "")
                )
            data = self._xp.asarray(data).astype(u.dtype, copy=False)
            if u.time_axis is not None:
                time_size = data.shape[u.time_axis]
            self._write_lanes(u.name, data, rows, u.time_axis, host_rows)
        if sizes is None:
            sizes = utterances.size_of(sizes_source) if sizes_source else utterances.input_lengths
        if mask_input is not None:
            if time_size is None:
                raise ValueError(f"{self.spec.source}: 'encoder_attention_mask' has no encoder input to "
                                 "take its length from")
            valid = self._xp.arange(time_size)[None, :] < self._xp.asarray(sizes).reshape(-1, 1)
            self._write_lanes(mask_input.name, valid.astype(mask_input.dtype), rows, mask_input.time_axis, host_rows)
        size_input = next((u for u in self.spec.utterance_inputs if u.name == size_name), None)
        if size_input is not None:
            self._write_lanes(size_name, self._xp.asarray(sizes).astype(size_input.dtype), rows, None, host_rows)

    def _source_of(self, u, produced) -> str:
        """The name of the encoder (or initializer) output that per-utterance input ``u`` takes."""
        return u.source or u.name

    def _write_lanes(self, name: str, data, targets, time_axis: int | None, host_targets: np.ndarray) -> None:
        """buffer[targets] = each utterance's data, repeated beam times for per-lane buffers
        (``targets``: the lanes, or the groups when grouped; ``host_targets`` the same on the
        host); buffers grow by rounding up."""
        xp, beam = self._xp, self.layout.beam_size
        rows = data if self._grouped else xp.repeat(data, beam, axis=0)
        buffer = self._lane_inputs.get(name)
        shape = list(rows.shape)
        shape[0] = self._lane_rows
        if time_axis is not None:
            shape[time_axis] = _round_up(rows.shape[time_axis])
            if buffer is not None:
                shape[time_axis] = max(shape[time_axis], buffer.shape[time_axis])
        if buffer is None or tuple(buffer.shape) != tuple(shape):
            grown = xp.zeros(shape, dtype=rows.dtype)
            if buffer is not None:
                grown[tuple(slice(0, d) for d in buffer.shape)] = buffer
                self._static = {}  # bound to the old buffer
            else:
                self._filled[name] = np.zeros(shape[0], dtype=np.int64)
            buffer = grown
            self._lane_inputs[name] = buffer
        if time_axis is not None:
            filled, length = self._filled[name], rows.shape[time_axis]  # host: frames written per row
            stale = filled[host_targets] > length  # old utterances' frames beyond the new ones' lengths
            if stale.any():
                buffer[xp.asarray(host_targets[stale])] = 0
            filled[host_targets] = length
            index = [targets] + [slice(None)] * (rows.ndim - 1)
            index[time_axis] = slice(0, rows.shape[time_axis])
            buffer[tuple(index)] = rows
        else:
            buffer[targets] = rows

    def release(self, groups) -> None:
        """Frees the state slots of the lanes of ``groups``."""
        ctx = self._ctx
        if ctx is None:
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
        self._group_bound[np.asarray(groups, dtype=np.int64)] = 0
        if ctx is None:
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

    def _chunks(self):
        """(start, rows) of the model calls of one step: a few, never one per hypothesis. With one
        input row per utterance a chunk holds whole utterances (``max_batch_size`` rounded down
        to a multiple of the beam, at least one utterance)."""
        num_lanes, beam = self.layout.num_lanes, self.layout.beam_size
        chunk = self.max_batch_size or num_lanes
        if self._grouped:
            chunk = max(beam, chunk // beam * beam)
        return [(start, slice(start, min(start + chunk, num_lanes))) for start in range(0, num_lanes, chunk)]

    def _padded_rows(self, num_rows: int) -> int:
        """The row bucket of a call of ``num_rows`` rows (whole utterances when grouped)."""
        if not self._grouped:
            return bucket_rows(num_rows, self.graph_options.min_rows)
        beam = self.layout.beam_size
        return beam * bucket_rows(-(-num_rows // beam), -(-self.graph_options.min_rows // beam))

    def _input_rows(self, rows: slice) -> slice:
        """The per-utterance input rows of hypothesis ``rows``."""
        if not self._grouped:
            return rows
        beam = self.layout.beam_size
        return slice(rows.start // beam, -(-rows.stop // beam))

    def _chunk_time_sizes(self, ctx: DecoderContext, chunks) -> list[int | None]:
        """Per chunk, the longest history its rows keep, so that each model call pads only to
        its own rows (one small transfer for all chunks); None (the table width) for one chunk."""
        if len(chunks) == 1 or self.states.family != "transformer":
            return [None] * len(chunks)
        xp, lengths = self.states.xp, ctx.histories.lengths
        size = chunks[0][1].stop - chunks[0][1].start
        padded = xp.zeros(len(chunks) * size, dtype=lengths.dtype)
        padded[:lengths.shape[0]] = lengths
        maxima = to_host(padded.reshape(len(chunks), size).max(axis=1))
        limit = min(ctx.histories.width, self.states._max_history)
        return [min(int(m), limit) for m in maxima]

    def score(self, ctx: DecoderContext):
        """[N, V] log-probabilities of the next label for every lane: float32, or float16 as a
        float16 model outputs log-probabilities (the label-step kernel reads them as they are).

        With CUDA graphs and one chunk, a view of the graphs' shared output buffer: the next
        ``score()`` overwrites it (the base class's contract)."""
        scores, slots = [], []
        chunks = self._chunks()
        for (_, rows), time_size in zip(chunks, self._chunk_time_sizes(ctx, chunks)):
            s, n = (self._run(ctx, rows, time_size) if self._graphs is None
                    else self._run_bucketed(ctx, rows, time_size, copy_scores=len(chunks) > 1))
            scores.append(s)
            slots.append(n)
        xp = self.states.xp
        ctx.new_slots = slots[0] if len(slots) == 1 else xp.concatenate(slots)
        out_xp = self.layout.xp
        result = scores[0] if len(scores) == 1 else out_xp.concatenate(scores)
        return result

    def _run(self, ctx: DecoderContext, rows: slice, time_size: int | None = None):
        xp, spec = self.states.xp, self.spec
        histories = ctx.histories
        if rows != slice(0, self.layout.num_lanes):
            histories = StateHistory(table=histories.table[rows], lengths=histories.lengths[rows])
        if self.spec.in_place_outputs:
            time_size = self._natural_time(histories, time_size)
        merged = self.states.merge(histories, time_size=time_size)
        labels = ctx.next_labels[rows].astype(self._label_dtype)[:, None]
        feeds = dict(merged.inputs)
        names = spec.hypothesis_inputs
        if spec.convention == "rasr":
            feeds[names["token"]] = labels
            if "token-length" in names:
                feeds[names["token-length"]] = xp.ones(labels.shape[0], dtype=self._input_dtype("token-length"))
            if "prefix-length" in names:
                feeds[names["prefix-length"]] = merged.prefix_lengths.astype(self._input_dtype("prefix-length"))
        else:
            feeds[names["input_ids"]] = labels
            mask, positions = hf_attention_inputs(merged.prefix_lengths, merged.time_size)
            if "attention_mask" in names:
                feeds[names["attention_mask"]] = mask
            if "position_ids" in names:
                feeds[names["position_ids"]] = positions
        for name, buffer in self._lane_inputs.items():
            feeds[name] = buffer[self._input_rows(rows)]
        in_place = self._in_place(merged.inputs)
        outputs = self.session.run(feeds, self._output_names(in_place), outputs=in_place)
        new_slots = self.states.split(self._state_outputs(outputs))
        return self._log_probs(outputs[spec.scores_output], copy=False), new_slots  # the run's own array

    def _run_bucketed(self, ctx: DecoderContext, rows: slice, time_size: int | None = None, copy_scores: bool = True):
        """One model call padded to its (rows, history) bucket, through the step graphs.

        Static inputs are views of the graph buffers: the merge writes the states and prefix
        lengths straight into them, padding rows and left padding as zeros (masked by
        ``prefix-length`` / ``attention_mask``). Per-utterance inputs are the lane buffers
        themselves. Only the first ``rows`` of the outputs are used.
        """
        spec, graphs, names = self.spec, self._graphs, self.spec.hypothesis_inputs
        buffers = graphs.buffers
        histories = ctx.histories
        num_rows = rows.stop - rows.start
        if rows != slice(0, self.layout.num_lanes):
            histories = StateHistory(table=histories.table[rows], lengths=histories.lengths[rows])
        padded_rows = self._padded_rows(num_rows)
        if self.states.family != "transformer":
            padded_time = 1
        else:
            natural = self._natural_time(histories, time_size)
            padded_time = bucket_time(natural, self.graph_options.time_step) if self._pad_time else natural
        bucket = (rows.start, padded_rows, padded_time)
        static = self._static_io(bucket)
        merged = self.states.merge(histories, out=static.states, prefix_lengths_out=static.prefix)
        feeds = dict(static.feeds)
        static.labels[num_rows:] = 0
        static.labels[:num_rows, 0] = ctx.next_labels[rows]
        if static.prefix_converted is not None:
            static.prefix_converted[...] = static.prefix
        if spec.convention != "rasr":
            mask, positions = hf_attention_inputs(merged.prefix_lengths, padded_time)
            for name, value in ((names.get("attention_mask"), mask), (names.get("position_ids"), positions)):
                if name is not None:
                    feeds[name][...] = value
        in_place = self._in_place(static.states)
        outputs = graphs.run(static.key, feeds, self._output_names(in_place),
                             lambda name, dtype, shape: in_place[name] if name in in_place
                             else buffers.view(name, dtype, shape, bucket))
        states_out = self._state_outputs(outputs)
        if self._rows_outermost:
            states_out = {v.output_name: _rows(states_out[v.output_name], v.batch_axis, num_rows)
                          for v in spec.state_variables}
            new_slots = self.states.split(states_out)
        else:
            new_slots = self.states.split(states_out)[:num_rows]
        return self._log_probs(outputs[spec.scores_output][:num_rows], copy=copy_scores), new_slots

    def _output_names(self, in_place: dict) -> list[str]:
        """The scores, the state outputs and the bound in-place outputs, each once."""
        state_outputs = [v.output_name for v in self.spec.state_variables]
        return list(dict.fromkeys([self.spec.scores_output, *state_outputs, *in_place]))

    def _state_outputs(self, outputs: dict) -> dict:
        """The state outputs for the split. One written in place (``spec.in_place_outputs``) holds
        its state input's bytes, new step last, and is read in that input's shape (its declared
        shape may differ, as keys declared in the layout an attention kernel reads); a host manager
        gets only its new step, not the whole history."""
        states = {}
        for layout in self.states.layouts:
            name = layout.variable.output_name
            array = outputs[name]
            if name in self.spec.in_place_outputs:
                rows = array.shape[layout.variable.batch_axis]
                array = array.reshape(layout.tensor_shape(rows, array.size // (rows * layout.token_size)))
                if self.states.device == "cpu":
                    index = [slice(None)] * array.ndim
                    index[layout.variable.time_axis] = slice(-1, None)
                    array = array[tuple(index)]
            states[name] = array
        return states

    def _natural_time(self, histories: StateHistory, time_size: int | None) -> int:
        """T of a call: the longest kept history (or ``time_size``), plus the position an in-place
        model (``spec.in_place_outputs``) writes the new step into."""
        natural = min(histories.width, self.states._max_history) if time_size is None else time_size
        return natural + bool(self.spec.in_place_outputs)

    def _in_place(self, state_inputs: dict) -> dict:
        """The in-place outputs bound to their state inputs' buffers (CUDA with device states; on
        the CPU provider, or with the states merged on the host, they are neither requested nor
        bound)."""
        if self.session.provider != "cuda" or self.states.device == "cpu":
            return {}
        bound = {}
        for output, name in self.spec.in_place_outputs.items():
            buffer = state_inputs[name]
            # the output may declare the same bytes in another shape (keys declared in the layout an
            # attention kernel reads): its own static dims, the buffer's batch and time
            declared = self.session.tensors.output(output).shape
            shape = tuple(d if isinstance(d, int) else n for d, n in zip(declared, buffer.shape))
            bound[output] = buffer if shape == tuple(buffer.shape) else buffer.reshape(shape)
        return bound

    def _static_io(self, bucket) -> "_StaticInputs":
        """The static inputs of ``bucket``: views of the graph buffers (and of the lane buffers),
        made once per bucket and buffer generation."""
        buffers, names, spec = self._graphs.buffers, self.spec.hypothesis_inputs, self.spec
        lanes = tuple(id(buffer) for buffer in self._lane_inputs.values())
        cached = self._static.get((bucket, buffers.generation, lanes))
        if cached is not None:
            return cached
        _, padded_rows, padded_time = bucket

        def view(name, dtype, shape):
            return buffers.view(name, dtype, shape, bucket)

        states = {layout.name: view(layout.name, layout.model_dtype, layout.tensor_shape(padded_rows, padded_time))
                  for layout in self.states.layouts}
        prefix_name = names.get("prefix-length")
        prefix_direct = prefix_name is not None and self._input_dtype("prefix-length") == np.int32
        prefix = view(prefix_name if prefix_direct else "#prefix-lengths", np.int32, (padded_rows,))
        label_name = names["token" if spec.convention == "rasr" else "input_ids"]
        labels = view(label_name, self._label_dtype, (padded_rows, 1))
        feeds = {**states, label_name: labels}
        converted = None
        if spec.convention == "rasr":
            if "token-length" in names:
                feeds[names["token-length"]] = view(names["token-length"], self._input_dtype("token-length"),
                                                    (padded_rows,))
                feeds[names["token-length"]].fill(1)
            if prefix_name is not None:
                if not prefix_direct:
                    converted = view(prefix_name, self._input_dtype("prefix-length"), (padded_rows,))
                feeds[prefix_name] = prefix if prefix_direct else converted
        else:
            shapes = {"attention_mask": (padded_rows, padded_time + 1), "position_ids": (padded_rows, 1)}
            for logical, shape in shapes.items():
                if logical in names:
                    feeds[names[logical]] = view(names[logical], self._input_dtype(logical), shape)
        lane_key = []
        for name, buffer in self._lane_inputs.items():
            feeds[name] = buffer[self._input_rows(slice(bucket[0], bucket[0] + padded_rows))]
            lane_key.append((name, buffer.shape))
        if self.session.provider == "cuda":
            lane_key += [buffer.data.ptr for buffer in self._lane_inputs.values()]
        static = _StaticInputs(key=(bucket, tuple(lane_key)), feeds=feeds, states=states, prefix=prefix,
                               prefix_converted=converted, labels=labels)
        generation = buffers.generation  # after any growth above
        self._static = {k: v for k, v in self._static.items() if k[1] == generation}
        self._static[(bucket, generation, lanes)] = static
        return static

    @property
    def captured_graphs(self) -> int:
        """CUDA graphs captured so far (0 without graphs, or where the model cannot be captured)."""
        return self._graphs.captures if self._graphs is not None else 0

    def warm_up(self, max_time: int) -> int:
        """Captures the step's graphs for every history bucket up to ``max_time`` (the current
        layout's chunks); returns the number of graphs. Runs on empty histories; the slots it
        allocates belong to no history and are freed by the next ``extend``."""
        if self._graphs is None:
            return 0
        xp = self.states.xp
        empty = DecoderContext(self.states.initial_histories(self.layout.num_lanes),
                               xp.zeros(self.layout.num_lanes, dtype=np.int64))
        # largest bucket first: the shared buffers reach their size at once, so no later growth
        # drops the graphs captured before it
        for time in reversed(time_buckets(max_time, self.graph_options.time_step)):
            for _, rows in self._chunks():
                for _ in range(2):  # ONNX Runtime captures on the second run of a graph id
                    self._run_bucketed(empty, rows, time_size=time)
        return self._graphs.num_graphs

    def _input_dtype(self, logical: str):
        return self.session.tensors.input(self.spec.hypothesis_inputs[logical]).dtype

    def _log_probs(self, raw, copy: bool):
        """``raw`` scores as [N, V] log-probabilities (``copy``: never a view of ``raw``); float16
        log-probabilities stay float16, everything else becomes float32."""
        xp = self.layout.xp
        scores = xp.asarray(raw)
        kept = np.float16 if scores.dtype == np.float16 and self.scores_kind == "log-probs" else np.float32
        scores = scores.reshape(scores.shape[0], -1, scores.shape[-1])[:, -1, :].astype(kept, copy=copy)
        if self.scores_kind == "neg-log-probs":
            return -scores
        if self.scores_kind == "logits":
            return _log_softmax(xp, scores)
        return scores

    def extend(self, ctx: DecoderContext, parents, labels) -> DecoderContext:
        """Children continue their parents' histories with the parents' new token states."""
        xp = self.states.xp
        if ctx.new_slots is None:
            raise AssertionError("extend() before score(): the parents' new token states are unknown")
        parents = self._on_states(parents).astype(np.int64, copy=False)
        labels = self._on_states(labels).astype(np.int64, copy=False)
        append = labels >= 0
        next_labels = xp.where(append, labels, ctx.next_labels[parents])
        if ctx.fresh is not None:  # a fresh parent's history already ends with its whole prompt
            append &= ~self._on_states(ctx.fresh)[parents]
        histories = self._trimmed(self.states.extend(ctx.histories, ctx.new_slots, parents, append=append))
        self.states.retain(histories)
        self._ctx = DecoderContext(histories, next_labels)
        return self._ctx

    def _trimmed(self, histories: StateHistory) -> StateHistory:
        """``histories`` cut to the longest possible history (a host bound; no sync)."""
        self._group_bound += 1
        if self.states.family != "transformer":
            return histories
        need = int(self._group_bound.max())
        if histories.width <= need:
            return histories
        table = self.states.xp.ascontiguousarray(histories.table[:, :need])
        return StateHistory(table=table, lengths=histories.lengths)

    def _on_states(self, array):
        """``array`` where the state manager keeps its histories (host or device)."""
        return to_host(array) if self.states.device == "cpu" else self.states.xp.asarray(array)

    def close(self) -> None:
        """Returns the state pool's and the graph buffers' memory."""
        self.states.close()
        if self._graphs is not None:
            self._graphs.clear()
            self._graphs.buffers.close()


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
