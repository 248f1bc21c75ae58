"""State managers: the facade that merges histories into model inputs and splits model outputs
into pool slots. One interface for transformer (one slot per token) and LSTM (one slot per
hypothesis) states, on the host (numpy) or the GPU (CuPy + kernels).

A search step, for the rows of one batched model call::

    merged = manager.merge(histories)                 # model inputs + prefix lengths
    outputs = run_model(merged.inputs, ...)           # state outputs by output name
    new_slots = manager.split(outputs)                # [N, S] slots of the new token states
    children = manager.extend(histories, new_slots, parents)
    manager.retain(children, *other_live_histories)   # frees every other slot

Merge outputs are views of buffers the manager owns (valid until the next merge), or the
caller's own buffers (``out=``), e.g. the static inputs of a CUDA graph padded to a larger
(N, T).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpudecode.backend import is_device_array, on_shared_stream, to_host
from gpudecode.sizes import next_power_of_two
from gpudecode.spec import StateVariable
from gpudecode.states.compiled import available as compiled_available
from gpudecode.states.compiled import compiled_loops, copies
from gpudecode.states.history import (
    StateHistory,
    effective_max_history,
    empty_histories,
    extend_histories,
    select_histories,
)
from gpudecode.states.layout import VariableLayout
from gpudecode.states.options import INTEGER_STATE_TYPES, StateManagerOptions
from gpudecode.states.pool import PoolStatistics, StatePool

logger = logging.getLogger(__name__)

FLOAT_STATE_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class MergedStates:
    """Batched state inputs of one model call.

    ``inputs``: input name -> array shaped like the declared input with N (and T) filled in.
    ``prefix_lengths``: ``[N]`` int32, token states kept per row after truncation (the model's
    ``prefix-length``). ``time_size``: T of the inputs (0 for an empty history; 1 for LSTMs).
    """

    inputs: dict
    prefix_lengths: object
    time_size: int
    #: [N] int64 host: row r of the inputs holds history ``rows_order[r]`` (None: history r), see
    #: ``StateManager.merge_resident(free_rows=True)``
    rows_order: object = None


class StateManager:
    """Keeps the states of ``state_variables`` between search steps.

    ``device``: ``"cpu"`` (numpy arrays, host merge/split) or ``"cuda"`` (CuPy arrays, kernels).
    Subclasses fix the family: :class:`TransformerStateManager`, :class:`LstmStateManager`; what
    differs between families is a method or class attribute of theirs.
    """

    family = ""
    #: family -> subclass: every subclass that sets ``family`` is the manager of that family's
    #: state manager types (``states.options.STATE_MANAGER_TYPES``), see ``factory``
    by_family: dict[str, type[StateManager]] = {}
    #: histories hold one slot per token state, along the model's time axis (False: one state per
    #: hypothesis, merged with T = 1)
    has_time_axis: bool

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.family:
            StateManager.by_family.setdefault(cls.family, cls)

    def __init__(self, options: StateManagerOptions, state_variables: Sequence[StateVariable], *, device: str):
        if options.family != self.family:
            raise ValueError(f"{type(self).__name__}: options are for a {options.family!r} state manager")
        if not state_variables:
            raise ValueError(f"state_manager {options.type!r}: the model has no state variables")
        self.options = options
        self.device = device
        self.state_variables = list(state_variables)
        storage = [self._storage_dtype(v) for v in self.state_variables]
        self.layouts = [VariableLayout.of(v, s) for v, s in zip(self.state_variables, storage)]
        self.pool = StatePool(
            [layout.token_shape for layout in self.layouts],
            storage,
            slots_per_chunk=options.slots_per_chunk,
            device=device,
            device_id=options.device_id,
        )
        self.xp = self.pool.xp
        if device == "cuda":
            from gpudecode.states.cuda import CudaStateCopy

            self._copy = CudaStateCopy(self.layouts, self.pool, device_id=options.device_id)
        else:
            from gpudecode.states.host import HostStateCopy

            scale = options.state_compression_scale if options.state_compression == "fixed-quantisation" else None
            self._copy = HostStateCopy(self.layouts, self.pool, quantisation_scale=scale)
        self._buffers: dict[str, object] = {}
        self._prefix_buffer = None
        self._last_out = None  # (buffer ids, checked result, the buffers themselves)
        self._by_output = {v.output_name: v for v in self.state_variables}
        self._resident = None  # ResidentStates, made by the first merge_resident
        self._resident_inputs: tuple = (None, {})  # (the resident views, them in the model's shapes)
        #: split_resident's last (views, them as [N, mid, C, inner], pool generation, its chunks' slabs)
        self._split_views: tuple = ([], (), -1, [])
        #: a host manager's per-step bookkeeping (resident merge, extend, mark and sweep) as compiled
        #: loops where numba imports (:mod:`gpudecode.states.compiled`); False: the numpy versions
        self.compiled = device == "cpu" and compiled_available()

    # ---- resident merge (CPU) ---------------------------------------------------------------------
    @property
    def resident_supported(self) -> bool:
        """Whether :meth:`merge_resident` can keep these states between steps: a host manager
        with ``cpu_in_place``, left-aligned histories, time-axis variables with the batch axis
        outermost stored in the model's dtype."""
        from gpudecode.states.resident import resident_layouts_supported

        return (self.device == "cpu" and self.options.cpu_in_place and self.options.history_alignment == "left"
                and resident_layouts_supported(self.layouts))

    def merge_resident(self, histories: StateHistory, *, key=0, time_size: int | None = None,
                       max_positions: int | None = None, free_rows: bool = False) -> MergedStates:
        """The left-aligned merged states of ``histories`` in buffers this manager keeps between
        steps (per ``key``, e.g. the first row of a model call), with ``C >= time_size + 1``
        positions: a model writes the new step at each row's length in place, then the caller
        reports it with :meth:`written_in_place`. The inputs are views ``[N, .., C, ..]``, valid
        until the next merge of ``key``; ``time_size`` of the result is T, not C
        (:mod:`gpudecode.states.resident`). ``max_positions``: C stays within it where T + 1 does
        (a model's context). ``free_rows``: a compiled manager may put the histories in other rows
        than their own, each where a row already holds it (fewer copies); the result's
        ``rows_order`` then says which history each row holds (its prefix lengths are by row)."""
        histories = self._as_histories(histories)
        if self._resident is None:
            if not self.resident_supported:
                raise ValueError(f"state_manager {self.options.type!r}: these states cannot stay resident")
            from gpudecode.states.resident import ResidentStates

            self._resident = ResidentStates(self.layouts, self.pool, self._copy.gather)
        if time_size is None:
            time_size = min(histories.width, self.max_history)
        views, kept, order = self._resident.merge(histories, key=key, time_size=time_size,
                                                  max_history=effective_max_history(self.max_history, time_size),
                                                  keep_first=self._keep_first, max_positions=max_positions,
                                                  compiled=self.compiled, free_rows=free_rows)
        cached = self._resident_inputs
        if cached[0] is not views:  # views made anew (other rows, regrown buffers): their model shapes
            shapes = [layout.tensor_shape(histories.num_rows, view.shape[2]) for layout, view in zip(self.layouts, views)]
            cached = self._resident_inputs = (views, {layout.name: view.reshape(shape) for layout, view, shape
                                                      in zip(self.layouts, views, shapes)})
        return MergedStates(inputs=dict(cached[1]), prefix_lengths=kept, time_size=time_size, rows_order=order)

    def resident_new_steps(self, merged: MergedStates) -> dict:
        """The new step a model wrote into the resident inputs of ``merged`` at each row's length,
        by state output name, shaped for :meth:`split` (one time step)."""
        kept = merged.prefix_lengths
        rows = np.arange(kept.shape[0])
        steps = {}
        for layout in self.layouts:
            buffer = merged.inputs[layout.name]
            view = buffer.reshape(buffer.shape[0], layout.mid, -1, layout.inner)
            if self.compiled and copies(view.dtype):
                host_jit = compiled_loops()
                step = np.empty((rows.size, layout.mid, layout.inner), view.dtype)
                host_jit.new_steps(view, kept, step)
            else:
                step = view[rows, :, kept]
            steps[layout.variable.output_name] = step.reshape(layout.tensor_shape(rows.size, 1))
        return steps

    def split_resident(self, merged: MergedStates):
        """``split(resident_new_steps(merged))``: [N, 1] slots holding the new steps a model wrote
        into the resident inputs of ``merged``. Compiled (one dtype the compiled loops copy): the
        steps go from the resident rows straight into the pool, one loop per pool chunk."""
        views = [merged.inputs[layout.name] for layout in self.layouts]
        if not (self.compiled and len({v.dtype for v in views}) == 1 and copies(views[0].dtype)):
            return self.split(self.resident_new_steps(merged))
        host_jit = compiled_loops()
        kept = np.ascontiguousarray(merged.prefix_lengths)
        num_rows = kept.shape[0]
        new_slots = self.pool.allocate(num_rows, 1, compiled=True)
        self._resident.allocated(new_slots, compiled=True)
        pool, (cached_views, buffers, generation, slabs) = self.pool, self._split_views
        if len(cached_views) != len(views) or any(a is not b for a, b in zip(cached_views, views)):
            buffers = tuple(v.reshape(num_rows, layout.mid, -1, layout.inner) for layout, v in zip(self.layouts, views))
        if generation != pool.generation:  # the pool's chunks as the copies take them
            slabs = [tuple(pool.slabs[v][c].reshape(pool.slots_per_chunk, -1) for v in range(len(self.layouts)))
                     for c in range(pool.num_chunks)]
        self._split_views = (views, buffers, pool.generation, slabs)
        for c, chunk in enumerate(slabs):
            host_jit.scatter_resident(buffers, kept, new_slots, pool.slots_per_chunk, c, chunk)
        return new_slots

    def written_in_place(self, new_slots, prefix_lengths, *, key=0) -> None:
        """After :meth:`merge_resident` of ``key`` and :meth:`split`: the model wrote row r's
        new step (``new_slots[r, 0]``) at position ``prefix_lengths[r]`` of its resident row."""
        self._resident.written(key=key, new_slots=np.asarray(new_slots), kept=np.asarray(prefix_lengths),
                               compiled=self.compiled)

    # ---- options -> dtypes ------------------------------------------------------------------------
    def _storage_dtype(self, variable: StateVariable) -> np.dtype:
        options = self.options
        model = np.dtype(variable.dtype)
        where = f"state_manager {options.type!r}, state variable {variable.input_name!r}"
        if options.type in INTEGER_STATE_TYPES:
            want = np.dtype(INTEGER_STATE_TYPES[options.type])
            if model != want:
                raise ValueError(f"{where}: expected {want} state tensors, got {model}")
            return model
        if model.name not in FLOAT_STATE_DTYPES:
            hint = "; use transformer-16bit / transformer-8bit for int16 / int8 states" if model.kind == "i" else ""
            raise ValueError(f"{where}: expected float states ({', '.join(FLOAT_STATE_DTYPES)}), got {model}{hint}")
        if self.device == "cpu" and options.state_compression == "reduced-precision":
            return np.dtype(np.float16)
        if self.device == "cpu" and options.state_compression == "fixed-quantisation":
            return np.dtype(np.int16 if options.state_compression_bits == 16 else np.int8)
        if options.storage_dtype is None:
            return model
        if options.storage_dtype == "bfloat16":
            try:
                return np.dtype("bfloat16")
            except TypeError:
                raise ValueError(f"{where}: storage_dtype bfloat16 needs the ml_dtypes package") from None
        return np.dtype(options.storage_dtype)

    # ---- histories --------------------------------------------------------------------------------
    def initial_histories(self, num_rows: int) -> StateHistory:
        """``num_rows`` histories holding no state yet."""
        raise NotImplementedError

    def _as_histories(self, histories: StateHistory) -> StateHistory:
        xp = self.xp
        if self.device == "cuda":
            from gpudecode.backend import to_device

            table = to_device(histories.table, self.options.device_id)
            lengths = to_device(histories.lengths, self.options.device_id)
        else:
            table, lengths = histories.table, histories.lengths
            if type(table) is np.ndarray and type(lengths) is np.ndarray and table.flags.c_contiguous \
                    and lengths.flags.c_contiguous:  # already a host history: as it is
                histories.validate()
                return histories
            table, lengths = to_host(table), to_host(lengths)
        histories = StateHistory(table=xp.ascontiguousarray(table), lengths=xp.ascontiguousarray(lengths))
        histories.validate()
        return histories

    @property
    def max_history(self) -> int:
        """The most states a history keeps."""
        raise NotImplementedError

    @property
    def _keep_first(self) -> bool:
        return self.options.always_include_first_token_state

    # ---- merge ------------------------------------------------------------------------------------
    def merge(
        self,
        histories: StateHistory,
        *,
        time_size: int | None = None,
        out: Mapping[str, object] | None = None,
        prefix_lengths_out=None,
    ) -> MergedStates:
        """Batched, left-padded state inputs of every state variable for ``histories``.

        ``time_size`` (transformer): T of the inputs, default ``min(table width, max_history)`` —
        the longest kept history when the table is as wide as the longest history. A smaller T
        truncates like ``max_history``. ``out``: the caller's buffers by input name, all shaped
        for the same (N_buf >= N, T_buf); rows >= N and the left padding are written as zeros, and
        T = T_buf. With left-aligned histories (``history_alignment="left"``: the model reads only
        each row's prefix) the positions after each history and the rows >= N are not written at
        all; the buffers this manager allocates start zeroed, so they only ever hold finite states.
        ``prefix_lengths_out``: ``[N_buf]`` int32 buffer for the prefix lengths.
        """
        histories = self._as_histories(histories)
        num_rows = histories.num_rows
        time_size = self._merge_time_size(time_size)
        if out is not None:
            outputs, out_rows, checked_time = self._checked_out(out)
            if out_rows < num_rows:
                raise ValueError(f"merge: out buffers hold {out_rows} rows, the histories {num_rows}")
            if time_size is not None and time_size != checked_time:
                raise ValueError(f"merge: time_size {time_size} differs from the out buffers' T {checked_time}")
            time_size = checked_time
        else:
            if time_size is None:
                time_size = min(histories.width, self.max_history)
            if time_size < 0:
                raise ValueError(f"merge: time_size must be >= 0, got {time_size}")
            out_rows = num_rows
            outputs = self._owned_buffers(out_rows, time_size)
        if prefix_lengths_out is None:
            prefix_lengths = self._owned_prefix(out_rows)
        else:
            prefix_lengths = prefix_lengths_out
            if prefix_lengths.shape != (out_rows,) or prefix_lengths.dtype != np.int32 or (
                is_device_array(prefix_lengths) != (self.device == "cuda")
            ):
                raise ValueError(
                    f"merge: prefix_lengths_out must be a [{out_rows}] int32 "
                    f"{'CuPy' if self.device == 'cuda' else 'numpy'} array, got {prefix_lengths.shape} "
                    f"{prefix_lengths.dtype}"
                )
        max_history = effective_max_history(self.max_history, time_size)
        self._copy.merge(
            histories,
            out_rows=out_rows,
            time_size=time_size,
            max_history=max_history,
            keep_first=self._keep_first,
            outputs=outputs,
            prefix_lengths=prefix_lengths,
            left_aligned=self.options.history_alignment == "left",
        )
        inputs = {layout.name: array for layout, array in zip(self.layouts, outputs)}
        return MergedStates(inputs=inputs, prefix_lengths=prefix_lengths, time_size=time_size)

    def _merge_time_size(self, time_size: int | None) -> int | None:
        """``time_size`` as this family's merge takes it."""
        return time_size

    def _checked_out(self, out: Mapping[str, object]):
        """``_check_out`` of ``out``, remembered for the same buffer objects (a CUDA graph's static
        inputs come back every step)."""
        key = tuple(id(out.get(layout.name)) for layout in self.layouts)
        if self._last_out is not None and self._last_out[0] == key:
            return self._last_out[1]
        checked = self._check_out(out)
        self._last_out = (key, checked, [out[layout.name] for layout in self.layouts])  # ids stay valid
        return checked

    def _check_out(self, out: Mapping[str, object]):
        outputs, sizes = [], set()
        for layout in self.layouts:
            if layout.name not in out:
                raise ValueError(f"merge: out has no buffer for state input {layout.name!r}")
            array = out[layout.name]
            if is_device_array(array) != (self.device == "cuda"):
                raise ValueError(
                    f"merge: buffer {layout.name!r} must be a {'CuPy' if self.device == 'cuda' else 'numpy'} array"
                )
            if array.dtype != layout.model_dtype or not array.flags.c_contiguous:
                raise ValueError(
                    f"merge: buffer {layout.name!r} must be C-contiguous {layout.model_dtype}, got {array.dtype}"
                )
            sizes.add(layout.rows_and_time(tuple(array.shape), "merge buffer"))
            outputs.append(array)
        if len(sizes) != 1:
            raise ValueError(f"merge: the out buffers disagree on (N, T): {sorted(sizes)}")
        out_rows, out_time = sizes.pop()
        return outputs, out_rows, out_time

    def _owned_buffers(self, rows: int, time: int) -> list:
        xp = self.xp
        arrays = []
        with self._on_device():
            for layout in self.layouts:
                shape = layout.tensor_shape(rows, time)
                size = int(np.prod(shape, dtype=np.int64))
                buffer = self._buffers.get(layout.name)
                if buffer is None or buffer.size < size:
                    # capacity rounded up to a power of two: few reallocations, never per step
                    capacity = next_power_of_two(size)
                    buffer = xp.zeros(capacity, dtype=layout.model_dtype)
                    self._buffers[layout.name] = buffer
                arrays.append(buffer[:size].reshape(shape))
        return arrays

    def _owned_prefix(self, rows: int):
        if self._prefix_buffer is None or self._prefix_buffer.size < rows:
            with self._on_device():
                self._prefix_buffer = self.xp.empty(next_power_of_two(rows), dtype=np.int32)
        return self._prefix_buffer[:rows]

    def _on_device(self):
        return self.pool._on_device()

    # ---- split ------------------------------------------------------------------------------------
    def split(self, outputs: Mapping[str, object], *, num_new_tokens: int = 1, token_counts=None, positions=None):
        """Stores the new token states of the model's state outputs in new slots.

        ``outputs``: output name -> ``[.., N, .., out_T, ..]`` arrays (numpy arrays are uploaded by
        the GPU managers, CuPy arrays downloaded by the host managers). New token p of row b is read
        at time index ``out_T - num_new_tokens + p``, so outputs may hold the whole time axis or
        only the new step. ``token_counts``: ``[N]`` tokens per row (default all
        ``num_new_tokens``, whose value must be the largest count). ``positions``: ``[>= N]``
        integers (the first N used; time-axis states only): token p of row b is read at
        ``positions[b] + p`` instead, clamped into ``[0, out_T - num_new_tokens]`` — e.g. the merge's
        prefix lengths for a left-aligned Hugging Face model, whose outputs hold each row's history
        first and its new step at the row's length. The GPU managers read there in the split's one
        launch (int32 device positions are used as they are); the host managers take those steps
        first. Returns ``[N, num_new_tokens]`` int32 slots, -1 where a row has fewer tokens.
        """
        self._check_new_tokens(num_new_tokens)
        if num_new_tokens < 0:
            raise ValueError(f"split: num_new_tokens must be >= 0, got {num_new_tokens}")
        sources, shapes = [], set()
        for layout in self.layouts:
            name = layout.variable.output_name
            if name not in outputs:
                raise ValueError(f"split: the model outputs lack state output {name!r} (have {sorted(outputs)})")
            array = outputs[name]
            if np.dtype(array.dtype) != layout.model_dtype:
                raise ValueError(f"split: state output {name!r}: expected dtype {layout.model_dtype}, got {array.dtype}")
            shapes.add(layout.rows_and_time(tuple(array.shape), "split: state output"))
            sources.append(self._to_here(array))
        if len(shapes) != 1:
            raise ValueError(f"split: the state outputs disagree on (N, T): {sorted(shapes)}")
        num_rows, source_time = shapes.pop()
        if source_time < num_new_tokens:
            raise ValueError(
                f"split: state outputs hold {source_time} time steps, fewer than num_new_tokens={num_new_tokens}"
            )
        if token_counts is not None and tuple(token_counts.shape) != (num_rows,):
            raise ValueError(f"split: token_counts must have shape ({num_rows},), got {tuple(token_counts.shape)}")
        if token_counts is not None and self.device == "cpu":
            token_counts = to_host(token_counts)
        at = {}  # the CUDA copy's positions
        if positions is not None:
            rows = self._split_positions(positions, num_rows)
            if self.device == "cpu":
                sources = [_steps_at(layout, source, num_rows, source_time, rows, num_new_tokens)
                           for layout, source in zip(self.layouts, sources)]
                source_time = num_new_tokens
            else:
                at = {"positions": rows}
        if token_counts is None and self._copy.allocates:
            new_slots = self.pool.book_uniform(num_rows, num_new_tokens)
            self._copy.split(sources, num_rows=num_rows, source_time=source_time, new_slots=new_slots, allocate=True,
                             **at)
        else:
            compiled = {"compiled": True} if self.compiled else {}  # host managers only
            new_slots = self.pool.allocate(num_rows, num_new_tokens, token_counts, **compiled)
            if self._resident is not None:
                self._resident.allocated(new_slots, compiled=self.compiled)
            self._copy.split(sources, num_rows=num_rows, source_time=source_time, new_slots=new_slots, **compiled,
                             **at)
        return new_slots

    def copy_steps(self, sources: Mapping[str, object], targets: Mapping[str, object], positions, *,
                   num_rows: int) -> None:
        """Row b's token state at time ``positions[b]`` of each state variable's ``sources[name]`` (by
        state input name; [.., R, .., S, ..], a left-aligned present output) written at that time of
        ``targets[name]`` ([.., R, .., T, ..], the model dtype: the step's own state input), rows
        b < ``num_rows``; positions outside [0, min(S, T)) are left alone. The resident greedy steps'
        new states (:class:`gpudecode.session.step_model.ResidentRows`): one launch on CUDA, numpy per
        variable on the host."""
        if not self.has_time_axis:
            raise ValueError(f"copy_steps: states without a time axis ({self.options.type!r})")
        src = [sources[layout.name] for layout in self.layouts]
        dst = [targets[layout.name] for layout in self.layouts]
        variable = self.layouts[0].variable
        rows, source_time = src[0].shape[variable.batch_axis], src[0].shape[variable.time_axis]
        target_time = dst[0].shape[variable.time_axis]
        at = self._split_positions(positions, num_rows)
        if self.device == "cuda":
            self._copy.copy_steps(src, dst, num_rows=num_rows, rows=rows, source_time=source_time,
                                  target_time=target_time, positions=at)
            return
        kept = np.flatnonzero((at >= 0) & (at < min(source_time, target_time)))
        for layout, source, target in zip(self.layouts, src, dst):
            s = source.reshape(layout.pre, rows, layout.mid, source_time, layout.inner)
            if not target.flags.c_contiguous:
                raise ValueError(f"copy_steps: target {layout.name!r} must be C-contiguous (written in place)")
            t = target.reshape(layout.pre, rows, layout.mid, target_time, layout.inner)
            t[:, kept, :, at[kept], :] = s[:, kept, :, at[kept], :]

    def _split_positions(self, positions, num_rows: int):
        """Split's ``positions`` as the copies read them: on the GPU int32 C-contiguous (as they are
        when already so; the kernels read the first ``num_rows``), on the host the first ``num_rows``
        as int64 numpy."""
        if not self.has_time_axis:
            raise ValueError(f"split: positions apply to states with a time axis, not {self.options.type!r}")
        if len(positions.shape) != 1 or positions.shape[0] < num_rows:
            raise ValueError(f"split: positions must have shape (>= {num_rows},), got {tuple(positions.shape)}")
        if self.device == "cpu":
            return to_host(positions[:num_rows]).astype(np.int64)
        if is_device_array(positions) and positions.dtype == np.int32 and positions.flags.c_contiguous:
            return positions
        with on_shared_stream(self.options.device_id):
            return self.xp.ascontiguousarray(self.xp.asarray(positions[:num_rows]), dtype=np.int32)

    def _check_new_tokens(self, num_new_tokens: int) -> None:
        """Raises when this family cannot take ``num_new_tokens`` new states per row."""

    def _to_here(self, array):
        xp = self.xp
        if self.device == "cuda" and is_device_array(array) and array.flags.c_contiguous:
            return array
        if self.device == "cuda":
            cupy = xp
            with on_shared_stream(self.options.device_id):
                return cupy.ascontiguousarray(cupy.asarray(array))
        return np.ascontiguousarray(to_host(array))

    # ---- histories & lifetime ---------------------------------------------------------------------
    def extend(self, histories: StateHistory, new_slots, parents, *, append=None) -> StateHistory:
        """Children's histories: child c continues row ``parents[c]`` with that row's new slots
        (``append[c]`` False: the parent's history unchanged). LSTM: the parent row's new state."""
        histories = self._as_histories(histories)
        xp = self.xp
        with self._on_device():
            return self._extended(histories, xp.asarray(new_slots), xp.asarray(parents), append)

    def _extended(self, histories: StateHistory, new_slots, parents, append) -> StateHistory:
        """:meth:`extend` on this manager's arrays (inside its device context)."""
        raise NotImplementedError

    def trimmed(self, histories: StateHistory, width: int) -> StateHistory:
        """``histories`` with a table at most ``width`` wide, for a caller that knows no history
        is longer (a host bound; no sync)."""
        raise NotImplementedError

    def extend_retained(self, histories: StateHistory, new_slots, parents, *, append=None,
                        width: int | None = None) -> StateHistory:
        """The children of :meth:`extend`, :meth:`trimmed` to ``width`` (None: as they are), and
        :meth:`retain` of them alone; returns the children. A compiled host manager with a time
        axis extends straight into the trimmed table where no ``max_history`` compacts it."""
        children = self._extend_retained_on_host(histories, new_slots, parents, append, width)
        if children is None:
            children = self.extend(histories, new_slots, parents, append=append)
            if width is not None:
                children = self.trimmed(children, width)
            self.retain(children)
        return children

    def _extend_retained_on_host(self, histories: StateHistory, new_slots, parents, append, width):
        """:meth:`extend_retained` as a compiled extension, one mark and one sweep, or None where
        that does not apply (see there)."""
        table, lengths = histories.table, histories.lengths
        if not (self.compiled and self.has_time_axis and all(type(a) is np.ndarray for a in (
                table, lengths, new_slots, parents)) and (append is None or type(append) is np.ndarray)):
            return None
        full = table.shape[1] + new_slots.shape[1]
        if self.options.max_history is not None and self.options.max_history < full:
            return None  # extend compacts to the window
        host_jit = compiled_loops()
        histories = self._as_histories(histories)
        parents = np.ascontiguousarray(parents, dtype=np.int64)
        out_width = full if width is None else min(full, width)
        children = StateHistory(table=np.empty((parents.shape[0], out_width), np.int32),
                                lengths=np.empty(parents.shape[0], np.int32))
        has_append = append is not None
        host_jit.extend(histories.table, histories.lengths, np.ascontiguousarray(new_slots, dtype=np.int32), parents,
                        np.ascontiguousarray(append, dtype=bool) if has_append else np.ones(1, dtype=bool),
                        has_append, children.table, children.lengths)
        self.pool.mark(children, max_history=self.max_history, keep_first=self._keep_first, compiled=True)
        self.pool.sweep(compiled=True)
        return children

    def select(self, histories: StateHistory, rows) -> StateHistory:
        """The histories of ``rows`` (survivors are a gather)."""
        with self._on_device():
            return select_histories(self._as_histories(histories), self.xp.asarray(rows))

    def retain(self, *histories: StateHistory) -> None:
        """Keeps the slots inside the windows of ``histories`` and frees every other slot."""
        with self._on_device():
            for h in histories:
                self.pool.mark(self._as_histories(h), max_history=self.max_history, keep_first=self._keep_first,
                               compiled=self.compiled)
            self.pool.sweep(compiled=self.compiled)

    def release_all(self) -> None:
        """Frees every slot (the pool keeps its chunks)."""
        self.pool.release_all()
        if self._resident is not None:
            self._resident.forget()
        self._resident_inputs = (None, {})
        self._split_views = ([], (), -1, [])

    def statistics(self) -> PoolStatistics:
        return self.pool.statistics()

    def close(self) -> None:
        """Returns the pool's and the merge buffers' memory."""
        self.pool.close()
        self._buffers.clear()
        self._resident = None
        self._resident_inputs = (None, {})
        self._split_views = ([], (), -1, [])
        self._prefix_buffer = None


def _steps_at(layout: VariableLayout, source: np.ndarray, num_rows: int, source_time: int, positions: np.ndarray,
              num_new: int) -> np.ndarray:
    """Host split's new tokens of ``source`` ([.., N, .., source_time, ..]) read at time
    ``positions[b] + p`` (clamped as the CUDA split does), as ``[pre, N, mid, num_new, inner]``."""
    view = source.reshape(layout.pre, num_rows, layout.mid, source_time, layout.inner)
    first = np.clip(positions, 0, source_time - num_new)
    times = first[:, None] + np.arange(num_new)[None, :]  # [N, S]
    taken = view[:, np.arange(num_rows)[:, None], :, times, :]  # [N, S, pre, mid, inner]
    return np.ascontiguousarray(taken.transpose(2, 0, 3, 1, 4))


class TransformerStateManager(StateManager):
    """One slot per token state; histories of any length, truncated by ``max_history``."""

    family = "transformer"
    has_time_axis = True

    def __init__(self, options, state_variables, *, device: str):
        for v in state_variables:
            if v.time_axis is None:
                raise ValueError(
                    f"state_manager {options.type!r}: state variable {v.input_name!r} has no time axis "
                    f"(shape {v.shape}); use an lstm state manager for per-hypothesis states"
                )
        super().__init__(options, state_variables, device=device)

    def initial_histories(self, num_rows: int) -> StateHistory:
        """``num_rows`` histories with no token state (an empty transformer past)."""
        return empty_histories(num_rows, self.xp, width=0)

    @property
    def max_history(self) -> int:
        """The most token states a history keeps (``options.max_history`` made effective)."""
        return effective_max_history(self.options.max_history)

    def _extended(self, histories: StateHistory, new_slots, parents, append) -> StateHistory:
        """:meth:`extend` on this manager's arrays (inside its device context)."""
        return extend_histories(
            histories,
            new_slots,
            parents,
            append=append,
            max_history=self.options.max_history,
            keep_first=self._keep_first,
            compiled=self.compiled,
        )

    def trimmed(self, histories: StateHistory, width: int) -> StateHistory:
        """``histories`` with a table at most ``width`` wide, for a caller that knows no history
        is longer (a host bound; no sync)."""
        if histories.width <= width:
            return histories
        table = self.xp.ascontiguousarray(histories.table[:, :width])
        return StateHistory(table=table, lengths=histories.lengths)


class LstmStateManager(StateManager):
    """One slot per hypothesis: merge and split are row gather and scatter ([N, H] or [L, N, H])."""

    family = "lstm"
    has_time_axis = False

    def __init__(self, options, state_variables, *, device: str):
        for v in state_variables:
            if v.time_axis is not None:
                raise ValueError(
                    f"state_manager {options.type!r}: state variable {v.input_name!r} has a time axis "
                    f"({v.time_axis} in shape {v.shape}); use a transformer state manager"
                )
        super().__init__(options, state_variables, device=device)

    def initial_histories(self, num_rows: int) -> StateHistory:
        """``num_rows`` histories holding no state (a zero LSTM state)."""
        return empty_histories(num_rows, self.xp, width=1)

    @property
    def max_history(self) -> int:
        """One: a history is the hypothesis' latest state."""
        return 1

    def _merge_time_size(self, time_size: int | None) -> int:
        if time_size not in (None, 1):
            raise ValueError(f"state_manager {self.options.type!r}: LSTM states have no time axis")
        return 1

    def _check_new_tokens(self, num_new_tokens: int) -> None:
        if num_new_tokens != 1:
            raise ValueError(f"state_manager {self.options.type!r}: an LSTM step adds exactly one state per row")

    def _extended(self, histories: StateHistory, new_slots, parents, append) -> StateHistory:
        """The parent row's new state."""
        xp = self.xp
        child = new_slots[parents][:, :1]
        if append is not None:
            child = xp.where(xp.asarray(append, dtype=bool)[:, None], child, histories.table[parents])
        child = xp.ascontiguousarray(child.astype(np.int32))
        return StateHistory(table=child, lengths=(child[:, 0] >= 0).astype(np.int32))

    def trimmed(self, histories: StateHistory, width: int) -> StateHistory:
        """``histories`` as they are (always one state wide)."""
        return histories
