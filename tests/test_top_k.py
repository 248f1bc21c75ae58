"""kernels/top_k.cu (``top_k_indices`` on CuPy for k <= 32) against the numpy path (GPU): every k,
rows within one segment and rows of several segments, ties, NaN, -inf and signed zeros.
The numpy partial selection (``topk._top_k_select``) against the full stable sort it replaces
(CPU): random keys, heavy ties, ties at the k-th key, NaN, +-inf, +-0, every k shape."""

import numpy as np
import pytest

from gpudecode.search import top_k_indices, topk

SEGMENT = topk._TOP_K_SEGMENT
SHAPES = [  # (rows, columns)
    (7, 1),
    (5, 33),
    (3, 1000),                  # shorter than a segment
    (4, SEGMENT),               # exactly one segment: one launch
    (3, SEGMENT + 1),           # a remainder of one column (fewer than k): two launches
    (2, 3 * SEGMENT + 100),     # several segments and a remainder
    (64, 80_000),               # beam 8 x vocabulary 10k
    (1000, 300),                # many rows
    (130, 9000),                # many rows of three segments
]


def _keys(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "ties":  # a few values, -inf, NaN, -0.0 and +0.0
        keys = rng.integers(-2, 2, size=(rows, cols)).astype(np.float32)
        keys[rng.random(keys.shape) < 0.1] = -np.inf
        keys[rng.random(keys.shape) < 0.1] = np.nan
        zeros = rng.random(keys.shape) < 0.2
        keys[zeros] = np.where(rng.random(keys.shape) < 0.5, np.float32(-0.0), np.float32(0.0))[zeros]
        return keys
    if kind == "signed_zeros":
        return np.where(rng.random((rows, cols)) < 0.5, np.float32(-0.0), np.float32(0.0))
    if kind == "nan":
        keys = np.full((rows, cols), np.nan, np.float32)
        keys[:, ::7] = -np.inf  # equal to NaN: column order decides
        return keys
    if kind == "neg_inf":
        return np.full((rows, cols), -np.inf, np.float32)
    if kind == "clustered":  # the best keys all in a few of the kernel's threads (columns % 256 < 32)
        column = np.arange(cols)
        row = np.where(column % 256 < 32, 1000.0 - (column % 256) * 16 - column // 256, -1.0)
        return np.repeat(row[None, :], rows, axis=0).astype(np.float32)
    if kind == "ascending":
        return np.repeat(np.arange(cols, dtype=np.float32)[None, :], rows, axis=0)
    raise AssertionError(kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["normal", "ties", "signed_zeros", "nan", "neg_inf", "clustered", "ascending"])
@pytest.mark.parametrize("rows, cols", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_kernel_matches_numpy_for_every_k(kind, rows, cols):
    import cupy

    keys = _keys(kind, rows, cols, seed=rows * 7919 + cols)
    max_k = min(cols, topk._KERNEL_MAX_K)
    expected = topk._top_k_rows(keys, max_k)  # a stable sort: top k is a prefix
    device_keys = cupy.asarray(keys)
    for k in range(1, max_k + 1):
        got = top_k_indices(device_keys, k)
        assert got.dtype == np.int64 and got.shape == (rows, k)
        got = cupy.asnumpy(got)
        assert (got == expected[:, :k]).all(), (kind, k, np.nonzero((got != expected[:, :k]).any(1))[0][:5])


@pytest.mark.gpu
@pytest.mark.parametrize("k", [17, 31, 32])
def test_merge_of_many_segments(k):
    """More candidates than the merge launch reads at once (segments * k > one segment)."""
    import cupy

    cols = 130 * SEGMENT + 7
    rng = np.random.default_rng(k)
    for keys in (rng.standard_normal((2, cols)).astype(np.float32),
                 rng.integers(0, 3, size=(2, cols)).astype(np.float32)):
        got = cupy.asnumpy(top_k_indices(cupy.asarray(keys), k))
        assert (got == topk._top_k_rows(keys, k)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cols, launches", [(1, ["rows"]), (SEGMENT, ["rows"]), (SEGMENT + 1, ["segments", "merge"]),
                                            (80_000, ["segments", "merge"])])
def test_launches_depend_only_on_the_row_length(cols, launches):
    import cupy

    from gpudecode import kernels

    names = []
    load_module = kernels.load_module

    class Recording:
        def __init__(self, module):
            self.module = module

        def get_function(self, name):
            names.append(name)
            return self.module.get_function(name)

    recording = lambda *args: Recording(load_module(*args))  # noqa: E731
    keys = cupy.asarray(np.random.default_rng(0).standard_normal((3, cols)).astype(np.float32))
    for k, kept in ((1, 1), (3, 4), (8, 8), (9, 16), (32, 32)):
        if k > cols:
            continue
        names.clear()
        top_k_indices(keys, k, load_module=recording)
        assert names == [f"top_k_{launch}_{kept}" for launch in launches]


# ---- the numpy partial selection (CPU) ----

def _stable_sort_top_k(keys, k):
    """The oracle: numpy's top-k as it was before the partial selection — NaN -> -inf, -0.0 ->
    +0.0, a row-wise stable argsort of the negated float32 keys, its first k columns."""
    clean = keys.astype(np.float32, copy=False) + np.float32(0)
    clean = np.where(np.isnan(clean), np.float32(-np.inf), clean)
    negated = -clean + np.float32(0)
    return np.argsort(negated, axis=1, kind="stable")[:, :k].astype(np.int64, copy=False)


def _cpu_keys(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "heavy_ties":  # two values: ties everywhere, at the k-th key too
        return rng.integers(0, 2, size=(rows, cols)).astype(np.float32)
    if kind == "boundary_ties":  # a few distinct best keys, then many equal to the k-th, scattered
        keys = rng.standard_normal((rows, cols)).astype(np.float32) - np.float32(10)
        for row in keys:
            columns = rng.permutation(cols)
            best = rng.integers(0, min(4, cols))
            row[columns[:best]] = np.float32(5) + np.arange(best, dtype=np.float32)
            row[columns[best:best + rng.integers(1, cols - best + 1)]] = np.float32(1)
        return keys
    if kind == "few_finite":  # fewer finite keys than k in most rows; the rest -inf and NaN
        keys = rng.standard_normal((rows, cols)).astype(np.float32)
        keys[rng.random(keys.shape) < 0.95] = -np.inf
        keys[rng.random(keys.shape) < 0.3] = np.nan
        keys[0] = np.nan
        return keys
    if kind == "infinities":  # +inf (ties), -inf, NaN, +-0 and finite keys
        keys = rng.choice(np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, -1.0], np.float32),
                          size=(rows, cols))
        return keys
    if kind == "nan_then_neg_inf":  # NaN before -inf in column order, and the reverse
        keys = np.full((rows, cols), -np.inf, np.float32)
        keys[:, ::2] = np.nan
        keys[1::2] = keys[1::2, ::-1]
        keys[:, cols // 2] = 3.0
        return keys
    return _keys(kind, rows, cols, seed)


CPU_KINDS = ["normal", "ties", "signed_zeros", "nan", "neg_inf", "clustered", "ascending",
             "heavy_ties", "boundary_ties", "few_finite", "infinities", "nan_then_neg_inf"]
CPU_SHAPES = [(1, 1), (3, 2), (6, 7), (5, 33), (9, 96), (4, 257), (64, 2000), (16, 4000), (2, 40_000)]


def _ks(cols: int):
    return sorted({k for k in (1, 2, 3, 4, 8, 25, cols // 3, cols // 2, cols - 1, cols) if 1 <= k <= cols})


@pytest.mark.parametrize("kind", CPU_KINDS)
@pytest.mark.parametrize("rows, cols", CPU_SHAPES, ids=[f"{r}x{c}" for r, c in CPU_SHAPES])
def test_select_equals_the_stable_sort(kind, rows, cols):
    keys = _cpu_keys(kind, rows, cols, seed=rows * 7919 + cols)
    for k in _ks(cols):
        expected = _stable_sort_top_k(keys, k)
        for got in (topk._top_k_select(keys, k), top_k_indices(keys, k)):
            assert got.dtype == np.int64 and got.shape == (rows, k)
            assert (got == expected).all(), (kind, k, np.nonzero((got != expected).any(1))[0][:5])


@pytest.mark.parametrize("seed", range(20))
def test_select_equals_the_stable_sort_on_random_shapes(seed):
    rng = np.random.default_rng(seed)
    rows, cols = int(rng.integers(1, 40)), int(rng.integers(1, 700))
    levels = int(rng.integers(1, 6))
    keys = rng.integers(0, levels, size=(rows, cols)).astype(np.float32)  # ties at every k
    special = rng.random(keys.shape)
    keys[special < 0.05] = np.nan
    keys[(special >= 0.05) & (special < 0.1)] = -np.inf
    keys[(special >= 0.1) & (special < 0.12)] = np.inf
    keys[(special >= 0.12) & (special < 0.2)] = -0.0
    for k in range(1, cols + 1, max(1, cols // 17)):
        assert (topk._top_k_select(keys, k) == _stable_sort_top_k(keys, k)).all(), (seed, k)
        assert (top_k_indices(keys, k) == _stable_sort_top_k(keys, k)).all(), (seed, k)


@pytest.mark.parametrize("k", [1, 5, 300])
def test_select_without_rows(k):
    keys = np.zeros((0, 300), np.float32)
    for got in (topk._top_k_select(keys, k), top_k_indices(keys, k)):
        assert got.dtype == np.int64 and got.shape == (0, k)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_select_of_other_float_dtypes(dtype):
    """Keys are compared as float32 (float64 keys equal after rounding tie), as the sort did."""
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((32, 500)).astype(dtype)
    keys[:, 100:200] = np.float64(1.0) + np.float64(2.0 ** -40) * rng.integers(0, 3, size=(32, 100))
    keys[rng.random(keys.shape) < 0.05] = np.nan
    keys[rng.random(keys.shape) < 0.05] = -np.inf
    keys[rng.random(keys.shape) < 0.05] = -0.0
    for k in (1, 8, 25, 166, 500):
        expected = _stable_sort_top_k(keys, k)
        assert (topk._top_k_select(keys, k) == expected).all(), k
        assert (top_k_indices(keys, k) == expected).all(), k


def test_select_of_a_strided_view():
    keys = np.random.default_rng(4).integers(0, 4, size=(300, 50)).astype(np.float32).T  # [50, 300]
    for k in (1, 7, 100):
        assert (topk._top_k_select(keys, k) == _stable_sort_top_k(keys, k)).all()


@pytest.mark.parametrize("cols, k, selected", [(2000, 25, True), (8000, 8, True), (4000, 4, True),
                                               (96, 32, True), (95, 8, False), (300, 101, False),
                                               (8, 8, False)])
def test_numpy_selects_small_k_of_long_rows(cols, k, selected):
    assert topk._numpy_selects(cols, k) == selected
