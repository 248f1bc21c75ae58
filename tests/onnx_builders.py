"""Tiny hand-made ONNX interfaces for validation tests (the computation does not matter)."""

import numpy as np
import onnx
from onnx import TensorProto, helper

_TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.int32: TensorProto.INT32,
          np.int64: TensorProto.INT64}


def interface_model(inputs, outputs, metadata=None) -> onnx.ModelProto:
    """A model with the given (name, dtype, shape) inputs and outputs; outputs are constants."""
    nodes, initializers = [], []
    for name, dtype, shape in outputs:
        const = f"const_{len(initializers)}"
        dims = [d if isinstance(d, int) else 1 for d in shape]
        initializers.append(helper.make_tensor(const, _TYPES[dtype], dims, [0] * int(np.prod(dims))))
        nodes.append(helper.make_node("Identity", [const], [name]))
    graph = helper.make_graph(
        nodes, "interface",
        [helper.make_tensor_value_info(n, _TYPES[d], s) for n, d, s in inputs],
        [helper.make_tensor_value_info(n, _TYPES[d], s) for n, d, s in outputs],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    for key, value in (metadata or {}).items():
        model.metadata_props.add(key=key, value=value)
    return model


def rasr_step_interface(inputs=None, outputs=None, metadata=None) -> onnx.ModelProto:
    """A valid RASR step interface with one K/V layer; the dicts replace tensors (None drops one)."""
    all_inputs = {
        "token": (np.int32, ["batch", 1]),
        "token-length": (np.int32, ["batch"]),
        "prefix-length": (np.int32, ["batch"]),
        "past-key-0": (np.float32, ["batch", 2, "time", 4]),
        "past-value-0": (np.float32, ["batch", 2, "time", 4]),
        "cross-key-0": (np.float32, ["batch", 2, "frames", 4]),
        "encoder-states-size": (np.int32, ["batch"]),
    }
    all_outputs = {
        "scores": (np.float32, ["batch", 1, 12]),
        "present-key-0": (np.float32, ["batch", 2, "time1", 4]),
        "present-value-0": (np.float32, ["batch", 2, "time1", 4]),
    }
    all_metadata = {"STATE_past-key-0": "present-key-0", "STATE_past-value-0": "present-value-0",
                    "UTTERANCE_cross-key-0": "cross-key-0"}
    for table, update in ((all_inputs, inputs), (all_outputs, outputs), (all_metadata, metadata)):
        for key, value in (update or {}).items():
            if value is None:
                table.pop(key)
            else:
                table[key] = value
    return interface_model(
        [(n, d, s) for n, (d, s) in all_inputs.items()],
        [(n, d, s) for n, (d, s) in all_outputs.items()],
        all_metadata,
    )
