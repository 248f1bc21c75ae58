"""``host_jit.copy_rows`` (the resident merge's row copies) against numpy: every source read before
any row is written (sources that are also destinations, chains and swaps), only each row's first
``kept`` positions written."""

import numpy as np
import pytest

pytest.importorskip("numba")


def test_copy_rows_equals_numpy_reads_before_writes():
    from gpudecode.states.host_jit import copy_rows

    rng = np.random.default_rng(21)
    for trial in range(300):
        rows, mid, positions, inner = int(rng.integers(1, 12)), int(rng.integers(1, 4)), int(rng.integers(1, 9)), \
            int(rng.integers(1, 6))
        buffers = tuple(rng.standard_normal((rows, mid, positions, inner)).astype(np.float32) for _ in range(2))
        count = int(rng.integers(0, rows + 1))
        destinations = rng.choice(rows, count, replace=False).astype(np.int64)
        sources = rng.integers(0, rows, count).astype(np.int64)  # often destinations too
        kept = rng.integers(0, positions + 1, rows).astype(np.int32)
        want = tuple(b.copy() for b in buffers)
        for buffer in want:
            before = buffer.copy()
            for d, s in zip(destinations, sources):
                buffer[d, :, :kept[d]] = before[s, :, :kept[d]]
        copy_rows(buffers, destinations, sources, kept)
        for got, expected in zip(buffers, want):
            np.testing.assert_array_equal(got, expected, err_msg=f"trial {trial}")
