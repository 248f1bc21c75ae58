"""``gpudecode bench transducer``: transducer beam search and greedy decoding on the GPU.

Measured in one run (random weights; the encoder is pinned: ``build_transducer_encoder`` with
12 layers, d = 512, 4× subsampling, 64 utterances × 1,000 input frames):

- frames/s (encoder frames decoded per second, all utterances together) of the beam search at each
  beam (default 1, 4, 8) and of batched greedy decoding, on the same encoder states (search only);
- end to end: encoder + beam 8 ÷ encoder + greedy (goal ≤ 1.2; NeMo reports 1.1–1.2×);
- LM fusion: the beam search (``lm_beam``, default 8) with an LSTM LM fused on label emission
  (``recurrent-lm``, scale 0.3, random weights), and its cost: with-LM ÷ without-LM time.

The prediction network is an LSTM driven by the ``lstm-cuda`` state manager (``lstm-cpu`` with
``device="cpu"``), the joint one batched ONNX call per (frame, symbol) step. Every size is a
parameter; ``device="cpu"`` runs the same code on numpy (a smoke test; figures mean something on
the GPU only).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from gpudecode.backend import array_module
from gpudecode.bench.common import default_graphs, fastest, lstm_lm_scorer, pyplot, save_figure, write_results

BLANK = 0
LM_SCALE = 0.3  # the fused LM's weight in the LM cell





def _models(device: str, *, encoder_dim: int, vocab_size: int, prediction_dim: int, prediction_hidden_dim: int,
            prediction_embed_dim: int, joint_dim: int, blank_bias: float):
    """(prediction-network factory, joint) on ``device``."""
    from gpudecode.scorers.transducer import JointNetwork, StatefulPredictionNetwork
    from gpudecode.session import OnnxSession, SessionOptions
    from gpudecode.states.options import StateManagerOptions
    from gpudecode.testing import build_joint_network, build_prediction_network

    graphs = default_graphs(device)
    session_options = SessionOptions(device=device, use_tf32=False)
    prediction_ref = build_prediction_network(0, vocab_size=vocab_size, embed_dim=prediction_embed_dim,
                                              hidden_dim=prediction_hidden_dim, output_dim=prediction_dim)
    joint_ref = build_joint_network(0, encoder_dim=encoder_dim, prediction_dim=prediction_dim, joint_dim=joint_dim,
                                    vocab_size=vocab_size, blank=BLANK, blank_bias=blank_bias)
    prediction_session = OnnxSession(prediction_ref.serialized(),
                                     replace(session_options, cuda_graphs=graphs.enabled))

    def prediction():
        return StatefulPredictionNetwork(model=prediction_session, blank=BLANK,
                                         state_manager=StateManagerOptions(type=f"lstm-{device}", slots_per_chunk=65536),
                                         graphs=graphs)

    return prediction, JointNetwork(model=joint_ref.serialized(), session_options=session_options, graphs=graphs)


def run_transducer_bench(*, num_utts: int = 64, encoder_frames: int = 1000, encoder_layers: int = 12,
                         encoder_dim: int = 512, subsampling: int = 4, num_features: int = 80,
                         vocab_size: int = 1000, prediction_dim: int = 512, prediction_hidden_dim: int = 512,
                         prediction_embed_dim: int = 256, joint_dim: int = 512, blank_bias: float = 4.0,
                         beams=(1, 4, 8), max_symbols_per_frame: int = 1, lm_beam: int | None = 8,
                         lm_hidden_dim: int = 512, lm_embed_dim: int = 128, device: str = "cuda", repeats: int = 1,
                         output_dir=None) -> dict:
    """Runs every measurement in one process; returns (and writes ``transducer.json`` / ``.png``).

    ``blank_bias`` is added to the joint's blank logit (trained transducers emit blank on most
    frames; random weights would not). ``max_symbols_per_frame`` 1 is k2's modified beam search.
    ``lm_beam``: the beam of the LM-fusion cell (``beam<lm_beam>+lm``; None: no LM cell); it is
    measured against the plain beam search at that beam, which runs too.
    """
    from gpudecode.backend import to_host
    from gpudecode.search import (
        TransducerOptions,
        transducer_greedy_search,
        transducer_search,
    )
    from gpudecode.session import OnnxSession, SessionOptions
    from gpudecode.testing import build_transducer_encoder

    xp = array_module(device)
    reference = build_transducer_encoder(0, num_features=num_features, model_dim=encoder_dim, subsampling=subsampling,
                                         num_layers=encoder_layers)
    encoder = OnnxSession(reference.serialized(), SessionOptions(device=device, use_tf32=False))
    rng = np.random.default_rng(0)
    features = xp.asarray(rng.standard_normal((num_utts, encoder_frames, num_features), dtype=np.float32))
    sizes = xp.asarray(np.full(num_utts, encoder_frames, np.int32))

    def encode():
        out = encoder.run({"features": features, "features-size": sizes})
        return xp.asarray(out["encoder-states"]), out["encoder-states-size"]

    prediction, joint = _models(device, encoder_dim=encoder_dim, vocab_size=vocab_size, prediction_dim=prediction_dim,
                                prediction_hidden_dim=prediction_hidden_dim,
                                prediction_embed_dim=prediction_embed_dim, joint_dim=joint_dim, blank_bias=blank_bias)
    greedy_net, beam_net = prediction(), prediction()

    def greedy(states, lengths):
        return transducer_greedy_search(states, lengths, greedy_net, joint, blank=BLANK,
                                        max_symbols_per_frame=max_symbols_per_frame, xp=xp)

    def beam_search(beam: int, lm_scorers=()):
        options = TransducerOptions(beam_size=beam, blank=BLANK, max_symbols_per_frame=max_symbols_per_frame)
        return lambda states, lengths: transducer_search(states, lengths, beam_net, joint, options, lm_scorers, xp=xp)

    beams = tuple(beams) + ((lm_beam,) if lm_beam is not None and lm_beam not in beams else ())
    searches = {"greedy": greedy, **{f"beam{beam}": beam_search(beam) for beam in beams}}
    lm = None
    if lm_beam is not None:
        lm = lstm_lm_scorer(device, vocab_size, start_label=BLANK, hidden_dim=lm_hidden_dim, embed_dim=lm_embed_dim,
                            num_layers=1)
        searches[f"beam{lm_beam}+lm"] = beam_search(lm_beam, [("lm", lm, LM_SCALE)])
    states, lengths = encode()
    num_frames = int(to_host(lengths).sum())
    results = {"benchmark": "transducer", "config": {
        "utterances": num_utts, "input_frames": encoder_frames, "encoder_frames": num_frames,
        "encoder": f"{encoder_layers} layers, d={encoder_dim}, {subsampling}x subsampling",
        "prediction": f"LSTM 1x{prediction_hidden_dim} (embedding {prediction_embed_dim}) -> {prediction_dim}",
        "joint": f"{joint_dim} -> V={vocab_size}", "max_symbols_per_frame": max_symbols_per_frame,
        "lm": None if lm_beam is None else f"LSTM 1x{lm_hidden_dim} (embedding {lm_embed_dim}), scale {LM_SCALE}",
        "device": device, "timing": f"fastest of {repeats}"}, "cells": []}
    warm = min(8, states.shape[1])
    for name, search in searches.items():  # warm-up (kernels, ORT shapes)
        search(states[:, :warm], np.full(num_utts, warm))
    for name, search in searches.items():
        seconds, nbest = fastest(xp, lambda search=search: search(states, lengths), repeats)
        results["cells"].append({"search": name, "beam": 1 if name == "greedy" else int(name[4:].split("+")[0]),
                                 "lm": name.endswith("+lm"), "seconds": seconds, "frames_per_s": num_frames / seconds,
                                 "mean_labels": float(np.mean([len(h[0].labels) for h in nbest])),
                                 "scores": sorted(nbest[0][0].scores) if nbest and nbest[0] else []})

    end_to_end = {}
    for name in ("greedy", "beam8"):
        if name in searches:
            end_to_end[f"{name}_seconds"], _ = fastest(xp, lambda search=searches[name]: search(*encode()), repeats)
    end_to_end["encoder_seconds"], _ = fastest(xp, encode, repeats)
    ratios = {}
    if "beam8_seconds" in end_to_end:
        ratios["end_to_end_beam8_over_greedy"] = end_to_end["beam8_seconds"] / end_to_end["greedy_seconds"]
    cell = {c["search"]: c for c in results["cells"]}
    for beam in beams:
        ratios[f"search_beam{beam}_over_greedy"] = cell[f"beam{beam}"]["seconds"] / cell["greedy"]["seconds"]
    if lm_beam is not None:
        ratios[f"lm_fusion_cost_beam{lm_beam}"] = cell[f"beam{lm_beam}+lm"]["seconds"] / cell[f"beam{lm_beam}"]["seconds"]
    results["end_to_end"] = end_to_end
    results["ratios"] = ratios
    for net in (greedy_net, beam_net) + ((lm,) if lm is not None else ()):
        net.close()
    return write_results(results, output_dir, "transducer", plot_transducer)


def plot_transducer(results: dict, path) -> str | None:
    """Frames/s per beam, greedy as a marker."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    beams = [c for c in results["cells"] if c["search"] != "greedy" and not c.get("lm")]
    ax.plot([c["beam"] for c in beams], [c["frames_per_s"] for c in beams], "o-", label="beam search")
    fused = [c for c in results["cells"] if c.get("lm")]
    if fused:
        ax.plot([c["beam"] for c in fused], [c["frames_per_s"] for c in fused], "s", label="beam search + LSTM LM")
    greedy = [c for c in results["cells"] if c["search"] == "greedy"]
    if greedy:
        ax.plot([1], [greedy[0]["frames_per_s"]], "k^", label="greedy")
    ax.set_xlabel("beam size")
    ax.set_ylabel("encoder frames / s (all utterances)")
    ax.set_yscale("log")
    ratio = results["ratios"].get("end_to_end_beam8_over_greedy")
    title = f"Transducer, {results['config']['utterances']} utterances"
    if ratio is not None:
        title += f"; end to end beam 8 ÷ greedy = {ratio:.2f}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(plt, fig, path)


def format_table(results: dict) -> str:
    lines = ["| search | beam | seconds | frames/s | mean labels |", "|---|---|---|---|---|"]
    for c in results["cells"]:
        lines.append(f"| {c['search']} | {c['beam']} | {c['seconds']:.3f} | {c['frames_per_s']:,.0f} | "
                     f"{c['mean_labels']:.1f} |")
    lines.append("")
    lines.extend(f"{name}: {value:.3f}" for name, value in results["ratios"].items())
    return "\n".join(lines)
