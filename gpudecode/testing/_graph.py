"""A small helper for writing ONNX graphs node by node, plus the numpy building blocks of the oracles."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSET = 17
IR_VERSION = 9  # what onnxruntime >= 1.17 loads

Dim = int | str


class GraphBuilder:
    """Collects nodes and initializers; every helper returns the name of its (first) output."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = itertools.count()

    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._count)}"

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.array(array, order="C"), name))
        return name

    def const(self, value, dtype) -> str:
        return self.weight(self.fresh("const"), np.asarray(value, dtype=dtype))

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        return self.ops(op_type, inputs, 1, out=[out] if out else None, **attrs)[0]

    def ops(
        self, op_type: str, inputs: Sequence[str], num_outputs: int, out=None, **attrs
    ) -> list[str]:
        outputs = list(out) if out else [self.fresh(op_type) for _ in range(num_outputs)]
        self.nodes.append(
            helper.make_node(op_type, list(inputs), outputs, name=self.fresh(f"{op_type}_node"), **attrs)
        )
        return outputs

    # -- composite helpers ------------------------------------------------------------------

    def linear(self, x: str, weights: dict[str, np.ndarray], key: str, out: str | None = None) -> str:
        """x @ weights[key.w] + weights[key.b] (each key used once per graph)."""
        w, b = self.weight(f"{key}.w", weights[f"{key}.w"]), self.weight(f"{key}.b", weights[f"{key}.b"])
        return self.op("Add", self.op("MatMul", x, w), b, out=out)

    def layer_norm(self, x: str, weights: dict[str, np.ndarray], key: str) -> str:
        g, b = self.weight(f"{key}.g", weights[f"{key}.g"]), self.weight(f"{key}.b", weights[f"{key}.b"])
        return self.op("LayerNormalization", x, g, b, axis=-1, epsilon=LN_EPSILON)

    def dim(self, x: str, axis: int) -> str:
        """Scalar int64: the size of ``x`` along ``axis``."""
        return self.op("Squeeze", self.op("Shape", x, start=axis, end=axis + 1))

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", x, self.const(list(axes), np.int64))

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        return self.op("Reshape", x, self.const(list(shape), np.int64))

    def stacked_frames(self, features: str, size: str, stride: int, num_features: int, dtype) -> str:
        """[U, T, F] ``features`` with frames at or beyond ``size`` ([U] int32) zeroed, padded to
        a multiple of ``stride`` frames and stacked: [U, ceil(T / stride), stride * F]."""
        i64 = np.int64
        num_t = self.dim(features, 1)
        x = self.masked_frames(features, size, dtype, num_t)
        step = self.const(stride, i64)
        pad = self.op("Mod", self.op("Sub", step, self.op("Mod", num_t, step)), step)  # (s - T % s) % s
        pads = self.op("Concat", self.const([0, 0, 0, 0], i64), self.unsqueeze(pad, [0]), self.const([0], i64), axis=0)
        return self.reshape(self.op("Pad", x, pads), [0, -1, stride * num_features])

    def masked_frames(self, x: str, size: str, dtype, num_t: str | None = None, out: str | None = None) -> str:
        """[U, T, D] ``x`` with frames t >= ``size`` ([U] int32) zeroed (``num_t``: T, if known)."""
        i64 = np.int64
        num_t = num_t if num_t is not None else self.dim(x, 1)
        frames = self.op("Range", self.const(0, i64), num_t, self.const(1, i64))
        size64 = self.op("Cast", size, to=onnx_type(i64))
        valid = self.op("Less", self.unsqueeze(frames, [0]), self.unsqueeze(size64, [1]))  # [U, T]
        return self.op("Mul", x, self.unsqueeze(self.op("Cast", valid, to=onnx_type(dtype)), [2]), out=out)

    def frame_encoder(self, features: str, size: str, weights: dict[str, np.ndarray], stride: int,
                      num_features: int, num_layers: int, dtype) -> str:
        """The reference encoders' body: ``stacked_frames``, tanh(Linear ``in``), then ``num_layers``
        residual blocks h + Linear ``ff2_i``(relu(Linear ``ff1_i``(h))) (weights of
        :func:`random_frame_encoder`)."""
        h = self.op("Tanh", self.linear(self.stacked_frames(features, size, stride, num_features, dtype), weights, "in"))
        for i in range(num_layers):
            h = self.op("Add", h, self.linear(self.op("Relu", self.linear(h, weights, f"ff1_{i}")), weights, f"ff2_{i}"))
        return h

    def build(
        self,
        inputs: Sequence[tuple[str, np.dtype, Sequence[Dim]]],
        outputs: Sequence[tuple[str, np.dtype, Sequence[Dim]]],
        name: str,
        metadata: dict[str, str] | None = None,
        opset: int = OPSET,
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            name,
            [_value_info(*spec) for spec in inputs],
            [_value_info(*spec) for spec in outputs],
            initializer=self.initializers,
        )
        contrib = [helper.make_opsetid("com.microsoft", 1)] if any(n.domain == "com.microsoft" for n in self.nodes) else []
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", opset), *contrib],
            ir_version=IR_VERSION if opset == OPSET else helper.find_min_ir_version_for([helper.make_opsetid("", opset)]),
            producer_name="gpudecode.testing",
        )
        if metadata:
            helper.set_model_props(model, metadata)
        return model


def onnx_type(dtype) -> int:
    """The ONNX element type (``TensorProto.FLOAT`` ...) of a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _value_info(name: str, dtype, shape: Sequence[Dim]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, onnx_type(dtype), list(shape))


# -- numpy building blocks (float32 compute) -----------------------------------------------------

LN_EPSILON = 1e-5


def layer_norm(x: np.ndarray, weights: dict[str, np.ndarray], key: str) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    g, b = weights[f"{key}.g"].astype(np.float32), weights[f"{key}.b"].astype(np.float32)
    return (x - mean) / np.sqrt(var + LN_EPSILON) * g + b


def linear(x: np.ndarray, weights: dict[str, np.ndarray], key: str) -> np.ndarray:
    return x @ weights[f"{key}.w"].astype(np.float32) + weights[f"{key}.b"].astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def stacked_frames(features: np.ndarray, size: np.ndarray, stride: int) -> np.ndarray:
    """numpy twin of :meth:`GraphBuilder.stacked_frames` (float32)."""
    num_u, num_t, num_f = features.shape
    features = masked_frames(features.astype(np.float32), size)
    num_out = -(-num_t // stride)
    features = np.pad(features, [(0, 0), (0, num_out * stride - num_t), (0, 0)])
    return features.reshape(num_u, num_out, stride * num_f)


def masked_frames(x: np.ndarray, size: np.ndarray) -> np.ndarray:
    """numpy twin of :meth:`GraphBuilder.masked_frames`."""
    return x * (np.arange(x.shape[1])[None, :] < np.asarray(size, dtype=np.int64)[:, None])[:, :, None]


def frame_encoder(features: np.ndarray, size: np.ndarray, weights: dict[str, np.ndarray], stride: int,
                  num_layers: int) -> np.ndarray:
    """numpy twin of :meth:`GraphBuilder.frame_encoder` (float32 ``weights``)."""
    h = np.tanh(linear(stacked_frames(features, size, stride), weights, "in"))
    for i in range(num_layers):
        h = h + linear(np.maximum(linear(h, weights, f"ff1_{i}"), 0), weights, f"ff2_{i}")
    return h


def random_frame_encoder(rng: np.random.Generator, weights: dict, in_dim: int, dim: int, num_layers: int) -> None:
    """Draws the weights of :meth:`GraphBuilder.frame_encoder`: ``in`` and each block's ``ff1_i``/``ff2_i``."""
    random_linear(rng, weights, "in", in_dim, dim)
    for i in range(num_layers):
        random_linear(rng, weights, f"ff1_{i}", dim, 2 * dim)
        random_linear(rng, weights, f"ff2_{i}", 2 * dim, dim)


def random_linear(rng: np.random.Generator, weights: dict, key: str, fan_in: int, fan_out: int) -> None:
    """Draws ``key.w`` [fan_in, fan_out] and ``key.b`` [fan_out] (float64; cast by the caller)."""
    weights[f"{key}.w"] = rng.normal(size=(fan_in, fan_out)) / np.sqrt(fan_in)
    weights[f"{key}.b"] = 0.1 * rng.normal(size=fan_out)


def random_layer_norm(rng: np.random.Generator, weights: dict, key: str, dim: int) -> None:
    weights[f"{key}.g"] = 1.0 + 0.1 * rng.normal(size=dim)
    weights[f"{key}.b"] = 0.1 * rng.normal(size=dim)


def cast_all(weights: dict[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=dtype) for k, v in weights.items()}
