"""Which form a decoder step export is in, and the one-line ``gpudecode prepare`` suggestion.

Read at model load (cheap: the model's spec, or op types of a loaded graph); nothing here runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass

#: metadata a prepared model carries: the form ``prepare`` gave it (e.g. ``group-query-attention``)
PREPARED_KEY = "gpudecode_prepared"
#: attention ops whose caches the toolkit keeps left-aligned and written in place
FAST_ATTENTION_OPS = ("GroupQueryAttention", "DecoderMaskedMultiHeadAttention")
#: the inputs that make a model an encoder: Hugging Face's audio features and waveform, the toolkit's features
ENCODER_INPUTS = ("input_features", "input_values", "features")


@dataclass(frozen=True)
class Detection:
    """A graph's export family: ``fast`` (fused attention over a left-aligned cache),
    ``hf-decoder-with-past`` (Hugging Face / Optimum names, attention as plain ops), ``rasr``
    (the toolkit's own convention), ``seq2seq-decoder`` (a cross-attention decoder: Whisper,
    Optimum's seq2seq), ``encoder`` or ``unknown``; ``detail`` says what decided it."""

    family: str
    detail: str


def detect_family(model, *, genai: bool = False) -> Detection:
    """The family of ``model`` (an ``onnx.ModelProto``); ``genai``: a ``genai_config.json`` names it
    as its decoder (ONNX Runtime GenAI's builder output, fast whatever attention op its precision
    and provider got: e.g. ``MultiHeadAttention`` in its float16 CPU export)."""
    ops = {node.op_type for node in model.graph.node}
    fused = sorted(ops & set(FAST_ATTENTION_OPS))
    inputs = {value.name for value in model.graph.input}
    if fused:
        return Detection("fast", f"attention already fused ({', '.join(fused)})")
    if genai:
        attention = sorted(op for op in ops if op.endswith("Attention"))
        return Detection("fast", "ONNX Runtime GenAI builder export (genai_config.json)"
                         + (f", attention {', '.join(attention)}" if attention else ""))
    if "token" in inputs:
        return Detection("rasr", "the toolkit's own convention (token, prefix-length)")
    if "encoder_hidden_states" in inputs or any(".encoder." in name for name in inputs if name.startswith("past_")):
        return Detection("seq2seq-decoder", "a cross-attention decoder (Whisper / Optimum seq2seq: "
                         "encoder_hidden_states or per-layer encoder keys)")
    if inputs & set(ENCODER_INPUTS) and not inputs & {"input_ids", "token"}:
        return Detection("encoder", f"an encoder ({', '.join(sorted(inputs & set(ENCODER_INPUTS)))})")
    if "input_ids" in inputs and any(name.startswith("past_key_values.") for name in inputs):
        branch = " (merged: an If on use_cache_branch)" if "If" in ops else ""
        return Detection("hf-decoder-with-past", f"Hugging Face decoder with past_key_values{branch}")
    return Detection("unknown", "no past_key_values inputs and no fused attention")


def prepare_hint(spec, *, fused_attention: bool = False, genai: bool = False) -> str | None:
    """One line suggesting ``gpudecode prepare`` for a step model (a ``ModelSpec``) that is not in
    the fast form: a Hugging Face decoder whose cache is right-aligned (the attention as plain ops,
    the history copied into every step); None for a model in the fast form (left-aligned, written in
    place, or ``fused_attention``: its graph runs one of :data:`FAST_ATTENTION_OPS`), one ``prepare``
    wrote already (metadata :data:`PREPARED_KEY`), a GenAI export (``genai``: ``prepare`` leaves it as
    it is), or of another kind."""
    variables = spec.state_variables
    if PREPARED_KEY in spec.tensors.metadata or genai:  # prepared already, or a GenAI export (already fast)
        return None
    if (spec.convention != "huggingface" or not variables or spec.history_alignment == "left" or fused_attention
            or spec.in_place_outputs or any(v.time_axis is None for v in variables)):
        return None
    return (f"{spec.source}: not in the fast form (attention as plain ops, the cache copied every step); "
            f"`gpudecode prepare {spec.source} -o FAST.onnx` rewrites it (for CUDA add --float16: ONNX "
            "Runtime's CUDA GroupQueryAttention runs float16 only)")
