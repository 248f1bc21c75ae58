"""State histories: which pool slots hold the token states of each hypothesis.

A history is a slot table ``[N, T]`` int32 (oldest token first, valid below ``lengths[b]``, -1
beyond) plus ``lengths [N]`` int32, both numpy or CuPy arrays. The functions here are written once
for both array modules (``xp``), use only whole-array operations (no Python loop over hypotheses
or tokens) and never synchronise with the device.

The **window** of a history is what a merge reads and what keeps slots alive: with
``max_history`` L the last ``kept = min(length, L)`` positions; with ``keep_first`` the very first
position followed by the last ``kept - 1`` (RASR's ``always_include_first_token_state``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpudecode.backend import get_array_module, on_shared_stream, require_cupy
from gpudecode.states.compiled import compiled_loops

NO_SLOT = -1
UNBOUNDED = np.iinfo(np.int32).max  # max_history=None, as the kernels see it


@dataclass(frozen=True)
class StateHistory:
    """Slot histories of a batch of hypotheses.

    ``table``: ``[N, T]`` int32 slot ids, oldest first, ``-1`` past the end of a row.
    ``lengths``: ``[N]`` int32, the number of valid entries per row.
    """

    table: object
    lengths: object

    @property
    def num_rows(self) -> int:
        return int(self.table.shape[0])

    @property
    def width(self) -> int:
        return int(self.table.shape[1])

    def validate(self) -> None:
        """Checks shapes and dtypes (never the values, which may live on the device)."""
        if self.table.ndim != 2 or self.table.dtype != np.int32:
            raise ValueError(
                f"history table: expected a [N, T] int32 array, got shape {tuple(self.table.shape)} "
                f"dtype {self.table.dtype}"
            )
        if self.lengths.shape != (self.table.shape[0],) or self.lengths.dtype != np.int32:
            raise ValueError(
                f"history lengths: expected shape ({self.table.shape[0]},) int32, "
                f"got {tuple(self.lengths.shape)} {self.lengths.dtype}"
            )
        if not self.table.flags.c_contiguous:
            raise ValueError("history table: expected a C-contiguous array")


def empty_histories(num_rows: int, xp=np, width: int = 0) -> StateHistory:
    """``num_rows`` empty histories (the initial state of a transformer decoder)."""
    return StateHistory(
        table=xp.full((num_rows, width), NO_SLOT, dtype=np.int32),
        lengths=xp.zeros(num_rows, dtype=np.int32),
    )


def effective_max_history(max_history: int | None, time_size: int | None = None) -> int:
    """L as the kernels take it: ``None`` -> unbounded, and never more than ``time_size``."""
    limit = UNBOUNDED if max_history is None else int(max_history)
    if time_size is not None:
        limit = min(limit, int(time_size))
    return limit


def kept_lengths(lengths, width: int, max_history: int):
    """``[N]`` number of token states in each row's window (the merge's ``prefix-length``)."""
    xp = get_array_module(lengths)
    clipped = xp.clip(lengths, 0, width)
    return xp.minimum(clipped, max_history).astype(np.int32)


def window_table(histories: StateHistory, time_size: int, max_history: int, keep_first: bool, left: bool = False):
    """``[N, time_size]`` slot ids of each row's window, right-aligned, -1 on the left padding
    (``left``: left-aligned, -1 on the right).

    ``max_history`` must already be effective (see :func:`effective_max_history`).
    Returns ``(slots, kept)`` with ``kept [N]`` the number of valid entries per row.
    """
    table, lengths = histories.table, histories.lengths
    xp = get_array_module(table)
    num_rows, width = table.shape
    length = xp.clip(lengths, 0, width).astype(np.int32)
    kept = xp.minimum(length, max_history).astype(np.int32)
    t = xp.arange(time_size, dtype=np.int32)[None, :]
    pad = xp.zeros_like(kept)[:, None] if left else (time_size - kept)[:, None]
    j = t - pad
    position = length[:, None] - kept[:, None] + j
    if keep_first:
        position = xp.where(j == 0, 0, position)
    valid = (j >= 0) & (j < kept[:, None])
    if width == 0:
        return xp.full((num_rows, time_size), NO_SLOT, dtype=np.int32), kept
    gathered = xp.take_along_axis(table, xp.clip(position, 0, width - 1), axis=1)
    return xp.where(valid, gathered, NO_SLOT).astype(np.int32), kept


def window_mask(histories: StateHistory, max_history: int, keep_first: bool):
    """``[N, T]`` bool: True where a table entry lies inside its row's window."""
    table, lengths = histories.table, histories.lengths
    xp = get_array_module(table)
    width = table.shape[1]
    length = xp.clip(lengths, 0, width)[:, None]
    kept = xp.minimum(length, max_history)
    j = xp.arange(width, dtype=np.int32)[None, :]
    inside = (j < length) & (j >= length - kept)
    if keep_first:
        inside |= (j == 0) & (kept > 0)
    return inside


def extend_histories(
    histories: StateHistory,
    new_slots,
    parents,
    *,
    append=None,
    max_history: int | None = None,
    keep_first: bool = False,
    compiled: bool = False,
) -> StateHistory:
    """Histories of the children: child c = parent ``parents[c]`` + the parent row's new slots.

    ``new_slots``: ``[N, S]`` int32 from a split, indexed by the rows of ``histories`` (-1 where a
    row got fewer than S tokens); ``parents``: ``[M]`` int row indices; ``append``: optional
    ``[M]`` bool, False where a child keeps its parent's history unchanged (e.g. a blank frame).
    With ``max_history`` the result is compacted to each row's window (width at most L), which
    merges exactly as the full history would. ``compiled`` (numpy): one compiled loop
    (:mod:`gpudecode.states.compiled`).
    """
    xp = get_array_module(histories.table, new_slots, parents)
    parents = xp.asarray(parents).astype(np.int64, copy=False)
    if xp is not np:
        extended = _extend_on_device(histories, new_slots, parents, append)
        width = extended.width
    elif compiled:
        extended, width = _extend_compiled(histories, new_slots, parents, append)
    else:
        extended, width = _extend_on_host(histories, new_slots, parents, append)
    if max_history is None or max_history >= width:
        return extended
    return _compacted(extended, int(max_history), keep_first)


#: Threads per block of ``extend_histories`` (``kernels/state_pool.cu``).
_EXTEND_THREADS = 256


def _extend_on_device(histories: StateHistory, new_slots, parents, append) -> StateHistory:
    """``extend_histories`` on CuPy arrays in one launch (``kernels/state_pool.cu``)."""
    cupy = require_cupy()
    device_id = histories.table.device.id
    with on_shared_stream(device_id):
        table = cupy.ascontiguousarray(histories.table, dtype=np.int32)
        lengths = cupy.ascontiguousarray(histories.lengths, dtype=np.int32)
        new_slots = cupy.ascontiguousarray(new_slots, dtype=np.int32)
        parents = cupy.ascontiguousarray(parents, dtype=np.int64)
        num_children, width, max_tokens = int(parents.shape[0]), int(table.shape[1]), int(new_slots.shape[1])
        children = cupy.empty((num_children, width + max_tokens), dtype=np.int32)
        total = num_children * (width + max_tokens)
        # the kernel writes every length when a child has at least one position
        child_lengths = (cupy.empty if total else cupy.zeros)(num_children, dtype=np.int32)
        if append is not None:
            append = cupy.ascontiguousarray(cupy.asarray(append, dtype=bool)).view(np.uint8)
        if total:
            from gpudecode.kernels import kernel_function

            kernel = kernel_function("state_pool", "extend_histories", device_id)
            grid = min(-(-total // _EXTEND_THREADS), 4096)
            kernel((grid,), (_EXTEND_THREADS,), (
                table, np.int32(width), lengths, new_slots, np.int32(max_tokens), parents,
                append if append is not None else np.uint64(0), np.int32(num_children), children, child_lengths,
            ))
    return StateHistory(table=children, lengths=child_lengths)


def _extend_on_host(histories: StateHistory, new_slots, parents, append):
    table, lengths = histories.table, histories.lengths
    xp = np
    parent_table = table[parents]
    parent_length = xp.clip(lengths[parents], 0, table.shape[1]).astype(np.int32)
    child_new = new_slots[parents]
    num_new = child_new.shape[1]
    added = (child_new >= 0).sum(axis=1).astype(np.int32)
    if append is not None:
        added = xp.where(xp.asarray(append, dtype=bool), added, 0).astype(np.int32)
    width = table.shape[1] + num_new
    t = xp.arange(width, dtype=np.int32)[None, :]
    from_parent = t < parent_length[:, None]
    k = t - parent_length[:, None]
    from_new = (~from_parent) & (k < added[:, None])
    pieces = []
    if table.shape[1] > 0:
        pieces.append(xp.take_along_axis(parent_table, xp.clip(t, 0, table.shape[1] - 1), axis=1))
    else:
        pieces.append(xp.full((parent_table.shape[0], width), NO_SLOT, dtype=np.int32))
    if num_new > 0:
        pieces.append(xp.take_along_axis(child_new, xp.clip(k, 0, num_new - 1), axis=1))
    else:
        pieces.append(xp.full((parent_table.shape[0], width), NO_SLOT, dtype=np.int32))
    new_table = xp.where(from_parent, pieces[0], xp.where(from_new, pieces[1], NO_SLOT)).astype(np.int32)
    return StateHistory(table=new_table, lengths=(parent_length + added).astype(np.int32)), width


def _extend_compiled(histories: StateHistory, new_slots, parents, append):
    """``_extend_on_host`` as one compiled loop (``host_jit.extend``)."""
    host_jit = compiled_loops()
    table = np.ascontiguousarray(histories.table, dtype=np.int32)
    new_slots = np.ascontiguousarray(new_slots, dtype=np.int32)
    width = table.shape[1] + new_slots.shape[1]
    children = np.empty((parents.shape[0], width), dtype=np.int32)
    lengths = np.empty(parents.shape[0], dtype=np.int32)
    has_append = append is not None
    append = np.ascontiguousarray(append, dtype=bool) if has_append else np.ones(1, dtype=bool)
    host_jit.extend(table, np.asarray(histories.lengths, dtype=np.int32), new_slots, parents, append, has_append,
                    children, lengths)
    return StateHistory(table=children, lengths=lengths), width


def _compacted(extended: StateHistory, compact_width: int, keep_first: bool) -> StateHistory:
    """``extended`` cut to each row's window of ``compact_width`` (merges exactly the same)."""
    xp = get_array_module(extended.table)
    new_table = extended.table
    slots, kept = window_table(extended, compact_width, compact_width, keep_first)
    # window_table right-aligns; histories are left-aligned: shift each row left by its padding.
    shift = (compact_width - kept)[:, None]
    j = xp.arange(compact_width, dtype=np.int32)[None, :]
    if compact_width == 0:
        return StateHistory(table=xp.zeros((new_table.shape[0], 0), dtype=np.int32), lengths=kept)
    left = xp.take_along_axis(slots, xp.clip(j + shift, 0, compact_width - 1), axis=1)
    left = xp.where(j < kept[:, None], left, NO_SLOT).astype(np.int32)
    return StateHistory(table=xp.ascontiguousarray(left), lengths=kept)


def select_histories(histories: StateHistory, rows) -> StateHistory:
    """The histories of ``rows`` (a gather; no new slots)."""
    xp = get_array_module(histories.table, rows)
    rows = xp.asarray(rows).astype(np.int64, copy=False)
    return StateHistory(table=xp.ascontiguousarray(histories.table[rows]), lengths=histories.lengths[rows])
