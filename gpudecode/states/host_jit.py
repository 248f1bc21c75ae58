"""The numba-compiled bodies of :mod:`gpudecode.states.host_compiled` (imported only where numba
is): the host state manager's per-step bookkeeping, row by row."""

from __future__ import annotations

import numpy as np
from numba import njit

NO_SLOT = -1


@njit(cache=True)
def resident_match(table, lengths, time_size, max_history, keep_first, stamp, owner, held, stamps,
                   slots, row_stamps, kept, source, moved, fetch):
    """``ResidentStates.merge`` up to the copies: each row's left-aligned window ``slots`` [N, T]
    with their stamps ``row_stamps`` and ``kept`` [N]; ``source`` [N]: the row holding the history
    (-1: none holds it, gather it from the pool when it is not empty), read from ``held`` / ``stamps``
    before any row changes. Returns how many rows copy another row's history (listed first in
    ``moved``) and how many gather theirs from the pool (first in ``fetch``)."""
    num_rows, width = table.shape
    num_moved = num_fetch = 0
    for n in range(num_rows):
        length = min(max(lengths[n], 0), width)
        keep = min(length, max_history)
        kept[n] = keep
        for t in range(time_size):
            slot = NO_SLOT
            if t < keep and width > 0:
                position = 0 if keep_first and t == 0 else length - keep + t
                slot = table[n, min(max(position, 0), width - 1)]
            slots[n, t] = slot
            row_stamps[n, t] = stamp[max(slot, 0)] if t < keep else 0
        source[n] = -1
        if keep > 0:
            last = slots[n, keep - 1]
            candidate = owner[max(last, 0)]
            if candidate >= 0:
                same = True
                for t in range(keep):
                    if held[candidate, t] != slots[n, t] or stamps[candidate, t] != row_stamps[n, t]:
                        same = False
                        break
                if same:
                    source[n] = candidate
            if source[n] < 0:
                fetch[num_fetch] = n
                num_fetch += 1
            elif source[n] != n:
                moved[num_moved] = n
                num_moved += 1
    return num_moved, num_fetch


@njit(cache=True)
def stamped(slots, stamp, next_stamp):
    """``ResidentStates.allocated``: the slots (>= 0) of ``slots`` get stamps from ``next_stamp`` on,
    in order; returns the next unused stamp."""
    for slot in slots:
        if slot >= 0:
            stamp[slot] = next_stamp
            next_stamp += 1
    return next_stamp


@njit(cache=True, inline="always")
def _hold(n, r, slots, row_stamps, kept, held, stamps, owner):
    """Row ``r`` holds history ``n``'s window (slots and stamps, the rest of the row empty) and owns
    its last slot."""
    time_size = slots.shape[1]
    for t in range(time_size):
        held[r, t] = slots[n, t]
        stamps[r, t] = row_stamps[n, t]
    for t in range(time_size, held.shape[1]):
        held[r, t] = NO_SLOT
    if kept[n] > 0:
        owner[slots[n, kept[n] - 1]] = r


@njit(cache=True)
def resident_commit(slots, row_stamps, kept, held, stamps, owner):
    """``ResidentStates.merge`` after the copies: the rows hold their windows; the owner of each
    window's last slot is its row (the last such row where several share it)."""
    for n in range(slots.shape[0]):
        _hold(n, n, slots, row_stamps, kept, held, stamps, owner)


@njit(cache=True)
def copy_rows(buffers, rows, sources, kept):
    """For each buffer of ``buffers`` (a tuple of C-contiguous [R, mid, C, inner] arrays):
    ``buffer[rows[i], :, :kept[rows[i]]] = buffer[sources[i], :, :kept[rows[i]]]`` (a row's positions
    from its history's length on are never read), every source read before any row is written: a
    source that is also a destination is copied aside first."""
    count = rows.shape[0]
    num_rows = buffers[0].shape[0]
    written = np.zeros(num_rows, np.bool_)
    for i in range(count):
        written[rows[i]] = True
    aside = np.full(num_rows, -1, np.int64)  # row -> its copy in taken
    num_aside = 0
    for i in range(count):
        if written[sources[i]] and aside[sources[i]] < 0:
            aside[sources[i]] = num_aside
            num_aside += 1
    for buffer in buffers:
        # (C-contiguous buffers) a row's first kept positions of each mid index are one run of
        # kept * inner values: copied as such
        mid, inner = buffer.shape[1], buffer.shape[3]
        flat = buffer.reshape(num_rows, mid, buffer.shape[2] * inner)
        taken = np.empty((num_aside, mid, flat.shape[2]), buffer.dtype)
        for i in range(count):
            source = sources[i]
            at = aside[source]
            if at >= 0:
                size = kept[rows[i]] * inner
                for m in range(mid):
                    for j in range(size):
                        taken[at, m, j] = flat[source, m, j]
        for i in range(count):
            row, source = rows[i], sources[i]
            at = aside[source]
            size = kept[row] * inner
            for m in range(mid):
                if at >= 0:
                    for j in range(size):
                        flat[row, m, j] = taken[at, m, j]
                else:
                    for j in range(size):
                        flat[row, m, j] = flat[source, m, j]


@njit(cache=True)
def new_steps(buffer, kept, out):
    """``out[n] = buffer[n, :, kept[n]]`` (``buffer`` [N, mid, C, inner], ``out`` [N, mid, inner]):
    the step a model wrote at each row's length."""
    for n in range(buffer.shape[0]):
        for m in range(buffer.shape[1]):
            for k in range(buffer.shape[3]):
                out[n, m, k] = buffer[n, m, kept[n], k]


@njit(cache=True)
def written(slots, kept, stamp, held, stamps, owner):
    """``ResidentStates.written``: row r holds slot ``slots[r]`` at position ``kept[r]`` (where the
    slot is one and the position lies within the rows)."""
    for r in range(slots.shape[0]):
        slot = slots[r]
        if slot >= 0 and kept[r] < held.shape[1]:
            held[r, kept[r]] = slot
            stamps[r, kept[r]] = stamp[slot]
            owner[slot] = r


@njit(cache=True)
def extend(table, lengths, new_slots, parents, append, has_append, out_table, out_lengths):
    """``history._extend_on_host``: child c = row ``parents[c]``'s history, then that row's new
    slots (the first ``count(new_slots[p] >= 0)`` of them; none where ``append[c]`` is False).
    ``out_table`` may be narrower than the extension's width (a trimmed table: its first columns)."""
    width = table.shape[1]
    num_new = new_slots.shape[1]
    for c in range(parents.shape[0]):
        p = parents[c]
        length = min(max(lengths[p], 0), width)
        added = 0
        for s in range(num_new):
            if new_slots[p, s] >= 0:
                added += 1
        if has_append and not append[c]:
            added = 0
        for t in range(out_table.shape[1]):
            if t < length:
                out_table[c, t] = table[p, min(t, width - 1)]
            elif t - length < added:
                out_table[c, t] = new_slots[p, min(t - length, num_new - 1)]
            else:
                out_table[c, t] = NO_SLOT
        out_lengths[c] = length + added


@njit(cache=True)
def mark(table, lengths, max_history, keep_first, marks, capacity):
    """``StatePool.mark`` on the host: the slots inside each row's window are referenced."""
    num_rows, width = table.shape
    for n in range(num_rows):
        length = min(max(lengths[n], 0), width)
        keep = min(length, max_history)
        for t in range(width):
            inside = (t < length and t >= length - keep) or (keep_first and t == 0 and keep > 0)
            if inside:
                slot = table[n, t]
                if slot >= 0 and slot < capacity:
                    marks[slot] = 1


@njit(cache=True)
def sweep(allocated, marks, free_stack, num_free):
    """``StatePool.sweep`` on the host: every allocated, unmarked slot goes onto the free stack (in
    slot order); the marks are cleared. Returns the new number of free slots."""
    for slot in range(allocated.shape[0]):
        if allocated[slot] == 1 and marks[slot] == 0:
            free_stack[num_free] = slot
            num_free += 1
            allocated[slot] = 0
        marks[slot] = 0
    return num_free


@njit(cache=True)
def allocate(counts, max_tokens, free_stack, num_free, allocated, new_slots):
    """``StatePool._allocate_numpy``: row r takes ``counts[r]`` slots (at most ``max_tokens``) off the
    top of the free stack, in row order, -1 past its count. Returns (slots left free, overflowed)."""
    taken = 0
    overflow = False
    for r in range(new_slots.shape[0]):
        count = min(max(counts[r], 0), max_tokens)
        for p in range(max_tokens):
            position = num_free - 1 - (taken + p)
            if p < count and position >= 0:
                slot = free_stack[position]
                new_slots[r, p] = slot
                allocated[slot] = 1
            else:
                new_slots[r, p] = NO_SLOT
                if p < count:
                    overflow = True
        taken += count
    return max(num_free - taken, 0), overflow


@njit(cache=True)
def scatter_tokens(source, first, new_slots, slots_per_chunk, chunk, slab):
    """``HostStateCopy.split`` of one variable into one chunk (no encoding): new token p of row b
    (``source`` [pre, rows, mid, time, inner] at time ``first + p``) into row ``slot % slots_per_chunk``
    of ``slab`` [slots_per_chunk, pre · mid · inner] where its slot lies in ``chunk``."""
    pre, num_rows, mid, _, inner = source.shape
    limit = (chunk + 1) * slots_per_chunk
    for b in range(num_rows):
        for p in range(new_slots.shape[1]):
            slot = new_slots[b, p]
            if slot < chunk * slots_per_chunk or slot >= limit:
                continue
            row = slot - chunk * slots_per_chunk
            k = 0
            for a in range(pre):
                for m in range(mid):
                    for i in range(inner):
                        slab[row, k] = source[a, b, m, first + p, i]
                        k += 1


@njit(cache=True)
def scatter_resident(buffers, kept, new_slots, slots_per_chunk, chunk, slabs):
    """``split(resident_new_steps(...))``'s copies into one chunk: the step a model wrote at
    position ``kept[b]`` of row b of every buffer of ``buffers`` (a tuple of [N, mid, C, inner])
    into row ``slot % slots_per_chunk`` of the same variable's ``slabs`` entry
    ([slots_per_chunk, mid · inner]) where ``new_slots[b, 0]`` lies in ``chunk``."""
    limit = (chunk + 1) * slots_per_chunk
    for b in range(new_slots.shape[0]):
        slot = new_slots[b, 0]
        if slot < chunk * slots_per_chunk or slot >= limit:
            continue
        row = slot - chunk * slots_per_chunk
        t = kept[b]
        for v in range(len(buffers)):
            buffer = buffers[v]
            slab = slabs[v]
            inner = buffer.shape[3]
            for m in range(buffer.shape[1]):
                for i in range(inner):
                    slab[row, m * inner + i] = buffer[b, m, t, i]


@njit(cache=True)
def resident_merge(table, lengths, time_size, max_history, keep_first, stamp, owner, held, stamps, buffers,
                   slots, row_stamps, kept, source, moved, fetch):
    """``ResidentStates.merge`` in one call where the rows' buffers are copied here (one dtype):
    :func:`resident_match`, the moved rows' copies (:func:`copy_rows`) and :func:`resident_commit`.
    Returns how many rows gather their history from the pool (first in ``fetch``; the caller
    gathers them, after this call)."""
    num_moved, num_fetch = resident_match(table, lengths, time_size, max_history, keep_first, stamp, owner, held,
                                          stamps, slots, row_stamps, kept, source, moved, fetch)
    if num_moved:
        copy_rows(buffers, moved[:num_moved], source[moved[:num_moved]], kept)
    resident_commit(slots, row_stamps, kept, held, stamps, owner)
    return num_moved, num_fetch


@njit(cache=True)
def resident_merge_free(table, lengths, time_size, max_history, keep_first, stamp, owner, held, stamps, buffers,
                        slots, row_stamps, kept, source, moved, fetch, row_of, order, kept_rows):
    """:func:`resident_merge` with the rows assigned freely: history n goes to ``row_of[n]`` (row r
    holds history ``order[r]``, ``kept_rows[r]`` its kept length), the row already holding it where
    that row is among the first N and no earlier history took it, else a row no history holds (so
    only histories sharing a row, or held beyond the first N rows, are copied; a row copied into
    is never a copy's source). Returns how many histories gather theirs from the pool (first in
    ``fetch``, history indices; the caller gathers them into their rows ``row_of``)."""
    resident_match(table, lengths, time_size, max_history, keep_first, stamp, owner, held, stamps, slots,
                   row_stamps, kept, source, moved, fetch)
    num_rows = source.shape[0]
    taken = np.zeros(num_rows, np.bool_)
    for n in range(num_rows):
        row_of[n] = -1
        c = source[n]
        if c >= 0 and c < num_rows and not taken[c]:
            row_of[n] = c
            taken[c] = True
    free = 0
    for n in range(num_rows):
        if row_of[n] < 0:
            while taken[free]:
                free += 1
            row_of[n] = free
            taken[free] = True
    for n in range(num_rows):
        order[row_of[n]] = n
        kept_rows[row_of[n]] = kept[n]
    num_moved = num_fetch = 0
    sources = np.empty(num_rows, np.int64)
    for n in range(num_rows):
        if source[n] >= 0 and row_of[n] != source[n]:
            moved[num_moved] = row_of[n]
            sources[num_moved] = source[n]
            num_moved += 1
        elif source[n] < 0 and kept[n] > 0:
            fetch[num_fetch] = n
            num_fetch += 1
    if num_moved:
        copy_rows(buffers, moved[:num_moved], sources[:num_moved], kept_rows)
    for n in range(num_rows):
        _hold(n, row_of[n], slots, row_stamps, kept, held, stamps, owner)
    return num_moved, num_fetch
