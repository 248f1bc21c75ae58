"""``prepare_model``: a decoder step export -> the form the fast path uses, and what was done.

1. The export's family (:mod:`gpudecode.prepare.detect`). Already fast (GenAI's builder output):
   copied, annotated (and ``genai_config.json`` copied next to it).
2. A Hugging Face decoder with past: each layer's attention as ``GroupQueryAttention`` over a
   left-aligned cache (:mod:`gpudecode.prepare.rewrite`), proven on random histories against the
   original before it is kept; a graph the rewrite does not recognise, or whose rewrite differs,
   keeps its attention (reported unfused, with the reason).
3. ONNX Runtime's generic fusions (:mod:`gpudecode.prepare.fuse`); optional float16 with float32
   logits; the metadata the toolkit reads (``HISTORY_ALIGNMENT``, :data:`detect.PREPARED_KEY`).
4. With ``check``: :func:`gpudecode.prepare.check.check_prepared`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from gpudecode.prepare.check import (
    CheckOptions, CheckReport, check_outputs, check_prepared, compare_outputs, compare_steps,
)
from gpudecode.prepare.detect import FAST_ATTENTION_OPS, PREPARED_KEY, detect_family
from gpudecode.prepare.fuse import fuse_generic, to_float16
from gpudecode.prepare.rewrite import RewriteError, find_attention, query_heads_count, to_group_query_attention
from gpudecode.session.discovery import HISTORY_ALIGNMENT_KEY
from gpudecode.session.genai import CONFIG_NAME

ATTENTION_CHOICES = ("auto", "gqa", "none")
#: the prepared forms (metadata :data:`PREPARED_KEY`)
FORM_GQA, FORM_UNFUSED, FORM_ALREADY_FAST = "group-query-attention", "unfused", "already-fast"
#: a step model with a fixed one-label input takes its prompts from this file next to it
PREFILL_NAME = "decoder_model.onnx"
#: max |Δ| of logits and states for which a rewrite or fusion is kept (float32; --check is stricter)
STEP_TOLERANCE = 1e-3
#: families checked by their outputs on random inputs (no decoder cache of their own to rewrite)
OUTPUTS_CHECKED = ("seq2seq-decoder", "encoder")
#: why such a family's attention is left as it is
_KEPT_ATTENTION = {"seq2seq-decoder": "a cross-attention decoder: its attention is left as it is (the rewrite "
                                      "covers decoder-only self-attention); fusions and float16 apply",
                   "encoder": "an encoder: no decoder cache to rewrite; fusions and float16 apply"}


@dataclass(frozen=True)
class PrepareReport:
    """What :func:`prepare_model` did: the family found, the form written, why attention stayed
    unfused (``reason``), the fused op counts, and the check (None without ``check``)."""

    source: str
    output: str
    family: str
    form: str
    layers: int = 0
    reason: str | None = None
    fused_ops: dict = field(default_factory=dict)
    float16: bool = False
    check: CheckReport | None = None
    #: why ONNX Runtime's generic fusions were skipped (None: they ran)
    fusion_note: str | None = None
    #: a GenAI export's config: where it was written, or why not (None: not a GenAI export)
    genai_config: str | None = None

    @property
    def fused(self) -> bool:
        return self.form in (FORM_GQA, FORM_ALREADY_FAST)

    @property
    def passed(self) -> bool:
        """The check passed (True without one, or where it was skipped: its table line says why)."""
        return self.check is None or self.check.skipped is not None or self.check.passed

    def rows(self) -> list[tuple[str, str]]:
        form = {FORM_GQA: f"GroupQueryAttention over a left-aligned cache ({self.layers} layers)",
                FORM_UNFUSED: f"unfused: {self.reason}",
                FORM_ALREADY_FAST: "already fast (copied and annotated)"}[self.form]
        rows = [("model", self.source), ("written", self.output), ("export family", self.family),
                ("attention", form),
                ("other fusions", self.fusion_note or ", ".join(f"{op} ×{n}" for op, n in sorted(self.fused_ops.items()))
                 or "none"),
                ("precision", "float16, logits float32" if self.float16 else "as exported")]
        if self.genai_config is not None:
            rows.append(("genai_config.json", self.genai_config))
        return rows + (self.check.rows() if self.check is not None else [])

    def table(self) -> str:
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def prepare_model(source, output, *, float16: bool = False, attention: str = "auto", check: bool = False,
                  prefill_model=None, check_options: CheckOptions = CheckOptions()) -> PrepareReport:
    """Writes ``source`` (an ONNX decoder step model) to ``output`` in the fast form (module
    docstring). ``attention``: ``auto``/``gqa`` fuse it where recognised, ``none`` leaves it;
    ``prefill_model``: the prompt model for the check's decode (default: ``decoder_model.onnx`` next
    to a model that takes one label per call, else the model itself)."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention {attention!r}: expected one of {', '.join(ATTENTION_CHOICES)}")
    source, output = Path(source), Path(output)
    if source.resolve() == output.resolve():
        raise ValueError(f"{output}: the output must not overwrite the model")
    model = onnx.load(str(source))
    output.parent.mkdir(parents=True, exist_ok=True)
    genai_config = _genai_config(source)
    detection = detect_family(model, genai=genai_config is not None)
    reason, layers, fused_ops, fusion_note, config_note = None, 0, {}, None, None
    if detection.family == "fast":
        form = FORM_ALREADY_FAST
        prepared = model
        if genai_config is not None:
            config_note = _copy_genai_config(genai_config, output)
    else:
        fused, fused_ops, fusion_note = _generic_fusions(model, detection)
        prepared, reason, layers = _fuse_attention(fused, attention, detection)
        form = FORM_GQA if reason is None else FORM_UNFUSED
    if float16:
        prepared = to_float16(prepared, _float32_io(prepared, detection))
    _annotate(prepared, form)
    onnx.save(prepared, str(output))
    report = PrepareReport(str(source), str(output), detection.family, form, layers, reason, fused_ops, float16,
                           fusion_note=fusion_note, genai_config=config_note)
    if check and detection.family in OUTPUTS_CHECKED:
        result = check_outputs(str(source), str(output), float16=float16, options=check_options)
        report = PrepareReport(**{**report.__dict__, "check": result})
    elif check:
        prefill = prefill_model if prefill_model is not None else _default_prefill(source, model)
        result = check_prepared(str(source), str(output), prefill=None if prefill is None else str(prefill),
                                float16=float16, options=check_options)
        report = PrepareReport(**{**report.__dict__, "check": result})
    return report


def _generic_fusions(model: onnx.ModelProto, detection) -> tuple[onnx.ModelProto, dict, str | None]:
    """ONNX Runtime's fusions where their result can be proven on random histories (a Hugging Face
    decoder with past); else the model as it is, and why."""
    if detection.family not in ("hf-decoder-with-past", *OUTPUTS_CHECKED):
        return model, {}, f"not applied: no equivalence check for this family ({detection.detail})"
    fused, ops, note = fuse_generic(model)
    if note is not None:
        return model, {}, note
    compare = compare_outputs if detection.family in OUTPUTS_CHECKED else lambda a, b, o: max(compare_steps(a, b, o))
    try:
        worst = compare(model, fused, CheckOptions(trials=2))
    except Exception as exc:  # noqa: BLE001 - an unrunnable fusion is dropped, not kept
        return model, {}, f"dropped: the fused model failed to run ({str(exc).splitlines()[0][:160]})"
    if not np.isfinite(worst) or worst > STEP_TOLERANCE:
        return model, {}, f"dropped: the fused model differs from the original (max |Δ| {worst:.3g})"
    return fused, ops, None


def _fuse_attention(model: onnx.ModelProto, attention: str, detection) -> tuple[onnx.ModelProto, str | None, int]:
    """(model, why its attention stayed unfused or None, layers fused)."""
    if attention == "none":
        return model, "--attention none", 0
    if detection.family in _KEPT_ATTENTION:
        return model, _KEPT_ATTENTION[detection.family], 0
    if detection.family != "hf-decoder-with-past":
        return model, f"not a Hugging Face decoder with past ({detection.detail})", 0
    try:
        matches = find_attention(model)
        heads = query_heads_count(model, matches, _probe_feeds(model, matches))
        rewritten = to_group_query_attention(model, matches, heads)
        logits, states = compare_steps(model, rewritten, CheckOptions(trials=2))
    except RewriteError as exc:
        return model, f"attention pattern not recognised: {exc}", 0
    except Exception as exc:  # noqa: BLE001 - a rewrite ONNX Runtime refuses keeps the original
        return model, f"the rewritten model failed to run ({str(exc).splitlines()[0][:200]})", 0
    worst = max(logits, states)
    if not np.isfinite(worst) or worst > STEP_TOLERANCE:
        return model, f"the rewritten attention differs from the original (max |Δ| {worst:.3g})", 0
    return rewritten, None, len(matches)


def _float32_io(model: onnx.ModelProto, detection) -> list[str]:
    """The inputs and outputs a float16 form keeps in float32: a decoder's logits; an encoder's
    inputs and outputs; a cross-attention decoder's all but its cache (its encoder states stay
    what a float32 encoder gives)."""
    names = [v.name for v in (*model.graph.input, *model.graph.output)]
    if detection.family == "encoder":
        return names
    if detection.family == "seq2seq-decoder":
        return [n for n in names if not n.startswith(("past_key_values.", "present."))]
    return [n for n in names if n == "logits"]


def _probe_feeds(model: onnx.ModelProto, matches) -> dict:
    """One row, two past positions, one new label: enough to read the query heads' shape."""
    declared = {v.name for v in model.graph.input}
    feeds = {"input_ids": np.zeros((1, 1), np.int64), "attention_mask": np.ones((1, 3), np.int64),
             "position_ids": np.full((1, 1), 2, np.int64)}
    for m in matches:
        for name in (m.past_key, m.past_value):
            feeds[name] = np.zeros((1, m.kv_heads, 2, m.head_size), np.float32)
    return {k: v for k, v in feeds.items() if k in declared}


def _annotate(model: onnx.ModelProto, form: str) -> None:
    """The metadata the toolkit reads: the cache alignment of a fused form (left: the fused ops read
    each row's history from its start; another graph's alignment is left to the load-time probe),
    and the prepared form."""
    props = {p.key: p.value for p in model.metadata_props}
    if form in (FORM_GQA, FORM_ALREADY_FAST) and any(n.op_type in FAST_ATTENTION_OPS for n in model.graph.node):
        props[HISTORY_ALIGNMENT_KEY] = "left"
    props[PREPARED_KEY] = form
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, props)


def _genai_config(source: Path) -> Path | None:
    """The ``genai_config.json`` next to ``source`` that names it as its decoder (a GenAI export), or None."""
    config = source.parent / CONFIG_NAME
    if not config.is_file():
        return None
    try:
        filename = json.loads(config.read_text())["model"]["decoder"]["filename"]
    except (ValueError, KeyError, TypeError):
        return None
    return config if filename == source.name else None


def _copy_genai_config(config: Path, output: Path) -> str:
    """A GenAI export's ``genai_config.json`` next to the output, naming the output's file; where
    it went (or, in the export's own folder, why its config was left naming the export)."""
    target = output.parent / CONFIG_NAME
    data = json.loads(config.read_text())
    data["model"]["decoder"]["filename"] = output.name
    if target.resolve() == config.resolve():  # the export's own config is not rewritten
        return (f"left naming {config.parent / json.loads(config.read_text())['model']['decoder']['filename']} "
                f"(the output is in the export's folder: write it to another folder to load it as a GenAI folder)")
    target.write_text(json.dumps(data, indent=4))
    return f"written: {target}"


def _default_prefill(source: Path, model: onnx.ModelProto) -> Path | None:
    """``decoder_model.onnx`` next to a step model whose ``input_ids`` take one label per call."""
    for value in model.graph.input:
        if value.name == "input_ids":
            dims = value.type.tensor_type.shape.dim
            if len(dims) == 2 and dims[1].dim_value == 1 and (source.parent / PREFILL_NAME).is_file():
                return source.parent / PREFILL_NAME
    return None
