"""A tiny decoder-only LM in ONNX Runtime GenAI's export convention, with a numpy oracle.

``input_ids`` [N, S], ``attention_mask`` [N, T+S], ``past_key_values.{i}.key|value``
[N, KV, T, kv_cache_dim] (the head size symbolic, as GenAI's builder declares it) ->
``logits`` [N, S, V], ``present.{i}.key|value``. The attention is ONNX Runtime's
``GroupQueryAttention`` (com.microsoft; grouped key-value heads, no rotary embedding), fed as the
builder feeds it: ``seqlens_k`` = sum(attention_mask) - 1 and ``total_sequence_length`` = T + S
computed from the mask (``lengths="mask"``) or taken as inputs of those names (``lengths="inputs"``).
The op ignores where the mask's zeros are: it reads each row's past from position 0.

``attention="unmasked"``: the same layers with a plain attention over every past position, the mask
ignored (a model no convention feeds correctly when histories are padded). ``history_alignment``
writes ``HISTORY_ALIGNMENT`` metadata (e.g. ``right``: a GQA model declared to be fed wrongly).
"""

from __future__ import annotations

import numpy as np

from gpudecode.testing._graph import GraphBuilder, onnx_type
from gpudecode.testing.reference import ReferenceModel


def _weights(seed: int, vocab: int, dim: int, heads: int, kv_heads: int, head: int, ffn: int, layers: int):
    rng = np.random.default_rng(seed)

    def init(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[0])).astype(np.float32)

    w = {"emb": rng.standard_normal((vocab, dim)).astype(np.float32), "out": init(dim, vocab, scale=4.0)}
    for i in range(layers):
        w.update({f"q{i}": init(dim, heads * head), f"k{i}": init(dim, kv_heads * head),
                  f"v{i}": init(dim, kv_heads * head), f"o{i}": init(heads * head, dim),
                  f"f1{i}": init(dim, ffn), f"f2{i}": init(ffn, dim)})
    return w


def build_genai_lm(
    seed: int = 0, *, vocab_size: int = 16, model_dim: int = 32, num_layers: int = 2, num_heads: int = 4,
    num_kv_heads: int = 2, ffn_dim: int = 48, attention: str = "gqa", lengths: str = "mask",
    history_alignment: str | None = None,
) -> ReferenceModel:
    """The model (see the module docstring) and its oracle: ``sequence_log_probs(tokens)`` [len, V]."""
    if attention not in ("gqa", "unmasked") or lengths not in ("mask", "inputs"):
        raise ValueError(f"attention {attention!r} / lengths {lengths!r}: expected gqa|unmasked / mask|inputs")
    if attention == "unmasked":
        num_kv_heads = num_heads
    head = model_dim // num_heads
    w = _weights(seed, vocab_size, model_dim, num_heads, num_kv_heads, head, ffn_dim, num_layers)
    g = GraphBuilder()
    x = g.op("Gather", g.weight("emb", w["emb"]), "input_ids")
    i32 = onnx_type(np.int32)
    if attention == "gqa" and lengths == "mask":
        total_sum = g.op("ReduceSum", "attention_mask", g.const([1], np.int64), keepdims=0)
        seqlens = g.op("Cast", g.op("Sub", total_sum, g.const(1, np.int64)), to=i32)
        total = g.op("Cast", g.dim("attention_mask", 1), to=i32)
    else:
        seqlens, total = "seqlens_k", "total_sequence_length"
    for i in range(num_layers):
        q, k, v = (g.op("MatMul", x, g.weight(f"{n}{i}", w[f"{n}{i}"])) for n in "qkv")
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        present_k, present_v = f"present.{i}.key", f"present.{i}.value"
        if attention == "gqa":
            att = g.ops("GroupQueryAttention", [q, k, v, past_k, past_v, seqlens, total], 3,
                        out=[g.fresh("attention"), present_k, present_v], domain="com.microsoft",
                        num_heads=num_heads, kv_num_heads=num_kv_heads)[0]
        else:  # every past position, the mask ignored (one new step)
            def heads(t, n):
                return g.op("Transpose", g.reshape(t, [0, 0, n, head]), perm=[0, 2, 1, 3])
            keys = g.op("Concat", past_k, heads(k, num_heads), axis=2, out=present_k)
            values = g.op("Concat", past_v, heads(v, num_heads), axis=2, out=present_v)
            logits = g.op("Mul", g.op("MatMul", heads(q, num_heads), g.op("Transpose", keys, perm=[0, 1, 3, 2])),
                          g.const(1 / np.sqrt(head), np.float32))
            att = g.op("MatMul", g.op("Softmax", logits, axis=-1), values)
            att = g.reshape(g.op("Transpose", att, perm=[0, 2, 1, 3]), [0, 0, model_dim])
        x = g.op("Add", x, g.op("MatMul", att, g.weight(f"o{i}", w[f"o{i}"])))
        hidden = g.op("Relu", g.op("MatMul", x, g.weight(f"f1{i}", w[f"f1{i}"])))
        x = g.op("Add", x, g.op("MatMul", hidden, g.weight(f"f2{i}", w[f"f2{i}"])))
    g.op("MatMul", x, g.weight("out", w["out"]), out="logits")

    head_dim = "kv_cache_dim" if attention == "gqa" else head  # GenAI's builder: symbolic
    inputs = [("input_ids", np.int64, ["batch_size", "sequence_length"]),
              ("attention_mask", np.int64, ["batch_size", "total_sequence_length"])]
    if lengths == "inputs":
        inputs += [("seqlens_k", np.int32, ["batch_size"]), ("total_sequence_length", np.int32, [])]
    outputs = [("logits", np.float32, ["batch_size", "sequence_length", vocab_size])]
    states = {}
    for i in range(num_layers):
        for kind in ("key", "value"):
            inputs.append((f"past_key_values.{i}.{kind}", np.float32,
                           ["batch_size", num_kv_heads, "past_sequence_length", head_dim]))
            outputs.append((f"present.{i}.{kind}", np.float32,
                            ["batch_size", num_kv_heads, "total_sequence_length", head_dim]))
            states[f"past_key_values.{i}.{kind}"] = f"present.{i}.{kind}"
    metadata = {"HISTORY_ALIGNMENT": history_alignment} if history_alignment else None
    model = g.build(inputs, outputs, name=f"genai-lm-{attention}", metadata=metadata)
    group = num_heads // num_kv_heads

    def sequence_log_probs(tokens, encoder_inputs=None) -> np.ndarray:
        x = w["emb"][np.asarray(tokens)].astype(np.float64)  # [L, D]
        length = len(tokens)
        causal = np.tril(np.ones((length, length), bool))
        for i in range(num_layers):
            q = (x @ w[f"q{i}"]).reshape(length, num_heads, head)
            k = (x @ w[f"k{i}"]).reshape(length, num_kv_heads, head)
            v = (x @ w[f"v{i}"]).reshape(length, num_kv_heads, head)
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            logits = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(head)
            logits = np.where(causal[None], logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            att = np.einsum("hqk,khd->qhd", p, v).reshape(length, model_dim)
            x = x + att @ w[f"o{i}"]
            x = x + np.maximum(x @ w[f"f1{i}"], 0) @ w[f"f2{i}"]
        logits = x @ w["out"]
        shifted = logits - logits.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    def oracle(feeds):
        raise NotImplementedError("use sequence_log_probs")

    return ReferenceModel(model=model, oracle=oracle, vocab_size=vocab_size, hidden_dim=model_dim,
                          num_layers=num_layers, num_heads=num_heads, head_dim=head, states=states, time_axis=2,
                          sequence_oracle=sequence_log_probs)
