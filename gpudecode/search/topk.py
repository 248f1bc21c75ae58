"""Deterministic top-k that selects identically on numpy and CuPy."""

from __future__ import annotations

import numpy as np

from gpudecode.backend import get_array_module
from gpudecode.sizes import next_power_of_two

# On CuPy, k up to this many columns are selected by kernels/top_k.cu (no sort): one launch for
# rows of at most _TOP_K_SEGMENT columns, two for longer rows (the best k of each segment, then of
# those); larger k sort. Rows at least _FLAT_SORT_MIN_COLUMNS long are sorted as one flat radix
# sort of (row, key) — about 3× faster than the row-wise sort at 64 × 80k on an H200.
_KERNEL_MAX_K = 32
_FLAT_SORT_MIN_COLUMNS = 16384
_TOP_K_THREADS = 256  # TOP_K_THREADS of kernels/top_k.cu
_TOP_K_SEGMENT = 4096  # TOP_K_SEGMENT of kernels/top_k.cu
# On numpy, rows of at least _SELECT_MIN_COLUMNS columns with k at most _SELECT_MAX_FRACTION of
# them are selected (:func:`_top_k_select`: a partition, then a sort of the k survivors only);
# shorter rows and larger k sort the whole row (numpy's stable sort of a short row is as fast).
_SELECT_MIN_COLUMNS = 96
_SELECT_MAX_FRACTION = 1 / 3


def top_k_indices(keys, k: int, *, load_module=None):
    """[R, k] int64: per row of ``keys`` [R, M] float32, the columns of the k largest keys,
    best first.

    Equal keys keep column order (lower column first) — the searches' tie-break when columns are
    laid out lane-major, then label. NaN ranks like -inf; -0.0 equals +0.0. Implemented with
    stable sorts, which numpy (``kind="stable"``) and CuPy (always stable) agree on; on numpy
    with a partial selection for small k (the same result: :func:`_top_k_select`).
    ``load_module``: how the CuPy kernels are loaded (None: :func:`gpudecode.kernels.load_module`).
    """
    xp = get_array_module(keys)
    if keys.ndim != 2 or not 1 <= k <= keys.shape[1]:
        raise ValueError(f"top_k_indices: expected keys [R, M] with 1 <= k <= M, got shape "
                         f"{tuple(keys.shape)} and k={k}")
    if xp is not np and k <= _KERNEL_MAX_K:
        return _top_k_kernel(keys, k, load_module)
    if xp is not np and keys.shape[1] >= _FLAT_SORT_MIN_COLUMNS:
        return _top_k_flat(keys, k)
    if xp is np and _numpy_selects(keys.shape[1], k):
        return _top_k_select(keys, k)
    return _top_k_rows(keys, k)


def _numpy_selects(num_cols: int, k: int) -> bool:
    """Whether numpy's top-k of ``num_cols`` columns selects (:func:`_top_k_select`) or sorts."""
    return num_cols >= _SELECT_MIN_COLUMNS and k <= _SELECT_MAX_FRACTION * num_cols


def _top_k_kernel(keys, k: int, load_module=None):
    """kernels/top_k.cu on the current stream, no host synchronisation: ``top_k_rows_<KEPT>``, or
    for rows longer than one segment ``top_k_segments_<KEPT>`` then ``top_k_merge_<KEPT>``."""
    if load_module is None:
        from gpudecode.kernels import load_module

    xp = get_array_module(keys)
    keys = xp.ascontiguousarray(keys, dtype=np.float32)
    num_rows, num_cols = keys.shape
    out = xp.empty((num_rows, k), dtype=np.int64)
    if not num_rows:
        return out
    kept = next_power_of_two(k)  # the per-thread list
    module = load_module("top_k", (), keys.device.id)
    block = (_TOP_K_THREADS,)
    if num_cols <= _TOP_K_SEGMENT:
        module.get_function(f"top_k_rows_{kept}")(
            (num_rows,), block, (keys, np.int64(num_cols), np.int32(num_cols), np.int32(k), out))
        return out
    segments = -(-num_cols // _TOP_K_SEGMENT)
    candidates = xp.empty((num_rows, segments * k), dtype=np.uint64)  # [R, S, k] packed
    module.get_function(f"top_k_segments_{kept}")(
        (num_rows * segments,), block,
        (keys, np.int64(num_cols), np.int32(num_cols), np.int32(segments), np.int32(k), candidates))
    module.get_function(f"top_k_merge_{kept}")(
        (num_rows,), block, (candidates, np.int32(segments * k), np.int32(k), out))
    return out


def _clean(keys):
    """float32 keys with -0.0 folded into +0.0 (a radix sort would order them) and NaN -> -inf."""
    xp = get_array_module(keys)
    keys = keys.astype(np.float32, copy=False) + np.float32(0)
    return xp.where(xp.isnan(keys), np.float32(-np.inf), keys)


def _top_k_rows(keys, k: int):
    """Row-wise stable argsort of the negated keys."""
    xp = get_array_module(keys)
    negated = -_clean(keys) + np.float32(0)
    if xp is np:
        order = np.argsort(negated, axis=1, kind="stable")
    else:
        order = xp.argsort(negated, axis=1)  # CuPy's sort is stable
    return order[:, :k].astype(np.int64, copy=False)


def _top_k_flat(keys, k: int):
    """One flat stable sort of uint64 (row << 32 | descending-order bits of the key)."""
    xp = get_array_module(keys)
    num_rows, num_cols = keys.shape
    bits = _clean(keys).view(np.uint32)
    # order-preserving map float32 -> uint32 (ascending), then flipped for descending
    ascending = xp.where(bits >> np.uint32(31) != 0, ~bits, bits | np.uint32(0x80000000))
    flat = ((xp.arange(num_rows, dtype=np.uint64)[:, None] << np.uint64(32))
            | (~ascending).astype(np.uint64)).reshape(-1)
    order = (np.argsort(flat, kind="stable") if xp is np else xp.argsort(flat))
    order = order.reshape(num_rows, num_cols)[:, :k].astype(np.int64, copy=False)
    return order - xp.arange(num_rows, dtype=np.int64)[:, None] * num_cols


def _top_k_select(keys: np.ndarray, k: int) -> np.ndarray:
    """numpy, exactly :func:`_top_k_rows` without sorting whole rows: per row the k-th largest
    cleaned key ``t`` (``np.partition``), the columns of keys > t and the lowest columns of keys
    == t (as many as make k), in column order, then a stable sort of those k by key."""
    num_rows, num_cols = keys.shape
    if not num_rows:
        return np.empty((0, k), dtype=np.int64)
    # _clean on numpy: fmax turns NaN into -inf, + 0 folds -0.0 into +0.0
    clean = np.fmax(keys.astype(np.float32, copy=False), np.float32(-np.inf)) + np.float32(0)
    threshold = np.partition(clean, num_cols - k, axis=1)[:, num_cols - k:num_cols - k + 1]
    kept = clean >= threshold  # at least k per row; more where keys equal to t are left over
    tied = np.nonzero(np.count_nonzero(kept, axis=1) != k)[0]
    if len(tied):
        rows, bound = clean[tied], threshold[tied]
        above = rows > bound
        equal = rows == bound
        wanted = k - np.count_nonzero(above, axis=1)[:, None]
        kept[tied] = above | (equal & (np.cumsum(equal, axis=1) <= wanted))
    columns = (np.flatnonzero(kept).reshape(num_rows, k)
               - np.arange(num_rows, dtype=np.int64)[:, None] * num_cols)  # ascending per row
    negated = -np.take_along_axis(clean, columns, axis=1) + np.float32(0)
    order = np.argsort(negated, axis=1, kind="stable")  # equal keys stay in column order
    return np.take_along_axis(columns, order, axis=1)
