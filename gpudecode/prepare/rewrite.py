"""The attention of a Hugging Face decoder-with-past export as ONNX Runtime's ``GroupQueryAttention``.

Per layer, the rewrite is anchored on the cache, not on one exporter's op pattern: the present key
and value are a ``Concat`` of the past and the new step's heads [N, kv heads, S, Dh]; the scores a
``MatMul`` of the query heads with the (transposed, possibly repeated) present keys, scaled by
constants; the context a ``MatMul`` of the softmax with the present values. Each layer's pair of
``MatMul`` and everything between (masks, softmax, the repeat of key-value heads) becomes one
``GroupQueryAttention`` (com.microsoft) fed the query / key / value as [N, S, heads·Dh], with the
lengths GenAI's exports derive from ``attention_mask`` (``seqlens_k`` = its row sums - 1,
``total_sequence_length`` = its width). The op reads each row's history left-aligned and writes the
new step at the row's own length: the convention the toolkit decodes in place.

Nothing here proves the result; :mod:`gpudecode.prepare.check` does (and the caller falls back to
the unfused model when it fails).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from gpudecode.prepare.graph import GraphIndex, attribute, remove_dead_nodes

MS_DOMAIN = "com.microsoft"
PAST_PATTERN = re.compile(r"past_key_values\.(\d+)\.(key|value)")
#: ops between a present output and the attention's MatMul that only move or repeat values
VIEW_OPS = ("Transpose", "Unsqueeze", "Expand", "Reshape", "Identity", "Squeeze", "Cast")


class RewriteError(ValueError):
    """The graph has a pattern the rewrite does not recognise (the message says which)."""


@dataclass(frozen=True)
class AttentionMatch:
    """One layer's self-attention, as found in the graph."""

    layer: int
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    key_heads: str  # the new step's keys [N, kv heads, S, Dh]
    value_heads: str
    query_heads: str  # [N, heads, S, Dh], before any scaling
    context: str  # the context MatMul's output [N, heads, S, Dh]
    scale: float
    kv_heads: int
    head_size: int


def _past_of(index: GraphIndex, name: str) -> str | None:
    """The graph input ``name`` comes from through single-input Concat / Identity, if any."""
    while name not in index.inputs:
        node = index.producer.get(name)
        if node is None or node.op_type not in ("Identity", "Concat") or len([i for i in node.input if i]) != 1:
            return None
        name = node.input[0]
    return name


def _forward_matmul(index: GraphIndex, name: str, *, transposed: bool) -> tuple[onnx.NodeProto, float]:
    """The one MatMul that reads ``name`` (through view ops and scalar scales) as its second input,
    and the product of those scales. ``transposed``: the last two axes must be swapped on the way."""
    found: list[tuple[onnx.NodeProto, float, bool]] = []

    def walk(tensor: str, scale: float, swapped: bool, depth: int) -> None:
        if depth > 12:
            return
        for node in index.consumers.get(tensor, []):
            if node.op_type == "MatMul" and node.input[1] == tensor:
                found.append((node, scale, swapped))
            elif node.op_type in VIEW_OPS and node.input[0] == tensor:
                flip = swapped
                if node.op_type == "Transpose":
                    perm = list(attribute(node, "perm", []))
                    if perm[-2:] == [len(perm) - 1, len(perm) - 2]:
                        flip = not swapped
                walk(node.output[0], scale, flip, depth + 1)
            elif node.op_type in ("Mul", "Div") and node.input[0] == tensor and index.scalar(node.input[1]):
                value = index.scalar(node.input[1])
                walk(node.output[0], scale * value if node.op_type == "Mul" else scale / value, swapped, depth + 1)
            elif node.op_type == "Mul" and node.input[1] == tensor and index.scalar(node.input[0]):
                walk(node.output[0], scale * index.scalar(node.input[0]), swapped, depth + 1)
    walk(name, 1.0, False, 0)
    if len(found) != 1:
        raise RewriteError(f"'{name}' reaches {len(found)} attention MatMul nodes (expected one)")
    node, scale, swapped = found[0]
    if swapped != transposed:
        raise RewriteError(f"'{name}' reaches MatMul '{node.name}' {'without' if transposed else 'with'} "
                           "a transpose of its last two axes")
    return node, scale


def _back_through_scales(index: GraphIndex, name: str) -> tuple[str, float]:
    """``name`` less any scalar Mul / Div in front of it: (the unscaled tensor, the scale)."""
    scale = 1.0
    while True:
        node = index.producer.get(name)
        if node is None or node.op_type not in ("Mul", "Div"):
            return name, scale
        left, right = index.scalar(node.input[0]), index.scalar(node.input[1])
        if right is not None:
            scale, name = (scale * right if node.op_type == "Mul" else scale / right), node.input[0]
        elif left is not None and node.op_type == "Mul":
            scale, name = scale * left, node.input[1]
        else:
            return name, scale


def _unfold_grouped_query(index: GraphIndex, query: str, context: str) -> tuple[str, str, float]:
    """(query heads, context, scale) with the grouped-query fold undone where there is one.

    ``torch.onnx``'s export of ``scaled_dot_product_attention(..., enable_gqa=True)`` does not repeat
    the key-value heads: it reshapes the query heads [N, heads, S, Dh] to [N, kv heads, groups·S, Dh]
    (each key-value head's query heads as rows), multiplies them with the unrepeated keys, and
    reshapes the context back to [N, heads, S, Dh]. Read as they are, the attention would have
    ``kv heads`` query heads over ``groups·S`` positions. Where the query comes from a ``Reshape`` and
    the context's one reader (besides ``Shape`` nodes) is a ``Reshape``, the pair is that fold: the
    query is the first Reshape's input and the context the second's output (their shapes are read in
    :func:`query_heads_count`, and the rewrite is proven against the original by the caller)."""
    fold = index.producer.get(query)
    readers = [n for n in index.consumers.get(context, []) if n.op_type != "Shape"]
    if fold is None or fold.op_type != "Reshape" or len(readers) != 1 or readers[0].op_type != "Reshape":
        return query, context, 1.0
    unfolded, scale = _back_through_scales(index, fold.input[0])
    return unfolded, readers[0].output[0], scale


def _scores_scale(index: GraphIndex, scores: str) -> float:
    """Scalar Mul / Div applied to the scores between their MatMul and the softmax."""
    scale = 1.0
    for _ in range(8):
        users = index.consumers.get(scores, [])
        if len(users) != 1:
            break
        node = users[0]
        if node.op_type in ("Mul", "Div") and node.input[0] == scores and index.scalar(node.input[1]) is not None:
            value = index.scalar(node.input[1])
            scale = scale * value if node.op_type == "Mul" else scale / value
        elif node.op_type == "Softmax":
            return scale
        elif node.op_type not in ("Add", "Where", "Cast", "Identity", "Slice"):
            break
        scores = node.output[0]
    if not _reaches_softmax(index, scores):
        raise RewriteError(f"the attention scores '{scores}' reach no Softmax")
    return scale


def _reaches_softmax(index: GraphIndex, name: str) -> bool:
    stack, seen = [name], set()
    while stack:
        tensor = stack.pop()
        for node in index.consumers.get(tensor, []):
            if node.op_type == "Softmax":
                return True
            if node.op_type in ("Add", "Where", "Cast", "Identity", "Slice", "Mul", "Div") and node.output[0] not in seen:
                seen.add(node.output[0])
                stack.append(node.output[0])
    return False


def find_attention(model: onnx.ModelProto) -> list[AttentionMatch]:
    """Every layer's self-attention over its cache; :class:`RewriteError` on anything unrecognised."""
    graph = model.graph
    index = GraphIndex(graph)
    layers: dict[int, dict[str, str]] = {}
    for value in graph.input:
        match = PAST_PATTERN.fullmatch(value.name)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = value.name
    if not layers:
        raise RewriteError("no past_key_values.N.key / .value inputs")
    matches = []
    for layer, pasts in sorted(layers.items()):
        if set(pasts) != {"key", "value"}:
            raise RewriteError(f"layer {layer}: past key or value missing")
        present = {kind: f"present.{layer}.{kind}" for kind in pasts}
        heads = {}
        for kind, out in present.items():
            if out not in index.outputs:
                raise RewriteError(f"layer {layer}: no output '{out}'")
            node = index.producer.get(out)
            axis = attribute(node, "axis") if node is not None else None
            if node is None or node.op_type != "Concat" or len(node.input) != 2 or axis not in (2, -2):
                raise RewriteError(f"'{out}' is not a Concat of the past and the new step along the time axis")
            if _past_of(index, node.input[0]) != pasts[kind]:
                raise RewriteError(f"'{out}' does not extend '{pasts[kind]}'")
            heads[kind] = node.input[1]
        shape = [d.dim_value or None for d in index.inputs[pasts["key"]].type.tensor_type.shape.dim]
        if len(shape) != 4 or shape[1] is None or shape[3] is None:
            raise RewriteError(f"'{pasts['key']}': expected [batch, kv heads, time, head size] with static heads "
                               f"and head size, got {shape}")
        score, key_scale = _forward_matmul(index, present["key"], transposed=True)
        context, _ = _forward_matmul(index, present["value"], transposed=False)
        query, query_scale = _back_through_scales(index, score.input[0])
        query, context_out, fold_scale = _unfold_grouped_query(index, query, context.output[0])
        scale = key_scale * query_scale * fold_scale * _scores_scale(index, score.output[0])
        matches.append(AttentionMatch(
            layer=layer, past_key=pasts["key"], past_value=pasts["value"], present_key=present["key"],
            present_value=present["value"], key_heads=heads["key"], value_heads=heads["value"], query_heads=query,
            context=context_out, scale=scale, kv_heads=int(shape[1]), head_size=int(shape[3])))
    return matches


def query_heads_count(model: onnx.ModelProto, matches: list[AttentionMatch], feeds: dict) -> dict[int, int]:
    """Each layer's number of query heads, read from one run of the original model on ``feeds``."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    for m in matches:
        if m.query_heads not in known:
            probe.graph.output.append(helper.make_empty_tensor_value_info(m.query_heads))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = session.run([m.query_heads for m in matches], feeds)
    counts = {}
    steps = feeds["input_ids"].shape[1] if "input_ids" in feeds else None
    for m, value in zip(matches, values):
        if (value.ndim != 4 or value.shape[3] != m.head_size or value.shape[1] % m.kv_heads
                or (steps is not None and value.shape[2] != steps)):
            raise RewriteError(f"layer {m.layer}: query heads {value.shape}: expected [N, heads, {steps or 'S'}, "
                               f"{m.head_size}] with heads a multiple of {m.kv_heads}")
        counts[m.layer] = int(value.shape[1])
    return counts


def _const(name: str, values, dtype) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.array(values, dtype), name))


def to_group_query_attention(model: onnx.ModelProto, matches: list[AttentionMatch],
                             heads: dict[int, int]) -> onnx.ModelProto:
    """A copy of ``model`` with each matched attention as one ``GroupQueryAttention``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    index = GraphIndex(graph)
    mask = "attention_mask"
    if mask not in {i.name for i in graph.input}:
        raise RewriteError("no 'attention_mask' input to derive the lengths from")
    prefix = "gpudecode_prepare/"
    new: list[onnx.NodeProto] = [
        _const(prefix + "axis1", [1], np.int64), _const(prefix + "one", 1, np.int64),
        _const(prefix + "index1", 1, np.int64), _const(prefix + "flat", [0, 0, -1], np.int64),
        helper.make_node("Cast", [mask], [prefix + "mask64"], to=onnx.TensorProto.INT64),
        helper.make_node("ReduceSum", [prefix + "mask64", prefix + "axis1"], [prefix + "mask_sum"], keepdims=0),
        helper.make_node("Sub", [prefix + "mask_sum", prefix + "one"], [prefix + "seqlens64"]),
        helper.make_node("Cast", [prefix + "seqlens64"], ["seqlens_k"], to=onnx.TensorProto.INT32),
        helper.make_node("Shape", [mask], [prefix + "mask_shape"]),
        helper.make_node("Gather", [prefix + "mask_shape", prefix + "index1"], [prefix + "total64"], axis=0),
        helper.make_node("Cast", [prefix + "total64"], ["total_sequence_length"], to=onnx.TensorProto.INT32),
    ]
    presents = {name for m in matches for name in (m.present_key, m.present_value)}
    for node in graph.node:  # the old present Concats go (what read them, e.g. a Shape, reads the op's)
        for i, name in enumerate(node.output):
            if name in presents:
                node.output[i] = prefix + "unused/" + name
    for m in matches:
        p = f"{prefix}layer{m.layer}/"
        flat = {}
        for kind, source in (("query", m.query_heads), ("key", m.key_heads), ("value", m.value_heads)):
            maker = index.producer.get(source)
            if maker is not None and maker.op_type == "Transpose" and list(attribute(maker, "perm", [])) == [0, 2, 1, 3]:
                bsnh = maker.input[0]  # the heads split before the export's own transpose
            else:
                bsnh = p + kind + "_bsnh"
                new.append(helper.make_node("Transpose", [source], [bsnh], perm=[0, 2, 1, 3]))
            new.append(helper.make_node("Reshape", [bsnh, prefix + "flat"], [p + kind]))
            flat[kind] = p + kind
        new.append(helper.make_node(
            "GroupQueryAttention",
            [flat["query"], flat["key"], flat["value"], m.past_key, m.past_value, "seqlens_k", "total_sequence_length"],
            [p + "output", m.present_key, m.present_value], domain=MS_DOMAIN, name=f"GroupQueryAttention_{m.layer}",
            num_heads=heads[m.layer], kv_num_heads=m.kv_heads, scale=float(m.scale)))
        readers = index.consumers.get(m.context, [])
        back = readers[0] if len(readers) == 1 else None
        if back is not None and back.op_type == "Transpose" and list(attribute(back, "perm", [])) == [0, 2, 1, 3]:
            # the export's own transpose back to [N, S, heads, Dh]: its readers take the op's output
            new.append(_const(p + "heads_shape", [0, 0, heads[m.layer], m.head_size], np.int64))
            new.append(helper.make_node("Reshape", [p + "output", p + "heads_shape"], [back.output[0]]))
            back.output[0] = p + "unused/context"
        else:
            new.append(_const(p + "heads_shape", [0, 0, heads[m.layer], m.head_size], np.int64))
            new.append(helper.make_node("Reshape", [p + "output", p + "heads_shape"], [p + "output_bsnh"]))
            new.append(helper.make_node("Transpose", [p + "output_bsnh"], [p + "context"], perm=[0, 2, 1, 3]))
            for node in graph.node:
                for i, name in enumerate(node.input):
                    if name == m.context:
                        node.input[i] = p + "context"
    nodes = list(graph.node) + new
    del graph.node[:]
    graph.node.extend(_topological(nodes, {i.name for i in graph.input} | {t.name for t in graph.initializer}))
    if not any(o.domain == MS_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    remove_dead_nodes(out)
    return out


def _topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` in an order where every input is made before it is read."""
    available = set(available) | {""}
    ordered, pending = [], list(nodes)
    while pending:
        ready = [n for n in pending if all(i in available for i in n.input)]
        if not ready:
            raise RewriteError("the rewritten graph has a cycle or an input nothing makes")
        for node in ready:
            available.update(node.output)
        ordered += ready
        ready_ids = {id(n) for n in ready}
        pending = [n for n in pending if id(n) not in ready_ids]
    return ordered
