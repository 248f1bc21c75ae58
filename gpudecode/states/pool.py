"""The state pool: slots for token states, grown in chunks, reference-marked in bulk.

A small allocator that does no compute beyond bookkeeping (like vLLM's block pool, in our words:
slot, chunk). Per state variable it holds one **slab** per chunk, an array
``[slots_per_chunk, *token_shape]`` of the storage dtype; slot ``s`` is row
``s % slots_per_chunk`` of chunk ``s // slots_per_chunk`` of every variable's slab. Memory is
added a whole chunk at a time and returned only by :meth:`StatePool.close`.

Bookkeeping lives where the data lives (numpy on the host, CuPy on the device) so that no step
synchronises with the host:

- ``free_stack [capacity]`` int32 + ``counters[0]`` (number free): allocation pops from the top
  (:meth:`allocate`, one kernel on the GPU);
- ``allocated [capacity]`` and ``marks [capacity]`` uint8: :meth:`mark` sets the mark of every slot
  inside the window of a live history (the reference count, as "count > 0"), :meth:`sweep` pushes
  every allocated, unmarked slot back on the free stack and clears the marks — so the slots of
  pruned branches and the slots that left every ``max_history`` window are free again within the
  step (:meth:`retain` = mark + sweep).

The host keeps only an upper bound of the live slots: the live count after the last sweep (copied
to pinned host memory asynchronously, read once that copy has landed) plus the slots allocated
since. It reads the true count (one sync) only when that bound would exceed the capacity, and then
grows by whole chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpudecode.states.compiled import compiled_loops
from gpudecode.states.history import StateHistory, effective_max_history, window_mask

_FREE, _PEAK, _OVERFLOW = 0, 1, 2
_THREADS = 256


@dataclass(frozen=True)
class PoolStatistics:
    """Pool figures at one moment (reading them synchronises with the device)."""

    capacity_slots: int
    live_slots: int
    peak_live_slots: int
    num_chunks: int
    slots_per_chunk: int
    bytes_per_slot: int
    slab_bytes: int  # capacity_slots * bytes_per_slot
    bookkeeping_bytes: int

    @property
    def bytes(self) -> int:
        return self.slab_bytes + self.bookkeeping_bytes


class StatePool:
    """Slots for the token states of ``len(token_shapes)`` state variables.

    ``token_shapes[v]`` / ``dtypes[v]``: shape and storage dtype of one token state of variable v.
    ``device``: ``"cpu"`` (numpy) or ``"cuda"`` (CuPy, on the shared stream of ``device_id``).
    """

    def __init__(
        self,
        token_shapes: Sequence[tuple[int, ...]],
        dtypes: Sequence[np.dtype],
        *,
        slots_per_chunk: int,
        device: str = "cpu",
        device_id: int = 0,
    ):
        if len(token_shapes) != len(dtypes) or not token_shapes:
            raise ValueError(
                f"state pool: expected one dtype per token shape and at least one variable, got "
                f"{len(token_shapes)} shapes and {len(dtypes)} dtypes"
            )
        if int(slots_per_chunk) <= 0:
            raise ValueError(f"state pool: slots_per_chunk must be positive, got {slots_per_chunk}")
        self.token_shapes = [tuple(int(d) for d in shape) for shape in token_shapes]
        self.dtypes = [np.dtype(d) for d in dtypes]
        self.slots_per_chunk = int(slots_per_chunk)
        self.device = device
        self.device_id = device_id
        if device == "cpu":
            self.xp = np
            self._cupy = None
        elif device == "cuda":
            from gpudecode.backend import require_cupy

            self._cupy = require_cupy()
            self.xp = self._cupy
        else:
            raise ValueError(f"state pool: unknown device {device!r}; valid: 'cpu', 'cuda'")
        xp = self.xp
        with self._on_device():
            self.slabs: list[list] = [[] for _ in self.token_shapes]
            self.free_stack = xp.zeros(0, dtype=np.int32)
            self.allocated = xp.zeros(0, dtype=np.uint8)
            self.marks = xp.zeros(0, dtype=np.uint8)
            self.counters = xp.zeros(4, dtype=np.int32)
            # device table of slab addresses [num_variables, chunk_stride] (CUDA only)
            self.chunk_stride = 0
            self.slab_table = xp.zeros((len(self.token_shapes), 0), dtype=np.uint64)
        self._host_slab_table = np.zeros((len(self.token_shapes), 0), dtype=np.uint64)
        self.num_chunks = 0
        self._live_bound = 0
        self._allocated_total = 0  # slots handed out so far (host count, upper bound per call)
        self._snapshot = None  # (event, pinned counters, capacity, allocated_total) after a sweep
        self._closed = False
        self.generation = 0  # bumped whenever chunks are added (the slab table changes)

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.num_chunks * self.slots_per_chunk

    @property
    def bytes_per_slot(self) -> int:
        return sum(
            int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            for shape, dtype in zip(self.token_shapes, self.dtypes)
        )

    def slot_location(self, slots):
        """``(chunk, row)`` arrays of slot ids."""
        return slots // self.slots_per_chunk, slots % self.slots_per_chunk

    # ---- growth -----------------------------------------------------------------------------------
    def _on_device(self):
        if self._cupy is None:
            import contextlib

            return contextlib.nullcontext()
        from gpudecode.backend import on_shared_stream

        return on_shared_stream(self.device_id)

    def _read_counters(self) -> np.ndarray:
        if self._cupy is None:
            return self.counters.copy()
        from gpudecode.backend import shared_stream

        return self.counters.get(stream=shared_stream(self.device_id))

    def live_slots(self) -> int:
        """The true number of live slots (synchronises with the device)."""
        self._check_open()
        live = self.capacity - int(self._read_counters()[_FREE])
        self._live_bound = live
        return live

    def _refresh_bound(self) -> None:
        """Tightens the live bound from the last sweep's counters if their copy has landed."""
        if self._snapshot is None:
            return
        event, counters, capacity, allocated_total = self._snapshot
        if not event.done:
            return
        live_at_sweep = capacity - int(counters[_FREE])
        self._live_bound = min(self._live_bound, live_at_sweep + self._allocated_total - allocated_total)
        self._snapshot = None

    def reserve(self, num_slots: int) -> None:
        """Makes sure ``num_slots`` more slots can be allocated without growing (may synchronise)."""
        self._check_open()
        if self._live_bound + num_slots <= self.capacity:
            return
        self._refresh_bound()
        if self._live_bound + num_slots <= self.capacity:
            return
        if self._snapshot is not None:  # the last sweep's counters are on their way: wait for them
            from gpudecode.backend import wait_for  # (one step back), not for all the work queued since

            wait_for(self._snapshot[0])
            self._refresh_bound()
            if self._live_bound + num_slots <= self.capacity:
                return
        live = self.live_slots()
        missing = live + num_slots - self.capacity
        if missing > 0:
            self._add_chunks(math.ceil(missing / self.slots_per_chunk))

    def _add_chunks(self, count: int) -> None:
        xp = self.xp
        old_capacity = self.capacity
        num_free = int(self._read_counters()[_FREE])
        new_capacity = old_capacity + count * self.slots_per_chunk
        with self._on_device():
            for v, (shape, dtype) in enumerate(zip(self.token_shapes, self.dtypes)):
                for _ in range(count):
                    self.slabs[v].append(xp.zeros((self.slots_per_chunk, *shape), dtype=dtype))
            stack = xp.zeros(new_capacity, dtype=np.int32)
            stack[:num_free] = self.free_stack[:num_free]
            # new slots on top, the lowest id topmost (popped first)
            stack[num_free : num_free + new_capacity - old_capacity] = xp.arange(
                new_capacity - 1, old_capacity - 1, -1, dtype=np.int32
            )
            self.free_stack = stack
            allocated = xp.zeros(new_capacity, dtype=np.uint8)
            allocated[:old_capacity] = self.allocated
            self.allocated = allocated
            marks = xp.zeros(new_capacity, dtype=np.uint8)
            marks[:old_capacity] = self.marks
            self.marks = marks
            self.counters[_FREE] = num_free + new_capacity - old_capacity
            self.num_chunks += count
            if self._cupy is not None:
                if self.num_chunks > self.chunk_stride:
                    self.chunk_stride = max(self.num_chunks, 2 * self.chunk_stride, 4)
                    table = np.zeros((len(self.token_shapes), self.chunk_stride), dtype=np.uint64)
                    table[:, : self._host_slab_table.shape[1]] = self._host_slab_table
                    self._host_slab_table = table
                for v in range(len(self.token_shapes)):
                    for c in range(self.num_chunks - count, self.num_chunks):
                        self._host_slab_table[v, c] = self.slabs[v][c].data.ptr
                self.slab_table = xp.asarray(self._host_slab_table)
        self.generation += 1

    # ---- allocation -------------------------------------------------------------------------------
    def allocate(self, num_rows: int, max_tokens: int, token_counts=None, *, compiled: bool = False):
        """New slots: ``[num_rows, max_tokens]`` int32, row b gets ``token_counts[b]`` (default all
        ``max_tokens``) slots, -1 beyond. ``token_counts`` may be a host or device array; with a
        host array the bound the pool tracks is exact. ``compiled`` (host pool): one compiled loop
        (:mod:`gpudecode.states.compiled`)."""
        if compiled and token_counts is None and self._cupy is None:  # a host step's case, in short
            self._book(num_rows * max_tokens)
            new_slots = np.empty((num_rows, max_tokens), dtype=np.int32)
            if num_rows and max_tokens:
                self._allocate_compiled(num_rows, max_tokens, None, new_slots)
            return new_slots
        xp = self.xp
        if token_counts is not None and not isinstance(token_counts, np.ndarray):
            need = num_rows * max_tokens  # a device array: count the upper bound
        elif token_counts is not None:
            need = int(np.clip(token_counts, 0, max_tokens).sum())
        else:
            need = num_rows * max_tokens
        self._book(need)
        with self._on_device():
            new_slots = xp.empty((num_rows, max_tokens), dtype=np.int32)
            if token_counts is not None:
                token_counts = xp.ascontiguousarray(xp.asarray(token_counts, dtype=np.int32))
            if num_rows == 0 or max_tokens == 0:
                return new_slots
            if self._cupy is None and compiled:
                self._allocate_compiled(num_rows, max_tokens, token_counts, new_slots)
            elif self._cupy is None:
                self._allocate_numpy(num_rows, max_tokens, token_counts, new_slots)
            elif token_counts is None:
                total = num_rows * max_tokens
                grid = min(math.ceil(total / _THREADS), 4096)
                _pool_kernel("allocate_uniform", self.device_id)(
                    (grid,), (_THREADS,), (np.int32(total), self.free_stack, self.counters, self.allocated, new_slots)
                )
                _pool_kernel("finish_allocation", self.device_id)(
                    (1,), (1,), (np.int32(total), self.counters, np.int32(self.capacity))
                )
            else:
                kernel = _pool_kernel("allocate_slots", self.device_id)
                kernel(
                    (1,), (1024,),
                    (
                        token_counts, np.int32(num_rows), np.int32(max_tokens), self.free_stack,
                        self.counters, np.int32(self.capacity), self.allocated, new_slots,
                    ),
                )
        return new_slots

    def book_uniform(self, num_rows: int, max_tokens: int):
        """Like ``allocate`` with every row getting ``max_tokens`` slots, but without the kernel:
        the caller's kernel takes them from the free stack itself (the split fuses the
        allocation, see ``kernels/state_copy.cu``). Returns the ``[num_rows, max_tokens]`` int32
        array that kernel fills. CUDA only."""
        if self._cupy is None:
            raise RuntimeError("state pool: book_uniform is for the CUDA pool")
        self._book(num_rows * max_tokens)
        with self._on_device():
            return self.xp.empty((num_rows, max_tokens), dtype=np.int32)

    def _book(self, need: int) -> None:
        """Host bookkeeping of an allocation of at most ``need`` slots (grows the pool if needed)."""
        self._check_open()
        self.reserve(need)
        self._live_bound += need
        self._allocated_total += need

    def _allocate_compiled(self, num_rows, max_tokens, token_counts, new_slots) -> None:
        """:meth:`_allocate_numpy` as one compiled loop (``host_jit.allocate``)."""
        host_jit = compiled_loops()
        counts = np.full(num_rows, max_tokens, dtype=np.int32) if token_counts is None else token_counts
        remaining, overflow = host_jit.allocate(counts, max_tokens, self.free_stack, int(self.counters[_FREE]),
                                                self.allocated, new_slots)
        if overflow:
            self.counters[_OVERFLOW] = 1
        self.counters[_FREE] = remaining
        self.counters[_PEAK] = max(int(self.counters[_PEAK]), self.capacity - remaining)

    def _allocate_numpy(self, num_rows, max_tokens, token_counts, new_slots) -> None:
        counts = (
            np.full(num_rows, max_tokens, dtype=np.int64)
            if token_counts is None
            else np.clip(token_counts.astype(np.int64), 0, max_tokens)
        )
        offsets = np.cumsum(counts) - counts
        p = np.arange(max_tokens)[None, :]
        valid = p < counts[:, None]
        num_free = int(self.counters[_FREE])
        position = num_free - 1 - (offsets[:, None] + p)
        if (position[valid] < 0).any():
            self.counters[_OVERFLOW] = 1
            valid &= position >= 0
        slots = np.where(valid, self.free_stack[np.clip(position, 0, None)], -1).astype(np.int32)
        new_slots[...] = slots
        self.allocated[slots[valid]] = 1
        remaining = max(num_free - int(counts.sum()), 0)
        self.counters[_FREE] = remaining
        self.counters[_PEAK] = max(int(self.counters[_PEAK]), self.capacity - remaining)

    # ---- reference marking ------------------------------------------------------------------------
    def mark(self, histories: StateHistory, *, max_history: int | None = None, keep_first: bool = False,
             compiled: bool = False) -> None:
        """Marks the slots inside the windows of ``histories`` as referenced (until the next sweep).
        ``compiled`` (host pool): one compiled loop (:mod:`gpudecode.states.compiled`)."""
        self._check_open()
        histories.validate()
        limit = effective_max_history(max_history)
        num_rows, width = histories.table.shape
        if num_rows == 0 or width == 0 or self.capacity == 0:
            return
        if self._cupy is None and compiled:
            host_jit = compiled_loops()
            host_jit.mark(histories.table, histories.lengths, limit, bool(keep_first), self.marks, self.capacity)
            return
        if self._cupy is None:
            inside = window_mask(histories, limit, keep_first)
            slots = histories.table[inside]
            slots = slots[(slots >= 0) & (slots < self.capacity)]
            self.marks[slots] = 1
            return
        with self._on_device():
            table = self.xp.ascontiguousarray(histories.table)
            lengths = self.xp.ascontiguousarray(histories.lengths)
            total = num_rows * width
            grid = min(math.ceil(total / _THREADS), 4096)
            _pool_kernel("mark_slots", self.device_id)(
                (grid,), (_THREADS,),
                (
                    table, np.int32(width), lengths, np.int32(num_rows), np.int32(limit),
                    np.int32(bool(keep_first)), self.marks, np.int32(self.capacity),
                ),
            )

    def sweep(self, *, compiled: bool = False) -> None:
        """Frees every allocated slot that no :meth:`mark` since the last sweep referenced.
        ``compiled`` (host pool): one compiled loop (:mod:`gpudecode.states.compiled`)."""
        self._check_open()
        if self.capacity == 0:
            return
        if self._cupy is None and compiled:
            host_jit = compiled_loops()
            self.counters[_FREE] = host_jit.sweep(self.allocated, self.marks, self.free_stack, int(self.counters[_FREE]))
            self._live_bound = self.capacity - int(self.counters[_FREE])
            return
        if self._cupy is None:
            released = np.flatnonzero((self.allocated == 1) & (self.marks == 0)).astype(np.int32)
            num_free = int(self.counters[_FREE])
            self.free_stack[num_free : num_free + released.size] = released
            self.counters[_FREE] = num_free + released.size
            self.allocated[released] = 0
            self.marks[:] = 0
            self._live_bound = self.capacity - int(self.counters[_FREE])
            return
        with self._on_device():
            grid = min(math.ceil(self.capacity / _THREADS), 4096)
            _pool_kernel("sweep_slots", self.device_id)(
                (grid,), (_THREADS,),
                (self.marks, self.allocated, self.free_stack, self.counters, np.int32(self.capacity)),
            )
            self._snapshot_counters()

    def _snapshot_counters(self) -> None:
        """Queues a copy of the counters to pinned host memory (read later by ``_refresh_bound``)."""
        from gpudecode.backend import shared_stream

        cupy = self._cupy
        stream = shared_stream(self.device_id)
        if stream.is_capturing():
            return  # inside a CUDA graph capture: no event queries, no extra nodes
        if self._snapshot is not None and not self._snapshot[0].done:
            return  # the previous copy is still in flight; its buffer must not be reused yet
        if getattr(self, "_pinned_counters", None) is None:
            memory = cupy.cuda.alloc_pinned_memory(self.counters.nbytes)
            self._pinned_counters = np.frombuffer(memory, np.int32, self.counters.size)
            self._pinned_memory = memory
        self._pinned_counters[...] = -1
        cupy.cuda.runtime.memcpyAsync(
            self._pinned_counters.ctypes.data, self.counters.data.ptr, self.counters.nbytes,
            cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr,
        )
        self._snapshot = (stream.record(), self._pinned_counters, self.capacity, self._allocated_total)

    def retain(self, *histories: StateHistory, max_history: int | None = None, keep_first: bool = False) -> None:
        """Keeps exactly the slots inside the windows of ``histories`` and frees all others."""
        for h in histories:
            self.mark(h, max_history=max_history, keep_first=keep_first)
        self.sweep()

    def release_all(self) -> None:
        """Frees every slot (chunks stay allocated)."""
        self.sweep()

    # ---- statistics & benchmarks ------------------------------------------------------------------
    def statistics(self) -> PoolStatistics:
        """Capacity, live and peak live slots, bytes (synchronises with the device)."""
        counters = self._read_counters()
        if counters[_OVERFLOW]:
            raise AssertionError("state pool: an allocation overran the free list (a bug in the pool's bound)")
        live = self.capacity - int(counters[_FREE])
        self._live_bound = live
        bookkeeping = self.capacity * (4 + 1 + 1) + self.counters.nbytes + self._host_slab_table.nbytes
        return PoolStatistics(
            capacity_slots=self.capacity,
            live_slots=live,
            peak_live_slots=int(counters[_PEAK]),
            num_chunks=self.num_chunks,
            slots_per_chunk=self.slots_per_chunk,
            bytes_per_slot=self.bytes_per_slot,
            slab_bytes=self.capacity * self.bytes_per_slot,
            bookkeeping_bytes=int(bookkeeping),
        )

    def shuffle_free_slots(self, seed: int = 0) -> None:
        """Permutes the free list so that later allocations scatter over the pool (benchmarks and
        tests of a fragmented pool)."""
        self._check_open()
        num_free = int(self._read_counters()[_FREE])
        order = np.random.default_rng(seed).permutation(num_free)
        with self._on_device():
            self.free_stack[:num_free] = self.free_stack[:num_free][self.xp.asarray(order)]

    def close(self) -> None:
        """Returns the slabs' memory; the pool cannot be used afterwards."""
        self.slabs = [[] for _ in self.token_shapes]
        self.free_stack = self.allocated = self.marks = None
        self.slab_table = None
        self.num_chunks = 0
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("state pool: used after close()")


def _pool_kernel(name: str, device_id: int):
    from gpudecode.kernels import kernel_function

    return kernel_function("state_pool", name, device_id)
