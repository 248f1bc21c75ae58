"""ONNX Runtime GenAI exports: ``genai_config.json`` and what a builder export's graph says.

A GenAI model folder holds ``genai_config.json`` next to the decoder (``model.decoder.filename``):
its input and output names (``past_key_values.%d.key`` patterns), head size and key-value heads
(the exports declare the head size as a symbolic ``kv_cache_dim``), and the sentence-begin,
sentence-end and padding labels.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_NAME = "genai_config.json"


@dataclass(frozen=True)
class GenAiConfig:
    """The parts of a ``genai_config.json`` the toolkit reads."""

    path: Path
    model_file: Path
    io_map: dict[str, str]  # logical -> model name (input_ids, attention_mask, position_ids, logits)
    state_patterns: tuple[tuple[str, str], ...]  # (past input regex, present output template)
    head_size: int | None
    num_key_value_heads: int | None
    num_layers: int | None
    vocab_size: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    context_length: int | None = None
    search: dict = field(default_factory=dict)


def _pattern(template: str) -> tuple[str, str]:
    """``past_key_values.%d.key`` -> (regex of the input, ``\\1`` in the other name)."""
    parts = template.split("%d")
    if len(parts) != 2:
        raise ValueError(f"name pattern {template!r}: expected one %d")
    return re.escape(parts[0]) + r"(\d+)" + re.escape(parts[1]), parts


def find_genai_config(model) -> Path | None:
    """The ``genai_config.json`` of ``model``: the file itself, the one in a model folder, or the
    one next to an ONNX file; None when there is none (or ``model`` is not a path)."""
    if not isinstance(model, (str, Path)) or str(model).startswith("<"):
        return None
    path = Path(model)
    if path.is_dir():
        path = path / CONFIG_NAME
    elif path.name != CONFIG_NAME:
        path = path.parent / CONFIG_NAME
    return path if path.is_file() else None


def read_genai_config(path) -> GenAiConfig:
    """Reads ``path`` (a ``genai_config.json``); ValueError naming the file on what it lacks."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        model = data["model"]
        decoder = model["decoder"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a GenAI config with model.decoder ({exc})") from exc
    inputs, outputs = decoder.get("inputs", {}), decoder.get("outputs", {})
    io_map = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
    if "logits" in outputs:
        io_map["logits"] = outputs["logits"]
    patterns = []
    for kind in ("key", "value"):
        past, present = inputs.get(f"past_{kind}_names"), outputs.get(f"present_{kind}_names")
        if past and present:
            regex, _ = _pattern(past)
            before, after = _pattern(present)[1]
            patterns.append((regex, before.replace("\\", "\\\\") + r"\1" + after.replace("\\", "\\\\")))
    eos = model.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    return GenAiConfig(
        path=path,
        model_file=path.parent / decoder.get("filename", "model.onnx"),
        io_map=io_map,
        state_patterns=tuple(patterns),
        head_size=decoder.get("head_size"),
        num_key_value_heads=decoder.get("num_key_value_heads"),
        num_layers=decoder.get("num_hidden_layers"),
        vocab_size=model.get("vocab_size"),
        bos_token_id=model.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=model.get("pad_token_id"),
        context_length=model.get("context_length"),
        search=dict(data.get("search", {})),
    )


def genai_state_dims(config: GenAiConfig, state_shapes: dict[str, tuple]) -> dict[str, int]:
    """Symbolic state dimensions -> sizes from ``config``: in GenAI's key-value layout
    [batch, key-value heads, time, head size] axis 1 is ``num_key_value_heads`` and axis 3
    ``head_size``. ``state_shapes``: state input name -> declared shape."""
    dims: dict[str, int] = {}
    for shape in state_shapes.values():
        if len(shape) != 4:
            continue
        for axis, value in ((1, config.num_key_value_heads), (3, config.head_size)):
            if isinstance(shape[axis], str) and value is not None:
                dims[shape[axis]] = int(value)
    return dims


def graph_state_dims(model_proto) -> dict[str, int]:
    """Symbolic dims of the past inputs of ONNX Runtime ``GroupQueryAttention`` nodes, from the
    nodes: key-value heads (``kv_num_heads``) on axis 1 and the head size (the packed query-key-value
    projection's width over num_heads + 2·kv_num_heads, or the key projection's over kv_num_heads) on
    axis 3, where those axes are symbolic in the graph's input."""
    graph = model_proto.graph
    weights = {t.name: tuple(t.dims) for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    declared = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input}

    def width(name: str) -> int | None:
        node = producers.get(name)
        while node is not None and node.op_type in ("Add", "Identity", "Cast"):
            node = producers.get(node.input[0])
        if node is None or node.op_type != "MatMul":
            return None
        shape = weights.get(node.input[1])
        return int(shape[-1]) if shape else None

    dims: dict[str, int] = {}
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 5:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        heads, kv_heads = attrs.get("num_heads"), attrs.get("kv_num_heads")
        if not heads or not kv_heads:
            continue
        packed = len(node.input) < 2 or not node.input[1]
        total = width(node.input[0]) if packed else width(node.input[1])
        head_size = None
        if total is not None:
            head_size = total // (heads + 2 * kv_heads) if packed else total // kv_heads
        for past in node.input[3:5]:
            shape = declared.get(past)
            if not shape or len(shape) != 4:
                continue
            for axis, value in ((1, kv_heads), (3, head_size)):
                if isinstance(shape[axis], str) and shape[axis] and value:
                    dims[shape[axis]] = int(value)
    return dims


def gqa_present_pairs(model_proto) -> dict[str, str]:
    """Present output -> past input of every ONNX Runtime ``GroupQueryAttention`` node that reads a
    graph input as its past key / value (inputs 3, 4) and writes a graph output as its present
    (outputs 1, 2): caches the op can append to in place when both are bound to one buffer."""
    graph = model_proto.graph
    inputs, outputs = {v.name for v in graph.input}, {v.name for v in graph.output}
    pairs = {}
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) < 5 or len(node.output) < 3:
            continue
        for past, present in zip(node.input[3:5], node.output[1:3]):
            if past in inputs and present in outputs:
                pairs[present] = past
    return pairs


def shared_presents(state_variables, pairs: dict[str, str]) -> dict[str, str]:
    """Present output -> past input of every state variable where each is the GroupQueryAttention
    present of its own past (``pairs``: :func:`gqa_present_pairs`); empty where one is not, or
    there are none (caches are shared for every state or for none)."""
    wanted = {v.output_name: v.input_name for v in state_variables}
    return wanted if wanted and all(pairs.get(output) == name for output, name in wanted.items()) else {}


def uses_group_query_attention(model_proto) -> bool:
    """Whether the graph runs ONNX Runtime's ``GroupQueryAttention``."""
    return any(node.op_type == "GroupQueryAttention" for node in model_proto.graph.node)
