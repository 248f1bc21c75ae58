"""``gpudecode bench ctc``: CTC prefix beam search on the GPU, with and without LSTM LM fusion.

Measured in one run (random, blank-heavy frame log-probs; random LM weights):
- frames/s (utterance frames decoded per second, all utterances of the batch together) of the
  prefix search at each beam and vocabulary size, without and with an LSTM LM (shallow fusion),
  and of batched greedy decoding on the same log-probs; the LM fusion cost is the with-LM ÷
  without-LM time;
- end to end with a pinned encoder (``build_ctc_encoder``: 12 layers, d = 512, 4× subsampling,
  64 utterances × 1,000 input frames): encoder + beam 8 ÷ encoder + greedy (goal ≤ 1.1), beam 8
  returning the best hypothesis (what greedy returns) and, as a second figure, the whole 8-best.

Every size is a parameter (the defaults are the issue's: 64 utterances × 10k frames); ``device``
"cpu" runs the same code on numpy (for a smoke test; figures only mean something on the GPU).
"""

from __future__ import annotations


import numpy as np

from gpudecode.backend import array_module
from gpudecode.bench.common import fastest, lstm_lm_scorer, pyplot, save_figure, write_results

BLANK = 0




def random_log_probs(xp, num_utts: int, num_frames: int, vocab_size: int, *, seed: int = 0,
                     sharpness: float = 4.0, blank_bias: float = 8.0):
    """[U, T, V] float32 log-softmax of random logits with a blank bias (generated on ``xp``)."""
    if xp is np:
        logits = np.random.default_rng(seed).standard_normal((num_utts, num_frames, vocab_size), np.float32)
    else:
        logits = xp.random.default_rng(seed).standard_normal((num_utts, num_frames, vocab_size),
                                                             dtype=np.float32)
    logits *= np.float32(sharpness)
    logits[:, :, BLANK] += np.float32(blank_bias)
    top = logits.max(axis=2, keepdims=True)
    logits -= top
    logits -= xp.log(xp.exp(logits).sum(axis=2, keepdims=True))
    return logits


def run_ctc_bench(*, num_utts: int = 64, num_frames: int = 10_000, vocab_sizes=(1000, 5000),
                  beams=(1, 8, 16), with_lm=(False, True), lm_hidden_dim: int = 512,
                  lm_embed_dim: int = 128, lm_layers: int = 1, encoder: bool = True,
                  encoder_frames: int = 1000, encoder_layers: int = 12, encoder_dim: int = 512,
                  encoder_vocab_size: int = 1000, subsampling: int = 4, num_features: int = 80,
                  device: str = "cuda", repeats: int = 1, output_dir=None) -> dict:
    """Runs every measurement in one process; returns (and writes ``ctc.json`` / ``ctc.png``)."""
    from gpudecode.search import CtcPrefixOptions, ctc_greedy_search, ctc_prefix_search
    from gpudecode.search.tuning import SearchTuning

    xp = array_module(device)
    results = {"benchmark": "ctc", "config": {
        "utterances": num_utts, "frames": num_frames, "vocab_sizes": list(vocab_sizes), "beams": list(beams),
        "lm": f"LSTM {lm_layers}x{lm_hidden_dim} (embedding {lm_embed_dim})", "device": device,
        "timing": f"fastest of {repeats} (LM cells: one run)", "log_probs": "random, blank-biased"}, "cells": []}
    lengths = np.full(num_utts, num_frames, dtype=np.int64)
    total_frames = num_utts * num_frames
    for vocab_size in vocab_sizes:
        log_probs = random_log_probs(xp, num_utts, num_frames, vocab_size)
        ctc_greedy_search(log_probs, lengths, xp=xp)  # warm-up: CuPy compiles its kernels per layout
        seconds, _ = fastest(xp, lambda: ctc_greedy_search(log_probs, lengths, xp=xp), repeats)
        results["cells"].append({"search": "greedy", "vocab_size": vocab_size, "beam": 1, "lm": False,
                                 "seconds": seconds, "frames_per_s": total_frames / seconds})
        for use_lm in with_lm:
            lm = lstm_lm_scorer(device, vocab_size, start_label=BLANK, hidden_dim=lm_hidden_dim,
                                embed_dim=lm_embed_dim, num_layers=lm_layers) if use_lm else None
            scorers = [("lm", lm, 0.3)] if use_lm else []
            for beam in beams:
                options = CtcPrefixOptions(beam_size=beam, sentence_end=None)
                # with the LM also with its frames launched one call at a time (no CUDA graphs)
                for captured in ((True, False) if use_lm and xp is not np else (True,)):
                    tuning = SearchTuning(captured_ctc_frames=captured)
                    ctc_prefix_search(log_probs[:, :8], np.full(num_utts, 8), options, scorers, xp=xp,
                                      tuning=tuning)  # warm-up
                    seconds, nbest = fastest(  # an LM cell takes seconds: timed once
                        xp, lambda: ctc_prefix_search(log_probs, lengths, options, scorers, xp=xp, tuning=tuning),
                        1 if use_lm else repeats)
                    results["cells"].append({
                        "search": "prefix", "vocab_size": vocab_size, "beam": beam, "lm": use_lm,
                        "captured_frames": captured if use_lm else None,
                        "seconds": seconds, "frames_per_s": total_frames / seconds,
                        "mean_labels": float(np.mean([len(h[0].labels) for h in nbest]))})
            if lm is not None:
                lm.close()
        log_probs = None  # frees the device memory before the next vocabulary
        if xp is not np:
            xp.get_default_memory_pool().free_all_blocks()

    cell = {(c["search"], c["vocab_size"], c["beam"], c["lm"], c.get("captured_frames") is not False): c
            for c in results["cells"]}
    ratios = {}
    for vocab_size in vocab_sizes:
        for beam in beams:
            with_, without = cell.get(("prefix", vocab_size, beam, True, True)), cell.get(("prefix", vocab_size, beam, False, True))
            launched = cell.get(("prefix", vocab_size, beam, True, False))
            if with_ and without:
                ratios[f"lm_fusion_cost_v{vocab_size}_beam{beam}"] = with_["seconds"] / without["seconds"]
            if with_ and launched:
                ratios[f"lm_frames_launched_over_replayed_v{vocab_size}_beam{beam}"] = launched["seconds"] / with_["seconds"]
    if encoder:
        results["end_to_end"] = _end_to_end(xp, device, num_utts=num_utts, num_frames=encoder_frames,
                                            num_layers=encoder_layers, model_dim=encoder_dim,
                                            vocab_size=encoder_vocab_size, subsampling=subsampling,
                                            num_features=num_features, repeats=repeats)
        ratios["end_to_end_beam8_over_greedy"] = results["end_to_end"]["beam8_over_greedy"]
        ratios["end_to_end_beam8_nbest8_over_greedy"] = results["end_to_end"]["beam8_nbest8_over_greedy"]
    results["ratios"] = ratios
    return write_results(results, output_dir, "ctc", plot_ctc)


def _end_to_end(xp, device: str, *, num_utts: int, num_frames: int, num_layers: int, model_dim: int,
                vocab_size: int, subsampling: int, num_features: int, repeats: int) -> dict:
    """Encoder + beam-8 prefix search ÷ encoder + greedy, on the same encoder outputs."""
    from gpudecode.search import CtcPrefixOptions, ctc_greedy_search, ctc_prefix_search
    from gpudecode.session import OnnxSession, SessionOptions
    from gpudecode.testing import build_ctc_encoder

    reference = build_ctc_encoder(0, num_features=num_features, vocab_size=vocab_size,
                                  subsampling=subsampling, model_dim=model_dim, num_layers=num_layers,
                                  blank_bias=2.0)
    session = OnnxSession(reference.serialized(), SessionOptions(device=device, use_tf32=False))
    rng = np.random.default_rng(0)
    features = xp.asarray(rng.standard_normal((num_utts, num_frames, num_features), dtype=np.float32))
    sizes = xp.asarray(np.full(num_utts, num_frames, np.int32))

    def encode():
        out = session.run({"features": features, "features-size": sizes})
        return xp.asarray(out["log-probs"]), out["log-probs-size"]

    # the same output as greedy (one transcript per utterance), and the whole 8-best
    best, nbest = CtcPrefixOptions(beam_size=8, nbest=1), CtcPrefixOptions(beam_size=8)
    encode()
    timings = {}
    for name, search in (("greedy", lambda lp, n: ctc_greedy_search(lp, n, xp=xp)),
                         ("beam8", lambda lp, n: ctc_prefix_search(lp, n, best, xp=xp)),
                         ("beam8_nbest8", lambda lp, n: ctc_prefix_search(lp, n, nbest, xp=xp))):
        search(*encode())  # warm-up (kernel compilation)
        timings[name], _ = fastest(xp, lambda: search(*encode()), repeats)
    encoder_seconds, _ = fastest(xp, encode, repeats)
    return {"encoder": f"{num_layers} layers, d={model_dim}, {subsampling}x subsampling, V={vocab_size}",
            "utterances": num_utts, "input_frames": num_frames, "encoder_seconds": encoder_seconds,
            "greedy_seconds": timings["greedy"], "beam8_seconds": timings["beam8"],
            "beam8_nbest8_seconds": timings["beam8_nbest8"],
            "beam8_over_greedy": timings["beam8"] / timings["greedy"],
            "beam8_nbest8_over_greedy": timings["beam8_nbest8"] / timings["greedy"]}


def plot_ctc(results: dict, path) -> str | None:
    """Frames/s per beam, one line per (vocabulary, LM) pair; greedy as a marker."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for vocab_size in results["config"]["vocab_sizes"]:
        for lm in (False, True):
            cells = [c for c in results["cells"] if c["search"] == "prefix" and c["vocab_size"] == vocab_size
                     and c["lm"] == lm and c.get("captured_frames") is not False]
            if cells:
                ax.plot([c["beam"] for c in cells], [c["frames_per_s"] for c in cells], "o-" if lm else "s--",
                        label=f"V={vocab_size}" + (" + LSTM LM" if lm else ""))
        greedy = [c for c in results["cells"] if c["search"] == "greedy" and c["vocab_size"] == vocab_size]
        if greedy:
            ax.plot([1], [greedy[0]["frames_per_s"]], "k^", label=f"greedy V={vocab_size}")
    ax.set_xlabel("beam size")
    ax.set_ylabel("frames / s (all utterances)")
    ax.set_yscale("log")
    ax.set_title(f"CTC prefix search, {results['config']['utterances']} utterances × "
                 f"{results['config']['frames']} frames")
    ax.legend(fontsize=7)
    return save_figure(plt, fig, path)


def format_table(results: dict) -> str:
    lines = ["| search | vocabulary | beam | LSTM LM | seconds | frames/s |", "|---|---|---|---|---|---|"]
    for c in results["cells"]:
        lm = "no" if not c["lm"] else {None: "yes", True: "yes, frames replayed",
                                       False: "yes, frames launched"}[c.get("captured_frames")]
        lines.append(f"| {c['search']} | {c['vocab_size']} | {c['beam']} | {lm} | "
                     f"{c['seconds']:.3f} | {c['frames_per_s']:,.0f} |")
    lines.append("")
    lines.extend(f"{name}: {value:.3f}" for name, value in results["ratios"].items())
    return "\n".join(lines)
