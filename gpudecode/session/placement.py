"""Checks that a CUDA session really runs on the GPU and copies no data between providers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # onnx (protobuf) is imported only when a CUDA session's placement is checked
    import onnx

_MEMCPY = ("MemcpyToHost", "MemcpyFromHost")
# Outputs of these depend only on shapes, never on tensor contents.
_SHAPE_OPS = ("Shape", "Size")


def data_copies(optimised: onnx.ModelProto) -> list[str]:
    """Memcpy nodes of an optimised model that move float data between providers.

    Copies whose input is computed from shapes and integer inputs only (small shape subgraphs
    placed on the CPU) are normal and not reported. Returns one description per offending node.
    """
    import onnx

    float_types = {
        onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE
    }
    graph = optimised.graph
    producer = {out: node for node in graph.node for out in node.output}
    float_sources = {v.name for v in graph.input if v.type.tensor_type.elem_type in float_types}
    float_sources |= {t.name for t in graph.initializer if t.data_type in float_types}

    def carries_data(tensor: str) -> bool:
        seen, todo = set(), [tensor]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in float_sources:
                return True
            node = producer.get(name)
            if node is None or node.op_type in _SHAPE_OPS:
                continue
            todo.extend(i for i in node.input if i)
        return False

    return [
        f"{node.op_type} '{node.name}' copies '{node.input[0]}'"
        for node in graph.node
        if node.op_type in _MEMCPY and carries_data(node.input[0])
    ]
