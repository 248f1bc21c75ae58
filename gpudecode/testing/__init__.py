"""Small reference ONNX models, each with a plain-numpy forward as the test oracle.

Built with ``onnx.helper`` (opset 17, IR version 9), deterministic from a seed; no PyTorch.
"""

from gpudecode.testing.ctc import build_ctc_encoder
from gpudecode.testing.encoder import build_encoder
from gpudecode.testing.examples import write_examples
from gpudecode.testing.genai_lm import build_genai_lm
from gpudecode.testing.lstm import build_lstm_lm
from gpudecode.testing.optimum_lm import build_optimum_lm
from gpudecode.testing.prefill import PrefillPair, build_optimum_pair, build_prefix_lm
from gpudecode.session.hf import hf_attention_inputs
from gpudecode.testing.reference import ReferenceModel
from gpudecode.testing.transducer import (
    build_joint_network,
    build_prediction_network,
    build_stateless_prediction_network,
    build_transducer_encoder,
)
from gpudecode.testing.transformer import build_transformer_decoder, build_transformer_lm

__all__ = [
    "PrefillPair",
    "ReferenceModel",
    "build_ctc_encoder",
    "build_encoder",
    "build_genai_lm",
    "build_joint_network",
    "build_lstm_lm",
    "build_optimum_lm",
    "build_optimum_pair",
    "build_prediction_network",
    "build_prefix_lm",
    "build_stateless_prediction_network",
    "build_transducer_encoder",
    "build_transformer_decoder",
    "build_transformer_lm",
    "hf_attention_inputs",
    "write_examples",
]
