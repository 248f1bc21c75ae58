"""numpy merge and split: the CPU state managers, and the reference the CUDA kernels are tested
against. Whole-array operations only; the one Python loop runs over the pool's chunks (a handful),
never over hypotheses or tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpudecode.states.compiled import compiled_loops, copies
from gpudecode.states.history import StateHistory, window_table
from gpudecode.states.layout import VariableLayout
from gpudecode.states.pool import StatePool


class HostStateCopy:
    """Merge and split on numpy arrays for the variables ``layouts`` stored in ``pool``.

    ``quantisation_scale``: with integer storage of float states (fixed quantisation) a state x is
    stored as ``clip(rint(x / scale))`` and read back as ``q * scale``.
    """

    allocates = False  # split takes slots from StatePool.allocate

    def __init__(self, layouts: Sequence[VariableLayout], pool: StatePool, *, quantisation_scale: float | None = None):
        self.layouts = list(layouts)
        self.pool = pool
        self.quantisation_scale = quantisation_scale

    # ---- codecs -----------------------------------------------------------------------------------
    def _decode(self, layout: VariableLayout, stored: np.ndarray) -> np.ndarray:
        if self.quantisation_scale is not None and stored.dtype.kind == "i" and layout.model_dtype.kind == "f":
            return stored.astype(layout.model_dtype) * layout.model_dtype.type(self.quantisation_scale)
        return stored.astype(layout.model_dtype, copy=False)

    def _encode(self, layout: VariableLayout, values: np.ndarray) -> np.ndarray:
        storage = layout.storage_dtype
        if self.quantisation_scale is not None and storage.kind == "i" and values.dtype.kind == "f":
            info = np.iinfo(storage)
            scaled = np.rint(values / values.dtype.type(self.quantisation_scale))
            return np.clip(scaled, info.min, info.max).astype(storage)
        return values.astype(storage, copy=False)

    # ---- merge ------------------------------------------------------------------------------------
    def merge(
        self,
        histories: StateHistory,
        *,
        out_rows: int,
        time_size: int,
        max_history: int,
        keep_first: bool,
        outputs: Sequence[np.ndarray],
        prefix_lengths: np.ndarray | None,
        left_aligned: bool = False,
    ) -> None:
        """Writes every variable's batched input into ``outputs`` (shaped ``tensor_shape(out_rows,
        time_size)``) and the kept lengths into ``prefix_lengths`` (``[out_rows]``); ``left_aligned``:
        each row's history first, the positions after it (and rows >= N) left as they are."""
        num_rows = histories.num_rows
        slots, kept = window_table(histories, time_size, max_history, keep_first, left=left_aligned)
        if prefix_lengths is not None:
            prefix_lengths[:num_rows] = kept
            prefix_lengths[num_rows:] = 0
        capacity = self.pool.capacity
        flat = slots.reshape(-1)
        valid = (flat >= 0) & (flat < capacity)
        chunk, row = self.pool.slot_location(np.where(valid, flat, 0))
        selections = [
            (c, np.flatnonzero(valid & (chunk == c))) for c in range(self.pool.num_chunks)
        ]
        for v, (layout, out) in enumerate(zip(self.layouts, outputs)):
            tokens = np.zeros((out_rows * time_size, layout.token_size), dtype=layout.model_dtype)
            for c, where in selections:
                if where.size:
                    slab = self.pool.slabs[v][c].reshape(self.pool.slots_per_chunk, -1)
                    tokens[where] = self._decode(layout, slab[row[where]])
            view = out.reshape(layout.pre, out_rows, layout.mid, time_size, layout.inner)
            merged = tokens.reshape(out_rows, time_size, layout.pre, layout.mid, layout.inner).transpose(2, 0, 3, 1, 4)
            if left_aligned:
                inside = np.zeros((out_rows, time_size), dtype=bool)
                inside[:num_rows] = np.arange(time_size)[None, :] < kept[:, None]
                merged = np.where(inside[None, :, None, :, None], merged, view)
            view[...] = merged

    def gather(self, slots: np.ndarray) -> list[np.ndarray]:
        """The token states of ``slots`` ``[M, T]`` per variable as ``[M, mid, T, inner]`` in the
        model's dtype, zeros where a slot is -1 (variables with the batch axis outermost)."""
        num_rows, time_size = slots.shape
        flat = slots.reshape(-1)
        valid = (flat >= 0) & (flat < self.pool.capacity)
        chunk, row = self.pool.slot_location(np.where(valid, flat, 0))
        selections = [(c, np.flatnonzero(valid & (chunk == c))) for c in range(self.pool.num_chunks)]
        result = []
        for v, layout in enumerate(self.layouts):
            tokens = np.zeros((num_rows * time_size, layout.token_size), dtype=layout.model_dtype)
            for c, where in selections:
                if where.size:
                    slab = self.pool.slabs[v][c].reshape(self.pool.slots_per_chunk, -1)
                    tokens[where] = self._decode(layout, slab[row[where]])
            result.append(tokens.reshape(num_rows, time_size, layout.mid, layout.inner).transpose(0, 2, 1, 3))
        return result

    # ---- split ------------------------------------------------------------------------------------
    def split(self, sources: Sequence[np.ndarray], *, num_rows: int, source_time: int, new_slots: np.ndarray,
              compiled: bool = False) -> None:
        """Copies new token p of row b (time index ``source_time - S + p``) of every source into
        slot ``new_slots[b, p]`` (skipped where -1). ``compiled``: where a variable is stored in the
        model's dtype, one compiled loop per chunk (:mod:`gpudecode.states.compiled`)."""
        num_new = new_slots.shape[1]
        first = source_time - num_new
        if compiled:
            host_jit = compiled_loops()
            rest = []
            for v, (layout, source) in enumerate(zip(self.layouts, sources)):
                if layout.storage_dtype != layout.model_dtype or source.dtype != layout.model_dtype or \
                        not copies(source.dtype):
                    rest.append(v)
                    continue
                view = source.reshape(layout.pre, num_rows, layout.mid, source_time, layout.inner)
                for c in range(self.pool.num_chunks):
                    slab = self.pool.slabs[v][c].reshape(self.pool.slots_per_chunk, -1)
                    host_jit.scatter_tokens(view, first, new_slots, self.pool.slots_per_chunk, c, slab)
            if not rest:
                return
            layouts, sources = [self.layouts[v] for v in rest], [sources[v] for v in rest]
        else:
            rest, layouts = list(range(len(self.layouts))), self.layouts
        flat = new_slots.reshape(-1)
        valid = (flat >= 0) & (flat < self.pool.capacity)
        chunk, row = self.pool.slot_location(np.where(valid, flat, 0))
        selections = [(c, np.flatnonzero(valid & (chunk == c))) for c in range(self.pool.num_chunks)]
        for v, layout, source in zip(rest, layouts, sources):
            view = source.reshape(layout.pre, num_rows, layout.mid, source_time, layout.inner)
            tokens = view[:, :, :, first:, :].transpose(1, 3, 0, 2, 4).reshape(num_rows * num_new, -1)
            for c, where in selections:
                if where.size:
                    slab = self.pool.slabs[v][c].reshape(self.pool.slots_per_chunk, -1)
                    slab[row[where]] = self._encode(layout, tokens[where])
