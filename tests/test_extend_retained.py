"""``StateManager.extend_retained`` (a compiled host manager: one extension straight into the trimmed
table, one mark, one sweep) against ``extend`` -> ``trimmed`` -> ``retain`` on a numpy manager, the
reference: the same children and the same pool (free stack, allocation and marks, counters) step by
step, with and without ``max_history`` (compacting: the reference path) and the first-token state,
trimmed or not."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_states_compiled import _assert_same, _pool, manager

pytest.importorskip("numba")


@pytest.mark.parametrize("limit,first", [(None, False), (4, False), (4, True), (1000, False)])
@pytest.mark.parametrize("trim", [False, True])
def test_extend_retained_equals_extend_trim_retain(limit, first, trim):
    fast, reference = manager(limit, first, True), manager(limit, first, False)
    rng = np.random.default_rng(13)
    histories = [s.initial_histories(5) for s in (fast, reference)]
    cut = 0
    for step in range(120):
        where = f"step {step}"
        if step % 41 == 40:
            for s in (fast, reference):
                s.release_all()
            rows = int(rng.integers(1, 8))
            histories = [s.initial_histories(rows) for s in (fast, reference)]
        rows = histories[0].num_rows
        slots = []
        for s in (fast, reference):
            steps = {v.output_name: np.full(layout.tensor_shape(rows, 1), step, layout.model_dtype)
                     for v, layout in zip(s.state_variables, s.layouts)}
            slots.append(s.split(steps))
        np.testing.assert_array_equal(slots[0], slots[1], err_msg=where)
        children = int(rng.integers(1, 8))
        parents = np.sort(rng.integers(0, rows, size=children))
        append = rng.random(children) < 0.8 if step % 3 else None
        bound = int(histories[0].lengths.max(initial=0)) + 1  # no child is longer
        width = bound if trim else None
        cut += trim and bound < histories[0].width + 1
        got = fast.extend_retained(histories[0], slots[0], parents, append=append, width=width)
        want = reference.extend(histories[1], slots[1], parents, append=append)
        if width is not None:
            want = reference.trimmed(want, width)
        reference.retain(want)
        np.testing.assert_array_equal(got.table, want.table, err_msg=where)
        np.testing.assert_array_equal(got.lengths, want.lengths, err_msg=where)
        assert got.table.dtype == want.table.dtype == np.int32 and got.lengths.dtype == np.int32
        _assert_same(_pool(fast), _pool(reference), where)
        histories = [got, want]
    assert cut > 5 or not trim or limit == 4  # trimmed narrower than the extension on some steps (uncompacted)
