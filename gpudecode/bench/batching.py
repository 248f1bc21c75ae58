"""Continuous vs static batching of the label-synchronous search on varied output lengths.

An attention decoder (6 layers, d = 512, 8 heads, vocabulary 10k, precomputed cross-attention
K/V; random weights) decodes a set of utterances whose output lengths vary between
``min_labels`` and ``max_labels`` (a length scorer forbids sentence-end before the utterance's
target length and forces it there). Input lengths — the sort key of both runs — correlate with
the output lengths only loosely, as in real data. Both runs take the utterances in the same
length-sorted (longest-first) order and keep at most K utterances in flight:

- **static**: consecutive batches of K utterances, each decoded until its longest is done;
- **continuous**: ``label_sync_search(..., max_active_utterances=K)``, finished utterances'
  lanes refilled as they free up (on CuPy the finished-groups mask is read one step late,
  ``SearchTuning.lagged_continuous_mask``);
- **continuous-mask-at-once**: the same with the mask read in the step that made it (a
  synchronisation per step; on numpy the two are the same).

Reported: utterances/s of each and their ratios to static, search steps, time per step, the
host's thread CPU and its waits for the GPU per step, refills, lane occupancy, state-pool
capacity and peak live token states, CuPy pool bytes, and the decoder-state tokens merged per
run against those the histories hold (``history_padding``: how much of the model's
self-attention input is left padding; a lane refilled mid-search sits beside long histories).
JSON + PNG.

Run: ``python -m gpudecode.bench.batching [--quick] [--output out/bench]`` (GPU), or
``--device cpu --quick`` for a smoke test.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpudecode.bench.common import decoder_export, pyplot, save_figure, write_results

from gpudecode.scorers import LabelScorer, UtteranceBatch

BOS, EOS = 0, 1


class TargetLengthScorer(LabelScorer):
    """Forbids sentence-end before each utterance's ``num-labels`` and forces it there.

    Per-utterance input ``num-labels`` [U] (written per lane at admission); context: [N] labels
    emitted so far.
    """

    def __init__(self, *, vocab_size: int):
        self.vocab_size = vocab_size

    def begin(self, layout):
        super().begin(layout)
        xp = layout.xp
        self._target = xp.zeros(layout.num_lanes, dtype=np.int64)
        self._forbid = xp.zeros(self.vocab_size, np.float32)
        self._forbid[EOS] = -1e9
        self._force = xp.full(self.vocab_size, -1e9, np.float32)
        self._force[EOS] = 0.0

    def admit(self, utterances, groups):
        xp = self.layout.xp
        targets = xp.asarray(np.asarray(utterances.inputs["num-labels"]), dtype=np.int64)
        self._target[xp.asarray(self.layout.lanes_of(groups))] = xp.repeat(targets, self.layout.beam_size)

    def initial_context(self, groups, ctx=None):
        xp = self.layout.xp
        count = xp.zeros(self.layout.num_lanes, dtype=np.int64) if ctx is None else ctx.copy()
        count[xp.asarray(self.layout.lanes_of(groups))] = 0
        return count

    def score(self, count):
        return self.layout.xp.where((count >= self._target)[:, None], self._force, self._forbid)

    def extend(self, count, parents, labels):
        return count[parents] + (labels >= 0)


def make_lengths(num_utts: int, min_labels: int, max_labels: int, seed: int = 0):
    """(input lengths, target output lengths): outputs uniform in [min, max], inputs ≈ 2 × output
    × lognormal(0, 0.4) noise (so sorting by input only roughly sorts by output)."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(min_labels, max_labels + 1, num_utts)
    inputs = np.maximum(np.round(2 * targets * rng.lognormal(0.0, 0.4, num_utts)), 1).astype(np.int64)
    return inputs, targets


@dataclass
class BatchingModes:
    """The two modes of the bench over one decoder, ready to run (:func:`batching_modes`).

    ``static()`` / ``continuous()`` / ``continuous_mask_at_once()`` decode all utterances (n-best
    lists in input order);
    ``counts`` holds the steps and merged / kept history tokens of the last run (reset it first);
    ``sync()`` waits for the GPU."""

    static: Callable[[], list]
    continuous: Callable[[], list]
    continuous_mask_at_once: Callable[[], list]
    warm_up: Callable[[], None]
    sync: Callable[[], None]
    decoder: object
    inputs: np.ndarray  # input lengths (the sort key)
    targets: np.ndarray  # output lengths
    counts: dict
    dims: dict  # the decoder's sizes


def batching_modes(*, num_utts: int = 512, max_active: int = 64, beam: int = 8, min_labels: int = 10,
                   max_labels: int = 200, encoder_length: int = 100, device: str = "cuda", quick: bool = False,
                   cuda_graphs: bool = False, max_batch_size: int | None = None,
                   utterance_rows: str = "utterance", export: str = "new-step",
                   dtype: str = "float32", tuning=None, stats=None) -> BatchingModes:
    """Builds the bench's decoder, utterances and both modes (arguments as :func:`run_batching_bench`;
    every search runs with ``tuning`` and adds to ``stats``)."""
    from gpudecode.backend import array_module, shared_stream
    from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer
    from gpudecode.search import LabelSyncOptions, label_sync_search
    from gpudecode.search.tuning import DEFAULT_TUNING
    from gpudecode.search.batching import admission_order
    from gpudecode.session import OnnxSession, SessionOptions
    from gpudecode.session.graphs import GraphOptions
    from gpudecode.states.options import StateManagerOptions
    from gpudecode.testing import build_transformer_decoder

    if cuda_graphs and device != "cuda":
        raise ValueError("bench batching: CUDA graphs need device cuda")
    xp = array_module(device)
    dims = dict(vocab_size=10_000, model_dim=512, num_layers=6, num_heads=8, ffn_dim=2048)
    if quick:
        dims = dict(vocab_size=500, model_dim=64, num_layers=2, num_heads=4, ffn_dim=128)
    reference = build_transformer_decoder(0, max_positions=max_labels + 8, utterance_rows=utterance_rows, **dims,
                                          dtype=np.dtype(dtype), **decoder_export(export))
    session = OnnxSession(reference.serialized(), SessionOptions(device=device, use_tf32=False,
                                                                 cuda_graphs=cuda_graphs))
    if cuda_graphs and not session.cuda_graphs:
        raise RuntimeError(f"the benchmark decoder cannot be captured: {session.graph_blocker}")
    inputs, targets = make_lengths(num_utts, min_labels, max_labels)
    rng = np.random.default_rng(1)
    shape = (num_utts, reference.num_heads, encoder_length, reference.head_dim)
    cross = {f"cross-{kind}-{layer}": xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
             for layer in range(reference.num_layers) for kind in ("key", "value")}
    batch = UtteranceBatch(ids=[str(u) for u in range(num_utts)], input_lengths=inputs,
                           inputs={**cross, "num-labels": targets},
                           sizes={k: np.full(num_utts, encoder_length) for k in cross})
    manager = "transformer-cuda" if device == "cuda" else "transformer-cpu"
    decoder = OnnxDecoderScorer(model=session, vocab_size=reference.vocab_size, start_labels=[BOS],
                                state_manager=StateManagerOptions(type=manager, slots_per_chunk=16384),
                                graphs=GraphOptions(enabled=cuda_graphs), max_batch_size=max_batch_size)
    options = LabelSyncOptions(beam_size=beam, sentence_end=EOS, max_labels_per_input=8.0,
                               max_labels=max_labels + 1)
    counts = {"steps": 0, "merged": 0, "kept": None}
    original_score = decoder.score

    def counting_score(ctx):
        counts["steps"] += 1
        return original_score(ctx)

    decoder.score = counting_score
    # decoder-state tokens per step: merged (T of the batched inputs x rows, padding included)
    # and kept (the histories' own lengths; summed on the device, no synchronisation)
    original_merge = decoder.states.merge

    def counting_merge(histories, **kwargs):
        merged = original_merge(histories, **kwargs)
        counts["merged"] += int(merged.time_size) * histories.num_rows
        kept = merged.prefix_lengths[:histories.num_rows].sum(dtype=np.int64)
        counts["kept"] = kept if counts["kept"] is None else counts["kept"] + kept
        return merged

    decoder.states.merge = counting_merge
    scorers = [("decoder", decoder, 1.0), ("length", TargetLengthScorer(vocab_size=reference.vocab_size), 1.0)]
    order = admission_order(inputs, "longest-first")

    def sync():
        if device == "cuda":
            shared_stream(0).synchronize()

    def static():
        results = [None] * num_utts
        for start in range(0, num_utts, max_active):
            chosen = order[start:start + max_active]
            for u, nbest in zip(chosen, label_sync_search(scorers, batch.select(chosen), options, xp=xp,
                                                          tuning=tuning, stats=stats)):
                results[u] = nbest
        return results

    tuning = tuning or DEFAULT_TUNING
    mask_at_once = dataclasses.replace(tuning, lagged_continuous_mask=False)

    def continuous(tuning=tuning):
        return label_sync_search(scorers, batch, options, xp=xp, max_active_utterances=max_active,
                                 admission_order="longest-first", tuning=tuning, stats=stats)

    def continuous_mask_at_once():
        return continuous(mask_at_once)

    def warm_up():
        if quick:
            warm = batch.select(order[:max_active])
            label_sync_search(scorers, warm, options, xp=xp, tuning=tuning)  # compilation, first allocations
            label_sync_search(scorers, warm, options, xp=xp, max_active_utterances=max_active // 2 or 1, tuning=tuning)
        else:  # each mode once: compilation, first allocations, every graph bucket it uses
            static()
            continuous()
            continuous_mask_at_once()

    return BatchingModes(static=static, continuous=continuous, continuous_mask_at_once=continuous_mask_at_once,
                         warm_up=warm_up, sync=sync, decoder=decoder, inputs=inputs, targets=targets, counts=counts,
                         dims=dims)


def run_batching_bench(*, num_utts: int = 512, max_active: int = 64, beam: int = 8, min_labels: int = 10,
                       max_labels: int = 200, encoder_length: int = 100, device: str = "cuda",
                       quick: bool = False, output_dir=None, cuda_graphs: bool = False,
                       max_batch_size: int | None = None, utterance_rows: str = "utterance",
                       export: str = "new-step", dtype: str = "float32", rounds: int = 5,
                       host_wait: str = "nap") -> dict:
    """Runs both modes in one process, each once untimed first (compilation, allocations, every
    CUDA-graph capture; ``quick``: a short warm-up), then ``rounds`` timed rounds of both, the
    order alternating (a slow spell of the host hits both alike); each mode's fastest round
    counts. Returns (and writes) the results.
    ``host_wait``: "nap" (the library's default: the host polls while it waits for the GPU and
    sleeps in between, 100 µs first, doubling up to 1 ms), "block" (it sleeps in the driver) or
    "spin" (it polls); results as ``batching[...]-block.json`` / ``-spin.json``.
    ``utterance_rows``: the decoder's cross-attention inputs per utterance or ("lane", results
    as ``batching[...]-lane.json``) per hypothesis.
    ``cuda_graphs`` (CUDA only): the decoder step runs as CUDA graphs in both modes.
    ``max_batch_size``: lanes per decoder call (the scorer's chunks; default all lanes).
    ``export``: how the decoder is exported (``common.DECODER_EXPORTS``; "full-history": results
    as ``batching[...]-full-history.json``). ``dtype``: the decoder's float type (``float16``:
    results as ``batching[...]-float16.json``)."""
    from gpudecode.backend import HostWait, array_module
    from gpudecode.search.stats import SearchStats
    from gpudecode.search.tuning import SearchTuning

    if rounds < 1:
        raise ValueError(f"bench batching: rounds must be >= 1, got {rounds}")
    stats = SearchStats()
    modes = batching_modes(num_utts=num_utts, max_active=max_active, beam=beam, min_labels=min_labels,
                           max_labels=max_labels, encoder_length=encoder_length, device=device, quick=quick,
                           cuda_graphs=cuda_graphs, max_batch_size=max_batch_size, utterance_rows=utterance_rows,
                           export=export, dtype=dtype, tuning=SearchTuning(host_wait=HostWait(host_wait)),
                           stats=stats)
    xp, decoder, targets, counts = array_module(device), modes.decoder, modes.targets, modes.counts
    modes.warm_up()
    runs = (("static", modes.static), ("continuous", modes.continuous),
            ("continuous-mask-at-once", modes.continuous_mask_at_once))
    cells, timings = {}, {name: [] for name, _ in runs}
    for r in range(rounds):
        for name, run in runs if r % 2 == 0 else runs[::-1]:
            captured = decoder.captured_graphs
            counts.update(steps=0, merged=0, kept=None)
            modes.sync()
            stats.reset()
            cpu, wall = time.thread_time(), time.perf_counter()
            results = run()
            modes.sync()
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            got = np.array([len(r[0].labels) for r in results])
            assert (got == targets).all(), "the target output lengths were not kept"
            cells[name] = _cell(decoder, xp, device, counts, targets, max_active, captured)
            steps = counts["steps"]
            timings[name].append({"seconds": wall, "ms_per_step": 1e3 * wall / steps,
                                  "host_cpu_ms_per_step": 1e3 * cpu / steps,
                                  "host_cpu_outside_waits_ms_per_step": 1e3 * (cpu - stats.host_waits.cpu_s) / steps,
                                  "waits_per_step": stats.host_waits.count / steps,
                                  "wait_ms_per_step": 1e3 * stats.host_waits.wall_s / steps,
                                  "refills": stats.refills.count,
                                  "refill_host_cpu_ms_per_step": 1e3 * stats.refills.cpu_s / steps})
    for name, cell in cells.items():
        fastest = min(timings[name], key=lambda t: t["seconds"])
        cell.update(fastest, utterances_per_s=num_utts / fastest["seconds"],
                    round_seconds=[t["seconds"] for t in timings[name]])
    decoder.close()
    results = {
        "benchmark": "batching",
        "config": {**modes.dims, "device": device, "cuda_graphs": cuda_graphs, "max_batch_size": max_batch_size,
                   "utterance_rows": utterance_rows, "decoder_export": export, "dtype": dtype,
                   "utterances": num_utts, "max_active_utterances": max_active,
                   "beam": beam, "output_labels": [min_labels, max_labels], "encoder_length": encoder_length,
                   "order": "longest-first by input length (both runs)", "rounds": rounds, "host_wait": host_wait,
                   "timing": "each mode's fastest of the rounds (order alternating)",
                   "input_output_length_correlation": float(np.corrcoef(modes.inputs, targets)[0, 1])},
        "cells": cells,
        "ratios": {"continuous_over_static_throughput":
                   cells["continuous"]["utterances_per_s"] / cells["static"]["utterances_per_s"],
                   "continuous_mask_at_once_over_static_throughput":
                   cells["continuous-mask-at-once"]["utterances_per_s"] / cells["static"]["utterances_per_s"]},
    }
    name = "batching" + ("-graphs" if cuda_graphs else "") + (f"-calls{max_batch_size}" if max_batch_size else "")
    name += ("-lane" if utterance_rows == "lane" else "") + ("" if export == "new-step" else f"-{export}")
    name += ("" if dtype == "float32" else f"-{dtype}") + ("" if host_wait == "nap" else f"-{host_wait}")
    return write_results(results, output_dir, name, plot_batching)


def _cell(decoder, xp, device: str, counts: dict, targets, max_active: int, captured: int) -> dict:
    """The figures of one timed run besides its time."""
    stats = decoder.states.statistics()
    num_steps = counts["steps"]
    return {"steps": num_steps, "lane_occupancy": float(targets.sum() + len(targets)) / (num_steps * max_active),
            "pool_capacity_slots": stats.capacity_slots, "pool_peak_live_slots": stats.peak_live_slots,
            "pool_bytes": stats.bytes,
            "cupy_pool_bytes": int(xp.get_default_memory_pool().total_bytes()) if device == "cuda" else None,
            "graphs_captured_while_timed": decoder.captured_graphs - captured,
            "history_tokens_merged": counts["merged"], "history_tokens_kept": int(counts["kept"]),
            "history_padding": counts["merged"] / max(int(counts["kept"]), 1)}


def plot_batching(results: dict, path) -> str | None:
    """Utterances/s and lane occupancy per mode."""
    plt = pyplot()
    if plt is None:
        return None
    cells = results["cells"]
    names = list(cells)
    colors = ["#999999", "#1f77b4", "#ff7f0e"][:len(names)]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(names, [cells[n]["utterances_per_s"] for n in names], color=colors)
    axes[0].set_ylabel("utterances / s")
    ratios = results["ratios"]
    axes[0].set_title(f"÷ static: {ratios['continuous_over_static_throughput']:.2f} (continuous), "
                      f"{ratios['continuous_mask_at_once_over_static_throughput']:.2f} (mask at once)", fontsize=9)
    axes[1].bar(names, [100 * cells[n]["lane_occupancy"] for n in names], color=colors)
    axes[1].set_ylabel("busy lane groups per step (%)")
    c = results["config"]
    fig.suptitle(f"{c['utterances']} utterances, K={c['max_active_utterances']}, beam {c['beam']}, "
                 f"{c['output_labels'][0]}–{c['output_labels'][1]} labels")
    return save_figure(plt, fig, path)


def format_table(results: dict) -> str:
    lines = ["| mode | utterances/s | seconds | steps | ms per step | host CPU ms per step (outside waits) "
             "| waits per step | waiting ms per step | refills (host CPU ms per step) | lane occupancy "
             "| pool capacity / peak live slots | merged ÷ kept history tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in results["cells"].items():
        lines.append(f"| {name} | {c['utterances_per_s']:.1f} | {c['seconds']:.2f} | {c['steps']} | "
                     f"{c['ms_per_step']:.2f} | {c['host_cpu_ms_per_step']:.2f} "
                     f"({c['host_cpu_outside_waits_ms_per_step']:.2f}) | {c['waits_per_step']:.2f} | "
                     f"{c['wait_ms_per_step']:.2f} | {c['refills']} ({c['refill_host_cpu_ms_per_step']:.2f}) | "
                     f"{100 * c['lane_occupancy']:.0f}% | {c['pool_capacity_slots']} / {c['pool_peak_live_slots']} | "
                     f"{c['history_padding']:.2f} |")
    lines.append("")
    for key, value in results["ratios"].items():
        lines.append(f"{key.replace('_', ' ')}: {value:.3f}")
    return "\n".join(lines)
