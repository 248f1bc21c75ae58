"""ONNX Runtime sessions on host or device tensors, and discovery of a model's conventions."""

from gpudecode.session.discovery import (
    EncoderLayout,
    EncoderSpec,
    ModelError,
    ModelSpec,
    UtteranceInput,
    discover_encoder,
    discover_step_model,
)
from gpudecode.session.hf import hf_attention_inputs, hf_encoder_attention_mask
from gpudecode.session.options import SessionOptions
from gpudecode.session.runner import OnnxSession, SessionError
from gpudecode.session.tensors import ModelTensors, TensorInfo, from_onnx_model, from_ort_session

__all__ = [
    "EncoderLayout", "EncoderSpec", "ModelError", "ModelSpec", "ModelTensors", "OnnxSession", "SessionError",
    "SessionOptions", "TensorInfo", "UtteranceInput", "discover_encoder", "discover_step_model",
    "from_onnx_model", "from_ort_session", "hf_attention_inputs", "hf_encoder_attention_mask",
]
