"""``gpudecode bench state-copy``: merge and split GB/s against a plain device-to-device copy of
the same bytes, measured in the same run, on a fragmented pool; and the CUDA state manager's time
per search step against the CPU manager's (host merge + upload, download + host split).

GB/s count bytes read + bytes written. Times are CUDA-event times (medians over ``repeats``) for
the kernels, wall times for whole steps. The GB/s figures time the GPU alone: each timed call is
queued behind a 2 ms GPU delay (``kernels/bench_delay.cu``, nvbench's blocking kernel), so the
host's launch preparation (argument checks, slot booking, pointer tables) overlaps the delay
instead of leaving the GPU idle between the events; ``*_launch_s`` are the same calls timed
without it. Results: a dict, written as JSON (+ a PNG plot).
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np

from gpudecode.bench.common import pyplot, save_figure, write_results

from gpudecode.spec import StateVariable

DEFAULT_HYPOTHESES = (64, 256, 1024, 4096)
DEFAULT_HISTORIES = (16, 64, 128, 512)


def _variables(layers: int, heads: int, head_dim: int, dtype) -> list[StateVariable]:
    return [
        StateVariable(
            input_name=f"past_{kind}_{layer}", output_name=f"present_{kind}_{layer}", dtype=np.dtype(dtype),
            shape=(None, heads, None, head_dim), batch_axis=0, time_axis=2,
        )
        for layer in range(layers)
        for kind in ("key", "value")
    ]


GPU_DELAY_NS = 2_000_000  # longer than any timed call's host preparation


def _gpu_delay(cupy, stream, nanoseconds: int) -> None:
    from gpudecode.kernels import load_module

    kernel = load_module("bench_delay", (), cupy.cuda.Device().id).get_function("gpu_delay")
    kernel((1,), (1,), (np.uint64(nanoseconds),), stream=stream)


def _event_times(cupy, stream, fn, repeats: int, warmup: int, before=None, hide_launch: bool = True) -> float:
    """Median seconds of ``fn`` between two CUDA events on ``stream`` (``before`` runs untimed);
    with ``hide_launch`` the events and ``fn``'s work are queued behind a GPU delay."""
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        if hide_launch:
            _gpu_delay(cupy, stream, GPU_DELAY_NS)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(times)


def _wall_times(fn, repeats: int, warmup: int, sync) -> float:
    times = []
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gpu_cell(cupy, stream, variables, num_rows, history, *, storage_dtype, repeats, warmup, seed, slots_per_chunk,
              device_id):
    from gpudecode.states import StateManagerOptions, create_state_manager

    options = StateManagerOptions(type="transformer-cuda", slots_per_chunk=slots_per_chunk,
                                  storage_dtype=storage_dtype, device_id=device_id)
    manager = create_state_manager(options, variables, execution_provider="cuda")
    pool = manager.pool
    num_tokens = num_rows * history
    pool.reserve(num_tokens + num_rows)
    pool.shuffle_free_slots(seed)  # fragmented: histories scattered over the pool
    with stream:
        prefill = {
            v.output_name: cupy.random.standard_normal((num_rows, v.shape[1], history, v.shape[3]), dtype=np.float32)
            .astype(v.dtype)
            for v in variables
        }
    histories = manager.extend(manager.initial_histories(num_rows), manager.split(prefill, num_new_tokens=history),
                               cupy.arange(num_rows))
    manager.retain(histories)
    del prefill
    payload = sum(num_tokens * int(np.prod(layout.token_shape)) * layout.model_dtype.itemsize for layout in manager.layouts)
    stored = sum(num_tokens * int(np.prod(layout.token_shape)) * layout.storage_dtype.itemsize for layout in manager.layouts)
    out = {layout.name: cupy.empty(layout.tensor_shape(num_rows, history), dtype=layout.model_dtype)
           for layout in manager.layouts}
    prefix = cupy.empty(num_rows, dtype=np.int32)
    merge = lambda: manager.merge(histories, out=out, prefix_lengths_out=prefix)  # noqa: E731
    merge_s = _event_times(cupy, stream, merge, repeats, warmup)
    merge_launch_s = _event_times(cupy, stream, merge, repeats, warmup, hide_launch=False)
    # baseline: one device-to-device copy of the same number of bytes, in the same run
    src = cupy.empty(payload, dtype=np.uint8)
    dst = cupy.empty(payload, dtype=np.uint8)
    copy = partial(dst.data.copy_from_device_async, src.data, payload, stream)
    copy_s = _event_times(cupy, stream, copy, repeats, warmup)
    copy_launch_s = _event_times(cupy, stream, copy, repeats, warmup, hide_launch=False)
    del copy, src, dst  # free the baseline's buffers before the split's slots are allocated
    # split: the merged tensors back into N x T new (scattered) slots
    sources = {layout.variable.output_name: out[layout.name] for layout in manager.layouts}

    def fresh_pool():
        manager.retain(histories)
        pool.shuffle_free_slots(seed + 1)

    split = lambda: manager.split(sources, num_new_tokens=history)  # noqa: E731
    split_s = _event_times(cupy, stream, split, repeats, warmup, before=fresh_pool)
    split_launch_s = _event_times(cupy, stream, split, repeats, warmup, before=fresh_pool, hide_launch=False)
    manager.retain(histories)
    # one search step: merge + split of one new token + extend + retain
    step_outputs = {
        v.output_name: cupy.random.standard_normal((num_rows, v.shape[1], 1, v.shape[3]), dtype=np.float32).astype(v.dtype)
        for v in variables
    }
    parents = cupy.arange(num_rows)

    def step():
        manager.merge(histories, out=out, prefix_lengths_out=prefix)
        slots = manager.split(step_outputs)
        manager.retain(manager.extend(histories, slots, parents))

    step_s = _wall_times(step, repeats, warmup, stream.synchronize)
    stats = manager.statistics()
    manager.close()
    return {
        "payload_bytes": payload,
        "stored_bytes": stored,
        "merge_s": merge_s,
        "split_s": split_s,
        "copy_s": copy_s,
        "merge_launch_s": merge_launch_s,
        "split_launch_s": split_launch_s,
        "copy_launch_s": copy_launch_s,
        "merge_over_copy_launch": copy_launch_s / merge_launch_s,
        "split_over_copy_launch": copy_launch_s / split_launch_s,
        "merge_gbps": (stored + payload) / merge_s / 1e9,
        "split_gbps": (stored + payload) / split_s / 1e9,
        "copy_gbps": 2 * payload / copy_s / 1e9,
        # same bytes written as the copy: time ratio = bandwidth ratio
        "merge_over_copy": copy_s / merge_s,
        "split_over_copy": copy_s / split_s,
        "step_cuda_s": step_s,
        "pool_bytes": stats.bytes,
    }


def _cpu_step(cupy, stream, variables, num_rows, history, *, repeats, warmup, seed):
    """CPU manager (the RASR baseline): host merge + upload, download + host split, per step."""
    from gpudecode.states import StateManagerOptions, create_state_manager

    manager = create_state_manager(StateManagerOptions(type="transformer-cpu", slots_per_chunk=4096), variables,
                                   execution_provider="cpu")
    rng = np.random.default_rng(seed)
    prefill = {v.output_name: rng.standard_normal((num_rows, v.shape[1], history, v.shape[3]), dtype=np.float32)
               .astype(v.dtype) for v in variables}
    histories = manager.extend(manager.initial_histories(num_rows), manager.split(prefill, num_new_tokens=history),
                               np.arange(num_rows))
    manager.retain(histories)
    del prefill
    with stream:
        step_outputs = {
            v.output_name: cupy.random.standard_normal((num_rows, v.shape[1], 1, v.shape[3]), dtype=np.float32)
            .astype(v.dtype)
            for v in variables
        }
    parents = np.arange(num_rows)

    def step():
        merged = manager.merge(histories)
        with stream:
            [cupy.asarray(array) for array in merged.inputs.values()]  # upload for the session
        host_outputs = {name: array.get(stream=stream) for name, array in step_outputs.items()}
        slots = manager.split(host_outputs)
        manager.retain(manager.extend(histories, slots, parents))

    step_s = _wall_times(step, max(3, repeats // 3), 1, stream.synchronize)
    manager.close()
    return step_s


def run_state_copy_bench(
    *,
    layers: int = 6,
    heads: int = 8,
    head_dim: int = 64,
    hypotheses=DEFAULT_HYPOTHESES,
    histories=DEFAULT_HISTORIES,
    dtype: str = "float32",
    storage_dtype: str | None = None,
    max_state_bytes: float = 20e9,
    cpu_max_state_bytes: float = 2e9,
    repeats: int = 10,
    warmup: int = 2,
    seed: int = 0,
    slots_per_chunk: int = 16384,
    device_id: int = 0,
    output_dir: str | Path | None = None,
) -> dict:
    """Measures every (hypotheses, history) cell whose states fit in ``max_state_bytes``; the CPU
    manager on the cells within ``cpu_max_state_bytes``. Writes ``state_copy.json`` and
    ``state_copy.png`` to ``output_dir`` when given. Returns the results."""
    from gpudecode.backend import require_cupy, shared_stream

    cupy = require_cupy()
    variables = _variables(layers, heads, head_dim, dtype)
    token_bytes = sum(heads * head_dim * np.dtype(dtype).itemsize for _ in variables)
    stream = shared_stream(device_id)
    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    results = {
        "benchmark": "state-copy",
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "config": {
            "layers": layers, "heads": heads, "head_dim": head_dim, "state_variables": len(variables),
            "dtype": dtype, "storage_dtype": storage_dtype or dtype, "bytes_per_token_state": token_bytes,
            "pool": "fragmented (shuffled free list)", "repeats": repeats, "timing": "CUDA events, median; GB/s behind a 2 ms GPU delay (launch preparation hidden), "
                      "*_launch_s without it",
            "gbps": "(bytes read + bytes written) / time",
        },
        "cells": [],
        "skipped": [],
    }
    with cupy.cuda.Device(device_id):
        for num_rows in hypotheses:
            for history in histories:
                state_bytes = num_rows * history * token_bytes
                if state_bytes > max_state_bytes:
                    results["skipped"].append({"hypotheses": num_rows, "history": history, "state_bytes": state_bytes})
                    continue
                cell = {"hypotheses": num_rows, "history": history, "state_bytes": state_bytes}
                cell.update(_gpu_cell(cupy, stream, variables, num_rows, history, storage_dtype=storage_dtype,
                                      repeats=repeats, warmup=warmup, seed=seed, slots_per_chunk=slots_per_chunk,
                                      device_id=device_id))
                if state_bytes <= cpu_max_state_bytes:
                    cell["step_cpu_s"] = _cpu_step(cupy, stream, variables, num_rows, history, repeats=repeats,
                                                   warmup=warmup, seed=seed)
                    cell["cpu_over_cuda_step"] = cell["step_cpu_s"] / cell["step_cuda_s"]
                results["cells"].append(cell)
                cupy.get_default_memory_pool().free_all_blocks()
    return write_results(results, output_dir, "state_copy", plot_state_copy)


def plot_state_copy(results: dict, path: str | Path) -> str | None:
    """A two-panel PNG: merge/split ÷ plain copy, and CPU ÷ CUDA manager time per step."""
    plt = pyplot()
    if plt is None:
        return None
    cells = results["cells"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for history in sorted({c["history"] for c in cells}):
        row = sorted((c for c in cells if c["history"] == history), key=lambda c: c["hypotheses"])
        xs = [c["hypotheses"] for c in row]
        ax1.plot(xs, [c["merge_over_copy"] for c in row], marker="o", label=f"merge, T={history}")
        ax1.plot(xs, [c["split_over_copy"] for c in row], marker="x", linestyle="--", label=f"split, T={history}")
        cpu = [c for c in row if "cpu_over_cuda_step" in c]
        if cpu:
            ax2.plot([c["hypotheses"] for c in cpu], [c["cpu_over_cuda_step"] for c in cpu], marker="o", label=f"T={history}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("hypotheses")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax1.axhline(0.85, color="gray", linestyle=":")
    ax1.set_ylabel("GB/s ÷ device-to-device copy GB/s")
    ax1.set_title(f"state copy on {results['device']} (fragmented pool)")
    ax2.set_yscale("log")
    ax2.set_ylabel("CPU manager ÷ CUDA manager, time per step")
    ax2.set_title("time per step")
    return save_figure(plt, fig, path)


def format_table(results: dict) -> str:
    """A Markdown table of the cells (for the README)."""
    lines = [
        "| hypotheses | history | states GB | merge GB/s | split GB/s | copy GB/s | merge÷copy | split÷copy "
        "| with launch: merge÷copy | split÷copy | CPU÷CUDA step |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in results["cells"]:
        cpu = f"{c['cpu_over_cuda_step']:.1f}" if "cpu_over_cuda_step" in c else "–"
        lines.append(
            f"| {c['hypotheses']} | {c['history']} | {c['state_bytes'] / 1e9:.2f} | {c['merge_gbps']:.0f} | "
            f"{c['split_gbps']:.0f} | {c['copy_gbps']:.0f} | {c['merge_over_copy']:.2f} | {c['split_over_copy']:.2f} | "
            f"{c['merge_over_copy_launch']:.2f} | {c['split_over_copy_launch']:.2f} | {cpu} |"
        )
    return "\n".join(lines)
