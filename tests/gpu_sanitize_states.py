"""Exercises the state kernels for compute-sanitizer, with CuPy's memory pool disabled (inside one
pooled allocation an out-of-bounds write goes unseen). Run on the GPU machine::

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu_sanitize_states.py
    compute-sanitizer --tool initcheck --error-exitcode 1 python3 tests/gpu_sanitize_states.py

Every merge is also compared with the numpy managers; a mismatch exits with status 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

cupy.cuda.set_allocator(None)
cupy.cuda.set_pinned_memory_allocator(None)

from gpudecode.spec import StateVariable  # noqa: E402
from gpudecode.states import StateManagerOptions, create_state_manager  # noqa: E402
from tests.test_dense_states import children_mismatches  # noqa: E402
from tests.test_resident_greedy import copy_mismatches  # noqa: E402
from tests.test_scorer_cache import scorer_cache_mismatches  # noqa: E402
from tests.test_split_positions import split_position_mismatches  # noqa: E402
from tests.test_state_managers import (  # noqa: E402
    Reference,
    Scenario,
    kv_variables,
    left_aligned_merge_keeps_the_padding,
    lstm_variables,
)


def run(state_type, variables, reference, *, steps, full_time_axis=True, **options):
    host = create_state_manager(StateManagerOptions(type=f"{state_type}-cpu", **options), variables,
                                execution_provider="cpu")
    device = create_state_manager(StateManagerOptions(type=f"{state_type}-cuda", **options), variables,
                                  execution_provider="cuda")
    scenario = Scenario(host, reference, np.random.default_rng(21), twin=device, full_time_axis=full_time_axis,
                        nan_buffers=True)
    scenario.start(num_rows=5, prefill_max=0 if state_type == "lstm" else 4)
    scenario.check_merge()
    for step in range(steps):
        scenario.step(max_children=9)
        scenario.check_merge(padded=step % 2 == 1)
        device.merge(scenario.histories[1], time_size=None if state_type == "lstm" else reference.time_size())
    device.release_all()
    device.close()


def main() -> int:
    try:
        for layout, dtype, storage, limit, first in [
            ("heads", np.float32, None, None, False),
            ("flat", np.float32, None, 3, True),
            ("layered", np.float16, None, 2, False),
            ("heads", np.float32, "float16", 4, True),
            ("flat", np.float16, "float32", None, False),
            ("chunks", np.float16, None, 3, True),  # one 16-byte vector per span: a lane per token
        ]:
            variables = kv_variables(2, dtype, layout)
            stored = (lambda a, s=storage, d=dtype: a.astype(s).astype(d)) if storage else (lambda a: a)
            reference = Reference(variables, max_history=limit, keep_first=first, stored=stored)
            for full in (True, False):
                run("transformer", variables, reference, steps=6, full_time_axis=full, max_history=limit,
                    always_include_first_token_state=first, slots_per_chunk=8, storage_dtype=storage)
        # 16-byte spans: the fast paths (merge, split of one token, span-major split of a prefill)
        aligned = [StateVariable(input_name=f"past_{n}", output_name=f"present_{n}", dtype=np.dtype(np.float32),
                                 shape=(None, 2, None, 8), batch_axis=0, time_axis=2) for n in ("key", "value")]
        for limit in (None, 2):
            run("transformer", aligned, Reference(aligned, max_history=limit), steps=6, max_history=limit,
                slots_per_chunk=8)
        for layout in ("heads", "chunks"):  # padding left unwritten
            left_aligned_merge_keeps_the_padding("transformer-cuda", "cuda", cupy, layout)
        for layered in (False, True):
            variables = lstm_variables(np.float32, layered)
            run("lstm", variables, Reference(variables, lstm=True), steps=6, slots_per_chunk=4)
        bad = children_mismatches(cupy)  # kernels/dense_states.cu, every copy unit
        assert not bad, f"dense children: {bad}"
        bad = scorer_cache_mismatches(cupy)  # kernels/scorer_cache.cu
        assert not bad, f"scorer cache: {bad}"
        bad = split_position_mismatches(cupy)  # split at per-row positions (src_positions)
        assert not bad, f"split at positions: {bad}"
        bad = copy_mismatches(cupy)  # copy_steps: resident greedy steps' new states
        assert not bad, f"copy steps: {bad}"
    except AssertionError as error:
        print(f"MISMATCH: {error}", file=sys.stderr)
        return 2
    cupy.cuda.runtime.deviceSynchronize()
    print("gpu_sanitize_states: all merges matched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
