"""Helpers every benchmark shares: timing on the shared stream and writing results."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def synchronize(xp) -> None:
    """Waits for all work on the shared stream (and CuPy's current one); a no-op on numpy."""
    if xp is not np:
        from gpudecode.backend import shared_stream

        shared_stream(0).synchronize()
        xp.cuda.get_current_stream().synchronize()


def fastest(xp, run: Callable[[], object], repeats: int) -> tuple[float, object]:
    """The fastest of ``repeats`` runs (seconds, synchronised) and the last result."""
    best, result = float("inf"), None
    for _ in range(repeats):
        synchronize(xp)
        start = time.perf_counter()
        result = run()
        synchronize(xp)
        best = min(best, time.perf_counter() - start)
    return best, result


def lstm_lm_scorer(device: str, vocab_size: int, *, start_label: int, hidden_dim: int, embed_dim: int,
                   num_layers: int):
    """A ``recurrent-lm`` scorer of a random LSTM LM (``gpudecode.testing.build_lstm_lm``) on
    ``device``, as the benches fuse it."""
    from gpudecode.scorers.onnx_decoder import RecurrentLmScorer
    from gpudecode.session import SessionOptions
    from gpudecode.states.options import StateManagerOptions
    from gpudecode.testing import build_lstm_lm

    reference = build_lstm_lm(1, vocab_size=vocab_size, embed_dim=embed_dim, hidden_dim=hidden_dim,
                              num_layers=num_layers)
    return RecurrentLmScorer(model=reference.serialized(), vocab_size=vocab_size, start_labels=[start_label],
                             state_manager=StateManagerOptions(type=f"lstm-{device}", slots_per_chunk=65536),
                             session_options=SessionOptions(device=device, use_tf32=False),
                             graphs=default_graphs(device))


def default_graphs(device: str):
    """The CUDA graph options a run on ``device`` gets by default (``runtime.cuda_graphs``)."""
    from gpudecode.config import CudaGraphsConfig

    return CudaGraphsConfig().to_options(device=device)


def write_results(results: dict, output_dir, name: str, plot: Callable[[dict, Path], str | None]) -> dict:
    """Writes ``<name>.json`` and ``<name>.png`` into ``output_dir`` (when given); returns ``results``
    with the PNG's path (None where matplotlib is missing)."""
    if output_dir is not None:
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / f"{name}.json").write_text(json.dumps(results, indent=2))
        results["png"] = plot(results, output_dir / f"{name}.png")
    return results


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path) -> str:
    """Writes ``fig`` as a PNG to ``path`` and closes it; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


#: How the benchmarks export their transformer decoder (``build_transformer_decoder`` options).
#: "new-step": the state outputs hold the new step alone (no copy of the history inside
#: the model) and the self-attention's query/key/value are one fused product; "full-history": each
#: state output is the past with the new step appended (a Concat per state variable and step), and
#: three separate products; "ragged": new-step, with ONNX Attention (opset 24) over each row's own
#: history length, left-aligned (metadata HISTORY_ALIGNMENT=left); "gqa": the same with ONNX Runtime's
#: GroupQueryAttention (CUDA: float16 only); "fused": new-step as ONNX Runtime's transformer optimizer
#: writes it (SkipLayerNormalization, the attention scale in the query weights, one-step head
#: splits as reshapes, cross-attention as one MultiHeadAttention: 40% fewer kernels per step), over
#: left-aligned histories (the merge never writes padding); "dmmha": fused, with the self-attention as
#: ONNX Runtime's DecoderMaskedMultiHeadAttention (one kernel per layer on the packed projection, its
#: bias added inside; in place, and those caches are the state outputs; the keys declared in the layout
#: its CUDA kernel reads: CUDA only); "fused-gqa": fused, with GroupQueryAttention on the
#: packed projection (CUDA: float16 only). The same function every way.
DECODER_EXPORTS = {"new-step": dict(state_outputs="new", fused_qkv=True),
                   "fused": dict(state_outputs="new", fused_qkv=True, fused_ops=True, history_alignment="left"),
                   "dmmha": dict(state_outputs="in-place", fused_qkv=True, fused_ops=True, attention="dmmha", ft_keys=True),
                   "fused-gqa": dict(state_outputs="new", fused_qkv=True, fused_ops=True, attention="gqa"),
                   "full-history": dict(state_outputs="full", fused_qkv=False),
                   "ragged": dict(state_outputs="new", fused_qkv=True, attention="ragged"),
                   "gqa": dict(state_outputs="new", fused_qkv=True, attention="gqa")}


def decoder_export(name: str) -> dict:
    """The ``build_transformer_decoder`` options of export ``name`` (a key of DECODER_EXPORTS)."""
    if name not in DECODER_EXPORTS:
        raise ValueError(f"decoder_export: expected one of {', '.join(DECODER_EXPORTS)}, got {name!r}")
    return DECODER_EXPORTS[name]
