"""The resident merge with rows assigned freely (``merge_resident(free_rows=True)``: each history
in a row that already holds it where one can) against the merge with row n for history n, which
``tests/test_states_compiled.py`` checks against numpy: step by step, every row holds the window of
the history ``rows_order`` names (the same values where the model reads, the same kept lengths), the
new steps stored from those rows are those of the same histories, and fewer rows are copied."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_states_compiled import manager

pytest.importorskip("numba")


@pytest.mark.parametrize("limit,first", [(None, False), (5, False), (5, True)])
def test_free_rows_hold_the_same_windows(limit, first):
    free, fixed = manager(limit, first, True), manager(limit, first, True)
    rng = np.random.default_rng(23)
    histories = [s.initial_histories(6) for s in (free, fixed)]
    permuted = 0
    for step in range(150):
        where = f"step {step}"
        if step % 47 == 46:
            rows = int(rng.integers(1, 9))
            for s in (free, fixed):
                s.release_all()
            histories = [s.initial_histories(rows) for s in (free, fixed)]
        a = free.merge_resident(histories[0], free_rows=True)
        b = fixed.merge_resident(histories[1])
        assert b.rows_order is None
        rows = b.prefix_lengths.shape[0]
        order = np.arange(rows) if a.rows_order is None else a.rows_order
        np.testing.assert_array_equal(np.sort(order), np.arange(rows), err_msg=where)
        permuted += bool((order != np.arange(rows)).any())
        np.testing.assert_array_equal(a.prefix_lengths, b.prefix_lengths[order], err_msg=where)
        kept = a.prefix_lengths
        valid = np.arange(a.time_size)[None, :] < kept[:, None]
        for name in b.inputs:
            got = np.moveaxis(a.inputs[name][:, :, :a.time_size], 2, 1)
            want = np.moveaxis(b.inputs[name][order][:, :, :b.time_size], 2, 1)
            np.testing.assert_array_equal(got[valid], want[valid], err_msg=f"{where}: {name}")
        for m, lanes in ((a, order), (b, np.arange(rows))):  # the "model": a step by history, at its length
            for k, name in enumerate(m.inputs):
                m.inputs[name][np.arange(rows), :, m.prefix_lengths] = step * 100 + lanes[:, None, None] + k / 4 + \
                    np.arange(6, dtype=np.float32).reshape(1, 2, 3) / 64
        slots = []
        for s, m, lanes in ((free, a, order), (fixed, b, np.arange(rows))):
            by_row = s.split_resident(m)
            s.written_in_place(by_row, m.prefix_lengths)
            by_history = np.empty_like(by_row)
            by_history[lanes] = by_row
            slots.append(by_history)
        for v in range(len(free.layouts)):  # the same states stored for each history
            got, want = (np.concatenate(s.pool.slabs[v])[sl[:, 0]] for s, sl in zip((free, fixed), slots))
            np.testing.assert_array_equal(got, want, err_msg=f"{where}: stored")
        children = int(rng.integers(1, 9))
        parents = np.sort(rng.integers(0, rows, size=children))
        append = rng.random(children) < 0.85
        histories = [s.extend_retained(h, sl, parents, append=append) for s, h, sl in zip((free, fixed), histories, slots)]
        np.testing.assert_array_equal(histories[0].lengths, histories[1].lengths, err_msg=where)
    assert permuted > 20
    assert free._resident.rows_moved < fixed._resident.rows_moved
