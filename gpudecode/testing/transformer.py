"""Reference transformer decoder step models (RASR and Hugging Face conventions)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from gpudecode.session.discovery import HISTORY_ALIGNMENT_KEY, IN_PLACE_PREFIX
from gpudecode.testing._graph import (
    LN_EPSILON,
    OPSET,
    GraphBuilder,
    cast_all,
    layer_norm,
    linear,
    log_softmax,
    onnx_type,
    random_layer_norm,
    random_linear,
)
from gpudecode.testing.reference import Feeds, ReferenceModel

CROSS_ATTENTION_MODES = ("precomputed", "encoder-states", None)
KV_LAYOUTS = ("bhtd", "btd")
STATE_OUTPUTS = ("full", "new", "in-place")
ATTENTIONS = ("dense", "ragged", "gqa", "dmmha")


def cross_projection_weights(seed: int, num_layers: int, encoder_dim: int, model_dim: int) -> dict:
    """Per layer ``cross_key_{i}`` / ``cross_value_{i}`` .w [E, D] and .b [D] (float64).

    Drawn from their own stream so the encoder and the decoder of one seed share them.
    """
    rng = np.random.default_rng([seed, 1])
    weights: dict[str, np.ndarray] = {}
    for i in range(num_layers):
        random_linear(rng, weights, f"cross_key_{i}", encoder_dim, model_dim)
        random_linear(rng, weights, f"cross_value_{i}", encoder_dim, model_dim)
    return weights


@dataclass(frozen=True, kw_only=True)
class _Config:
    vocab_size: int
    model_dim: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    encoder_dim: int
    max_positions: int
    dtype: np.dtype

    @property
    def head_dim(self) -> int:
        return self.model_dim // self.num_heads

    @property
    def masked_logit(self) -> float:
        """Attention logit of a masked key: exp() of it is 0 and it fits in float16."""
        return -1e4 if self.dtype == np.float16 else -1e9


def _decoder_weights(seed: int, cfg: _Config) -> dict[str, np.ndarray]:
    """All decoder weights in the model dtype; cross-attention weights are drawn in every mode."""
    rng = np.random.default_rng(seed)
    dim, weights = cfg.model_dim, {}
    weights["tok_emb"] = rng.normal(size=(cfg.vocab_size, dim))
    weights["pos_emb"] = 0.5 * rng.normal(size=(cfg.max_positions, dim))
    for i in range(cfg.num_layers):
        random_layer_norm(rng, weights, f"self_ln_{i}", dim)
        for name in ("q", "k", "v", "o"):
            random_linear(rng, weights, f"self_{name}_{i}", dim, dim)
        random_layer_norm(rng, weights, f"cross_ln_{i}", dim)
        random_linear(rng, weights, f"cross_query_{i}", dim, dim)
        random_linear(rng, weights, f"cross_out_{i}", dim, dim)
        random_layer_norm(rng, weights, f"ffn_ln_{i}", dim)
        random_linear(rng, weights, f"ffn1_{i}", dim, cfg.ffn_dim)
        random_linear(rng, weights, f"ffn2_{i}", cfg.ffn_dim, dim)
    random_layer_norm(rng, weights, "final_ln", dim)
    random_linear(rng, weights, "out", dim, cfg.vocab_size)
    weights.update(cross_projection_weights(seed, cfg.num_layers, cfg.encoder_dim, dim))
    return cast_all(weights, cfg.dtype)


# -- numpy forward (float32) ----------------------------------------------------------------------


def _heads(x: np.ndarray, cfg: _Config) -> np.ndarray:
    """[N, Q, H*Dh] -> [N, H, Q, Dh]."""
    n, q, _ = x.shape
    return x.reshape(n, q, cfg.num_heads, cfg.head_dim).transpose(0, 2, 1, 3)


def _merge_heads(x: np.ndarray) -> np.ndarray:
    """[N, H, Q, Dh] -> [N, Q, H*Dh]."""
    n, h, q, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(n, q, h * d)


def _attend(q, k, v, valid, cfg: _Config) -> np.ndarray:
    """q [N,H,Q,Dh], k/v [N,H,K,Dh], valid broadcastable to [N,H,Q,K] -> [N,H,Q,Dh]."""
    logits = (q / np.sqrt(cfg.head_dim)) @ k.transpose(0, 1, 3, 2)
    logits = np.where(valid, logits, np.float32(cfg.masked_logit))
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    return (probs / probs.sum(-1, keepdims=True)) @ v


def _forward(w, cfg: _Config, x, past, self_valid, cross=None, cross_valid=None):
    """x [N,Q,D]; past: per layer (k, v) [N,H,T,Dh]; self_valid [N,Q,T+Q] bool;
    cross: per layer (k, v) [N,H,S,Dh] or None; cross_valid [N,S] bool.
    -> logits [N,Q,V], per layer new (k, v) [N,H,Q,Dh]. All float32."""
    new = []
    for i, (past_k, past_v) in enumerate(past):
        h = layer_norm(x, w, f"self_ln_{i}")
        q, k, v = (_heads(linear(h, w, f"self_{n}_{i}"), cfg) for n in ("q", "k", "v"))
        new.append((k, v))
        keys, values = np.concatenate([past_k, k], 2), np.concatenate([past_v, v], 2)
        att = _attend(q, keys, values, self_valid[:, None], cfg)
        x = x + linear(_merge_heads(att), w, f"self_o_{i}")
        if cross is not None:
            h = layer_norm(x, w, f"cross_ln_{i}")
            q = _heads(linear(h, w, f"cross_query_{i}"), cfg)
            att = _attend(q, cross[i][0], cross[i][1], cross_valid[:, None, None, :], cfg)
            x = x + linear(_merge_heads(att), w, f"cross_out_{i}")
        h = layer_norm(x, w, f"ffn_ln_{i}")
        x = x + linear(np.maximum(linear(h, w, f"ffn1_{i}"), 0), w, f"ffn2_{i}")
    return linear(layer_norm(x, w, "final_ln"), w, "out"), new


def _cross_inputs(w, cfg: _Config, mode, feeds: Feeds):
    """Per layer cross (k, v) [N,H,S,Dh] float32 and valid [N,S] from the per-utterance feeds."""
    if mode is None:
        return None, None
    if mode == "precomputed":
        cross = [
            (feeds[f"cross-key-{i}"].astype(np.float32), feeds[f"cross-value-{i}"].astype(np.float32))
            for i in range(cfg.num_layers)
        ]
    else:
        states = feeds["encoder-states"].astype(np.float32)
        cross = [
            tuple(
                _heads(linear(states, w, f"cross_{kind}_{i}").astype(cfg.dtype).astype(np.float32), cfg)
                for kind in ("key", "value")
            )
            for i in range(cfg.num_layers)
        ]
    num_s = cross[0][0].shape[2]
    valid = np.arange(num_s)[None, :] < feeds["encoder-states-size"].astype(np.int64)[:, None]
    return cross, valid


def _sequence_oracle(w, cfg: _Config, mode):
    def sequence_log_probs(tokens: list[int], encoder_inputs: Feeds | None) -> np.ndarray:
        num_tokens = len(tokens)
        if num_tokens > cfg.max_positions:
            raise ValueError(f"{num_tokens} tokens exceed max_positions={cfg.max_positions}")
        x = (w["tok_emb"][tokens] + w["pos_emb"][:num_tokens])[None]  # [1, L, D]
        empty = np.zeros((1, cfg.num_heads, 0, cfg.head_dim), np.float32)
        causal = np.tril(np.ones((num_tokens, num_tokens), bool))[None]
        cross = valid = None
        if mode is not None:
            if encoder_inputs is None:
                raise ValueError("this decoder needs encoder_inputs (its per-utterance inputs)")
            size = int(encoder_inputs["encoder-states-size"][0])
            cut = {
                k: (v[:, :, :size] if k.startswith("cross-") else v[:, :size])
                for k, v in encoder_inputs.items()
                if k != "encoder-states-size"
            }
            cut["encoder-states-size"] = np.array([size])
            cross, valid = _cross_inputs(w, cfg, mode, cut)
        logits, _ = _forward(w, cfg, x, [(empty, empty)] * cfg.num_layers, causal, cross, valid)
        return log_softmax(logits[0])

    return sequence_log_probs


# -- ONNX graph ------------------------------------------------------------------------------------


def _graph_layers(g: GraphBuilder, w, cfg: _Config, x: str, self_valid: str, states, layout, mode,
                  out: str | None = None, grouped: bool = False, state_outputs: str = "full",
                  fused_qkv: bool = False, ragged: tuple[str, str] | None = None,
                  gqa: tuple[str, str] | None = None, fused_ops: bool = False,
                  dmmha: tuple[str, str] | None = None, ft_keys: bool = False) -> str:
    """Adds the decoder layers to ``g``; returns the name (``out``) of the logits [N, 1, V].

    ``self_valid`` is a bool [N, 1, 1, T+1] (dense attention only); ``states`` per layer
    (past-key, past-value, present-key, present-value) names. ``grouped``: the per-utterance inputs have G rows and the
    N rows are G groups of N / G consecutive rows (cross-attention as one batched product per
    utterance). ``state_outputs``: "full" — present = past with the new step appended (a Concat
    of the whole history per state variable); "new" — present is the new step alone, and the
    self-attention takes the past and the new step as two parts (no copy of the history).
    "in-place" (fused dmmha only) — the state outputs are the op's present outputs themselves, the
    past's buffers with the new step at position T - 1 (the split reads that last position).
    ``fused_qkv``: one [D, 3D] product for the self-attention's query, key and value.
    ``ragged`` = (write index [N] int64, valid length [N] int64): the past is left-aligned (each
    row's history first, then padding that is never read); the new step is written into its row's
    slot at the write index (``TensorScatter``) and ONNX ``Attention`` (opset 24) attends over the
    first valid-length positions of each row (``nonpad_kv_seqlen``). Needs state_outputs "new".
    ``gqa`` = (history lengths [N] int32, T as a scalar int32): the same left-aligned past read by
    ONNX Runtime's ``GroupQueryAttention`` (com.microsoft), which reads only each row's own
    positions; it writes the new step at position ``seqlens_k`` = the history length of its
    present outputs, ``kv-cache-key-{i}`` / ``kv-cache-value-{i}`` shaped like the past: bound to
    the past's own buffer (metadata ``IN_PLACE_``) the op appends in place instead of copying the
    past. T must exceed every history length.
    ``dmmha`` = (key mask [N, T] int32, T - 1 as a scalar int32 in host memory): the same
    left-aligned past read by ONNX Runtime's ``DecoderMaskedMultiHeadAttention`` (com.microsoft;
    CUDA: head size 32, 64 or 128), one kernel per layer. It writes the new step at position T - 1
    of its present outputs ``kv-cache-*`` (shaped like the past, bound in place like
    GroupQueryAttention's), and the mask keeps each row's first prefix-length positions and that
    last one. ``ft_keys``: the past keys are declared [N, H·Dh/x, T, x] (x = 16 bytes / element
    size), the layout ONNX Runtime's CUDA kernel reads ([N, H, Dh/x, T, x], FasterTransformer's),
    which a state manager's merge then writes (fused_ops, whose state outputs are the present
    outputs, declared [N, H, T, Dh] as the op makes them). The CPU kernel reads [N, H, T, Dh]:
    ``ft_keys`` is CUDA only.
    ``fused_ops`` (one new step per row; state_outputs "new" (dmmha: "in-place"), fused_qkv, layout
    "bhtd"): the same function as ONNX Runtime's transformer optimizer writes it, in fewer
    kernels: each residual add with its bias and the next LayerNorm as one
    ``SkipLayerNormalization`` (com.microsoft), 1/√Dh folded into the query weights, one-step
    head splits as reshapes, the new key/value written by the ``Split`` of the fused projection
    straight into the present outputs, and the cross-attention as one ``MultiHeadAttention``
    (com.microsoft) per layer with an additive mask made once per step; with dmmha, the projection's
    bias added by the op itself, which takes the packed projection on CUDA (``ft_keys``; its CPU
    kernel reads only a split one).
    """
    heads, head_dim, dtype = cfg.num_heads, cfg.head_dim, cfg.dtype
    dim = heads * head_dim
    masked = g.const(cfg.masked_logit, dtype)
    scale = None if fused_ops else g.const(1 / np.sqrt(head_dim), dtype)
    query_factor = np.asarray(1 / np.sqrt(head_dim), dtype)  # fused_ops: folded into the query weights

    def split(t: str, perm) -> str:
        return g.op("Transpose", g.reshape(t, [0, 0, heads, head_dim]), perm=perm)

    def step_heads(t: str) -> str:
        """One step [N, 1, H·Dh] -> [N, H, 1, Dh]."""
        return g.reshape(t, [0, heads, 1, head_dim]) if fused_ops else split(t, [0, 2, 1, 3])

    def merged_heads(att: str) -> str:
        """[N, H, T, Dh] -> [N, T, H·Dh] (fused_ops: T = 1, a reshape)."""
        if fused_ops:
            return g.reshape(att, [0, 1, dim])
        return g.reshape(g.op("Transpose", att, perm=[0, 2, 1, 3]), [0, 0, heads * head_dim])

    def scaled(q: str) -> str:
        return q if fused_ops else g.op("Mul", q, scale)  # fused_ops: in the query weights

    def query(h: str, key: str) -> str:
        """The query projection ``key`` of h (fused_ops: its weights and bias scaled by 1/√Dh)."""
        if not fused_ops:
            return g.linear(h, w, key)
        return g.linear(h, {f"{key}.w": w[f"{key}.w"] * query_factor, f"{key}.b": w[f"{key}.b"] * query_factor}, key)

    def attend(q: str, keys_t: str, values: str, valid: str) -> str:
        logits = g.op("Where", valid, g.op("MatMul", scaled(q), keys_t), masked)
        return merged_heads(g.op("MatMul", g.op("Softmax", logits, axis=-1), values))

    def attend_grouped(q: str, keys_t: str, values: str, valid: str) -> str:
        """q [N, H, 1, Dh] as [G, H, N/G, Dh] against one utterance's keys [G, H, Dh, S]."""
        groups = g.op("Shape", "encoder-states-size")  # [G]
        shape = g.op("Concat", groups, g.const([-1, heads, head_dim], np.int64), axis=0)
        q = g.op("Transpose", g.op("Reshape", q, shape), perm=[0, 2, 1, 3])
        logits = g.op("Where", valid, g.op("MatMul", scaled(q), keys_t), masked)
        att = g.op("MatMul", g.op("Softmax", logits, axis=-1), values)  # [G, H, N/G, Dh]
        return g.reshape(g.op("Transpose", att, perm=[0, 2, 1, 3]), [-1, 1, heads * head_dim])

    if mode is not None:
        if mode == "precomputed":
            num_s = g.dim("cross-key-0", 2)
        else:
            num_s = g.dim("encoder-states", 1)
        positions = g.op("Range", g.const(0, np.int64), num_s, g.const(1, np.int64))
        size = g.op("Cast", "encoder-states-size", to=onnx_type(np.int64))
        cross_valid = g.op("Less", g.unsqueeze(positions, [0]), g.unsqueeze(size, [1]))
        cross_valid = g.unsqueeze(cross_valid, [1, 2])  # [N, 1, 1, S]
        if fused_ops:  # the additive mask of MultiHeadAttention: [N, 1, 1, S], grouped [G, 1, N/G, S]
            rows = g.const(0, dtype)
            if grouped:  # a zero per hypothesis row, as [G, 1, N/G, 1]
                zeros = g.op("Cast", g.op("Mul", "prefix-length", g.const(0, np.int32)), to=onnx_type(dtype))
                shape = g.op("Concat", g.op("Shape", "encoder-states-size"), g.const([1, -1, 1], np.int64), axis=0)
                rows = g.op("Reshape", zeros, shape)
            cross_bias = g.op("Where", cross_valid, rows, masked)

    def attend_cross(q: str, i: int) -> str:
        """Cross-attention of the query [N, 1, D] as one ``MultiHeadAttention`` (com.microsoft), the
        1/√Dh in the query weights; grouped: each utterance's N/G rows as its query sequence."""
        if mode == "precomputed":  # [G, H, S, Dh]
            keys, values = f"cross-key-{i}", f"cross-value-{i}"
        else:  # [G, S, D]
            keys, values = (g.linear("encoder-states", w, f"cross_{p}_{i}") for p in ("key", "value"))
        if grouped:
            shape = g.op("Concat", g.op("Shape", "encoder-states-size"), g.const([-1, dim], np.int64), axis=0)
            q = g.op("Reshape", q, shape)
        att = g.op("MultiHeadAttention", q, keys, values, "", "", cross_bias, domain="com.microsoft",
                   num_heads=heads, scale=1.0)
        return g.reshape(att, [-1, 1, dim]) if grouped else att

    def attend_past_and_new(q: str, past_keys_t: str, past_values: str, key: str, value: str, valid: str) -> str:
        """``attend`` over the T past positions and the new one (q, key, value [N, H, 1, Dh]) without
        concatenating the history: the logits and the weights are split instead."""
        q = scaled(q)
        if fused_ops:  # key [N, H, 1, Dh] read as [N, H, Dh, 1]: a reshape
            new_logit = g.op("MatMul", q, g.reshape(key, [0, heads, head_dim, 1]))
        else:
            new_logit = g.op("ReduceSum", g.op("Mul", q, key), g.const([-1], np.int64), keepdims=1)
        logits = g.op("Concat", g.op("MatMul", q, past_keys_t), new_logit, axis=-1)
        weights = g.op("Softmax", g.op("Where", valid, logits, masked), axis=-1)  # [N, H, 1, T+1]
        last = g.const([-1], np.int64)
        past_weights = g.op("Slice", weights, g.const([0], np.int64), last, g.const([3], np.int64))
        new_weight = g.op("Slice", weights, last, g.const([np.iinfo(np.int64).max], np.int64), g.const([3], np.int64))
        return merged_heads(g.op("Add", g.op("MatMul", past_weights, past_values), g.op("Mul", new_weight, value)))

    def residual(x: str, sub: str, key: str, norm: str) -> tuple[str, str]:
        """x + Linear ``key``(sub), and LayerNorm ``norm`` of that sum: (sum, normalised)."""
        if not fused_ops:
            x = g.op("Add", x, g.linear(sub, w, key))
            return x, g.layer_norm(x, w, norm)
        weights = [g.weight(f"{norm}.g", w[f"{norm}.g"]), g.weight(f"{norm}.b", w[f"{norm}.b"]),
                   g.weight(f"{key}.b", w[f"{key}.b"])]
        product = g.op("MatMul", sub, g.weight(f"{key}.w", w[f"{key}.w"]))
        last = norm == "final_ln"  # the sum is not needed after the last LayerNorm
        h, *rest = g.ops("SkipLayerNormalization", [product, x, *weights], 1 if last else 4, domain="com.microsoft",
                         epsilon=LN_EPSILON)
        return (None if last else rest[-1]), h

    def packed_qkv(i: int) -> tuple[str, str]:
        """The self-attention's query, key and value projections as one [D, 3D] weight and [3D] bias
        (fused_ops: the query's scaled by 1/√Dh)."""
        qkv_w = np.concatenate([w[f"self_{p}_{i}.w"] for p in "qkv"], axis=1)
        qkv_b = np.concatenate([w[f"self_{p}_{i}.b"] for p in "qkv"])
        if fused_ops:  # (concatenate made new arrays)
            qkv_w[:, :dim] *= query_factor
            qkv_b[:dim] *= query_factor
        return g.weight(f"self_qkv_{i}.w", qkv_w), g.weight(f"self_qkv_{i}.b", qkv_b)

    def self_qkv(h: str, i: int, present_k: str, present_v: str) -> tuple[str, str, str, str]:
        """(the query for GroupQueryAttention, the query [N, H, 1, Dh], k, v) of the self-attention;
        with fused_ops k and v are the present outputs [N, H, 1, Dh] (and no GroupQueryAttention)."""
        if not fused_qkv:
            q_flat = g.linear(h, w, f"self_q_{i}")
            return q_flat, split(q_flat, [0, 2, 1, 3]), g.linear(h, w, f"self_k_{i}"), g.linear(h, w, f"self_v_{i}")
        qkv_w, qkv_b = packed_qkv(i)
        qkv = g.op("Add", g.op("MatMul", h, qkv_w), qkv_b)
        if fused_ops:  # [N, 1, 3·H·Dh] as [N, 3H, 1, Dh]: each third is [N, H, 1, Dh]
            q, k, v = g.ops("Split", [g.reshape(qkv, [0, 3 * heads, 1, head_dim]), g.const([heads] * 3, np.int64)],
                            3, out=[g.fresh("query"), present_k, present_v], axis=1)
            return qkv, q, k, v  # (GroupQueryAttention takes the packed [N, 1, 3·H·Dh])
        q, k, v = g.ops("Split", [qkv, g.const([dim] * 3, np.int64)], 3, axis=-1)
        return q, split(q, [0, 2, 1, 3]), k, v

    def dmmha_in_place(h: str, i: int, past_k: str, past_v: str, cache_k: str, cache_v: str) -> str:
        """The self-attention as one ``DecoderMaskedMultiHeadAttention`` that adds the projection's
        bias itself and writes the new step into the caches (the state outputs) at T - 1."""
        qkv_w, qkv_b = packed_qkv(i)
        qkv = g.op("MatMul", h, qkv_w)  # [N, 1, 3·H·Dh]
        step = [qkv, "", ""] if ft_keys else g.ops("Split", [qkv, g.const([dim] * 3, np.int64)], 3, axis=-1)
        mask, past_length = dmmha
        keys = g.reshape(past_k, [0, heads, -1, head_dim]) if ft_keys else past_k  # the same bytes
        return g.ops("DecoderMaskedMultiHeadAttention",
                     [*step, mask, "", keys, past_v, past_length, "", "", qkv_b], 3,
                     out=[g.fresh("attention"), cache_k, cache_v], domain="com.microsoft", num_heads=heads,
                     past_present_share_buffer=1, scale=1.0)[0]

    norms = [f"{n}_ln_{i}" for i in range(len(states)) for n in ("self", "cross", "ffn") if mode or n != "cross"]
    next_norm = dict(zip(norms, [*norms[1:], "final_ln"]))
    h = g.layer_norm(x, w, norms[0])
    for i, (past_k, past_v, present_k, present_v) in enumerate(states):
        if state_outputs == "in-place":
            att = dmmha_in_place(h, i, past_k, past_v, present_k, present_v)
        else:
            q_flat, q, k, v = self_qkv(h, i, present_k, present_v)
        if state_outputs == "new":
            if fused_ops:
                k_heads, v_heads = k, v
            else:
                k_heads, v_heads = split(k, [0, 2, 1, 3]), split(v, [0, 2, 1, 3])
                g.op("Identity", k_heads if layout == "bhtd" else k, out=present_k)
                g.op("Identity", v_heads if layout == "bhtd" else v, out=present_v)
            if dmmha is not None:  # (bhtd, not fused) [N, 1, H·Dh] in and out
                mask, past_length = dmmha
                caches = [past.replace("past-", "kv-cache-") for past in (past_k, past_v)]
                att = g.ops("DecoderMaskedMultiHeadAttention", [q_flat, k, v, mask, "", past_k, past_v, past_length], 3,
                            out=[g.fresh("attention"), *caches], domain="com.microsoft", num_heads=heads,
                            past_present_share_buffer=1)[0]
            elif gqa is not None:  # (bhtd only)
                seqlens, total = gqa
                caches = [past.replace("past-", "kv-cache-") for past in (past_k, past_v)]
                step = [q_flat, "", ""] if fused_ops else [q_flat, k, v]  # fused_ops: the packed projection
                att = g.ops("GroupQueryAttention", [*step, past_k, past_v, seqlens, total], 3,
                            out=[g.fresh("attention"), *caches], domain="com.microsoft", num_heads=heads,
                            kv_num_heads=heads, **({"scale": 1.0} if fused_ops else {}))[0]
            elif ragged is not None:  # (bhtd only)
                write_index, valid_length = ragged
                caches = [g.op("TensorScatter", g.op("Concat", past, new, axis=2), new, write_index, axis=2)
                          for past, new in ((past_k, k_heads), (past_v, v_heads))]
                att = merged_heads(g.op("Attention", q, *caches, "", "", "", valid_length))  # from [N, H, 1, Dh]
            else:
                if layout == "bhtd":
                    past_keys_t, past_values = g.op("Transpose", past_k, perm=[0, 1, 3, 2]), past_v
                else:
                    past_keys_t, past_values = split(past_k, [0, 2, 3, 1]), split(past_v, [0, 2, 1, 3])
                att = attend_past_and_new(q, past_keys_t, past_values, k_heads, v_heads, self_valid)
        elif state_outputs == "full":
            if layout == "bhtd":
                g.op("Concat", past_k, split(k, [0, 2, 1, 3]), axis=2, out=present_k)
                g.op("Concat", past_v, split(v, [0, 2, 1, 3]), axis=2, out=present_v)
                keys_t, values = g.op("Transpose", present_k, perm=[0, 1, 3, 2]), present_v
            else:
                g.op("Concat", past_k, k, axis=1, out=present_k)
                g.op("Concat", past_v, v, axis=1, out=present_v)
                keys_t, values = split(present_k, [0, 2, 3, 1]), split(present_v, [0, 2, 1, 3])
            att = attend(q, keys_t, values, self_valid)
        x, h = residual(x, att, f"self_o_{i}", next_norm[f"self_ln_{i}"])
        if mode is not None and fused_ops:
            x, h = residual(x, attend_cross(query(h, f"cross_query_{i}"), i), f"cross_out_{i}", f"ffn_ln_{i}")
        elif mode is not None:
            q = step_heads(query(h, f"cross_query_{i}"))
            if mode == "precomputed":
                keys_t = g.op("Transpose", f"cross-key-{i}", perm=[0, 1, 3, 2])
                values = f"cross-value-{i}"
            else:
                keys_t = split(g.linear("encoder-states", w, f"cross_key_{i}"), [0, 2, 3, 1])
                values = split(g.linear("encoder-states", w, f"cross_value_{i}"), [0, 2, 1, 3])
            cross = attend_grouped if grouped else attend
            x, h = residual(x, cross(q, keys_t, values, cross_valid), f"cross_out_{i}", f"ffn_ln_{i}")
        x, h = residual(x, g.op("Relu", g.linear(h, w, f"ffn1_{i}")), f"ffn2_{i}", next_norm[f"ffn_ln_{i}"])
    return g.linear(h, w, "out", out=out)


def build_transformer_decoder(
    seed: int = 0,
    *,
    vocab_size: int = 12,
    model_dim: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    ffn_dim: int = 64,
    encoder_dim: int = 32,
    cross_attention: str | None = "precomputed",
    kv_layout: str = "bhtd",
    max_positions: int = 256,
    dtype=np.float32,
    utterance_rows: str = "lane",
    state_outputs: str = "full",
    fused_qkv: bool = False,
    attention: str = "dense",
    fused_ops: bool = False,
    history_alignment: str = "right",
    ft_keys: bool = False,
) -> ReferenceModel:
    """Transformer decoder step model, RASR convention (pre-LayerNorm, learned positions).

    Inputs: ``token`` [N,1] int32, ``token-length`` [N] int32 (unused), ``prefix-length`` [N]
    int32; per layer i ``past-key-{i}``, ``past-value-{i}`` [N,H,T,Dh] (kv_layout "bhtd") or
    [N,T,H*Dh] ("btd"), right-aligned: only the last prefix-length[n] of the T positions are
    valid. Per utterance: "precomputed" -> ``cross-key-{i}``, ``cross-value-{i}`` [N,H,S,Dh];
    "encoder-states" -> ``encoder-states`` [N,S,E]; both with ``encoder-states-size`` [N] int32
    (keys s < size are valid); None -> a decoder-only LM. ``utterance_rows="utterance"``: the
    per-utterance inputs have G rows, one per utterance, for N = G × beam hypothesis rows, utterance
    g's beam in rows g·beam … (g+1)·beam − 1 (metadata ``PER_UTTERANCE_ROWS``); "lane": N rows.
    Outputs: ``scores`` [N,1,V] log-softmax; ``present-key-{i}``, ``present-value-{i}`` = past
    with the new token appended on the time axis (T+1 positions), or with ``state_outputs="new"``
    the new token's alone (1 position; the conventions let a model output either).
    The new token sits at position prefix-length[n]. ``fused_qkv``: the self-attention's three
    input projections as one product (as ``torch.nn.MultiheadAttention`` exports them); the same
    function. ``attention``: "dense" (the above), or the past left-aligned (metadata
    ``HISTORY_ALIGNMENT=left``: the first prefix-length[n] positions are valid, the rest is never
    read) through ONNX ``Attention`` (opset 24, "ragged") or ONNX Runtime's ``GroupQueryAttention``
    ("gqa": on CUDA float16/bfloat16 only; head size a multiple of 8) or ``DecoderMaskedMultiHeadAttention``
    ("dmmha": one kernel per layer, in place; CUDA: head size 32, 64 or 128; ``ft_keys``: the past
    keys in the layout its CUDA kernel reads, see ``_graph_layers``; CUDA only). ``fused_ops``: the graph
    ONNX Runtime's transformer optimizer writes (``SkipLayerNormalization``, the attention scale in
    the query weights, reshapes for one-step head splits, cross-attention as ``MultiHeadAttention``;
    see ``_graph_layers``); the same function,
    in fewer kernels per step. Needs state_outputs "new", fused_qkv, kv_layout "bhtd", attention
    "dense", "dmmha" or "gqa" (which then takes the packed query-key-value projection).
    ``history_alignment="left"`` (dense attention, state_outputs "new", "bhtd"): the past is
    left-aligned (metadata HISTORY_ALIGNMENT=left: the first prefix-length[n] positions are valid,
    the rest is masked), so the state manager's merge copies each row's history and never writes
    padding; ragged and gqa attention are always left-aligned.
    """
    if state_outputs not in STATE_OUTPUTS:
        raise ValueError(f"state_outputs: expected one of {STATE_OUTPUTS}, got {state_outputs!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention: expected one of {ATTENTIONS}, got {attention!r}")
    if history_alignment not in ("right", "left"):
        raise ValueError(f"history_alignment: expected 'right' or 'left', got {history_alignment!r}")
    left_aligned = attention in ("ragged", "gqa", "dmmha") or history_alignment == "left"
    if left_aligned and (state_outputs == "full" or kv_layout != "bhtd"):
        raise ValueError(f"left-aligned histories (attention={attention!r}, history_alignment={history_alignment!r}) "
                         "need state_outputs='new' or 'in-place' and kv_layout='bhtd'")
    if cross_attention not in CROSS_ATTENTION_MODES:
        raise ValueError(
            f"cross_attention: expected one of {CROSS_ATTENTION_MODES}, got {cross_attention!r}"
        )
    if fused_ops and ((fused_qkv, kv_layout) != (True, "bhtd") or attention not in ("dense", "dmmha", "gqa")):
        raise ValueError("fused_ops needs fused_qkv=True, kv_layout='bhtd' and attention 'dense', 'dmmha' or 'gqa'")
    if (state_outputs == "in-place") != (fused_ops and attention == "dmmha"):
        raise ValueError("state_outputs='in-place' goes with the fused dmmha export (fused_ops, attention='dmmha') "
                         "and it alone")
    if fused_ops and attention != "dmmha" and state_outputs != "new":
        raise ValueError("fused_ops needs state_outputs='new' (with attention='dmmha': 'in-place')")
    if ft_keys and not (fused_ops and attention == "dmmha"):
        raise ValueError("ft_keys needs attention='dmmha' and fused_ops")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    if utterance_rows not in ("lane", "utterance"):
        raise ValueError(f"utterance_rows: expected 'lane' or 'utterance', got {utterance_rows!r}")
    grouped = utterance_rows == "utterance" and cross_attention is not None
    if model_dim % num_heads:
        raise ValueError(f"model_dim={model_dim} is not divisible by num_heads={num_heads}")
    cfg = _Config(
        vocab_size=vocab_size, model_dim=model_dim, num_layers=num_layers, num_heads=num_heads,
        ffn_dim=ffn_dim, encoder_dim=encoder_dim, max_positions=max_positions, dtype=np.dtype(dtype),
    )
    dtype, mode = cfg.dtype, cross_attention
    w = _decoder_weights(seed, cfg)
    if kv_layout == "bhtd":
        state_shape = ["batch", num_heads, "time", cfg.head_dim]
    else:
        state_shape = ["batch", "time", model_dim]
    present_time = {"full": "present-time", "new": 1, "in-place": "time"}[state_outputs]
    present_shape = [d if d != "time" else present_time for d in state_shape]
    time_axis = state_shape.index("time")

    g = GraphBuilder()
    x = g.op("Gather", g.weight("tok_emb", w["tok_emb"]), "token")  # [N, 1, D]
    pos = g.op("Gather", g.weight("pos_emb", w["pos_emb"]), "prefix-length")  # [N, D]
    x = g.op("Add", x, g.unsqueeze(pos, [1]))
    def kept_positions(num_positions: str, left: bool) -> str:
        """[N, num_positions] bool, the last position the new step's: left-aligned, t < prefix-length
        or the last; else the last prefix-length positions before the last, and the last. Made from
        CumSums of ones on the device: no shape value is copied from the host, so the model can be
        captured in a CUDA graph."""
        ones = g.op("ConstantOfShape", num_positions, value=helper.make_tensor("one", onnx.TensorProto.INT32, [1], [1]))
        to_end = g.op("CumSum", ones, g.const(0, np.int32), reverse=1)  # 1 at the last position
        if not left:
            distance = g.op("Sub", to_end, g.const(1, np.int32))
            return g.op("LessOrEqual", g.unsqueeze(distance, [0]), g.unsqueeze("prefix-length", [1]))
        position = g.op("Sub", g.op("CumSum", ones, g.const(0, np.int32)), g.const(1, np.int32))
        return g.op("Or", g.op("Less", g.unsqueeze(position, [0]), g.unsqueeze("prefix-length", [1])),
                    g.unsqueeze(g.op("Equal", to_end, g.const(1, np.int32)), [0]))

    num_t = g.op("Shape", "past-key-0", start=time_axis, end=time_axis + 1)
    self_valid = None  # only the dense attention reads it: [N, 1, 1, T+1] over the past and the new step
    if attention == "dense":
        self_valid = g.unsqueeze(kept_positions(g.op("Add", num_t, g.const([1], np.int64)), left_aligned), [1, 2])
    present = "kv-cache" if state_outputs == "in-place" else "present"
    names = [
        (f"past-key-{i}", f"past-value-{i}", f"{present}-key-{i}", f"{present}-value-{i}")
        for i in range(num_layers)
    ]
    ragged_inputs = gqa_inputs = None
    if attention == "ragged":  # the new step's slot and each row's valid length (history + new step)
        write_index = g.op("Cast", "prefix-length", to=onnx_type(np.int64))
        ragged_inputs = (write_index, g.op("Add", write_index, g.const([1], np.int64)))
    elif attention == "gqa":  # total_sequence_length T, a shape value (host memory for the op)
        gqa_inputs = ("prefix-length", g.op("Squeeze", g.op("Cast", num_t, to=onnx_type(np.int32))))
    dmmha_inputs = None
    if attention == "dmmha":  # keep t < prefix-length and t = T - 1 (the new step's slot)
        keep = kept_positions(num_t, left=True)
        past_length = g.op("Squeeze", g.op("Cast", g.op("Sub", num_t, g.const([1], np.int64)), to=onnx_type(np.int32)))
        dmmha_inputs = (g.op("Cast", keep, to=onnx_type(np.int32)), past_length)  # T - 1: host memory for the op
    logits = _graph_layers(g, w, cfg, x, self_valid, names, kv_layout, mode, grouped=grouped,
                           state_outputs=state_outputs, fused_qkv=fused_qkv, ragged=ragged_inputs, gqa=gqa_inputs,
                           fused_ops=fused_ops, dmmha=dmmha_inputs, ft_keys=ft_keys)
    g.op("LogSoftmax", logits, axis=-1, out="scores")

    inputs = [
        ("token", np.int32, ["batch", 1]),
        ("token-length", np.int32, ["batch"]),
        ("prefix-length", np.int32, ["batch"]),
    ]
    outputs = [("scores", dtype, ["batch", 1, vocab_size])]
    metadata, states = {}, {}
    chunk = 16 // cfg.dtype.itemsize
    key_shape = state_shape
    if ft_keys:  # FasterTransformer's key layout [N, H, Dh/x, T, x] as [N, H·Dh/x, T, x]
        key_shape = ["batch", model_dim // chunk, "time", chunk]
    for past_k, past_v, present_k, present_v in names:
        inputs += [(past_k, dtype, key_shape), (past_v, dtype, state_shape)]
        outputs += [(present_k, dtype, present_shape), (present_v, dtype, present_shape)]
        states.update({past_k: present_k, past_v: present_v})
    metadata.update({f"STATE_{k}": v for k, v in states.items()})
    if mode == "precomputed":
        for i in range(num_layers):
            for kind in ("key", "value"):
                shape = ["batch", num_heads, "encoder-time", cfg.head_dim]
                inputs.append((f"cross-{kind}-{i}", dtype, shape))
                metadata[f"UTTERANCE_cross-{kind}-{i}"] = f"cross-{kind}-{i}"
    elif mode == "encoder-states":
        inputs.append(("encoder-states", dtype, ["batch", "encoder-time", encoder_dim]))
    if mode is not None:
        inputs.append(("encoder-states-size", np.int32, ["batch"]))
    if grouped:  # per-utterance inputs: a batch of their own
        inputs = [(n, t, ["utterances", *shape[1:]]) if n.startswith(("cross-", "encoder-")) else (n, t, shape)
                  for n, t, shape in inputs]
        metadata["PER_UTTERANCE_ROWS"] = "utterance"
    if left_aligned:
        metadata[HISTORY_ALIGNMENT_KEY] = "left"
    if attention in ("gqa", "dmmha"):  # the op's present outputs, bound to the past's buffers
        for past_k, past_v, _, _ in names:
            for past in (past_k, past_v):
                cache = past.replace("past-", "kv-cache-")
                if state_outputs != "in-place":  # (else they are the state outputs)
                    outputs.append((cache, dtype, state_shape))
                metadata[f"{IN_PLACE_PREFIX}{cache}"] = past
    model = g.build(inputs, outputs, name="reference-transformer-decoder", metadata=metadata,
                    opset=24 if attention == "ragged" else OPSET)

    w32 = cast_all(w, np.float32)

    def to_bhtd(state: np.ndarray) -> np.ndarray:
        state = state.astype(np.float32)
        return state if kv_layout == "bhtd" else _heads(state, cfg)

    def from_bhtd(state: np.ndarray) -> np.ndarray:
        return (state if kv_layout == "bhtd" else _merge_heads(state)).astype(dtype)

    def keys_to_bhtd(state: np.ndarray) -> np.ndarray:
        """Past keys as [N, H, T, Dh] (ft_keys: from [N, H·Dh/x, T, x], i.e. [N, H, Dh/x, T, x])."""
        if ft_keys:
            rows, _, num_t, _ = state.shape
            state = state.reshape(rows, num_heads, cfg.head_dim // chunk, num_t, chunk).transpose(0, 1, 3, 2, 4)
            state = state.reshape(rows, num_heads, num_t, cfg.head_dim)
        return to_bhtd(state)

    def oracle(feeds: Feeds) -> Feeds:
        token, prefix = feeds["token"][:, 0], feeds["prefix-length"].astype(np.int64)
        x = (w32["tok_emb"][token] + w32["pos_emb"][prefix])[:, None]
        past = [(keys_to_bhtd(feeds[k]), to_bhtd(feeds[v])) for k, v, _, _ in names]
        num_t = past[0][0].shape[2]
        t = np.arange(num_t + 1)[None, :]
        if left_aligned:  # the history first; the new step is appended last here
            self_valid = ((t < prefix[:, None]) | (t == num_t))[:, None]
        else:
            self_valid = (t >= (num_t - prefix)[:, None])[:, None]
        if grouped:  # each utterance's row for each of its N / G hypothesis rows
            beam = token.shape[0] // feeds["encoder-states-size"].shape[0]
            feeds = {k: np.repeat(v, beam, axis=0) if k.startswith(("cross-", "encoder-")) else v
                     for k, v in feeds.items()}
        cross, cross_valid = _cross_inputs(w32, cfg, mode, feeds)
        logits, new = _forward(w32, cfg, x, past, self_valid, cross, cross_valid)
        result = {"scores": log_softmax(logits).astype(dtype)}
        for (past_k, past_v, present_k, present_v), (k, v) in zip(names, new):
            for past, present, new_step in ((past_k, present_k, k), (past_v, present_v, v)):
                result[present] = from_bhtd(new_step)
                if state_outputs == "full":
                    result[present] = np.concatenate([feeds[past], result[present]], time_axis)
                elif state_outputs == "in-place":  # the past's bytes, the new step at T - 1 (ft_keys: as
                    cache = feeds[past].copy()  # [N, H, Dh/x, 1, x], the bytes of [N, H·Dh/x, x])
                    cache[:, :, -1] = result[present].reshape(cache[:, :, -1].shape)
                    result[present] = cache.reshape(len(token), num_heads, -1, cfg.head_dim)
        return result

    return ReferenceModel(
        model=model, oracle=oracle, dtype=dtype, vocab_size=vocab_size, hidden_dim=model_dim,
        num_layers=num_layers, num_heads=num_heads, head_dim=cfg.head_dim, states=states,
        time_axis=time_axis,
        sequence_oracle=_sequence_oracle(w32, cfg, mode),
    )


def build_transformer_lm(
    seed: int = 0,
    *,
    convention: str = "rasr",
    vocab_size: int = 12,
    model_dim: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    ffn_dim: int = 64,
    kv_layout: str = "bhtd",
    max_positions: int = 256,
    dtype=np.float32,
) -> ReferenceModel:
    """Decoder-only transformer LM step model; one seed gives the same weights in both conventions.

    "rasr": ``build_transformer_decoder(cross_attention=None)``.
    "huggingface": inputs ``input_ids`` [N,1] int64, ``attention_mask`` [N,T+1] int64 (1 = valid,
    the new token last), ``position_ids`` [N,1] int64, per layer ``past_key_values.{i}.key`` /
    ``.value`` [N,H,T,Dh] -> ``logits`` [N,1,V] (raw), ``present.{i}.key`` / ``.value``
    [N,H,T+1,Dh]; no metadata (states are found by name). Feed it ``hf_attention_inputs``.
    ``sequence_log_probs`` gives log-probabilities in both conventions.
    """
    if convention == "rasr":
        return build_transformer_decoder(
            seed, vocab_size=vocab_size, model_dim=model_dim, num_layers=num_layers,
            num_heads=num_heads, ffn_dim=ffn_dim, cross_attention=None, kv_layout=kv_layout,
            max_positions=max_positions, dtype=dtype,
        )
    if convention != "huggingface":
        raise ValueError(f"convention: expected 'rasr' or 'huggingface', got {convention!r}")
    if kv_layout != "bhtd":
        raise ValueError(f"the huggingface convention has kv_layout 'bhtd', got {kv_layout!r}")
    if model_dim % num_heads:
        raise ValueError(f"model_dim={model_dim} is not divisible by num_heads={num_heads}")
    cfg = _Config(
        vocab_size=vocab_size, model_dim=model_dim, num_layers=num_layers, num_heads=num_heads,
        ffn_dim=ffn_dim, encoder_dim=model_dim, max_positions=max_positions, dtype=np.dtype(dtype),
    )
    dtype = cfg.dtype
    w = _decoder_weights(seed, cfg)

    g = GraphBuilder()
    x = g.op("Gather", g.weight("tok_emb", w["tok_emb"]), "input_ids")  # [N, 1, D]
    x = g.op("Add", x, g.op("Gather", g.weight("pos_emb", w["pos_emb"]), "position_ids"))
    self_valid = g.unsqueeze(g.op("Cast", "attention_mask", to=onnx_type(bool)), [1, 2])
    names = [
        (f"past_key_values.{i}.key", f"past_key_values.{i}.value",
         f"present.{i}.key", f"present.{i}.value")
        for i in range(num_layers)
    ]
    _graph_layers(g, w, cfg, x, self_valid, names, "bhtd", None, out="logits")

    state_shape = ["batch_size", num_heads, "past_sequence_length", cfg.head_dim]
    present_shape = ["batch_size", num_heads, "past_sequence_length + 1", cfg.head_dim]
    inputs = [
        ("input_ids", np.int64, ["batch_size", 1]),
        ("attention_mask", np.int64, ["batch_size", "past_sequence_length + 1"]),
        ("position_ids", np.int64, ["batch_size", 1]),
    ]
    outputs = [("logits", dtype, ["batch_size", 1, vocab_size])]
    states = {}
    for past_k, past_v, present_k, present_v in names:
        inputs += [(past_k, dtype, state_shape), (past_v, dtype, state_shape)]
        outputs += [(present_k, dtype, present_shape), (present_v, dtype, present_shape)]
        states.update({past_k: present_k, past_v: present_v})
    model = g.build(inputs, outputs, name="reference-transformer-lm-hf")

    w32 = cast_all(w, np.float32)

    def oracle(feeds: Feeds) -> Feeds:
        token, position = feeds["input_ids"][:, 0], feeds["position_ids"][:, 0]
        x = (w32["tok_emb"][token] + w32["pos_emb"][position])[:, None]
        past = [(feeds[k].astype(np.float32), feeds[v].astype(np.float32)) for k, v, _, _ in names]
        self_valid = feeds["attention_mask"].astype(bool)[:, None]
        logits, new = _forward(w32, cfg, x, past, self_valid)
        result = {"logits": logits.astype(dtype)}
        for (past_k, past_v, present_k, present_v), (k, v) in zip(names, new):
            result[present_k] = np.concatenate([feeds[past_k], k.astype(dtype)], 2)
            result[present_v] = np.concatenate([feeds[past_v], v.astype(dtype)], 2)
        return result

    return ReferenceModel(
        model=model, oracle=oracle, dtype=dtype, vocab_size=vocab_size, hidden_dim=model_dim,
        num_layers=num_layers, num_heads=num_heads, head_dim=cfg.head_dim, states=states, time_axis=2,
        sequence_oracle=_sequence_oracle(w32, cfg, None),
    )
