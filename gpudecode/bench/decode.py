"""``gpudecode bench decode``: label-synchronous decoding of an attention decoder on the GPU.

A realistic decoder (6 layers, d = 512, 8 heads, vocabulary 10k, precomputed cross-attention K/V;
random weights) decodes a fixed number of labels per utterance (sentence-end is forbidden until
the last step, then forced). Measured in one run, every figure as a ratio against its baseline:
- ``transformer-cuda`` ÷ ``transformer-cpu`` state manager, both with the same CUDA session;
- beam 8 ÷ beam 1;
- host CPU time per step (thread CPU time) at 4,096 ÷ 64 hypotheses.
"""

from __future__ import annotations

import time

import numpy as np

from gpudecode.bench.common import decoder_export, pyplot, save_figure, write_results
from gpudecode.scorers import LabelScorer, UtteranceBatch

BOS, EOS = 0, 1


class FixedLengthScorer(LabelScorer):
    """Forbids sentence-end before ``num_labels`` labels and forces it afterwards.

    ``gpu_delay_ns``: each step also queues a GPU delay of that many nanoseconds (a control: the
    step becomes GPU-bound, so the host waits as long as it does for a large batch)."""

    def __init__(self, *, vocab_size: int, num_labels: int, gpu_delay_ns: int = 0):
        self.vocab_size, self.num_labels = vocab_size, num_labels
        self.gpu_delay_ns = gpu_delay_ns
        self._delay = None

    def begin(self, layout):
        super().begin(layout)
        xp = layout.xp
        if self.gpu_delay_ns:
            from gpudecode.kernels import load_module

            self._delay = load_module("bench_delay", (), xp.cuda.Device().id).get_function("gpu_delay")
        forbid = xp.zeros(self.vocab_size, np.float32)
        forbid[EOS] = -1e9
        force = xp.full(self.vocab_size, -1e9, np.float32)
        force[EOS] = 0.0
        # one row for every lane (a broadcast view): the label step reads the row, never an [N, V] array
        self._forbid = xp.broadcast_to(forbid, (layout.num_lanes, self.vocab_size))
        self._force = xp.broadcast_to(force, (layout.num_lanes, self.vocab_size))

    def initial_context(self, groups, ctx=None):
        return 0

    def score(self, ctx):
        if self._delay is not None:  # on the current stream: the search's shared one
            self._delay((1,), (1,), (np.uint64(self.gpu_delay_ns),))
        return self._force if ctx >= self.num_labels else self._forbid

    def extend(self, ctx, parents, labels):
        return ctx + 1


def _blocking_sync() -> bool:
    """Makes CUDA synchronisation block instead of spin (driver API), so thread CPU time counts
    only host work. False where the driver refuses."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device = ctypes.c_int()
        ok = driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(device), 0) == 0
        return ok and driver.cuDevicePrimaryCtxSetFlags(device, 4) == 0  # CU_CTX_SCHED_BLOCKING_SYNC
    except OSError:
        return False


def _utterances(cupy, reference, num_utts: int, encoder_length: int, seed: int,
                dtype: str = "float32") -> UtteranceBatch:
    rng = np.random.default_rng(seed)
    shape = (num_utts, reference.num_heads, encoder_length, reference.head_dim)
    inputs = {}
    for layer in range(reference.num_layers):
        for kind in ("key", "value"):
            inputs[f"cross-{kind}-{layer}"] = cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
    return UtteranceBatch(ids=[str(i) for i in range(num_utts)], input_lengths=np.full(num_utts, encoder_length),
                          inputs=inputs)


class SearchCell:
    """One cell of the bench: ``utts`` utterances at ``beam`` with state manager ``manager``.

    A warm-up search of the same batch runs at construction (3 labels; with ``graphs``, all labels
    so every bucket is captured), so compilation, captures and first allocations stay out of the
    timing. Each :meth:`round` times one search of ``num_labels`` and one half as long (whose host
    CPU is subtracted: per-search work such as admission and the n-best lists cancels out);
    :meth:`result` reports the fastest round. Rounds of several cells can be interleaved
    (:func:`measure_interleaved`), so a slow spell of the host hits every cell alike.
    """

    def __init__(self, session, reference, manager: str, beam: int, utts: int, *, encoder_length: int,
                 num_labels: int, graphs=None, gpu_delay_ms: float = 0.0, tuning=None):
        from gpudecode.backend import require_cupy, shared_stream
        from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer
        from gpudecode.search.stats import SearchStats
        from gpudecode.search.tuning import DEFAULT_TUNING
        from gpudecode.session.graphs import GraphOptions
        from gpudecode.states.options import StateManagerOptions

        cupy = require_cupy()
        self.tuning, self.stats = tuning or DEFAULT_TUNING, SearchStats()
        self.stream = shared_stream(0)
        self.manager, self.beam, self.utts, self.num_labels = manager, beam, utts, num_labels
        self.reference, self.gpu_delay_ns = reference, int(gpu_delay_ms * 1e6)
        self.batch = _utterances(cupy, reference, utts, encoder_length, seed=1, dtype=reference.dtype)
        self.graphs = graphs or GraphOptions()
        self.decoder = OnnxDecoderScorer(model=session, vocab_size=reference.vocab_size, start_labels=[BOS],
                                         state_manager=StateManagerOptions(type=manager, slots_per_chunk=65536),
                                         graphs=self.graphs)
        # wall, cpu, wait cpu; the half search's cpu, wait cpu; step-loop cpu per step
        self.rounds: list[tuple[float, float, float, float, float, float]] = []
        self.nbest = self.search(num_labels if self.graphs.enabled else 3)

    def search(self, labels: int):
        from gpudecode.backend import require_cupy
        from gpudecode.search import LabelSyncOptions, label_sync_search

        vocab_size = self.reference.vocab_size
        scorers = [("decoder", self.decoder, 1.0),
                   ("length", FixedLengthScorer(vocab_size=vocab_size, num_labels=labels,
                                                gpu_delay_ns=self.gpu_delay_ns), 1.0)]
        options = LabelSyncOptions(beam_size=self.beam, sentence_end=EOS, max_labels_per_input=1.0,
                                   max_labels=labels + 1)
        return label_sync_search(scorers, self.batch, options, xp=require_cupy(), tuning=self.tuning,
                                 stats=self.stats)

    def _timed(self, labels: int) -> tuple[float, float, float, float]:
        """(wall, thread CPU, thread CPU inside the waits, thread CPU per step of the step loop)
        seconds of one search (the waits: the search's own, :class:`gpudecode.search.stats.SearchStats`)."""
        stats = self.stats
        self.stream.synchronize()
        stats.reset()
        wall, cpu = time.perf_counter(), time.thread_time()
        self.nbest = self.search(labels)
        self.stream.synchronize()
        loop_cpu_per_step = stats.step_loop.cpu_s / max(stats.step_loop.count, 1)
        return time.perf_counter() - wall, time.thread_time() - cpu, stats.host_waits.cpu_s, loop_cpu_per_step

    def round(self) -> None:
        wall, cpu, wait, loop = self._timed(self.num_labels)
        assert all(len(n[0].labels) == self.num_labels for n in self.nbest), "the fixed output length was not kept"
        half = self._timed(self.num_labels // 2)[1:3] if self._extra_step else (0.0, 0.0)
        self.rounds.append((wall, cpu, wait, *half, loop))

    @property
    def _extra_step(self) -> bool:
        return self.manager.endswith("cuda") and self.num_labels // 2 > 0

    def result(self) -> dict:
        """The fastest round's figures (and, plain CUDA runs, GPU time per phase of one more run)."""
        wall, cpu, wait_cpu, cpu_half, wait_half, _ = min(self.rounds)
        step_loop_cpu = min(r[5] for r in self.rounds)
        num_labels, half = self.num_labels, self.num_labels // 2
        steps = num_labels + 1
        measure_phases = self.manager.endswith("cuda") and not self.graphs.enabled  # replays bypass session.run
        phases = _phase_times(self.decoder, self.stream, lambda: self.search(num_labels)) if measure_phases else {}
        extra = {}
        if self._extra_step:
            extra = {"host_cpu_ms_per_extra_step": 1000 * (cpu - cpu_half) / (num_labels - half),
                     "host_work_ms_per_extra_step": 1000 * ((cpu - wait_cpu) - (cpu_half - wait_half))
                     / (num_labels - half)}
        return {"graphs_captured": self.decoder.captured_graphs, "state_manager": self.manager,
                "gpu_delay_ms": self.gpu_delay_ns / 1e6,
                "cuda_graphs": self.graphs.enabled, "beam": self.beam, "utterances": self.utts,
                "hypotheses": self.beam * self.utts, "rounds": len(self.rounds),
                "seconds": wall, "step_ms": 1000 * wall / steps, "host_cpu_ms_per_step": 1000 * cpu / steps,
                "host_wait_cpu_ms_per_step": 1000 * wait_cpu / steps, **extra,
                "host_cpu_ms_per_loop_step": 1000 * step_loop_cpu,
                "utterances_per_s": self.utts / wall,
                **{f"{name}_ms_per_step": 1000 * seconds / steps for name, seconds in phases.items()}}

    def close(self) -> None:
        from gpudecode.backend import require_cupy

        self.decoder.close()
        require_cupy().get_default_memory_pool().free_all_blocks()


def measure_interleaved(cells: list[SearchCell], rounds: int) -> list[dict]:
    """``rounds`` rounds of every cell, one cell after the other in each round; each cell's fastest."""
    for _ in range(rounds):
        for cell in cells:
            cell.round()
    results = [cell.result() for cell in cells]
    for cell in cells:
        cell.close()
    return results


def measure_search(session, reference, manager: str, beam: int, utts: int, *, encoder_length: int,
                   num_labels: int, repeats: int = 1, graphs=None, tuning=None) -> dict:
    """The fastest of ``repeats`` timed searches of one cell (see :class:`SearchCell`)."""
    return measure_interleaved([SearchCell(session, reference, manager, beam, utts, encoder_length=encoder_length,
                                           num_labels=num_labels, graphs=graphs, tuning=tuning)], repeats)[0]


def _phase_times(decoder, stream, run) -> dict[str, float]:
    """GPU seconds per phase (model, merge, split; the rest of the step is search) of one more run,
    from CUDA events around the scorer's merge, model call and split on the shared stream."""
    import cupy

    marks: dict[str, list] = {"model": [], "merge": [], "split": []}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = stream.record()
            result = fn(*args, **kwargs)
            marks[name].append((start, stream.record()))
            return result
        return wrapper

    originals = (decoder.session.run, decoder.states.merge, decoder.states.split)
    decoder.session.run = timed("model", originals[0])
    decoder.states.merge = timed("merge", originals[1])
    decoder.states.split = timed("split", originals[2])
    try:
        stream.synchronize()
        begin = stream.record()
        run()
        end = stream.record()
        end.synchronize()
    finally:
        del decoder.session.run, decoder.states.merge, decoder.states.split
    seconds = {name: sum(cupy.cuda.get_elapsed_time(a, b) for a, b in pairs) / 1000 for name, pairs in marks.items()}
    seconds["rest"] = cupy.cuda.get_elapsed_time(begin, end) / 1000 - sum(seconds.values())
    return seconds


def run_decode_bench(*, num_utts: int = 64, encoder_length: int = 200, num_labels: int = 50,
                     beams=(1, 4, 8, 16), large_utts: int = 512, output_dir=None, quick: bool = False,
                     cuda_graphs: bool = False, utterance_rows: str = "utterance", tf32: bool = False,
                     host_wait: str = "nap", export: str = "new-step", rounds: int = 5,
                     control_delay_ms: float = 0.0, dtype: str = "float32",
                     graph_time_step: int | None = None, stop_test: tuple[int, int] | None = None) -> dict:
    """Runs every measurement in one process; returns (and writes) the results.

    ``utterance_rows``: the decoder's cross-attention keys/values have one row per utterance
    (each beam attends to its utterance's row) or, with "lane", one row per hypothesis (results
    as ``decode[-graphs]-lane.json``).

    ``cuda_graphs``: the CUDA-manager cells run the decoder step as CUDA graphs (results as
    ``decode-graphs.json``); the CPU-manager baseline cannot be captured and runs plain.

    ``tf32``: the decoder's float32 matrix products on TF32 tensor cores (ONNX Runtime's
    ``use_tf32``; results as ``decode[-graphs]-tf32.json``). Off by default, as in the library: the
    results equal the CPU's only without it.

    ``host_wait``: how the search waits for the GPU (``SearchTuning.host_wait``): "nap" (the
    library's default: the host polls and sleeps in between, 100 µs first, each sleep twice as long
    up to 1 ms), "block" (it sleeps in the driver; ``*-block.json``) or "spin" (it polls;
    ``*-spin.json``). Host CPU time is reported with and without the search's waits
    (``host_work_ms_per_extra_step``: the extra step's thread CPU time outside them).

    ``rounds``: timed rounds of each CUDA-manager cell, interleaved (each cell's fastest counts).

    ``control_delay_ms`` > 0: one more cell, beam 1 × ``num_utts`` with a GPU delay of that many
    ms queued in every step, so the host waits about as long per step as at 4,096 hypotheses; the
    ratio ``host_cpu_per_loop_step_4096_over_64_gpu_bound`` compares host CPU per step at equal
    waiting (what grows with the hypotheses, apart from what waiting does to the host).

    ``graph_time_step``: the CUDA graphs' history bucket step (``GraphOptions.time_step``; default:
    the library's; results as ``*-step<N>.json``). The results give the device memory in use once
    every cell has been built (all graphs captured).

    ``stop_test`` = (lag, every): the search reads its stop flag ``lag`` posts late and posts it
    every ``every`` steps (``SearchTuning.stop_test_lag`` / ``stop_test_every``; default the
    library's; results as ``*-stop<lag>x<every>.json``).

    ``export``: how the decoder is exported (``common.DECODER_EXPORTS``; "full-history": results
    as ``*-full-history.json``). ``dtype``: the decoder's float type (``float16``: results as
    ``*-float16.json``).
    """
    from gpudecode.backend import HostWait, require_cupy
    from gpudecode.search.tuning import DEFAULT_TUNING, SearchTuning
    from gpudecode.session import OnnxSession, SessionOptions
    from gpudecode.session.graphs import GraphOptions
    from gpudecode.testing import build_transformer_decoder

    if not {1, 8} <= set(beams):
        raise ValueError(f"beams: the ratios need beams 1 and 8, got {list(beams)}")
    lag, every = stop_test or (DEFAULT_TUNING.stop_test_lag, DEFAULT_TUNING.stop_test_every)
    tuning = SearchTuning(host_wait=HostWait(host_wait), stop_test_lag=lag, stop_test_every=every)
    # before any CUDA work: waiting in the driver must not count as host CPU time
    blocking = _blocking_sync() if host_wait != "spin" else False
    require_cupy()
    dims = dict(vocab_size=10_000, model_dim=512, num_layers=6, num_heads=8, ffn_dim=2048)
    if quick:
        dims = dict(vocab_size=1000, model_dim=128, num_layers=2, num_heads=4, ffn_dim=256)
    reference = build_transformer_decoder(0, max_positions=num_labels + 8, utterance_rows=utterance_rows, **dims,
                                          dtype=np.dtype(dtype), **decoder_export(export))
    session = OnnxSession(reference.serialized(), SessionOptions(device="cuda", use_tf32=tf32))
    cuda_session, graphs = session, None
    if cuda_graphs:
        cuda_session = OnnxSession(reference.serialized(), SessionOptions(device="cuda", use_tf32=tf32,
                                                                          cuda_graphs=True))
        if not cuda_session.cuda_graphs:
            raise RuntimeError(f"the benchmark decoder cannot be captured: {cuda_session.graph_blocker}")
        graphs = GraphOptions(enabled=True, **({} if graph_time_step is None else {"time_step": graph_time_step}))
    fixed = dict(encoder_length=encoder_length, num_labels=num_labels)
    results = {"benchmark": "decode", "config": {**dims, "encoder_length": encoder_length, "num_labels": num_labels,
                                                 "utterances": num_utts, "cross_attention": "precomputed",
                                                 "utterance_rows": utterance_rows, "tf32": tf32,
                                                 "decoder_export": export, "dtype": dtype,
                                                 "cuda_graphs": "CUDA-manager cells" if cuda_graphs else "off",
                                                 "host_sync": "blocking" if blocking else "spin (host CPU includes waits)",
                                                 "host_wait": host_wait,
                                                 "naps_us": [tuning.host_wait.nap_s * 1e6,
                                                             tuning.host_wait.max_nap_s * 1e6]
                                                 if host_wait == "nap" else None,
                                                 "timing": f"fastest of {rounds} interleaved rounds (CPU manager: 1)"},
               "cells": []}

    # the CUDA-manager cells in interleaved rounds (a slow spell of the host hits all alike)
    cuda_cells = [SearchCell(cuda_session, reference, "transformer-cuda", beam, utts, graphs=graphs, tuning=tuning,
                             **fixed)
                  for beam, utts in [*((b, num_utts) for b in beams), (8, large_utts)]]
    if control_delay_ms > 0:
        cuda_cells.append(SearchCell(cuda_session, reference, "transformer-cuda", 1, num_utts, graphs=graphs,
                                     gpu_delay_ms=control_delay_ms, tuning=tuning, **fixed))
    free, total = require_cupy().cuda.runtime.memGetInfo()
    results["config"]["device_memory_in_use_gb"] = (total - free) / 1e9
    results["config"]["graph_time_step"] = graphs.time_step if graphs is not None else None
    results["config"]["stop_test_lag_every"] = [tuning.stop_test_lag, tuning.stop_test_every]
    measured = measure_interleaved(cuda_cells, rounds)
    control = measured.pop() if control_delay_ms > 0 else None
    results["cells"] = measured
    results["cells"].insert(len(beams), measure_search(session, reference, "transformer-cpu", 8, num_utts,
                                                       tuning=tuning, **fixed))
    if control is not None:
        results["control_cell"] = control
    cell = {(c["state_manager"], c["beam"], c["utterances"]): c for c in results["cells"]}
    cuda8, cpu8 = cell[("transformer-cuda", 8, num_utts)], cell[("transformer-cpu", 8, num_utts)]
    beam1, large = cell[("transformer-cuda", 1, num_utts)], cell[("transformer-cuda", 8, large_utts)]
    results["ratios"] = {
        "cuda_over_cpu_manager_beam8": cuda8["seconds"] / cpu8["seconds"],
        "beam8_over_beam1": cuda8["seconds"] / beam1["seconds"],
        "host_cpu_per_step_4096_over_64": large["host_cpu_ms_per_step"] / beam1["host_cpu_ms_per_step"],
        "host_cpu_per_extra_step_4096_over_64": (large["host_cpu_ms_per_extra_step"]
                                                 / beam1["host_cpu_ms_per_extra_step"]),
        "host_work_per_extra_step_4096_over_64": (large["host_work_ms_per_extra_step"]
                                                  / beam1["host_work_ms_per_extra_step"]),
        "host_cpu_per_loop_step_4096_over_64": (large["host_cpu_ms_per_loop_step"]
                                                / beam1["host_cpu_ms_per_loop_step"]),
    }
    if control is not None:
        results["ratios"]["host_cpu_per_loop_step_4096_over_64_gpu_bound"] = (
            large["host_cpu_ms_per_loop_step"] / control["host_cpu_ms_per_loop_step"])
    name = (("decode-graphs" if cuda_graphs else "decode") + ("-lane" if utterance_rows == "lane" else "")
            + ("-tf32" if tf32 else "") + ("" if host_wait == "nap" else f"-{host_wait}")
            + ("" if stop_test is None else f"-stop{stop_test[0]}x{stop_test[1]}")
            + ("" if graph_time_step is None else f"-step{graph_time_step}")
            + ("" if export == "new-step" else f"-{export}") + ("" if dtype == "float32" else f"-{dtype}"))
    return write_results(results, output_dir, name, plot_decode)


def plot_decode(results: dict, path) -> str | None:
    """Step time per beam (CUDA manager) with the CPU-manager baseline at beam 8."""
    plt = pyplot()
    if plt is None:
        return None
    cuda = [c for c in results["cells"] if c["state_manager"] == "transformer-cuda"
            and c["utterances"] == results["config"]["utterances"]]
    cpu = [c for c in results["cells"] if c["state_manager"] == "transformer-cpu"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([c["beam"] for c in cuda], [c["step_ms"] for c in cuda], "o-", label="transformer-cuda")
    ax.plot([c["beam"] for c in cpu], [c["step_ms"] for c in cpu], "s", label="transformer-cpu (same CUDA session)")
    ax.set_xlabel("beam size")
    ax.set_ylabel("ms per search step")
    ax.set_yscale("log")
    ax.set_title(f"{results['config']['utterances']} utterances, d={results['config']['model_dim']}, "
                 f"V={results['config']['vocab_size']}")
    ax.legend()
    return save_figure(plt, fig, path)


def format_table(results: dict) -> str:
    lines = ["| state manager | beam | utterances | ms/step | host CPU ms/step | host CPU ms/extra step "
             "| outside waits | step loop | utterances/s | GPU ms/step: model / merge / split / rest (search, idle) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in results["cells"]:
        split = " / ".join(f"{c[f'{p}_ms_per_step']:.2f}" for p in ("model", "merge", "split", "rest")
                           if f"{p}_ms_per_step" in c) or "–"
        extra = f"{c['host_cpu_ms_per_extra_step']:.2f}" if "host_cpu_ms_per_extra_step" in c else "–"
        work = f"{c['host_work_ms_per_extra_step']:.2f}" if "host_work_ms_per_extra_step" in c else "–"
        lines.append(f"| {c['state_manager']} | {c['beam']} | {c['utterances']} | {c['step_ms']:.2f} | "
                     f"{c['host_cpu_ms_per_step']:.2f} | {extra} | {work} | {c['host_cpu_ms_per_loop_step']:.2f} | "
                     f"{c['utterances_per_s']:.1f} | {split} |")
    r = results["ratios"]
    lines.append("")
    lines.append(f"CUDA ÷ CPU state manager (beam 8): {r['cuda_over_cpu_manager_beam8']:.3f}; "
                 f"beam 8 ÷ beam 1: {r['beam8_over_beam1']:.3f}; "
                 f"host CPU per step 4,096 ÷ 64 hypotheses: {r['host_cpu_per_step_4096_over_64']:.3f} "
                 f"(per extra step: {r['host_cpu_per_extra_step_4096_over_64']:.3f}; outside waits: "
                 f"{r['host_work_per_extra_step_4096_over_64']:.3f}; step loop alone: "
                 f"{r['host_cpu_per_loop_step_4096_over_64']:.3f})")
    if "control_cell" in results:
        c = results["control_cell"]
        lines.append(f"Control: beam 1 × {c['utterances']} with a {c['gpu_delay_ms']:.1f} ms GPU delay per step: "
                     f"{c['step_ms']:.2f} ms/step, step loop {c['host_cpu_ms_per_loop_step']:.2f} ms host CPU; "
                     f"4,096 ÷ 64 at equal waiting: {r['host_cpu_per_loop_step_4096_over_64_gpu_bound']:.3f}")
    return "\n".join(lines)
