"""A readable summary of an ONNX model's interface, as `gpudecode inspect` prints it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import onnx

from gpudecode.prepare.detect import prepare_hint
from gpudecode.session.conventions import discover_with_hints, model_hints
from gpudecode.session.discovery import ModelError, discover_encoder
from gpudecode.session.genai import gqa_present_pairs, shared_presents, uses_group_query_attention
from gpudecode.session.tensors import ModelTensors, from_onnx_model


def _table(rows: list[tuple[str, str]], indent: str = "  ") -> list[str]:
    width = max((len(a) for a, _ in rows), default=0)
    return [f"{indent}{a:<{width}}  {b}" for a, b in rows]


def _is_joint_network(tensors: ModelTensors, io_map: Mapping[str, str]) -> bool:
    """Inputs 'encoder-frame' and 'prediction', output 'log-probs' (names through ``io_map``)."""
    name = lambda logical: io_map.get(logical, logical)  # noqa: E731
    return (tensors.input(name("encoder-frame")) is not None and tensors.input(name("prediction")) is not None
            and tensors.output(name("log-probs")) is not None)


def _alignment(spec, model) -> str:
    """The history alignment line: RASR's from the metadata; a Hugging Face decoder's is chosen at
    load by the parity probe (left for GroupQueryAttention fed from the mask)."""
    if spec.convention == "rasr":
        return ("left (each row's history first; the model reads prefix-length positions)"
                if spec.history_alignment == "left" else "right (RASR: padding first)")
    if not any(n in spec.hypothesis_inputs for n in ("attention_mask", "seqlens_k")):
        return "none needed (no attention_mask: histories are never padded)"
    if spec.history_alignment == "left" or uses_group_query_attention(model):
        return ("left, expected (GroupQueryAttention: the mask's ones over each row's first prefix+1 positions, "
                "the new step read at the row's own length); proven at load by a parity probe, else refused")
    return "right, expected (padding first, masked by attention_mask); proven at load by a parity probe, else refused"


def _shared_presents_line(spec, model) -> str | None:
    """What CUDA graphs do with the cache of a Hugging Face decoder whose presents all come straight
    from GroupQueryAttention over their own pasts (``runtime.cuda_graphs.shared_presents``); None
    for any other model."""
    if (spec.convention != "huggingface" or spec.in_place_outputs
            or not shared_presents(spec.state_variables, gqa_present_pairs(model))):
        return None
    return ("cache with CUDA graphs: appended in place (each present bound to its past's buffer: "
            "GroupQueryAttention writes only the new step; runtime.cuda_graphs.shared_presents)")


def describe_model(path: str | Path, io_map: Mapping[str, str] | None = None) -> str:
    """Inputs, outputs, state variables with time axes, per-utterance inputs, metadata, convention."""
    path = Path(path)
    try:
        hints = model_hints(path)
    except ValueError as exc:
        raise ModelError(str(exc)) from exc
    if hints is not None and (path.is_dir() or path.suffix == ".json"):
        path = hints.model_file  # a GenAI model folder or genai_config.json: its decoder
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a folder without a genai_config.json: give the model file")
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    if path.stat().st_size == 0:
        raise ModelError(f"{path}: empty file (0 bytes), not an ONNX model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"{path}: not a readable ONNX file ({exc})") from exc
    if not (model.graph.input or model.graph.output or model.graph.node):
        raise ModelError(f"{path}: not an ONNX model (no graph inputs, outputs or nodes)")
    tensors: ModelTensors = from_onnx_model(model, str(path))
    lines = [f"model: {path}"]
    if hints is not None:
        eos = ", ".join(str(e) for e in hints.eos_token_ids) or "none"
        lines.append(f"GenAI config: {hints.path} (sentence-begin {hints.bos_token_id}, sentence-end {eos}, "
                     f"padding {hints.pad_token_id})")
    lines.append("inputs:")
    lines += _table([(t.name, t.describe()) for t in tensors.inputs])
    lines.append("outputs:")
    lines += _table([(t.name, t.describe()) for t in tensors.outputs])

    hf_encoder = (tensors.input("input_features") is not None and tensors.input("input_ids") is None
                  and "features" not in (io_map or {}))  # Optimum's encoder_model (Whisper)
    if tensors.input((io_map or {}).get("features", "features")) is not None or hf_encoder:
        io_map = dict(io_map or {})
        ctc = ("encoder-states" not in io_map and tensors.output("encoder-states") is None
               and tensors.output("log-probs") is not None)
        if ctc:  # a CTC encoder: frame log-probs are its encoder states
            io_map.update({"encoder-states": "log-probs", "encoder-states-size": "log-probs-size"})
        try:
            encoder = discover_encoder(tensors, io_map=io_map)
            lines.append("convention: CTC encoder (features -> frame log-probs 'log-probs' + 'log-probs-size')"
                         if ctc else "convention: encoder (features -> encoder-states)")
            layout = encoder.layout
            if layout.channels_first or layout.fixed_frames is not None or not encoder.has_lengths:
                lines.append(f"layout: features '{encoder.names['features']}' "
                             + ("[U, F, T]" if layout.channels_first else "[U, T, F]")
                             + (f", exactly {layout.fixed_frames} frames" if layout.fixed_frames else "")
                             + (", no lengths (every frame of the output is attended to)" if not encoder.has_lengths
                                else "") + f"; encoder states '{encoder.names['encoder-states']}'")
            if encoder.extra_outputs:
                lines.append("further outputs (per-utterance inputs of a decoder): " + ", ".join(encoder.extra_outputs))
        except ModelError as exc:
            lines.append(f"convention: not recognised ({exc})")
    elif _is_joint_network(tensors, io_map or {}):
        names = {k: (io_map or {}).get(k, k) for k in ("encoder-frame", "prediction", "log-probs")}
        lines.append(f"convention: transducer joint network ('{names['encoder-frame']}' + '{names['prediction']}' "
                     f"-> '{names['log-probs']}')")
    else:
        io_map = dict(io_map or {})
        prediction = ("scores" not in io_map and tensors.output("scores") is None
                      and tensors.output("prediction") is not None)
        if prediction:  # a transducer prediction network: its prediction vector stands where scores would
            io_map["scores"] = "prediction"
        notes = []
        try:
            try:
                spec = discover_with_hints(tensors, io_map=io_map, hints=hints)
            except ModelError as exc:
                if "could not be masked" not in str(exc):
                    raise
                spec = discover_with_hints(tensors, io_map=io_map, hints=hints, fixed_frames=True)
                notes.append("per-utterance inputs without a mask: only behind a fixed-length encoder without "
                             "lengths (models.encoder.layout lengths: none, e.g. Whisper's)")
        except ModelError as exc:
            lines.append(f"convention: not recognised ({exc})")
        else:
            if spec.state_variables and any(v.time_axis is not None for v in spec.state_variables) and not any(
                    n in spec.hypothesis_inputs for n in ("prefix-length", "attention_mask", "seqlens_k")):
                notes.append("no attention_mask: one model call per history length among a step's rows")
            kind = {"rasr": "RASR stateful step model", "huggingface": "Hugging Face decoder with past"}
            lines.append(f"convention: {spec.convention} ({kind[spec.convention]}"
                         + (", as a transducer prediction network)" if prediction else ")"))
            lines.append("per-hypothesis inputs: " + ", ".join(f"{k}='{v}'" for k, v in spec.hypothesis_inputs.items()))
            lines.append(f"scores output: '{spec.scores_output}'")
            lines.append(f"state variables ({len(spec.state_variables)}):")
            rows = []
            for v in spec.state_variables:
                info = tensors.input(v.input_name)
                axis = "none (one state per hypothesis)" if v.time_axis is None else str(v.time_axis)
                rows.append((f"{v.input_name} -> {v.output_name}", f"{info.describe()}  batch axis {v.batch_axis}  time axis {axis}"))
            lines += _table(rows)
            if spec.resolved_dims:
                lines.append("symbolic state dims resolved: " + ", ".join(
                    f"{k}={v}" for k, v in sorted(spec.resolved_dims.items()))
                    + (" (genai_config.json)" if hints is not None else " (GroupQueryAttention nodes)"))
            if any(v.time_axis is not None for v in spec.state_variables):
                lines.append("history alignment: " + _alignment(spec, model))
            if spec.in_place_outputs:
                lines.append("written in place (output -> the state input whose buffer it writes):")
                lines += _table(sorted(spec.in_place_outputs.items()))
            shared = _shared_presents_line(spec, model)
            if shared:
                lines.append(shared)
            rows_of = "one row per utterance" if spec.utterance_rows == "utterance" else "one row per hypothesis"
            lines.append(f"per-utterance inputs ({len(spec.utterance_inputs)}"
                         + (f", {rows_of}" if spec.utterance_inputs else "") + "):")
            lines += _table([
                (u.name, f"{tensors.input(u.name).describe()}" + (f"  from '{u.source}'" if u.source else ""))
                for u in spec.utterance_inputs
            ])
            hint = prepare_hint(spec, fused_attention=uses_group_query_attention(model), genai=hints is not None)
            if hint is not None:
                notes.append(hint)
            lines += [f"note: {n}" for n in notes]
    lines.append("metadata:" if tensors.metadata else "metadata: none")
    lines += _table(sorted(tensors.metadata.items()))
    return "\n".join(lines)
