"""Merged states kept between steps on the CPU, for a model that writes each new step into its
past buffer in place (ONNX Runtime's ``GroupQueryAttention`` with a shared past/present buffer, on
the CPU provider as on CUDA).

The merge's buffers ``[R, mid, C, inner]`` (batch axis outermost, C positions along the time axis)
stay alive between steps, each row's history left-aligned in its first positions. A row knows
which pool slots it holds (``held``, with each slot's allocation stamp, so that a freed and reused
slot never passes for its old state). A merge then finds, for each history, a row that already
holds it: the row holding its last slot (``owner``), checked position by position. A row that
holds its own history costs nothing (greedy search: every row), one that holds another row's is a
row copy of the history's positions (a beam's reordering), and only a history no row holds is
gathered from the pool. The model writes the new step at each row's length; :meth:`written` records
it. The pool stays the truth (every new step is also split into it), so the histories, ``retain``
and ``max_history`` mean what they mean elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpudecode.sizes import next_power_of_two
from gpudecode.states.compiled import compiled_loops, copies
from gpudecode.states.history import NO_SLOT, StateHistory, window_table
from gpudecode.states.layout import VariableLayout
from gpudecode.states.pool import StatePool

#: the fewest positions a resident row holds (capacities are powers of two from here)
MIN_POSITIONS = 16


def resident_layouts_supported(layouts: Sequence[VariableLayout]) -> bool:
    """Whether the states can stay resident: every variable with a time axis and its batch axis
    outermost (a row's states are then one contiguous block of the buffer), stored in the model's
    dtype (a compressed pool would be read back rounded, a resident row would not)."""
    return bool(layouts) and all(
        layout.pre == 1 and layout.variable.time_axis is not None and layout.storage_dtype == layout.model_dtype
        for layout in layouts)


class _Rows:
    """One set of resident rows (one model call's rows)."""

    def __init__(self, layouts: Sequence[VariableLayout], rows: int, time: int):
        self.buffers = [np.zeros((rows, layout.mid, time, layout.inner), dtype=layout.model_dtype)
                        for layout in layouts]
        self.held = np.full((rows, time), NO_SLOT, dtype=np.int32)
        self.stamps = np.zeros((rows, time), dtype=np.int64)
        #: the compiled merge copies these buffers' rows (one dtype it takes, :mod:`gpudecode.states.compiled`)
        self.compiled_copies = len({b.dtype for b in self.buffers}) == 1 and copies(self.buffers[0].dtype)
        self.buffer_tuple = tuple(self.buffers)
        self._views: tuple = (-1, [])  # (rows, the buffers' first rows) of the last merge

    def views(self, num_rows: int) -> list:
        """The buffers' first ``num_rows`` rows (views, made once per row count in a row)."""
        if self._views[0] != num_rows:
            self._views = (num_rows, [buffer[:num_rows] for buffer in self.buffers])
        return self._views[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.held.shape

    def grown(self, layouts, rows: int, time: int) -> "_Rows":
        """At least ``rows`` x ``time``, keeping what is held."""
        old_rows, old_time = self.shape
        if rows <= old_rows and time <= old_time:
            return self
        new = _Rows(layouts, max(rows, old_rows), max(time, old_time))
        for old, buffer in zip(self.buffers, new.buffers):
            buffer[:old_rows, :, :old_time] = old
        new.held[:old_rows, :old_time] = self.held
        new.stamps[:old_rows, :old_time] = self.stamps
        return new


class ResidentStates:
    """Resident merge buffers of the variables ``layouts`` stored in ``pool`` (see the module).

    ``gather(slots)`` reads windows of slots from the pool: ``[M, T]`` slot ids -> per variable
    ``[M, mid, T, inner]`` (zeros where -1), e.g. :meth:`HostStateCopy.gather`.
    """

    def __init__(self, layouts: Sequence[VariableLayout], pool: StatePool, gather):
        if not resident_layouts_supported(layouts):
            raise ValueError("resident states need time-axis variables with the batch axis outermost, "
                             "stored in the model's dtype")
        self.layouts = list(layouts)
        self.pool = pool
        self._gather = gather
        self._stamp = np.zeros(0, dtype=np.int64)  # per slot: its allocation's number
        self._owner = np.zeros(0, dtype=np.int32)  # per slot: a row whose window ended with it
        self._next_stamp = 1
        self._rows: dict[object, _Rows] = {}
        self.rows_fetched = 0  # histories gathered from the pool (no row held them), for tests
        self.rows_moved = 0  # histories copied from another row

    def _grow_slot_tables(self) -> None:
        capacity = max(self.pool.capacity, 1)  # never empty: indexed (masked) where no slot is
        if self._stamp.size < capacity:
            self._stamp = np.concatenate([self._stamp, np.zeros(capacity - self._stamp.size, np.int64)])
        if self._owner.size < capacity:
            self._owner = np.concatenate([self._owner, np.full(capacity - self._owner.size, -1, np.int32)])

    def allocated(self, new_slots: np.ndarray, compiled: bool = False) -> None:
        """Stamps the slots just handed out (any row still holding a slot's old state stops
        matching it). ``compiled``: one compiled loop."""
        self._grow_slot_tables()
        if compiled:
            host_jit = compiled_loops()
            self._next_stamp = host_jit.stamped(np.ascontiguousarray(new_slots).reshape(-1), self._stamp,
                                                self._next_stamp)
            return
        flat = new_slots.reshape(-1)
        flat = flat[flat >= 0]
        self._stamp[flat] = self._next_stamp + np.arange(flat.size, dtype=np.int64)
        self._next_stamp += int(flat.size)

    def merge(self, histories: StateHistory, *, key, time_size: int, max_history: int, keep_first: bool,
              max_positions: int | None = None, compiled: bool = False, free_rows: bool = False):
        """(the rows ``[:N]`` of the resident buffers of ``key`` holding the histories' windows
        left-aligned, C >= ``time_size`` + 1 (room for the new step); the rows' kept lengths [N];
        ``order`` [N] int64, row r holding history ``order[r]``, or None: row r holds history r).
        ``max_positions``: C never exceeds it (the model's context) unless ``time_size`` + 1 does.
        ``compiled``: the matching and copies as compiled loops (:mod:`gpudecode.states.compiled`);
        ``free_rows`` (compiled, one dtype the loops copy): each history goes to a row that already
        holds it where one can (``host_jit.resident_merge_free``), else row n holds history n."""
        self._grow_slot_tables()
        num_rows = histories.num_rows
        rows = self._rows.get(key)
        capacity = next_power_of_two(max(time_size + 1, MIN_POSITIONS))  # regrown rarely, never per step
        if max_positions is not None:
            capacity = max(min(capacity, max_positions), time_size + 1)
        rows = _Rows(self.layouts, num_rows, capacity) if rows is None else \
            rows.grown(self.layouts, num_rows, capacity)
        self._rows[key] = rows
        if compiled and free_rows and rows.compiled_copies:
            return self._merge_free(histories, rows, time_size, max_history, keep_first)
        if compiled:
            return (*self._merge_compiled(histories, rows, time_size, max_history, keep_first), None)
        slots, kept = window_table(histories, time_size, max_history, keep_first, left=True)
        index = np.arange(num_rows)
        valid = np.arange(time_size)[None, :] < kept[:, None]
        stamps = np.where(valid, self._stamp[np.clip(slots, 0, None)], 0)
        has = kept > 0
        last = slots[index, np.maximum(kept - 1, 0)] if time_size else np.full(num_rows, NO_SLOT, np.int32)
        candidate = np.where(has, self._owner[np.clip(last, 0, None)], -1)
        source = np.clip(candidate, 0, None)
        same = (rows.held[source, :time_size] == slots) & (rows.stamps[source, :time_size] == stamps)
        held = (candidate >= 0) & (same | ~valid).all(axis=1)
        moved = np.flatnonzero(held & (candidate != index))
        fetch = np.flatnonzero(has & ~held)
        if moved.size:
            src = candidate[moved]
            for buffer in rows.buffers:  # the right side is a copy: sources overwritten here are read first
                buffer[moved, :, :time_size] = buffer[src, :, :time_size]
        if fetch.size:
            for buffer, tokens in zip(rows.buffers, self._gather(slots[fetch])):
                buffer[fetch, :, :time_size] = tokens
        self.rows_moved += int(moved.size)
        self.rows_fetched += int(fetch.size)
        rows.held[:num_rows, :time_size] = slots
        rows.held[:num_rows, time_size:] = NO_SLOT
        rows.stamps[:num_rows, :time_size] = stamps
        self._owner[last[has]] = index[has]
        return [buffer[:num_rows] for buffer in rows.buffers], kept, None

    def _merge_free(self, histories: StateHistory, rows: _Rows, time_size: int, max_history: int,
                    keep_first: bool):
        """:meth:`merge` with ``free_rows``, after the rows are sized: one compiled call, then the
        gathers of histories no row holds."""
        host_jit = compiled_loops()
        num_rows = histories.num_rows
        slots = np.empty((num_rows, time_size), np.int32)
        stamps = np.empty((num_rows, time_size), np.int64)
        kept, kept_rows = np.empty((2, num_rows), np.int32)
        source, moved, fetch, row_of, order = np.empty((5, num_rows), np.int64)
        num_moved, num_fetch = host_jit.resident_merge_free(
            histories.table, histories.lengths, time_size, max_history, keep_first, self._stamp, self._owner,
            rows.held, rows.stamps, rows.buffer_tuple, slots, stamps, kept, source, moved, fetch, row_of, order,
            kept_rows)
        fetch = fetch[:num_fetch]
        if fetch.size:
            for buffer, tokens in zip(rows.buffers, self._gather(slots[fetch])):
                buffer[row_of[fetch], :, :time_size] = tokens
        self.rows_moved += int(num_moved)
        self.rows_fetched += int(num_fetch)
        return rows.views(num_rows), kept_rows, order

    def _merge_compiled(self, histories: StateHistory, rows: _Rows, time_size: int, max_history: int,
                        keep_first: bool):
        """:meth:`merge` after the rows are sized, as compiled loops (``host_jit``)."""
        host_jit = compiled_loops()
        num_rows = histories.num_rows
        slots = np.empty((num_rows, time_size), np.int32)
        stamps = np.empty((num_rows, time_size), np.int64)
        kept = np.empty(num_rows, np.int32)
        source, moved, fetch = np.empty((3, num_rows), np.int64)
        if rows.compiled_copies:  # matching, copies and commit in one call; then the gathers
            num_moved, num_fetch = host_jit.resident_merge(
                histories.table, histories.lengths, time_size, max_history, keep_first, self._stamp, self._owner,
                rows.held, rows.stamps, rows.buffer_tuple, slots, stamps, kept, source, moved, fetch)
            fetch = fetch[:num_fetch]
            if fetch.size:
                for buffer, tokens in zip(rows.buffers, self._gather(slots[fetch])):
                    buffer[fetch, :, :time_size] = tokens
            self.rows_moved += int(num_moved)
            self.rows_fetched += int(num_fetch)
            return rows.views(num_rows), kept
        num_moved, num_fetch = host_jit.resident_match(
            histories.table, histories.lengths, time_size, max_history, keep_first, self._stamp, self._owner,
            rows.held, rows.stamps, slots, stamps, kept, source, moved, fetch)
        moved, fetch = moved[:num_moved], fetch[:num_fetch]
        if moved.size and rows.compiled_copies:
            host_jit.copy_rows(tuple(rows.buffers), moved, source[moved], kept)
        elif moved.size:
            for buffer in rows.buffers:  # the right side is a copy: sources overwritten here are read first
                buffer[moved, :, :time_size] = buffer[source[moved], :, :time_size]
        if fetch.size:
            for buffer, tokens in zip(rows.buffers, self._gather(slots[fetch])):
                buffer[fetch, :, :time_size] = tokens
        self.rows_moved += int(moved.size)
        self.rows_fetched += int(fetch.size)
        host_jit.resident_commit(slots, stamps, kept, rows.held, rows.stamps, self._owner)
        return [buffer[:num_rows] for buffer in rows.buffers], kept

    def written(self, *, key, new_slots: np.ndarray, kept: np.ndarray, compiled: bool = False) -> None:
        """The model wrote row r's new step (slot ``new_slots[r, 0]``) at position ``kept[r]`` of
        the resident rows of ``key``. ``compiled``: one compiled loop."""
        self._grow_slot_tables()
        rows = self._rows[key]
        if compiled:
            host_jit = compiled_loops()
            host_jit.written(np.ascontiguousarray(new_slots[:, 0]), np.asarray(kept, dtype=np.int32), self._stamp,
                             rows.held, rows.stamps, self._owner)
            return
        slot = new_slots[:, 0]
        index = np.flatnonzero((slot >= 0) & (kept < rows.shape[1]))
        where, slot = kept[index], slot[index]
        rows.held[index, where] = slot
        rows.stamps[index, where] = self._stamp[slot]
        self._owner[slot] = index

    def forget(self) -> None:
        """Drops every resident row (their memory too)."""
        self._rows.clear()
