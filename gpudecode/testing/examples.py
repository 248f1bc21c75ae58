"""The example models shipped in ``examples/models/``."""

from __future__ import annotations

from pathlib import Path

from gpudecode.testing.ctc import build_ctc_encoder
from gpudecode.testing.encoder import build_encoder
from gpudecode.testing.lstm import build_lstm_lm
from gpudecode.testing.prefill import build_prefix_lm
from gpudecode.testing.transducer import build_joint_network, build_prediction_network, build_transducer_encoder
from gpudecode.testing.transformer import build_transformer_decoder


def write_examples(folder: str | Path) -> list[Path]:
    """Writes ``encoder.onnx``, ``decoder.onnx`` (precomputed cross-attention), ``lstm-lm.onnx`` and
    the prefix LM pair ``prefix-lm-step.onnx`` / ``prefix-lm-prefill.onnx`` and the CTC encoder
    ``ctc-encoder.onnx`` (12 labels, blank 0) and a transducer (``transducer-encoder.onnx``,
    ``transducer-prediction.onnx``, ``transducer-joint.onnx``; 12 labels, blank 0) (seed 0) into
    ``folder``; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    prefix_lm = build_prefix_lm(0)
    return [
        build_transducer_encoder(0, num_features=16, model_dim=32).save(folder / "transducer-encoder.onnx"),
        build_prediction_network(0, vocab_size=12).save(folder / "transducer-prediction.onnx"),
        build_joint_network(0, encoder_dim=32, prediction_dim=16, vocab_size=12, blank=0, blank_bias=1.0)
        .save(folder / "transducer-joint.onnx"),
        build_ctc_encoder(0, num_features=16, vocab_size=12, blank=0).save(folder / "ctc-encoder.onnx"),
        prefix_lm.step.save(folder / "prefix-lm-step.onnx"),
        prefix_lm.prefill.save(folder / "prefix-lm-prefill.onnx"),
        build_encoder(0).save(folder / "encoder.onnx"),
        build_transformer_decoder(0, cross_attention="precomputed").save(folder / "decoder.onnx"),
        build_lstm_lm(0).save(folder / "lstm-lm.onnx"),
    ]
