"""CUDA state managers: bit-identical to the numpy managers, and a constant launch graph.

Run on the GPU machine with ``pytest -m gpu tests/test_state_gpu.py``. Merge buffers are
pre-filled with NaN, so padding a kernel forgot shows up; the numpy twin (itself checked against
the hand-written reference) must match byte for byte.
"""

from __future__ import annotations

import ctypes
import zlib
from collections import Counter

import numpy as np
import pytest

from gpudecode.spec import StateVariable
from gpudecode.states import StateManagerOptions, create_state_manager
from tests.test_state_managers import (
    TRANSFORMER_CASES,
    Reference,
    Scenario,
    _case_id,
    assert_pool_consistent,
    bits,
    kv_variables,
    left_aligned_merge_keeps_the_padding,
    lstm_variables,
    random_outputs,
)

pytestmark = pytest.mark.gpu


def _pair(state_type: str, variables, **options):
    host = create_state_manager(StateManagerOptions(type=f"{state_type}-cpu", **options), variables,
                                execution_provider="cpu")
    device = create_state_manager(StateManagerOptions(type=f"{state_type}-cuda", **options), variables,
                                  execution_provider="cuda")
    assert host.device == "cpu" and device.device == "cuda"
    return host, device


@pytest.mark.parametrize("case", TRANSFORMER_CASES, ids=_case_id)
@pytest.mark.parametrize("full_time_axis", [True, False], ids=["full-axis", "new-step"])
def test_cuda_transformer_bit_identical_to_numpy(case, full_time_axis):
    layout, dtype, storage, limit, first = case
    variables = kv_variables(2, dtype, layout)
    host, device = _pair("transformer", variables, max_history=limit, always_include_first_token_state=first,
                         slots_per_chunk=16, storage_dtype=storage)
    stored = (lambda a: a.astype(storage).astype(dtype)) if storage else (lambda a: a)
    reference = Reference(variables, max_history=limit, keep_first=first, stored=stored)
    rng = np.random.default_rng(zlib.crc32(_case_id(case).encode()))
    scenario = Scenario(host, reference, rng, twin=device, full_time_axis=full_time_axis, nan_buffers=True)
    scenario.start(num_rows=6, prefill_max=5)
    scenario.check_merge()
    for step in range(10):
        scenario.step()
        scenario.check_merge(padded=step % 3 == 1)
        assert_pool_consistent(device, scenario.histories[1])
    # the GPU manager's own buffers (no out=) as well
    own = device.merge(scenario.histories[1], time_size=reference.time_size())
    expected, prefix = reference.merge()
    for name, array in expected.items():
        assert np.array_equal(bits(own.inputs[name]), bits(array))
    assert np.array_equal(own.prefix_lengths.get(), prefix)


@pytest.mark.parametrize("layered", [False, True], ids=["NH", "LNH"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cuda_lstm_bit_identical_to_numpy(layered, dtype):
    variables = lstm_variables(dtype, layered)
    host, device = _pair("lstm", variables, slots_per_chunk=8)
    scenario = Scenario(host, Reference(variables, lstm=True), np.random.default_rng(11), twin=device, nan_buffers=True)
    scenario.start(num_rows=5)
    scenario.check_merge()
    for step in range(12):
        scenario.step(keep_probability=0.7)
        scenario.check_merge(padded=step % 4 == 3)
        assert_pool_consistent(device, scenario.histories[1])


def test_cuda_split_accepts_device_and_host_outputs_and_token_counts():
    import cupy

    variables = kv_variables(1, np.float32, "heads")
    host, device = _pair("transformer", variables, slots_per_chunk=4)
    rng = np.random.default_rng(12)
    outputs = random_outputs(rng, variables, 3, 5)
    counts = np.array([5, 2, 0], dtype=np.int32)
    results = []
    for manager, outs, token_counts in (
        (host, outputs, counts),
        (device, {k: cupy.asarray(v) for k, v in outputs.items()}, cupy.asarray(counts)),  # device outputs
    ):
        slots = manager.split(outs, num_new_tokens=5, token_counts=token_counts)
        assert (manager.xp.asarray(slots) >= 0).sum().item() == 7
        histories = manager.extend(manager.initial_histories(3), slots, manager.xp.arange(3))
        results.append(manager.merge(histories))
    for name in results[0].inputs:
        assert np.array_equal(bits(results[0].inputs[name]), bits(results[1].inputs[name]))
    assert results[1].prefix_lengths.get().tolist() == [5, 2, 0]


def test_cuda_pool_invariants_and_growth():
    variables = [StateVariable(input_name="past", output_name="present", dtype=np.dtype(np.float32),
                               shape=(None, None, 1), time_axis=1)]
    device = create_state_manager(StateManagerOptions(type="transformer-cuda", slots_per_chunk=8, max_history=3),
                                  variables, execution_provider="cuda")
    scenario = Scenario(device, Reference(variables, max_history=3), np.random.default_rng(13), full_time_axis=False)
    scenario.start(num_rows=4)
    for step in range(200):
        scenario.step(max_children=10)
        stats = assert_pool_consistent(device, scenario.histories[0])
        assert stats.live_slots <= 3 * scenario.histories[0].num_rows
        assert stats.capacity_slots <= -(-stats.peak_live_slots // 8) * 8
        if step % 20 == 0:
            scenario.check_merge()
    device.release_all()
    assert device.statistics().live_slots == 0


@pytest.mark.parametrize("shape,time_axis,batch_axis", [
    ((None, 3, None, 8), 2, 0),       # 32-byte spans: 2 vectors
    ((None, 2, None, 64), 2, 0),      # 256-byte spans: 16 vectors
    ((None, None, 48), 1, 0),         # [N, T, 48]: 12 vectors, the lane walk carries
    ((2, None, 3, None, 4), 3, 1),    # layered, 1 vector per span
    ((None, 1, None, 160), 2, 0),     # 40 vectors per span: more than a warp
    ((None, 4, None, 640), 2, 0),     # 10 KiB token states
], ids=["v2", "v16", "v12-flat", "v1-layered", "v40", "v160-large"])
def test_split_of_several_new_tokens_equals_numpy(shape, time_axis, batch_axis):
    """A split of several new tokens per row with 16-byte spans (the kernel's fast path) on a
    fragmented pool: the stored states merge back to what the numpy manager stores, for token runs
    shorter than, equal to and longer than a warp's batch of 32 (batches cross rows)."""
    import cupy

    variables = [StateVariable(input_name=f"past_{n}", output_name=f"present_{n}", dtype=np.dtype(np.float32),
                               shape=shape, batch_axis=batch_axis, time_axis=time_axis) for n in ("key", "value")]
    host, device = _pair("transformer", variables, slots_per_chunk=32)
    device.pool.reserve(2000)
    device.pool.shuffle_free_slots(7)
    rng = np.random.default_rng(17)
    for num_rows, num_new, extra in ((5, 2, 0), (3, 32, 1), (4, 70, 3), (1, 3, 2)):
        outputs = random_outputs(rng, variables, num_rows, num_new + extra)
        merged = []
        for manager, outs in ((host, outputs), (device, {k: cupy.asarray(v) for k, v in outputs.items()})):
            launches = getattr(getattr(manager, "_copy", None), "num_launches", 0)
            slots = manager.split(outs, num_new_tokens=num_new)
            if manager is device:
                assert device._copy.num_launches == launches + 1
            histories = manager.extend(manager.initial_histories(num_rows), slots, manager.xp.arange(num_rows))
            merged.append(manager.merge(histories, time_size=num_new + 1))
            manager.release_all()
        for name in merged[0].inputs:
            assert np.array_equal(bits(merged[0].inputs[name]), bits(merged[1].inputs[name])), name


def test_split_with_fused_allocation_equals_separate_allocation():
    """The split's own allocation (free stack read in the copy kernel) hands out the slots, flags
    and counters that StatePool.allocate's kernels would, and stores the same states."""
    import cupy

    variables = kv_variables(3, np.float32, "heads")
    managers = [create_state_manager(StateManagerOptions(type="transformer-cuda", slots_per_chunk=64), variables,
                                     execution_provider="cuda") for _ in range(2)]
    for manager in managers:
        manager.pool.reserve(400)
        manager.pool.shuffle_free_slots(3)
    rng = np.random.default_rng(5)
    for num_rows, num_new in ((7, 3), (50, 1), (1, 9)):
        outputs = {k: cupy.asarray(v) for k, v in random_outputs(rng, variables, num_rows, num_new + 2).items()}
        fused = managers[0].split(outputs, num_new_tokens=num_new)
        separate = managers[1].pool.allocate(num_rows, num_new)
        managers[1]._copy.split([outputs[v.output_name] for v in variables], num_rows=num_rows,
                                source_time=num_new + 2, new_slots=separate)
        assert fused.get().tolist() == separate.get().tolist()
        assert (fused.get() >= 0).all()
        for name in ("counters", "allocated", "free_stack"):
            assert getattr(managers[0].pool, name).get().tolist() == getattr(managers[1].pool, name).get().tolist(), name
        assert managers[0].pool.counters.get()[3] == 0
        for slabs_fused, slabs_separate in zip(managers[0].pool.slabs, managers[1].pool.slabs):
            for a, b in zip(slabs_fused, slabs_separate):
                assert np.array_equal(bits(a), bits(b))


# ---- launch graph: constant in N, T and the number of state variables ---------------------------

_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
               7: "event_record", 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}


def graph_node_types(graph_handle: int) -> Counter:
    """Node types of a CUDA graph, read with the driver API (CuPy keeps no cudaGraph_t)."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    count = ctypes.c_size_t(0)
    assert libcuda.cuGraphGetNodes(ctypes.c_void_p(graph_handle), None, ctypes.byref(count)) == 0
    nodes = (ctypes.c_void_p * max(count.value, 1))()
    assert libcuda.cuGraphGetNodes(ctypes.c_void_p(graph_handle), nodes, ctypes.byref(count)) == 0
    types = Counter()
    for i in range(count.value):
        node_type = ctypes.c_int(-1)
        assert libcuda.cuGraphNodeGetType(ctypes.c_void_p(nodes[i]), ctypes.byref(node_type)) == 0
        types[_NODE_TYPES.get(node_type.value, str(node_type.value))] += 1
    return types


def capture(fn) -> Counter:
    """Runs ``fn`` under stream capture on the shared stream and returns its graph's node types.
    A host synchronisation inside ``fn`` would make the capture fail."""
    import cupy

    from gpudecode.backend import shared_stream

    stream = shared_stream(0)
    stream.synchronize()
    with stream:
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = cupy.cuda.runtime.streamEndCapture(stream.ptr)
    try:
        return graph_node_types(graph)
    finally:
        cupy.cuda.runtime.graphDestroy(graph)


def _captured_counts(num_vars: int, num_rows: int, history: int = 16):
    import cupy

    variables = kv_variables(6, np.float32, "heads")[:num_vars]
    assert len(variables) == num_vars
    manager = create_state_manager(StateManagerOptions(type="transformer-cuda", slots_per_chunk=256), variables,
                                   execution_provider="cuda")
    rng = np.random.default_rng(14)
    prefill = {k: cupy.asarray(v) for k, v in random_outputs(rng, variables, num_rows, history).items()}
    histories = manager.extend(manager.initial_histories(num_rows), manager.split(prefill, num_new_tokens=history),
                               cupy.arange(num_rows))
    manager.retain(histories)
    manager.pool.reserve(4 * num_rows)  # no growth (a host sync) inside the captures
    out = {layout.name: cupy.empty(layout.tensor_shape(num_rows, history + 4), dtype=np.float32)
           for layout in manager.layouts}
    prefix = cupy.empty(num_rows, dtype=np.int32)
    step = {k: cupy.asarray(v) for k, v in random_outputs(rng, variables, num_rows, 1).items()}
    manager.merge(histories, out=out, prefix_lengths_out=prefix)  # warm-up: compile, buffers
    manager.merge(histories)
    manager.split(step)
    manager.retain(histories)
    counts = {
        "merge": capture(lambda: manager.merge(histories, out=out, prefix_lengths_out=prefix)),
        "merge-owned": capture(lambda: manager.merge(histories)),
        "split": capture(lambda: manager.split(step)),
        "retain": capture(lambda: manager.retain(histories)),
    }
    manager.close()
    return counts


def test_captured_merge_split_graph_is_constant():
    results = {(num_vars, rows): _captured_counts(num_vars, rows) for num_vars in (1, 12) for rows in (64, 4096)}
    first = results[(1, 64)]
    for key, counts in results.items():
        assert counts == first, f"{key}: {counts} != {first}"
    assert first["merge"] == Counter(kernel=1), first["merge"]  # one launch, no memset, no memcpy
    assert first["merge-owned"] == Counter(kernel=1), first["merge-owned"]
    for name, counts in first.items():
        assert counts["memcpy"] == 0, f"{name}: a memcpy node (host-to-device upload?) {counts}"
        assert counts["host"] == 0, name
    assert first["split"] == Counter(kernel=1), first["split"]  # the split allocates its slots itself


def test_steady_search_steps_do_not_synchronise(monkeypatch):
    """Allocate + retain step after step with chunk headroom: the live bound comes from the
    asynchronous counter snapshots, so (almost) no step reads the counters synchronously."""
    import cupy

    from gpudecode.states.pool import StatePool

    variables = kv_variables(2, np.float32, "heads")
    manager = create_state_manager(StateManagerOptions(type="transformer-cuda", slots_per_chunk=4096, max_history=8),
                                   variables, execution_provider="cuda")
    rng = np.random.default_rng(3)
    step = {k: cupy.asarray(v) for k, v in random_outputs(rng, variables, 64, 1).items()}
    histories = manager.initial_histories(64)
    reads = []
    original = StatePool._read_counters
    monkeypatch.setattr(StatePool, "_read_counters", lambda self: reads.append(1) or original(self))
    for _ in range(300):
        slots = manager.split(step)
        histories = manager.extend(histories, slots, cupy.asarray(rng.integers(0, 64, 64)))
        manager.retain(histories)
    stats = manager.statistics()
    assert stats.live_slots <= 64 * 8 and stats.capacity_slots == 4096
    assert len(reads) <= 1 + 30, len(reads)  # the statistics call, plus at most one in ten steps
    manager.close()


@pytest.mark.parametrize("max_history", [None, 3])
@pytest.mark.parametrize("with_append", [False, True])
def test_extend_histories_kernel_equals_the_host_version(max_history, with_append):
    """The one-launch CUDA extension gives the numpy version's tables, for ragged parents, new
    slots with -1 padding, children that keep their parent's history, and max_history windows."""
    import cupy

    from gpudecode.states.history import StateHistory, extend_histories

    rng = np.random.default_rng(7)
    for rows, width, tokens, children in ((6, 5, 1, 9), (4, 0, 2, 4), (8, 7, 3, 16), (3, 4, 0, 5)):
        lengths = rng.integers(0, width + 2, size=rows).astype(np.int32)  # some beyond the width
        table = np.where(np.arange(width)[None, :] < lengths[:, None],
                         rng.integers(0, 1000, size=(rows, width)), -1).astype(np.int32)
        counts = rng.integers(0, tokens + 1, size=rows)
        new_slots = np.where(np.arange(tokens)[None, :] < counts[:, None],
                             rng.integers(1000, 2000, size=(rows, tokens)), -1).astype(np.int32)
        parents = rng.integers(0, rows, size=children)
        append = rng.random(children) < 0.7 if with_append else None
        host = extend_histories(StateHistory(table=table, lengths=lengths), new_slots, parents, append=append,
                                max_history=max_history)
        device = extend_histories(StateHistory(table=cupy.asarray(table), lengths=cupy.asarray(lengths)),
                                  cupy.asarray(new_slots), cupy.asarray(parents),
                                  append=None if append is None else cupy.asarray(append), max_history=max_history)
        np.testing.assert_array_equal(cupy.asnumpy(device.lengths), host.lengths)
        np.testing.assert_array_equal(cupy.asnumpy(device.table), host.table)


@pytest.mark.parametrize("layout", ["heads", "chunks"])
def test_cuda_left_aligned_merge_keeps_the_padding(layout):
    import cupy

    left_aligned_merge_keeps_the_padding("transformer-cuda", "cuda", cupy, layout)
