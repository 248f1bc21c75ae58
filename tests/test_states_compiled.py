"""The host state managers' compiled bookkeeping (``gpudecode.states.compiled``, numba) against the
numpy versions, which stay the oracle: two managers fed the same random steps — resident merge,
the model's in-place write, split, extend (beams reordering, children keeping their parent's
history), retain, release — one compiled and one with ``compiled`` False, must agree on every step:
the merged rows (the positions a model reads), the rows' slot and stamp tables, the slots handed
out, the histories, and the pool (free stack, allocation and reference marks, counters); with and
without ``max_history`` and the first-token state, over several pool chunks. The same for the
plain extension of histories on random tables.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.states import StateManagerOptions, create_state_manager
from gpudecode.states.history import StateHistory, extend_histories
from tests.test_cpu_in_place import variables

pytest.importorskip("numba")


def manager(limit, first, compiled: bool, dtype=np.float32):
    states = create_state_manager(
        StateManagerOptions(type="transformer-cpu", slots_per_chunk=16, max_history=limit,
                            always_include_first_token_state=first, history_alignment="left"),
        [v.__class__(**{**v.__dict__, "dtype": np.dtype(dtype)}) for v in variables()], execution_provider="cpu")
    assert states.compiled  # numba imports: compiled by default
    states.compiled = compiled
    return states


def _pool(states) -> dict:
    pool = states.pool
    num_free = int(pool.counters[0])
    return {"free": pool.free_stack[:num_free].copy(), "allocated": pool.allocated.copy(),
            "marks": pool.marks.copy(), "counters": pool.counters.copy(), "capacity": pool.capacity}


def _assert_same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=f"{where}: {key}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16-numpy-copies"])
@pytest.mark.parametrize("limit,first", [(None, False), (5, False), (5, True)])
@pytest.mark.parametrize("fused", [False, True], ids=["split", "split_resident"])
def test_compiled_manager_steps_equal_numpy(limit, first, dtype, fused):
    """``fused``: the compiled manager stores the new steps with ``split_resident`` (straight from
    the resident rows into the pool), the numpy one with ``split(resident_new_steps(...))``."""
    both = [manager(limit, first, compiled, dtype) for compiled in (True, False)]
    rng = np.random.default_rng(7)
    histories = [s.initial_histories(6) for s in both]
    moved = 0
    for step in range(200):
        where = f"step {step}"
        if step % 53 == 52:  # the utterances end, others start: every slot freed, then reused
            rows = int(rng.integers(1, 9))
            for s in both:
                s.release_all()
            histories = [s.initial_histories(rows) for s in both]
        merged = [s.merge_resident(h) for s, h in zip(both, histories)]
        kept = np.asarray(merged[1].prefix_lengths)
        np.testing.assert_array_equal(merged[0].prefix_lengths, kept, err_msg=where)
        assert merged[0].time_size == merged[1].time_size
        valid = np.arange(merged[1].time_size)[None, :] < kept[:, None]
        for name in merged[1].inputs:
            got, want = (np.moveaxis(m.inputs[name][:, :, :m.time_size], 2, 1) for m in merged)
            np.testing.assert_array_equal(got[valid], want[valid], err_msg=f"{where}: {name}")
        resident = [s._resident for s in both]
        assert resident[0].rows_moved == resident[1].rows_moved and resident[0].rows_fetched == resident[1].rows_fetched
        rows_a, rows_b = (r._rows[0] for r in resident)
        np.testing.assert_array_equal(rows_a.held, rows_b.held, err_msg=where)
        np.testing.assert_array_equal(rows_a.stamps, rows_b.stamps, err_msg=where)
        np.testing.assert_array_equal(resident[0]._owner, resident[1]._owner, err_msg=where)
        rows = kept.shape[0]
        slots = []
        for s, m in zip(both, merged):  # the "model" writes a new step at each row's length
            for k, name in enumerate(m.inputs):
                m.inputs[name][np.arange(rows), :, kept] = step * 100 + np.arange(rows)[:, None, None] + k / 4 + \
                    np.arange(6, dtype=np.float32).reshape(1, 2, 3) / 64
            slots.append(s.split_resident(m) if fused and s.compiled else s.split(s.resident_new_steps(m)))
            s.written_in_place(slots[-1], m.prefix_lengths)
        np.testing.assert_array_equal(slots[0], slots[1], err_msg=where)
        for v in range(len(both[0].layouts)):
            for a, b in zip(both[0].pool.slabs[v], both[1].pool.slabs[v]):
                np.testing.assert_array_equal(a, b, err_msg=f"{where}: slabs")
        children = int(rng.integers(1, 9))
        parents = np.sort(rng.integers(0, rows, size=children))
        append = rng.random(children) < 0.85
        histories = [s.extend(h, sl, parents, append=append) for s, h, sl in zip(both, histories, slots)]
        np.testing.assert_array_equal(histories[0].table, histories[1].table, err_msg=where)
        np.testing.assert_array_equal(histories[0].lengths, histories[1].lengths, err_msg=where)
        for s, h in zip(both, histories):
            s.retain(h)
        _assert_same(_pool(both[0]), _pool(both[1]), where)
        moved = resident[0].rows_moved
    assert moved > 100 and both[0].pool.num_chunks > 1


@pytest.mark.parametrize("max_history,keep_first", [(None, False), (3, False), (3, True)])
@pytest.mark.parametrize("with_append", [False, True])
def test_compiled_extension_equals_numpy(max_history, keep_first, with_append):
    rng = np.random.default_rng(11)
    for trial in range(50):
        rows, width, num_new = int(rng.integers(1, 7)), int(rng.integers(0, 6)), int(rng.integers(0, 3))
        lengths = rng.integers(-1, width + 2, rows).astype(np.int32)  # out of range too: clipped
        table = np.where(np.arange(width)[None, :] < lengths[:, None], rng.integers(0, 50, (rows, width)),
                         -1).astype(np.int32)
        new_slots = rng.integers(-1, 50, (rows, num_new)).astype(np.int32)  # -1 anywhere
        parents = rng.integers(0, rows, int(rng.integers(0, 8)))
        append = rng.random(parents.shape[0]) < 0.7 if with_append else None
        got, want = (extend_histories(StateHistory(table=table, lengths=lengths), new_slots, parents, append=append,
                                      max_history=max_history, keep_first=keep_first, compiled=compiled)
                     for compiled in (True, False))
        np.testing.assert_array_equal(got.table, want.table, err_msg=f"trial {trial}")
        np.testing.assert_array_equal(got.lengths, want.lengths, err_msg=f"trial {trial}")
        assert got.table.dtype == want.table.dtype and got.lengths.dtype == want.lengths.dtype
