"""``gpudecode bench graphs``: the decoder step with CUDA graphs off and on.

The decoder of ``bench decode`` (6 layers, d = 512, vocabulary 10k, precomputed cross-attention)
decodes a fixed number of labels, at a small batch (≤ 32 hypotheses, where launch overhead
dominates) and a large one (≥ 1,024 hypotheses). Measured in one run:
- time per step and host CPU per step, graphs on ÷ off, at both sizes;
- device memory held by the graphs with one buffer per bucket vs one shared buffer per tensor
  name: ``cudaMemGetInfo`` around capturing every history bucket (ONNX Runtime's arena growing
  by exactly what is requested), and the bytes the graph buffers hold.
"""

from __future__ import annotations

import numpy as np

from gpudecode.bench.common import pyplot, save_figure, write_results
from gpudecode.bench.decode import BOS, _blocking_sync, _utterances, measure_search


def _graph_memory(reference, *, utts: int, beam: int, encoder_length: int, max_time: int, shared: bool) -> dict:
    """Device bytes taken by capturing every bucket up to ``max_time`` history steps."""
    import cupy

    from gpudecode.scorers.base import LaneLayout
    from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer
    from gpudecode.session import OnnxSession, SessionOptions
    from gpudecode.session.graphs import GraphOptions
    from gpudecode.states.options import StateManagerOptions

    session = OnnxSession(reference.serialized(), SessionOptions(
        device="cuda", cuda_graphs=True, arena_extend_strategy="kSameAsRequested"))
    decoder = OnnxDecoderScorer(model=session, vocab_size=reference.vocab_size, start_labels=[BOS],
                                state_manager=StateManagerOptions(type="transformer-cuda", slots_per_chunk=65536),
                                graphs=GraphOptions(enabled=True, shared_buffers=shared))
    decoder.begin(LaneLayout(num_groups=utts, beam_size=beam, xp=cupy))
    decoder.admit(_utterances(cupy, reference, utts, encoder_length, seed=2), np.arange(utts))
    cupy.cuda.runtime.deviceSynchronize()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    decoder.warm_up(max_time)
    cupy.cuda.runtime.deviceSynchronize()
    held = free_before - cupy.cuda.runtime.memGetInfo()[0]
    result = {"shared_buffers": shared, "graphs": decoder.captured_graphs, "device_bytes": held,
              "buffer_bytes": decoder.runner.graphs.buffers.nbytes}
    decoder.close()
    del decoder, session
    cupy.get_default_memory_pool().free_all_blocks()
    return result


def run_graphs_bench(*, small_utts: int = 4, large_utts: int = 128, beam: int = 8, encoder_length: int = 200,
                     num_labels: int = 50, output_dir=None, quick: bool = False) -> dict:
    """Runs every measurement in one process; returns (and writes) the results."""
    from gpudecode.backend import require_cupy
    from gpudecode.session import OnnxSession, SessionOptions
    from gpudecode.session.graphs import GraphOptions
    from gpudecode.testing import build_transformer_decoder

    blocking = _blocking_sync()
    require_cupy()
    dims = dict(vocab_size=10_000, model_dim=512, num_layers=6, num_heads=8, ffn_dim=2048)
    if quick:
        dims = dict(vocab_size=1000, model_dim=128, num_layers=2, num_heads=4, ffn_dim=256)
    reference = build_transformer_decoder(0, max_positions=num_labels + 8, **dims)
    plain = OnnxSession(reference.serialized(), SessionOptions(device="cuda"))
    captured = OnnxSession(reference.serialized(), SessionOptions(device="cuda", cuda_graphs=True))
    if not captured.cuda_graphs:
        raise RuntimeError(f"the benchmark decoder cannot be captured: {captured.graph_blocker}")
    fixed = dict(encoder_length=encoder_length, num_labels=num_labels, repeats=3)
    results = {"benchmark": "graphs", "config": {**dims, "beam": beam, "encoder_length": encoder_length,
                                                 "num_labels": num_labels,
                                                 "host_sync": "blocking" if blocking else "spin",
                                                 "timing": "fastest of 3 searches after a full warm-up search"},
               "cells": [], "memory": []}
    for utts in (small_utts, large_utts):
        results["cells"].append(measure_search(plain, reference, "transformer-cuda", beam, utts, **fixed))
        results["cells"].append(measure_search(captured, reference, "transformer-cuda", beam, utts,
                                               graphs=GraphOptions(enabled=True), **fixed))
    del plain, captured
    _graph_memory(reference, utts=large_utts, beam=beam, encoder_length=encoder_length,
                  max_time=num_labels + 1, shared=True)  # loads what any first capture loads
    for shared in (True, False):
        results["memory"].append(_graph_memory(reference, utts=large_utts, beam=beam, encoder_length=encoder_length,
                                               max_time=num_labels + 1, shared=shared))
    cell = {(c["utterances"], c["cuda_graphs"]): c for c in results["cells"]}
    memory = {m["shared_buffers"]: m for m in results["memory"]}
    results["ratios"] = {
        f"on_over_off_step_{n * beam}_hyps": cell[(n, True)]["step_ms"] / cell[(n, False)]["step_ms"]
        for n in (small_utts, large_utts)
    } | {
        f"on_over_off_host_cpu_{n * beam}_hyps": cell[(n, True)]["host_cpu_ms_per_step"]
        / cell[(n, False)]["host_cpu_ms_per_step"] for n in (small_utts, large_utts)
    } | {
        "memory_shared_over_per_bucket": memory[True]["device_bytes"] / memory[False]["device_bytes"],
        "buffers_shared_over_per_bucket": memory[True]["buffer_bytes"] / memory[False]["buffer_bytes"],
    }
    return write_results(results, output_dir, "graphs", plot_graphs)


def plot_graphs(results: dict, path) -> str | None:
    """Step time with graphs off/on at both batch sizes, and graph memory both ways."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    sizes = sorted({c["hypotheses"] for c in results["cells"]})
    width = 0.38
    for offset, on in ((-width / 2, False), (width / 2, True)):
        times = [next(c["step_ms"] for c in results["cells"] if c["hypotheses"] == n and c["cuda_graphs"] == on)
                 for n in sizes]
        left.bar(np.arange(len(sizes)) + offset, times, width, label="graphs on" if on else "graphs off")
    left.set_xticks(range(len(sizes)), [f"{n} hyps" for n in sizes])
    left.set_ylabel("ms per search step")
    left.legend()
    memory = results["memory"]
    right.bar(["shared buffers", "per bucket"],
              [m["device_bytes"] / 2**20 for m in sorted(memory, key=lambda m: not m["shared_buffers"])])
    right.set_ylabel("MiB held by the graphs (cudaMemGetInfo)")
    fig.suptitle(f"CUDA graphs, d={results['config']['model_dim']}, V={results['config']['vocab_size']}")
    return save_figure(plt, fig, path)


def format_table(results: dict) -> str:
    lines = ["| hypotheses | CUDA graphs | graphs captured | ms/step | host CPU ms/step | utterances/s |",
             "|---|---|---|---|---|---|"]
    for c in results["cells"]:
        lines.append(f"| {c['hypotheses']} | {'on' if c['cuda_graphs'] else 'off'} | {c['graphs_captured']} | "
                     f"{c['step_ms']:.2f} | {c['host_cpu_ms_per_step']:.2f} | {c['utterances_per_s']:.1f} |")
    lines += ["", "| graph buffers | graphs | device MiB (cudaMemGetInfo) | buffer MiB |", "|---|---|---|---|"]
    for m in results["memory"]:
        lines.append(f"| {'shared' if m['shared_buffers'] else 'per bucket'} | {m['graphs']} | "
                     f"{m['device_bytes'] / 2**20:.1f} | {m['buffer_bytes'] / 2**20:.1f} |")
    lines += ["", "; ".join(f"{k}: {v:.3f}" for k, v in results["ratios"].items())]
    return "\n".join(lines)
