"""Declared tensors of an ONNX model, read from an ONNX file or from a live ORT session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # onnx (protobuf) is imported only where a model proto is read
    import onnx

Dim = int | str | None  # static size, symbolic name, or unknown


@dataclass(frozen=True)
class TensorInfo:
    """One declared input or output: name, element type and shape (dims may be symbolic)."""

    name: str
    dtype: np.dtype
    shape: tuple[Dim, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        dims = ",".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype.name}[{dims}]"


@dataclass(frozen=True)
class ModelTensors:
    """Everything the discovery needs to know about a model's interface."""

    source: str  # file name for messages
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    metadata: dict[str, str]

    def input(self, name: str) -> TensorInfo | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorInfo | None:
        return next((t for t in self.outputs if t.name == name), None)


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


def _ort_dtype(type_string: str) -> np.dtype:
    if type_string == "tensor(bfloat16)":
        return np.dtype("V2")  # no numpy bfloat16; kept distinct from float16
    if type_string not in _ORT_TYPES:
        raise ValueError(f"unsupported tensor type {type_string}")
    return np.dtype(_ORT_TYPES[type_string])


def from_ort_session(session, source: str) -> ModelTensors:
    """The interface of a live ``onnxruntime.InferenceSession``."""

    def info(arg) -> TensorInfo:
        return TensorInfo(arg.name, _ort_dtype(arg.type), tuple(arg.shape))

    return ModelTensors(
        source=source,
        inputs=tuple(info(a) for a in session.get_inputs()),
        outputs=tuple(info(a) for a in session.get_outputs()),
        metadata=dict(session.get_modelmeta().custom_metadata_map),
    )


def _proto_info(value_info: onnx.ValueInfoProto) -> TensorInfo:
    import onnx

    tensor_type = value_info.type.tensor_type
    dims: list[Dim] = []
    for d in tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    elem = tensor_type.elem_type
    dtype = np.dtype("V2") if elem == onnx.TensorProto.BFLOAT16 else onnx.helper.tensor_dtype_to_np_dtype(elem)
    return TensorInfo(value_info.name, np.dtype(dtype), tuple(dims))


def from_onnx_model(model: onnx.ModelProto, source: str) -> ModelTensors:
    """The interface of an ONNX ``ModelProto`` (initializers listed as inputs are not inputs)."""
    initializers = {t.name for t in model.graph.initializer}
    return ModelTensors(
        source=source,
        inputs=tuple(_proto_info(v) for v in model.graph.input if v.name not in initializers),
        outputs=tuple(_proto_info(v) for v in model.graph.output),
        metadata={p.key: p.value for p in model.metadata_props},
    )
