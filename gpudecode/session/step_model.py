"""``StepModelRunner``: one step of a stateful step model over merged state histories.

Builds the model's inputs in the RASR convention (``token``, ``token-length``, ``prefix-length``)
or the Hugging Face one (``input_ids``, ``attention_mask``, ``position_ids``), merges the
histories' states into its state inputs, runs it plainly or padded to a graph bucket (static
inputs that are views of the graph buffers, so the merge writes straight into them), and splits
its new token states into the state pool.

Per-utterance inputs come from a lane-buffer object with ``buffers`` (input name -> array, a row
per lane or per group of ``group_size`` lanes) and ``version`` (changes when a buffer is
replaced), e.g. :class:`gpudecode.scorers.lanes.LaneInputs`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpudecode.backend import get_array_module, to_host
from gpudecode.session.discovery import HF_BRANCH_INPUT, ModelError, ModelSpec
from gpudecode.session.genai import shared_presents
from gpudecode.session.graphs import GraphBuckets, GraphOptions
from gpudecode.session.hf import hf_attention_inputs, hf_length_inputs, new_step_states, write_attention_inputs
from gpudecode.session.runner import OnnxSession
from gpudecode.states.history import StateHistory
from gpudecode.states.managers import StateManager


def hf_step_feeds(spec: ModelSpec, tensors, prefix_lengths, time_size: int, num_new: int = 1) -> dict:
    """The Hugging Face convention's per-row inputs of a step over histories of ``prefix_lengths``
    [N] in T = ``time_size`` past positions (``spec.history_alignment``), by model input name, in the
    model's dtypes: ``attention_mask``, ``position_ids``, GroupQueryAttention's explicit
    ``seqlens_k`` / ``total_sequence_length``, and a merged Optimum decoder's ``use_cache_branch``
    (True: the with-past branch), where the model takes them."""
    names = spec.hypothesis_inputs
    mask, positions = hf_attention_inputs(prefix_lengths, time_size, num_new, spec.history_alignment)
    values = {"attention_mask": mask, "position_ids": positions, HF_BRANCH_INPUT: np.array(True)}
    if "seqlens_k" in names or "total_sequence_length" in names:
        seqlens, total = hf_length_inputs(prefix_lengths, time_size, num_new)
        values.update(seqlens_k=seqlens, total_sequence_length=total)
    return _hf_feeds(names, tensors, values)


def _hf_feeds(names: dict, tensors, values: dict) -> dict:
    """``values`` (by logical name) of the inputs the model takes, by model input name in its
    dtypes; the scalars ``total_sequence_length`` and ``use_cache_branch`` stay on the host, shaped
    () or [1] as the model declares them."""
    feeds = {}
    for logical, value in values.items():
        if logical in names:
            info = tensors.input(names[logical])
            value = value.astype(info.dtype, copy=False)
            if logical in ("total_sequence_length", HF_BRANCH_INPUT):
                value = value.reshape(() if info.rank == 0 else (1,))
            feeds[names[logical]] = value
    return feeds


class HostStepFeeds:
    """:func:`hf_step_feeds` of one new step on host prefix lengths, for a model whose per-row
    inputs are ``attention_mask`` and/or ``position_ids`` only: the same arrays, with the input
    names, dtypes and mask columns looked up once instead of every step."""

    def __init__(self, spec: ModelSpec, tensors):
        names = spec.hypothesis_inputs
        self.left = spec.history_alignment == "left"
        self.mask = (names["attention_mask"], tensors.input(names["attention_mask"]).dtype) \
            if "attention_mask" in names else None
        self.positions = (names["position_ids"], tensors.input(names["position_ids"]).dtype) \
            if "position_ids" in names else None
        self._columns = np.arange(0, dtype=np.int64)

    @staticmethod
    def applies(spec: ModelSpec) -> bool:
        """Whether the model's per-row step inputs are ``attention_mask`` / ``position_ids`` only."""
        extra = {"seqlens_k", "total_sequence_length", HF_BRANCH_INPUT}
        return spec.convention == "huggingface" and not extra & set(spec.hypothesis_inputs)

    def __call__(self, prefix_lengths: np.ndarray, time_size: int) -> dict:
        prefix = prefix_lengths.astype(np.int64)
        feeds = {}
        if self.mask is not None:
            if self._columns.size < time_size + 1:
                self._columns = np.arange(2 * (time_size + 1), dtype=np.int64)
            columns = self._columns[None, :time_size + 1]
            mask = columns < (prefix + 1)[:, None] if self.left else columns >= (time_size - prefix)[:, None]
            name, dtype = self.mask
            feeds[name] = mask.astype(dtype)
        if self.positions is not None:
            name, dtype = self.positions
            feeds[name] = prefix[:, None].astype(dtype)
        return feeds


def hf_prompt_feeds(spec: ModelSpec, tensors, sizes, width: int) -> dict:
    """The Hugging Face convention's inputs of a prompt run with empty pasts: prompts of ``sizes``
    [U] right-padded to ``width`` (each row's prompt first), by model input name in the model's
    dtypes: ``attention_mask`` ones over each row's prompt, ``position_ids`` 0..width-1,
    GroupQueryAttention's ``seqlens_k`` (size - 1) / ``total_sequence_length`` (width), and a
    merged Optimum decoder's ``use_cache_branch`` (False: the branch without pasts)."""
    xp = get_array_module(sizes)
    names = spec.hypothesis_inputs
    sizes = xp.asarray(sizes).astype(xp.int64)
    columns = xp.arange(width, dtype=xp.int64)
    values = {"attention_mask": (columns[None, :] < sizes[:, None]).astype(xp.int64),
              "position_ids": xp.broadcast_to(columns[None, :], (sizes.shape[0], width)).copy(),
              "seqlens_k": (sizes - 1).astype(xp.int32), "total_sequence_length": np.array(width, np.int32),
              HF_BRANCH_INPUT: np.array(False)}
    return _hf_feeds(names, tensors, values)


def _rows(array, axis: int, count: int):
    """The first ``count`` rows of ``array`` along its batch ``axis`` (a view; the array itself
    where it has no more)."""
    if array.shape[axis] == count:
        return array
    index = [slice(None)] * array.ndim
    index[axis] = slice(0, count)
    return array[tuple(index)]


def _input_rows(rows: slice, group_size: int) -> slice:
    """The per-utterance input rows of hypothesis ``rows`` (a row per ``group_size`` lanes)."""
    if group_size == 1:
        return rows
    return slice(rows.start // group_size, -(-rows.stop // group_size))


@dataclass
class ResidentRows:
    """Greedy steps' states kept in the bucketed step's own state inputs, with no state pool: row
    b's history at positions ``[0, lengths[b])`` of the state inputs of ``bucket`` (a left-aligned
    Hugging Face model: each row's history first). A step writes its new token states there at each
    row's length (:meth:`StepModelRunner.run_resident`); the search's ``extend`` then counts them
    (:meth:`extended`). One row per lane, and the lanes never reorder: a search with one hypothesis
    per utterance (beam 1), whose lanes each continue only themselves."""

    bucket: tuple  # (first row, padded rows, padded time) whose static state inputs hold the rows
    lengths: Any  # [N] int32 on the states' array module: the rows' history lengths
    bound: int  # host upper bound of lengths.max()
    #: the pool histories :meth:`StepModelRunner.materialize` made of these rows (made once)
    materialized: StateHistory | None = None

    def extended(self, appended) -> ResidentRows:
        """The rows after a step: ``appended`` [N] bool, the rows whose new token state joins their
        history (the others keep theirs; their written step is past their length, never read)."""
        return ResidentRows(self.bucket, self.lengths + appended.astype(np.int32), self.bound + 1)


@dataclass
class _StaticInputs:
    """One bucket's static model inputs (views that stay valid while the buffers do)."""

    key: tuple  # the graph's key: bucket and lane buffers
    feeds: dict  # every input by name
    states: dict  # the merge's out buffers
    prefix: Any  # int32 prefix lengths (the merge writes them)
    prefix_converted: Any  # the model's prefix-length when it is not int32, else None
    labels: Any
    #: outputs bound to the state inputs' buffers (in-place outputs, shared presents), by output name
    bound: dict


class StepModelRunner:
    """Runs the step model of ``spec`` on ``session`` with the states of ``states``.

    ``graphs``: with ``enabled``, every call is padded to its (rows, history) bucket and runs
    through :class:`GraphBuckets` (captured CUDA graphs, or padded runs where the session cannot
    capture); the state manager must then live where the model runs.
    """

    def __init__(self, session: OnnxSession, spec: ModelSpec, states: StateManager,
                 graphs: GraphOptions = GraphOptions()) -> None:
        self.session = session
        self.spec = spec
        self.states = states
        names = spec.hypothesis_inputs
        self.label_name = names["token" if spec.convention == "rasr" else "input_ids"]
        self.label_dtype = session.tensors.input(self.label_name).dtype
        if graphs.enabled and states.device != session.provider:
            raise ValueError(
                f"{spec.source}: cuda_graphs needs the state manager where the model runs "
                f"({session.provider}), got a {states.device} state manager"
            )
        if graphs.enabled and ("seqlens_k" in names or "total_sequence_length" in names):
            raise ValueError(f"{spec.source}: cuda_graphs: a model with explicit 'seqlens_k' / "
                             "'total_sequence_length' inputs runs without graphs (turn cuda_graphs off)")
        #: a model with a time axis that takes no lengths (no prefix-length, attention_mask or
        #: seqlens_k: Optimum's Whisper decoder, positions from the past length) cannot be fed a padded
        #: history: each call holds rows of one history length (one call per length present)
        self._by_length = states.has_time_axis and not any(
            n in names for n in ("prefix-length", "attention_mask", "seqlens_k"))
        if self._by_length and spec.utterance_rows == "utterance" and spec.utterance_inputs:
            raise ValueError(f"{spec.source}: a model without attention_mask (or prefix-length) cannot take "
                             "per-utterance inputs with one row per utterance (PER_UTTERANCE_ROWS=utterance)")
        if self._by_length and graphs.enabled:
            warnings.warn(f"{spec.source}: runs without CUDA graphs: the model takes no attention_mask (or "
                          "prefix-length), so its histories cannot be padded to a graph's bucket", stacklevel=2)
            graphs = GraphOptions()
        self.graphs = GraphBuckets(session, graphs) if graphs.enabled else None
        self._static: dict = {}  # (bucket, buffer generation, lanes version) -> _StaticInputs
        # left padding of the history is exact only when the model masks it
        self._pad_time = states.has_time_axis and ("prefix-length" in names or "attention_mask" in names)
        # state outputs sliced to their first rows stay contiguous when the batch axis is outermost
        self._rows_outermost = all(layout.pre == 1 for layout in states.layouts)
        #: in-place output -> (its state input, its declared shape), bound when the states live on CUDA
        self._in_place_outputs = {} if session.provider != "cuda" or states.device == "cpu" else {
            output: (name, session.tensors.output(output).shape) for output, name in spec.in_place_outputs.items()}
        #: present output -> its past input, both bound to one buffer in bucketed calls (the past one
        #: position wider than the bucket): GroupQueryAttention appends the new step in place
        self._shared_presents = self._shareable_presents(graphs)
        self._present_room = int(bool(self._shared_presents))  # the extra position of those buffers
        #: on the CPU, a left-aligned Hugging Face model (GroupQueryAttention) with states that can stay
        #: resident (``StateManager.resident_supported``) is fed the resident merge and writes each new
        #: step into it (present bound to the past buffer); the first such call is checked against a
        #: plain run, and a model that does not write in place runs plainly from then on
        self._resident = (session.provider == "cpu" and self.graphs is None and not self._by_length
                          and spec.convention == "huggingface" and not spec.in_place_outputs
                          and spec.history_alignment == "left" and states.resident_supported)
        self._resident_checked = False
        #: a resident step's scores output [rows, 1, V] when its shape is declared so (then bound)
        scores_info = session.tensors.output(spec.scores_output)
        shape = tuple(scores_info.shape)
        self._scores_shape = (1, shape[2]) if len(shape) == 3 and isinstance(shape[2], int) else None
        self._scores_dtype = scores_info.dtype
        #: a host step's attention_mask / position_ids, built with lookups made once
        self._host_feeds = HostStepFeeds(spec, session.tensors) if (
            states.device == "cpu" and HostStepFeeds.applies(spec)) else None

    # --- one step ----------------------------------------------------------------------------------
    def run(self, histories: StateHistory, labels, rows: slice, lanes, time_size: int | None = None):
        """The model on the lanes ``rows`` of ``histories`` fed ``labels`` ([N] int, the lanes' next
        labels): (raw scores of those rows, their new slots [R, 1]). Bucketed with graphs (the
        scores are then a view of the graphs' output buffer), else a plain run."""
        if rows != slice(0, histories.num_rows):
            histories = StateHistory(table=histories.table[rows], lengths=histories.lengths[rows])
        if self._by_length:
            return self._run_by_length(histories, labels[rows], rows, lanes)
        if self.graphs is None:
            return self._run_plain(histories, labels[rows], rows, lanes, time_size)
        return self._run_bucketed(histories, labels[rows], rows, lanes, time_size)

    @property
    def runs_lane_subsets(self) -> bool:
        """Whether :meth:`run_lanes` can run a subset of the lanes: a plain run on the CPU (the CPU
        provider, numpy states, no graphs) of a model fed its histories' lengths."""
        return (self.session.provider == "cpu" and self.states.device == "cpu" and self.graphs is None
                and not self._by_length)

    def run_lanes(self, histories: StateHistory, labels, index: np.ndarray, lanes, *, any_order: bool = False):
        """The model on the lanes ``index`` ([R] int64 host, ascending) of ``histories`` fed
        ``labels[index]`` (numpy, :attr:`runs_lane_subsets`; one row per lane of the per-utterance
        inputs): (raw scores [R, ...], new slots [R, 1]), row i for lane ``index[i]``. The other
        lanes' states are untouched. ``any_order``: the rows may come in another order (resident
        states put each lane where its history already is): (scores, slots, the lane of each row)."""
        if not self.runs_lane_subsets or lanes.group_size != 1:
            raise AssertionError("run_lanes: a host run of a model with a per-utterance row per lane")
        histories = StateHistory(table=histories.table[index], lengths=histories.lengths[index])
        labels = labels[index]
        time_size = None  # as time_sizes: the rows' longest kept history
        if self.states.has_time_axis and index.size:
            time_size = min(int(histories.lengths.max()), histories.width, self.states.max_history)
        if self._resident:
            scores, slots, order = self._run_resident(histories, labels, slice(0, index.size), lanes, time_size,
                                                      input_rows=index, free_rows=any_order)
            if any_order:
                return scores, slots, index if order is None else index[order]
            return scores, slots
        scores, states, _ = self._plain_step(histories, labels, slice(0, index.size), lanes, time_size, index)
        return (scores, self.states.split(states)) + ((index,) if any_order else ())

    def run_dense(self, states: dict, labels):
        """The model on dense states (``gpudecode.states.dense``): ``states`` input name -> the
        lanes' state arrays, ``labels`` [N] the labels fed. Returns (raw scores, the new states by
        state input name)."""
        names, xp = self.spec.hypothesis_inputs, self.states.xp
        num_rows = int(labels.shape[0])
        feeds = dict(states)
        feeds[self.label_name] = labels.astype(self.label_dtype, copy=False)[:, None]
        if "token-length" in names:
            ones = self._dense_ones
            if ones is None or ones.shape[0] != num_rows:
                ones = self._dense_ones = xp.ones(num_rows, dtype=self._input_dtype("token-length"))
            feeds[names["token-length"]] = ones
        outputs = self.session.run(feeds, self._output_names({}), outputs=self._dense_buffers(states, num_rows))
        new_states = {v.input_name: outputs[v.output_name] for v in self.spec.state_variables}
        return outputs[self.spec.scores_output], new_states

    _dense_ones = None  # [N] token-length ones of the dense runs
    _dense_outputs: tuple = (-1, {})  # (N, output name -> buffer) of the dense runs on CUDA

    def _dense_buffers(self, states: dict, num_rows: int) -> dict:
        """Output buffers of a dense run on CUDA, made once per row count and written again by
        every run (its scores and new states are read before the next run: the scorer's contract);
        none on the CPU."""
        if self.states.device != "cuda":
            return {}
        if self._dense_outputs[0] != num_rows:
            xp = self.states.xp
            buffers = {v.output_name: xp.empty_like(states[v.input_name]) for v in self.spec.state_variables}
            scores = self.session.tensors.output(self.spec.scores_output)
            shape = [num_rows if axis == 0 else d for axis, d in enumerate(scores.shape)]
            if all(isinstance(d, int) for d in shape):  # a dynamic axis besides the rows: the runtime allocates
                buffers[self.spec.scores_output] = xp.empty(tuple(shape), dtype=scores.dtype)
            self._dense_outputs = (num_rows, buffers)
        return self._dense_outputs[1]

    def _run_by_length(self, histories: StateHistory, labels, rows: slice, lanes):
        """A model that takes no lengths: one plain call per history length among the rows, each
        with T = that length, so no row is padded (rows of length 0 — lanes without a history, whose
        scores nobody reads — ride along with the first call)."""
        xp = self.states.xp
        lengths = to_host(histories.lengths).astype(np.int64)
        if (lengths > self.states.max_history).any():
            raise ValueError(f"{self.spec.source}: a model without attention_mask (or prefix-length) cannot "
                             "drop old history positions (state_manager.max_history)")
        distinct = np.unique(lengths[lengths > 0])
        if len(distinct) <= 1:
            time = int(distinct[0]) if len(distinct) else None
            return self._run_plain(histories, labels, rows, lanes, time)
        scores, slots = None, xp.full((histories.num_rows, 1), -1, dtype=np.int32)
        for i, length in enumerate(distinct):
            host = np.flatnonzero((lengths == length) | ((lengths == 0) & (i == 0)))
            index = xp.asarray(host)
            part = StateHistory(table=histories.table[index], lengths=histories.lengths[index])
            part_scores, part_slots = self._run_plain(part, labels[index], rows, lanes, int(length),
                                                      input_rows=lanes.xp.asarray(host + rows.start))
            if scores is None:
                scores = xp.zeros((histories.num_rows, *part_scores.shape[1:]), dtype=part_scores.dtype)
            scores[index] = part_scores
            slots[index] = part_slots
        return scores, slots

    def time_sizes(self, histories: StateHistory, chunks: list[slice]) -> list[int | None]:
        """Per chunk of rows, the longest history it keeps, so that each model call pads only to
        its own rows (one small transfer for all chunks); None (the table width) for one chunk."""
        if len(chunks) == 1 or not self.states.has_time_axis:
            return [None] * len(chunks)
        xp, lengths = self.states.xp, histories.lengths
        size = chunks[0].stop - chunks[0].start
        padded = xp.zeros(len(chunks) * size, dtype=lengths.dtype)
        padded[:lengths.shape[0]] = lengths
        maxima = to_host(padded.reshape(len(chunks), size).max(axis=1))
        limit = min(histories.width, self.states.max_history)
        return [min(int(m), limit) for m in maxima]

    def _run_plain(self, histories: StateHistory, labels, rows: slice, lanes, time_size: int | None,
                   input_rows=None):
        if self._resident and input_rows is None:
            return self._run_resident(histories, labels, rows, lanes, time_size)[:2]
        scores, new_slots, _ = self._plain_step(histories, labels, rows, lanes, time_size, input_rows, split=True)
        return scores, new_slots

    def _run_resident(self, histories: StateHistory, labels, rows: slice, lanes, time_size: int | None,
                      input_rows=None, free_rows: bool = False):
        """A CPU step on the resident merge (``StateManager.merge_resident``), the model writing the
        new step in place; the first call is also run plainly and compared. ``input_rows``: the
        per-utterance input rows by index (a subset of the lanes, :meth:`run_lanes`), else those of
        ``rows``. ``free_rows`` (with ``input_rows``, after the first call): the merge may put the
        histories in other rows. Returns (scores, new slots, order): row r for history ``order[r]``
        (None: history r)."""
        if self.spec.max_time is not None:
            time_size = self._natural_time(histories, time_size)
        context = None if self.spec.max_time is None else self.spec.max_time + 1
        try:
            merged = self.states.merge_resident(histories, key=rows.start, time_size=time_size, max_positions=context,
                                                free_rows=free_rows and input_rows is not None and self._resident_checked)
            order = merged.rows_order
            if order is not None:  # the rows hold the histories in this order
                labels, input_rows = labels[order], input_rows[order]
            feeds = self._feeds(merged, labels, _input_rows(rows, lanes.group_size) if input_rows is None
                                else input_rows, lanes)
            shared = {v.output_name: merged.inputs[v.input_name] for v in self.spec.state_variables}
            bound = dict(shared)
            if self._scores_shape is not None:  # the scores bound too: no output to wrap after the run
                bound[self.spec.scores_output] = np.empty((labels.shape[0], *self._scores_shape), self._scores_dtype)
            scores = self.session.run(feeds, [self.spec.scores_output, *shared], outputs=bound)[self.spec.scores_output]
            # read where written (once checked, straight into the pool: split_resident)
            states = None if self._resident_checked else self.states.resident_new_steps(merged)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime refusing the shared buffer: plain runs
            # (the pool holds every state: the plain runs go on from there, whatever the buffers hold)
            return (*self._resident_refused(f"the run with a shared past/present buffer failed ({exc})",
                                            histories, labels, rows, lanes, time_size, input_rows), None)
        if not self._resident_checked:
            plain_scores, plain_states, _ = self._plain_step(histories, labels, rows, lanes, time_size, input_rows)
            same = np.allclose(scores, plain_scores, rtol=1e-4, atol=1e-4) and all(
                np.allclose(states[name], plain_states[name], rtol=1e-4, atol=1e-5) for name in plain_states)
            if not same:
                return (*self._resident_refused("its outputs with a shared past/present buffer differ from a "
                                                "plain run's", histories, labels, rows, lanes, time_size,
                                                input_rows), None)
            self._resident_checked = True
        new_slots = self.states.split_resident(merged) if states is None else self.states.split(states)
        self.states.written_in_place(new_slots, merged.prefix_lengths, key=rows.start)
        return scores, new_slots, order

    def _resident_refused(self, why: str, histories, labels, rows, lanes, time_size, input_rows=None):
        warnings.warn(f"{self.spec.source}: states merged from the pool every step on the CPU: {why}", stacklevel=3)
        self._resident = False
        if input_rows is not None:
            scores, states, _ = self._plain_step(histories, labels, rows, lanes, time_size, input_rows)
            return scores, self.states.split(states)
        return self._run_plain(histories, labels, rows, lanes, time_size)

    def _plain_step(self, histories: StateHistory, labels, rows: slice, lanes, time_size: int | None, input_rows,
                    *, split: bool = False):
        """A plain run on a merge from the pool: (scores, the new steps' state outputs, the merge);
        ``split``: their new slots [R, 1] in place of the new steps (:meth:`_new_steps`)."""
        spec = self.spec
        if spec.in_place_outputs or spec.max_time is not None:
            time_size = self._natural_time(histories, time_size)
        merged = self.states.merge(histories, time_size=time_size)
        if input_rows is None:  # else: the lanes' rows of the per-utterance inputs, by index
            input_rows = _input_rows(rows, lanes.group_size)
        feeds = self._feeds(merged, labels, input_rows, lanes)
        in_place = self._in_place(merged.inputs)
        outputs = self.session.run(feeds, self._output_names(in_place), outputs=in_place)
        states, at = self._new_steps(self._state_outputs(outputs), merged.prefix_lengths, for_split=split)
        if split:
            return outputs[spec.scores_output], self.states.split(states, **at), merged
        return outputs[spec.scores_output], states, merged  # the run's own arrays

    def _feeds(self, merged, labels, input_rows, lanes) -> dict:
        """The model's inputs of a plain step: the merged states, the labels, the convention's
        per-row inputs and the lanes' per-utterance rows ``input_rows``."""
        xp, spec = self.states.xp, self.spec
        labels = labels.astype(self.label_dtype)[:, None]
        feeds = dict(merged.inputs)
        names = spec.hypothesis_inputs
        feeds[self.label_name] = labels
        if spec.convention == "rasr":
            if "token-length" in names:
                feeds[names["token-length"]] = xp.ones(labels.shape[0], dtype=self._input_dtype("token-length"))
            if "prefix-length" in names:
                feeds[names["prefix-length"]] = merged.prefix_lengths.astype(self._input_dtype("prefix-length"))
        elif self._host_feeds is not None and type(merged.prefix_lengths) is np.ndarray:
            feeds.update(self._host_feeds(merged.prefix_lengths, merged.time_size))
        else:
            feeds.update(hf_step_feeds(spec, self.session.tensors, merged.prefix_lengths, merged.time_size))
        for name, buffer in lanes.buffers.items():
            feeds[name] = buffer[input_rows]
        return feeds

    def _run_bucketed(self, histories: StateHistory, labels, rows: slice, lanes, time_size: int | None):
        """One model call padded to its (rows, history) bucket, through the graph buckets.

        Static inputs are views of the graph buffers: the merge writes the states and prefix
        lengths straight into them, padding rows and left padding as zeros (masked by
        ``prefix-length`` / ``attention_mask``). Per-utterance inputs are the lane buffers
        themselves. Only the first ``rows`` of the outputs are used.
        """
        spec, graphs, names = self.spec, self.graphs, self.spec.hypothesis_inputs
        buffers = graphs.buffers
        num_rows = rows.stop - rows.start
        padded_rows = graphs.rows(num_rows, lanes.group_size)
        if not self.states.has_time_axis:
            padded_time = 1
        else:
            padded_time = self._time_bucket(self._natural_time(histories, time_size))
        bucket = (rows.start, padded_rows, padded_time)
        static = self._static_io(bucket, lanes)
        merged = self.states.merge(histories, out=static.states, prefix_lengths_out=static.prefix)
        feeds = dict(static.feeds)
        static.labels[num_rows:] = 0
        static.labels[:num_rows, 0] = labels
        if static.prefix_converted is not None:
            static.prefix_converted[...] = static.prefix
        if spec.convention != "rasr":
            write_attention_inputs(merged.prefix_lengths, padded_time, spec.history_alignment,
                                   feeds.get(names.get("attention_mask")), feeds.get(names.get("position_ids")))
        bound = static.bound
        outputs = graphs.run(static.key, feeds, self._output_names(bound),
                             lambda name, dtype, shape: bound[name] if name in bound
                             else buffers.view(name, dtype, shape, bucket))
        states_out, at = self._new_steps(self._state_outputs(outputs), merged.prefix_lengths, for_split=True)
        if self._rows_outermost:
            states_out = {v.output_name: _rows(states_out[v.output_name], v.batch_axis, num_rows)
                          for v in spec.state_variables}
            new_slots = self.states.split(states_out, **{name: rows[:num_rows] for name, rows in at.items()})
        else:
            new_slots = self.states.split(states_out, **at)[:num_rows]
        return outputs[spec.scores_output][:num_rows], new_slots

    # --- resident greedy steps ---------------------------------------------------------------------
    @property
    def resident_capable(self) -> bool:
        """Whether greedy steps can keep their states in the step's own inputs (:class:`ResidentRows`):
        bucketed steps (graphs) of a left-aligned Hugging Face model padded in time, every state with a
        time axis, no in-place outputs, no history truncation (``max_history``), and no step of
        this runner found a state output that does not hold the whole history (see :meth:`run_resident`)."""
        return self._resident_steps and self._whole_left_histories

    @property
    def _whole_left_histories(self) -> bool:
        """Bucketed steps (graphs) of a left-aligned Hugging Face model padded in time, every state
        with a time axis, no in-place outputs and no history truncation (``max_history``): each
        present holds a row's whole history and its new step at the row's length."""
        spec = self.spec
        return (self.graphs is not None and spec.convention == "huggingface" and spec.history_alignment == "left"
                and self._pad_time and not spec.in_place_outputs and self.states.options.max_history is None
                and all(v.time_axis is not None for v in spec.state_variables))

    _resident_steps = True  # cleared for good by a step whose state outputs hold the new step alone
    resident_runs = 0  # steps run on resident rows (their states not merged from the pool)

    def run_resident(self, source, labels, lanes):
        """A greedy step over all lanes (one row each, never reordered) that keeps the states in the
        step's own inputs: ``source`` the pool histories (the first such step: merged as usual) or
        the :class:`ResidentRows` of the previous step (nothing merged). The model's left-aligned
        present outputs hold each row's new step at its length; it is written into the state inputs
        there (one ``StateManager.copy_steps``; nothing with shared presents, which the model wrote
        into the inputs itself), or, where the next step needs a larger time bucket, the whole
        presents are (a copy per state, once per bucket). Returns (raw scores [N, ...],
        the :class:`ResidentRows` before the search's extension, None), or — a model whose state
        outputs do not hold the whole history, after which this runner never tries again — the
        plain bucketed step's (raw scores, None, new slots [N, 1])."""
        graphs, limit = self.graphs, self.spec.max_time
        if isinstance(source, ResidentRows):
            num_rows, bucket, bound = int(source.lengths.shape[0]), source.bucket, source.bound
            if limit is not None and bucket[2] > limit:
                self._check_context(int(to_host(source.lengths.max())) if num_rows else 0)
            static = self._static_io(bucket, lanes)
            static.prefix[:num_rows] = source.lengths
            prefix_lengths, lengths = static.prefix, source.lengths
            self.resident_runs += 1
        else:
            num_rows = source.num_rows
            bound = self._natural_time(source, None)
            bucket = (0, graphs.rows(num_rows, lanes.group_size), self._time_bucket(bound))
            static = self._static_io(bucket, lanes)
            merged = self.states.merge(source, out=static.states, prefix_lengths_out=static.prefix)
            prefix_lengths = merged.prefix_lengths
            lengths = None
        padded_rows, padded_time = bucket[1], bucket[2]
        feeds = dict(static.feeds)
        if num_rows < padded_rows:
            static.labels[num_rows:] = 0
        static.labels[:num_rows, 0] = labels
        names = self.spec.hypothesis_inputs
        write_attention_inputs(prefix_lengths, padded_time, "left", feeds.get(names.get("attention_mask")),
                               feeds.get(names.get("position_ids")))
        shared, binding = bool(self._shared_presents), static.bound  # (no in-place outputs here)
        outputs = graphs.run(static.key, feeds, self._output_names(binding),
                             lambda name, dtype, shape: binding[name] if name in binding
                             else graphs.buffers.view(name, dtype, shape, bucket))
        scores = outputs[self.spec.scores_output][:num_rows]
        # shared presents: the step is in the inputs already; else the presents [.., T + 1, ..]
        presents = static.states if shared else self._presents(outputs, padded_time)
        if presents is None:
            self._resident_steps = False  # the new step alone (or another form): split as before
            states_out, at = self._new_steps(self._state_outputs(outputs), prefix_lengths, for_split=True)
            return scores, None, self.states.split(states_out, **at)[:num_rows]
        if lengths is None:
            lengths = prefix_lengths[:num_rows].copy()
        next_time = self._next_time(bound + 1, lengths)
        if next_time == padded_time:
            if not shared:
                self.states.copy_steps(presents, static.states, prefix_lengths, num_rows=num_rows)
        else:  # the next step reads a longer bucket (sharing the shorter one's buffers): the whole presents
            if shared:  # (the next bucket's inputs are other views of the same buffers)
                presents = {name: array.copy() for name, array in presents.items()}
            target = self._static_io((0, padded_rows, next_time), lanes)
            target_time = next_time + self._present_room
            kept = min(padded_time + 1, target_time)
            for layout in self.states.layouts:
                into = target.states[layout.name].reshape(layout.pre, padded_rows, layout.mid, target_time,
                                                          layout.inner)
                into[:, :, :, :kept] = presents[layout.name].reshape(
                    layout.pre, padded_rows, layout.mid, padded_time + 1, layout.inner)[:, :, :, :kept]
            target.prefix[num_rows:] = 0
        return scores, ResidentRows((0, padded_rows, next_time), lengths, bound), None

    def _presents(self, outputs: dict, padded_time: int) -> dict | None:
        """The state outputs of a step over ``padded_time`` positions by state input name, or None
        where one does not hold the whole history and the new step (``padded_time + 1`` positions).
        Made once per output dict (a captured bucket returns the same one each replay)."""
        cached = self._presents_of
        if cached is not None and cached[0] is outputs:
            return cached[1]
        presents = {layout.name: outputs[layout.variable.output_name] for layout in self.states.layouts}
        if any(layout.rows_and_time(tuple(presents[layout.name].shape), "state output")[1] != padded_time + 1
               for layout in self.states.layouts):
            presents = None
        self._presents_of = (outputs, presents)
        return presents

    _presents_of: tuple | None = None  # (the output dict, its presents) of the latest resident step

    def _next_time(self, natural: int, lengths) -> int:
        """The time bucket of the next resident step, whose histories hold at most ``natural``
        positions, capped at the model's context (``spec.max_time``): past it, the exact bound from
        the rows' ``lengths`` now (read back; only near the context), which the next step checks."""
        limit = self.spec.max_time
        if limit is not None and natural > limit:
            natural = int(to_host(lengths.max())) + 1 if lengths.shape[0] else 0
        return self._time_bucket(natural)

    def _time_bucket(self, natural: int) -> int:
        """The padded time of a bucketed call over histories of ``natural`` positions: the graphs'
        bucket (``natural`` itself where the model cannot be padded in time), never beyond the model's
        context (``spec.max_time``) unless ``natural`` already is."""
        padded = self.graphs.time(natural) if self._pad_time else natural
        limit = self.spec.max_time
        return padded if limit is None else max(natural, min(padded, limit))

    def _check_context(self, longest: int) -> None:
        """Raises where a history of ``longest`` labels passes the model's context (``spec.max_time``)."""
        limit = self.spec.max_time
        if limit is not None and longest > limit:
            raise ModelError(f"{self.spec.source}: a history of {longest} labels (prompt included) "
                             f"exceeds the model's context of {limit + 1} positions; lower "
                             "search.max_labels or shorten the prompts")

    def materialize(self, rows: ResidentRows, lanes) -> StateHistory:
        """Pool histories of the resident ``rows`` (their states split from the step's inputs into new
        slots), for what needs them: admitting utterances into other lanes, and the steps after."""
        if rows.materialized is None:
            static = self._static_io(rows.bucket, lanes)
            num_rows, (_, padded_rows, padded_time) = int(rows.lengths.shape[0]), rows.bucket
            xp = self.states.xp
            width = min(rows.bound, padded_time)
            if width == 0:
                table = xp.full((num_rows, 0), -1, dtype=np.int32)
            else:
                counts = xp.zeros(padded_rows, dtype=np.int32)
                counts[:num_rows] = rows.lengths
                outputs = {layout.variable.output_name: static.states[layout.name] for layout in self.states.layouts}
                table = self.states.split(outputs, num_new_tokens=width, token_counts=counts,
                                          positions=xp.zeros(padded_rows, dtype=np.int32))[:num_rows]
            rows.materialized = StateHistory(table=xp.ascontiguousarray(table), lengths=rows.lengths.copy())
        return rows.materialized

    def warm_up(self, max_time: int, chunks: list[slice], lanes) -> int:
        """Captures the step's graphs for every history bucket up to ``max_time`` and each chunk
        of rows; returns the number of graphs. Runs on empty histories; the slots it allocates
        belong to no history and are freed by the next ``retain``."""
        if self.graphs is None:
            return 0
        num_rows = max(chunk.stop for chunk in chunks)
        empty = self.states.initial_histories(num_rows)
        labels = self.states.xp.zeros(num_rows, dtype=np.int64)
        return self.graphs.warm_up(max_time, chunks, lambda rows, time: self.run(empty, labels, rows, lanes, time))

    # --- inputs and outputs ------------------------------------------------------------------------
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

    def _new_steps(self, states: dict, prefix_lengths, *, for_split: bool = False) -> tuple[dict, dict]:
        """Hugging Face left-aligned histories (GroupQueryAttention fed from the mask): a present
        output holding the history and the new step has the new step at each row's own length, not
        last; it is read there. Everything else as it is (the split reads the last time step).
        Returns (the state outputs, the split's keywords). ``for_split`` (the caller only splits
        them) with a CUDA state manager: the outputs as they are and ``positions`` for the split,
        which reads each row's new step at its length in its one launch (no per-output work here)."""
        spec = self.spec
        if spec.convention == "rasr" or spec.history_alignment != "left":
            return states, {}
        if for_split and self._split_at_positions(states):
            return states, {"positions": prefix_lengths}
        by_output = {v.output_name: v for v in spec.state_variables}
        positions: dict = {}  # one index for every output of a shape
        return {name: new_step_states(array, prefix_lengths[:array.shape[0]], by_output[name].time_axis, "left",
                                      index_cache=positions)
                if name in by_output and by_output[name].time_axis is not None and name not in spec.in_place_outputs
                else array
                for name, array in states.items()}, {}

    def _split_at_positions(self, states: dict) -> bool:
        """Whether the split can read the new steps of ``states`` at each row's length itself: a
        CUDA state manager, no state output written in place (those hold the new step last), every
        state output with a time axis, all of one time size."""
        if self.states.device == "cpu" or any(name in self.spec.in_place_outputs for name in states):
            return False
        variables = self.spec.state_variables
        if any(v.time_axis is None for v in variables):
            return False
        return len({states[v.output_name].shape[v.time_axis] for v in variables}) == 1

    def _natural_time(self, histories: StateHistory, time_size: int | None) -> int:
        """T of a call: the longest kept history (or ``time_size``), plus the position an in-place
        model (``spec.in_place_outputs``) writes the new step into."""
        natural = min(histories.width, self.states.max_history) if time_size is None else time_size
        limit = self.spec.max_time
        if limit is not None and natural > limit:  # the width is a bound: the longest history decides
            longest = min(int(to_host(histories.lengths.max())) if histories.num_rows else 0,
                          self.states.max_history)
            self._check_context(longest)
            natural = longest
        return natural + bool(self.spec.in_place_outputs)

    def _in_place(self, state_inputs: dict) -> dict:
        """The in-place outputs bound to their state inputs' buffers (CUDA with device states; on
        the CPU provider, or with the states merged on the host, they are neither requested nor
        bound)."""
        bound = {}
        for output, (name, declared) in self._in_place_outputs.items():
            buffer = state_inputs[name]
            # the output may declare the same bytes in another shape (keys declared in the layout an
            # attention kernel reads): its own static dims, the buffer's batch and time
            shape = tuple(d if isinstance(d, int) else n for d, n in zip(declared, buffer.shape))
            bound[output] = buffer if shape == tuple(buffer.shape) else buffer.reshape(shape)
        return bound

    def _shareable_presents(self, options: GraphOptions) -> dict:
        """Present output -> past input where bucketed calls bind both to one buffer: with
        ``options.shared_presents``, CUDA graphs over device states, and a left-aligned Hugging Face
        model padded in time, with no history truncation, whose every state output is the
        GroupQueryAttention present of its own past input (``OnnxSession.gqa_present_pairs``); else empty."""
        if not (options.shared_presents and self.session.provider == "cuda" and self.states.device != "cpu"
                and self._whole_left_histories):
            return {}
        return shared_presents(self.spec.state_variables, self.session.gqa_present_pairs)

    @property
    def shares_presents(self) -> bool:
        """Whether bucketed calls bind the presents to their pasts' buffers (:meth:`_shareable_presents`)."""
        return bool(self._shared_presents)

    def _static_io(self, bucket, lanes) -> _StaticInputs:
        """The static inputs of ``bucket``: views of the graph buffers (and of the lane buffers),
        made once per bucket, buffer generation and lane-buffer version."""
        buffers, names, spec = self.graphs.buffers, self.spec.hypothesis_inputs, self.spec
        cached = self._static.get((bucket, buffers.generation, lanes.version))
        if cached is not None:
            return cached
        start, padded_rows, padded_time = bucket

        def view(name, dtype, shape):
            return buffers.view(name, dtype, shape, bucket)

        state_time = padded_time + self._present_room
        states = {layout.name: view(layout.name, layout.model_dtype, layout.tensor_shape(padded_rows, state_time))
                  for layout in self.states.layouts}
        prefix_name = names.get("prefix-length")
        prefix_direct = prefix_name is not None and self._input_dtype("prefix-length") == np.int32
        prefix = view(prefix_name if prefix_direct else "#prefix-lengths", np.int32, (padded_rows,))
        labels = view(self.label_name, self.label_dtype, (padded_rows, 1))
        feeds = {**states, self.label_name: labels}
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
            if HF_BRANCH_INPUT in names:  # a merged decoder's branch: a host constant (an If's condition)
                feeds.update(_hf_feeds(names, self.session.tensors, {HF_BRANCH_INPUT: np.array(True)}))
        lane_key = []
        input_rows = _input_rows(slice(start, start + padded_rows), lanes.group_size)
        for name, buffer in lanes.buffers.items():
            feeds[name] = buffer[input_rows]
            lane_key.append((name, buffer.shape))
        if self.session.provider == "cuda":
            lane_key += [buffer.data.ptr for buffer in lanes.buffers.values()]
        bound = {**self._in_place(states), **{output: states[name] for output, name in self._shared_presents.items()}}
        static = _StaticInputs(key=(bucket, tuple(lane_key)), feeds=feeds, states=states, prefix=prefix,
                               prefix_converted=converted, labels=labels, bound=bound)
        current = (buffers.generation, lanes.version)  # after any growth above
        # views of replaced buffers would keep them alive
        self._static = {k: v for k, v in self._static.items() if k[1:] == current}
        self._static[(bucket, *current)] = static
        return static

    def _input_dtype(self, logical: str):
        return self.session.tensors.input(self.spec.hypothesis_inputs[logical]).dtype

    def close(self) -> None:
        """Returns the graph buffers' memory."""
        if self.graphs is not None:
            self.graphs.close()
