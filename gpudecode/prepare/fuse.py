"""ONNX Runtime's transformer optimiser (``onnxruntime.transformers.optimizer``) on a step model:
its LayerNorm / GELU / bias / skip-LayerNorm fusions, its own attention fusion off (the attention is
:mod:`gpudecode.prepare.rewrite`'s), and its float16 conversion with float32 logits."""

from __future__ import annotations

import logging
from collections import Counter

import onnx

#: op types the float16 conversion leaves in float32 (ONNX Runtime's defaults, plus what must stay exact)
FLOAT16_BLOCKED_OPS = ("ReduceSum", "Range", "CumSum")


def fuse_generic(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int], str | None]:
    """The optimiser's Python fusions (``opt_level`` 0: the graph stays portable between
    providers): (the model, fused op counts, why nothing was fused or None)."""
    try:
        from onnxruntime.transformers.fusion_options import FusionOptions
        from onnxruntime.transformers.optimizer import optimize_model

        options = FusionOptions("gpt2")
        options.enable_attention = False
        options.enable_rotary_embeddings = False
        options.enable_embed_layer_norm = False
        options.enable_shape_inference = False  # (it needs sympy; the fusions used here do not)
        before = Counter(node.op_type for node in model.graph.node)
        copy = onnx.ModelProto()
        copy.CopyFrom(model)  # (the optimiser edits the model it is given)
        previous = logging.root.manager.disable  # (the optimiser's notes on what it was not given)
        logging.disable(logging.WARNING)
        try:
            optimized = optimize_model(copy, model_type="gpt2", optimization_options=options, opt_level=0)
        finally:
            logging.disable(previous)
        optimized.topological_sort()
        result = optimized.model
    except Exception as exc:  # noqa: BLE001 - the fusions are optional: the model stays as it was
        return model, {}, f"ONNX Runtime's optimiser failed ({str(exc).splitlines()[0][:200]})"
    after = Counter(node.op_type for node in result.graph.node)
    fused = {op: n for op, n in after.items() if n > before.get(op, 0)}
    return result, fused, None


def to_float16(model: onnx.ModelProto, float32_outputs: list[str]) -> onnx.ModelProto:
    """Weights and activations in float16; ``float32_outputs`` (inputs and outputs by name, e.g. the
    logits) stay float32. The result is sorted and checked (``onnx.checker``, full): a conversion
    the converter gets wrong (an ``If``'s subgraphs: Optimum's merged decoders) raises ValueError
    rather than being written."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    converted = OnnxModel(convert_float_to_float16(
        model, keep_io_types=list(float32_outputs), disable_shape_infer=True,
        op_block_list=list(DEFAULT_OP_BLOCK_LIST) + list(FLOAT16_BLOCKED_OPS)))
    converted.topological_sort()  # (the converter appends the kept inputs' casts after their readers)
    imported = {entry.domain for entry in converted.model.opset_import}
    for domain in sorted({node.domain for node in converted.model.graph.node} - imported - {"", "ai.onnx"}):
        converted.model.opset_import.append(onnx.helper.make_opsetid(domain, 1))  # (the fusions' contrib ops)
    try:
        onnx.checker.check_model(converted.model, full_check=True)
    except Exception as exc:  # noqa: BLE001 - onnx's checker raises several kinds
        raise ValueError(f"float16: ONNX Runtime's float16 converter wrote an invalid model "
                         f"({str(exc).splitlines()[0][:200]}); prepare it without --float16") from exc
    return converted.model
