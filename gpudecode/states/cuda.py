"""Launchers of ``kernels/state_copy.cu``: merge and split of all state variables in one launch.

Static per-variable geometry is uploaded once (a device table); the pool's slab-address table is
re-uploaded by the pool only when it grows; the tensor addresses of a launch travel by value in the
kernel's parameters. So a merge or split issues no host-to-device copy and a constant number of
launches, whatever the number of hypotheses, tokens or state variables.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from gpudecode.backend import on_shared_stream, require_cupy
from gpudecode.states.history import StateHistory
from gpudecode.states.layout import VariableLayout
from gpudecode.states.pool import StatePool

MAX_STATE_VARIABLES = 128  # kernels/state_copy.cu
WARPS_PER_BLOCK = 8
THREADS_PER_BLOCK = 32 * WARPS_PER_BLOCK
RESIDENT_BLOCKS_PER_SM = 3  # __launch_bounds__(256, MIN_BLOCKS_PER_SM): the guaranteed residency

DTYPE_OTHER, DTYPE_FLOAT32, DTYPE_FLOAT16, DTYPE_BFLOAT16 = 0, 1, 2, 3
_CONVERSIONS = {
    (DTYPE_FLOAT16, DTYPE_FLOAT32),
    (DTYPE_FLOAT32, DTYPE_FLOAT16),
    (DTYPE_BFLOAT16, DTYPE_FLOAT32),
    (DTYPE_FLOAT32, DTYPE_BFLOAT16),
}
_POINTERS = np.dtype([("ptr", np.uint64, (MAX_STATE_VARIABLES,))])


def dtype_code(dtype) -> int:
    """The kernels' code of a dtype (one helper, as CuPy's ``_get_typename``)."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return DTYPE_FLOAT32
    if dtype == np.float16:
        return DTYPE_FLOAT16
    if dtype.name == "bfloat16":
        return DTYPE_BFLOAT16
    return DTYPE_OTHER


def check_copyable(layout: VariableLayout) -> None:
    """Raises ValueError where the kernels cannot convert between the model and storage dtypes."""
    model, storage = layout.model_dtype, layout.storage_dtype
    if model == storage:
        if model.itemsize not in (1, 2, 4, 8):
            raise ValueError(f"state variable {layout.name!r}: dtype {model} has an unsupported item size")
        return
    if (dtype_code(storage), dtype_code(model)) not in _CONVERSIONS:
        raise ValueError(
            f"state variable {layout.name!r}: cannot store {model} states as {storage} on the GPU; "
            "supported: the model's dtype, float16 or bfloat16 for float32 models, float32 for float16/bfloat16 models"
        )


@functools.cache
def _num_sms(device_id: int) -> int:
    cupy = require_cupy()
    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _kernel(name: str, device_id: int):
    from gpudecode.kernels import kernel_function

    return kernel_function("state_copy", name, device_id)


def _resident_blocks(kernel, device_id: int) -> int:
    """Blocks of ``kernel`` resident per SM (the occupancy API; the launch bounds' minimum if absent)."""
    try:
        from cupy.cuda import driver

        with require_cupy().cuda.Device(device_id):
            blocks = int(driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.ptr, THREADS_PER_BLOCK, 0))
        if blocks > 0:
            return blocks
    except Exception:  # noqa: BLE001 - an older CuPy without the occupancy call
        pass
    return RESIDENT_BLOCKS_PER_SM


class CudaStateCopy:
    """Merge and split on CuPy arrays for the variables ``layouts`` stored in ``pool``."""

    allocates = True  # split(allocate=True) takes uniform allocations from the free stack itself

    def __init__(self, layouts: Sequence[VariableLayout], pool: StatePool, *, device_id: int = 0):
        if len(layouts) > MAX_STATE_VARIABLES:
            raise ValueError(
                f"the CUDA state kernels take at most {MAX_STATE_VARIABLES} state variables, got {len(layouts)}"
            )
        for layout in layouts:
            check_copyable(layout)
        self.cupy = require_cupy()
        self.layouts = list(layouts)
        self.pool = pool
        self.device_id = device_id
        geometry = np.zeros((len(layouts), 8), dtype=np.int64)
        for v, layout in enumerate(layouts):
            geometry[v] = (
                layout.pre, layout.mid, layout.inner, layout.token_size,
                dtype_code(layout.storage_dtype), dtype_code(layout.model_dtype),
                layout.storage_dtype.itemsize, layout.model_dtype.itemsize,
            )
        with on_shared_stream(device_id):
            self.geometry = self.cupy.asarray(geometry)  # uploaded once
        self._pointers = np.zeros(1, dtype=_POINTERS)
        self._merge = _kernel("merge_states", device_id)
        self._split = _kernel("split_states", device_id)
        self._copy_steps = None  # copy_steps, loaded with the first resident step
        self._copy_steps_args = None  # (buffers and sizes, grid, the launch's arguments but the positions)
        # one resident wave: each warp takes an equal contiguous share of the (variable, token) copies
        self._full_grid = {
            "merge": _num_sms(device_id) * _resident_blocks(self._merge, device_id),
            "split": _num_sms(device_id) * _resident_blocks(self._split, device_id),
        }
        self.num_launches = 0  # kernel launches issued (for tests and benchmarks)

    def _grid(self, kind: str, num_tokens: int, min_blocks: int = 1) -> tuple[int]:
        """A 1-D grid: the resident blocks of the device, fewer when there are fewer token copies
        (one warp copies one token at a time) than resident warps."""
        blocks = -(-num_tokens * len(self.layouts) // WARPS_PER_BLOCK)
        return (max(1, min_blocks, min(blocks, self._full_grid[kind])),)

    def _pointer_struct(self, arrays) -> np.ndarray:
        pointers = self._pointers.copy()
        pointers["ptr"][0, : len(arrays)] = [a.data.ptr for a in arrays]
        return pointers

    def merge(
        self,
        histories: StateHistory,
        *,
        out_rows: int,
        time_size: int,
        max_history: int,
        keep_first: bool,
        outputs,
        prefix_lengths,
        left_aligned: bool = False,
    ) -> None:
        pool = self.pool
        grid = self._grid("merge", out_rows * time_size, min_blocks=min(-(-out_rows // THREADS_PER_BLOCK),
                                                                         self._full_grid["merge"]))
        with on_shared_stream(self.device_id):
            self._merge(
                grid, (THREADS_PER_BLOCK,),
                (
                    self.geometry, pool.slab_table, np.int32(pool.chunk_stride), np.int32(pool.slots_per_chunk),
                    np.int32(pool.capacity), self._pointer_struct(outputs),
                    histories.table, np.int32(histories.width), histories.lengths,
                    np.int32(histories.num_rows), np.int32(out_rows), np.int32(time_size),
                    np.int32(max_history), np.int32(bool(keep_first)), np.int32(bool(left_aligned)), prefix_lengths,
                    np.int32(len(self.layouts)),
                ),
            )
        self.num_launches += 1

    def split(self, sources, *, num_rows: int, source_time: int, new_slots, allocate: bool = False,
              positions=None) -> None:
        """``allocate``: ``new_slots`` is filled here with ``num_new`` slots per row from the pool's
        free stack (booked by ``StatePool.book_uniform``), the allocation fused into the copy.
        ``positions``: ``[>= num_rows]`` int32 CuPy array, C-contiguous: row b's new token p is read at
        time index ``positions[b] + p`` (clamped into ``[0, source_time - num_new]``) instead of
        ``source_time - num_new + p``, in the same launch."""
        pool = self.pool
        num_new = int(new_slots.shape[1])
        if num_rows * num_new == 0:
            return
        free_stack, counters, allocated = (pool.free_stack, pool.counters, pool.allocated) if allocate else (np.uint64(0),) * 3
        if positions is None:
            positions = np.uint64(0)
        with on_shared_stream(self.device_id):
            self._split(
                self._grid("split", num_rows * num_new), (THREADS_PER_BLOCK,),
                (
                    self.geometry, pool.slab_table, np.int32(pool.chunk_stride), np.int32(pool.slots_per_chunk),
                    np.int32(pool.capacity), self._pointer_struct(sources),
                    np.int32(num_rows), np.int32(source_time), np.int32(num_new), positions, new_slots,
                    free_stack, counters, allocated, np.int32(len(self.layouts)),
                ),
            )
        self.num_launches += 1

    def copy_steps(self, sources, targets, *, num_rows: int, rows: int, source_time: int, target_time: int,
                   positions) -> None:
        """Row b's token state at time ``positions[b]`` ([>= num_rows] int32, C-contiguous) of each
        variable's ``sources`` tensor ([.., rows, .., source_time, ..]) written at that time of its
        ``targets`` tensor ([.., rows, .., target_time, ..], same dtype), rows b < ``num_rows``, in one
        launch (``copy_steps``); positions outside both time axes are skipped."""
        if num_rows == 0:
            return
        if self._copy_steps is None:
            self._copy_steps = _kernel("copy_steps", self.device_id)
        # a resident step copies between the same buffers step after step: their launch made once
        key = (*(a.data.ptr for a in sources), *(a.data.ptr for a in targets), num_rows, rows, source_time,
               target_time)
        cached = self._copy_steps_args
        if cached is None or cached[0] != key:
            spans = max(layout.pre * layout.mid for layout in self.layouts)
            grid = (max(1, min(-(-num_rows * spans // WARPS_PER_BLOCK), self._full_grid["split"])),)
            cached = self._copy_steps_args = (key, grid, (
                self.geometry, self._pointer_struct(sources), self._pointer_struct(targets), np.int32(num_rows),
                np.int32(rows), np.int32(source_time), np.int32(target_time)))
        _, grid, args = cached
        with on_shared_stream(self.device_id):
            self._copy_steps(grid, (THREADS_PER_BLOCK,), (*args, positions, np.int32(len(self.layouts))))
        self.num_launches += 1
