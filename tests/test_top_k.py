"""kernels/top_k.cu (``top_k_indices`` on CuPy for k <= 32) against the numpy path (GPU): every k,
rows within one segment and rows of several segments, ties, NaN, -inf and signed zeros."""

import numpy as np
import pytest

from gpudecode.search import top_k_indices, topk

pytestmark = pytest.mark.gpu

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
