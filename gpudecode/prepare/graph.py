"""Small helpers over an ONNX graph: producers, consumers, constants, dead-node removal."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper


class GraphIndex:
    """Who produces and who consumes each tensor of ``graph``, and its constant values."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer = {out: node for node in graph.node for out in node.output if out}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                if name:
                    self.consumers.setdefault(name, []).append(node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.inputs = {v.name: v for v in graph.input}
        self.outputs = {v.name: v for v in graph.output}

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` when it is an initializer or a ``Constant`` node's output."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
                if attr.name in ("value_float", "value_int"):
                    return np.array(onnx.helper.get_attribute_value(attr))
        return None

    def scalar(self, name: str) -> float | None:
        value = self.constant(name)
        return float(value.reshape(())) if value is not None and value.size == 1 else None


def attribute(node: onnx.NodeProto, name: str, default=None):
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return default


def remove_dead_nodes(model: onnx.ModelProto) -> None:
    """Drops the nodes and initializers no graph output depends on (in place)."""
    graph = model.graph
    index = GraphIndex(graph)
    needed = {o.name for o in graph.output}
    stack = list(needed)
    while stack:
        node = index.producer.get(stack.pop())
        if node is None:
            continue
        for name in node.input:
            if name and name not in needed:
                needed.add(name)
                stack.append(name)
    keep = [n for n in graph.node if any(o in needed for o in n.output)]
    del graph.node[:]
    graph.node.extend(keep)
    used = {i for n in keep for i in n.input} | {o.name for o in graph.output}
    inits = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(inits)
