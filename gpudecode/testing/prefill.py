"""Reference prefill (initializer) models and their step models, with no-cache numpy oracles.

Two designs, each a pair of ONNX models that share their weights:

- **Prefix LM** (:func:`build_prefix_lm`, RASR convention): a decoder-only transformer prompted
  with ``prompt labels + projected encoder states + suffix labels``. The prompted sequence of
  utterance n is ``prompt[n, :prompt-size[n]]`` (token embeddings), then
  ``enc_proj(encoder-states[n, :encoder-states-size[n]])`` (one position per encoder frame), then
  ``suffix[n, :suffix-size[n]]``; position t gets ``pos_emb[t]``. The prefill model runs that
  sequence at once (no state inputs) and outputs the states of every prompt position, packed to
  the left (row n's ``prefix-length[n]`` positions first, padding after), the ``scores`` of the
  next label and ``prefix-length``. The step model is
  ``build_transformer_decoder(seed, cross_attention=None)`` with the same weights.
- **Optimum seq2seq pair** (:func:`build_optimum_pair`): ``decoder_model`` (no past:
  ``input_ids`` [N, L], ``encoder_hidden_states``, ``encoder_attention_mask`` -> ``logits``
  [N, L, V], ``present.{i}.decoder.key/value`` [N, H, L, Dh], ``present.{i}.encoder.key/value``
  [N, H, S, Dh]) and ``decoder_with_past_model`` (``input_ids`` [N, 1], ``attention_mask``
  [N, T+1], ``encoder_attention_mask`` [N, S], ``past_key_values.{i}.decoder.*`` [N, H, T, Dh],
  ``past_key_values.{i}.encoder.*`` [N, H, S, Dh] -> ``logits`` [N, 1, V],
  ``present.{i}.decoder.*`` [N, H, T+1, Dh]). The step model takes the position of the new token
  from its ``attention_mask`` (number of valid positions - 1), so left-padded histories of
  different lengths are exact.

Both come with a sequence oracle that runs the whole prompted sequence without a cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpudecode.testing._graph import (
    GraphBuilder,
    cast_all,
    linear,
    log_softmax,
    onnx_type,
    random_linear,
)
from gpudecode.testing.reference import Feeds, ReferenceModel
from gpudecode.testing.transformer import (
    _Config,
    _decoder_weights,
    _forward,
    _graph_layers,
    _heads,
    build_transformer_decoder,
)


@dataclass(frozen=True)
class PrefillPair:
    """An initializer (prefill) model, its step model and the no-cache oracle of the pair.

    ``sequence_log_probs(labels, prompt=..., encoder_states=..., suffix=...)`` ->
    ``[len(labels) + 1, V]`` float32: row p holds log p(next label | prompted sequence +
    ``labels[:p]``). For the Optimum pair ``prompt`` are the decoder start labels and the encoder
    states are attended to, not prepended.
    """

    prefill: ReferenceModel
    step: ReferenceModel
    oracle: object

    def sequence_log_probs(self, labels: Sequence[int], *, prompt: Sequence[int] = (),
                           encoder_states: np.ndarray | None = None,
                           suffix: Sequence[int] = ()) -> np.ndarray:
        return self.oracle(list(labels), list(prompt), encoder_states, list(suffix))


def _config(vocab_size, model_dim, num_layers, num_heads, ffn_dim, encoder_dim, max_positions):
    if model_dim % num_heads:
        raise ValueError(f"model_dim={model_dim} is not divisible by num_heads={num_heads}")
    return _Config(vocab_size=vocab_size, model_dim=model_dim, num_layers=num_layers,
                   num_heads=num_heads, ffn_dim=ffn_dim, encoder_dim=encoder_dim,
                   max_positions=max_positions, dtype=np.dtype(np.float32))


def _empty_past(g: GraphBuilder, batch_of: str, cfg: _Config) -> str:
    """A float32 [N, H, 0, Dh] tensor (the past of a model without state inputs)."""
    shape = g.op("Concat", g.op("Shape", batch_of, start=0, end=1),
                 g.const([cfg.num_heads, 0, cfg.head_dim], np.int64), axis=0)
    return g.op("ConstantOfShape", shape, value=_float_tensor(0.0))


def _float_tensor(value: float):
    from onnx import numpy_helper

    return numpy_helper.from_array(np.array([value], np.float32))


# -- prefix LM -------------------------------------------------------------------------------------


def build_prefix_lm(
    seed: int = 0,
    *,
    vocab_size: int = 12,
    model_dim: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    ffn_dim: int = 64,
    encoder_dim: int = 32,
    max_positions: int = 256,
) -> PrefillPair:
    """A prefix LM: prefill model + RASR step model (float32), see the module docstring.

    Prefill inputs: ``prompt`` [N, P] int32, ``prompt-size`` [N] int32, ``encoder-states``
    [N, S, E] float32, ``encoder-states-size`` [N] int32, ``suffix`` [N, Q] int32, ``suffix-size``
    [N] int32 (P and Q may be 0). Outputs: ``scores`` [N, 1, V] log-softmax at the last prompt
    position, ``prefix-length`` [N] int32 = prompt-size + encoder-states-size + suffix-size, and
    ``present-key-{i}`` / ``present-value-{i}`` [N, H, P+S+Q, Dh], row n valid in its first
    prefix-length[n] positions.
    """
    cfg = _config(vocab_size, model_dim, num_layers, num_heads, ffn_dim, encoder_dim, max_positions)
    w = _decoder_weights(seed, cfg)
    rng = np.random.default_rng([seed, 2])
    random_linear(rng, w, "enc_proj", encoder_dim, model_dim)
    w = cast_all(w, np.float32)
    step = build_transformer_decoder(
        seed, vocab_size=vocab_size, model_dim=model_dim, num_layers=num_layers,
        num_heads=num_heads, ffn_dim=ffn_dim, encoder_dim=encoder_dim, cross_attention=None,
        max_positions=max_positions,
    )

    i64 = np.int64
    g = GraphBuilder()
    tok_emb = g.weight("tok_emb", w["tok_emb"])
    prompt = g.op("Gather", tok_emb, "prompt")  # [N, P, D]
    enc = g.linear("encoder-states", w, "enc_proj")  # [N, S, D]
    suffix = g.op("Gather", tok_emb, "suffix")  # [N, Q, D]
    cat = g.op("Concat", prompt, enc, suffix, axis=1)  # [N, P+S+Q, D]
    num_p, num_s, num_q = g.dim("prompt", 1), g.dim("encoder-states", 1), g.dim("suffix", 1)
    num_t = g.dim(cat, 1)
    one = g.const(1, i64)
    t = g.unsqueeze(g.op("Range", g.const(0, i64), num_t, one), [0])  # [1, T]
    ps, es, qs = (g.unsqueeze(g.op("Cast", n, to=onnx_type(i64)), [1])
                  for n in ("prompt-size", "encoder-states-size", "suffix-size"))  # [N, 1]
    pe = g.op("Add", ps, es)
    count = g.op("Add", pe, qs)  # [N, 1]
    # packed position t of row n reads column idx[n, t] of the padded concatenation
    from_suffix = g.op("Add", g.op("Add", num_p, num_s), g.op("Sub", t, pe))
    idx = g.op("Where", g.op("Less", t, count), from_suffix, g.const(0, i64))
    idx = g.op("Where", g.op("Less", t, pe), g.op("Add", num_p, g.op("Sub", t, ps)), idx)
    idx = g.op("Where", g.op("Less", t, ps), t, idx)  # [N, T]
    shape = g.op("Shape", cat)
    x = g.op("GatherElements", cat, g.op("Expand", g.unsqueeze(idx, [2]), shape), axis=1)
    positions = g.op("Range", g.const(0, i64), num_t, one)
    x = g.op("Add", x, g.op("Gather", g.weight("pos_emb", w["pos_emb"]), positions))
    # causal and within the row's prompt: query t sees keys t' <= t with t' < count
    keys = g.unsqueeze(t, [0])  # [1, 1, T]
    queries = g.unsqueeze(g.op("Transpose", t, perm=[1, 0]), [0])  # [1, T, 1]
    causal = g.op("LessOrEqual", keys, queries)  # [1, T, T]
    inside = g.unsqueeze(g.op("Less", t, count), [1])  # [N, 1, T]
    self_valid = g.unsqueeze(g.op("And", causal, inside), [1])  # [N, 1, T, T]
    empty = _empty_past(g, "prompt", cfg)
    names = [(empty, empty, f"present-key-{i}", f"present-value-{i}") for i in range(num_layers)]
    logits = _graph_layers(g, w, cfg, x, self_valid, names, "bhtd", None)  # [N, T, V]
    last = g.op("Sub", count, one)  # [N, 1]
    last = g.op("Expand", g.unsqueeze(last, [2]),
                g.op("Concat", g.op("Shape", last), g.const([vocab_size], i64), axis=0))  # [N, 1, V]
    g.op("LogSoftmax", g.op("GatherElements", logits, last, axis=1), axis=-1, out="scores")
    g.op("Cast", g.op("Squeeze", count, g.const([1], i64)), to=onnx_type(np.int32), out="prefix-length")

    state_shape = ["batch", num_heads, "prompt-time", cfg.head_dim]
    inputs = [
        ("prompt", np.int32, ["batch", "prompt-labels"]),
        ("prompt-size", np.int32, ["batch"]),
        ("encoder-states", np.float32, ["batch", "encoder-time", encoder_dim]),
        ("encoder-states-size", np.int32, ["batch"]),
        ("suffix", np.int32, ["batch", "suffix-labels"]),
        ("suffix-size", np.int32, ["batch"]),
    ]
    outputs = [("scores", np.float32, ["batch", 1, vocab_size]), ("prefix-length", np.int32, ["batch"])]
    for _, _, key, value in names:
        outputs += [(key, np.float32, state_shape), (value, np.float32, state_shape)]
    model = g.build(inputs, outputs, name="reference-prefix-lm-prefill")

    def embed(labels, encoder_states, suffix):
        """The prompted sequence's inputs [L, D] (without positions)."""
        parts = [w["tok_emb"][np.asarray(labels, np.int64)].reshape(-1, model_dim)]
        if encoder_states is not None and len(encoder_states):
            parts.append(linear(np.asarray(encoder_states, np.float32), w, "enc_proj"))
        parts.append(w["tok_emb"][np.asarray(suffix, np.int64)].reshape(-1, model_dim))
        return np.concatenate(parts, 0)

    def run(x):
        """x [L, D] -> logits [L, V] and per layer (k, v) [H, L, Dh], no cache."""
        num = x.shape[0]
        if num > max_positions:
            raise ValueError(f"{num} positions exceed max_positions={max_positions}")
        x = (x + w["pos_emb"][:num])[None]
        empty = np.zeros((1, num_heads, 0, cfg.head_dim), np.float32)
        causal = np.tril(np.ones((num, num), bool))[None]
        logits, new = _forward(w, cfg, x, [(empty, empty)] * num_layers, causal)
        return logits[0], [(k[0], v[0]) for k, v in new]

    def prefill_oracle(feeds: Feeds) -> Feeds:
        n_rows = feeds["prompt"].shape[0]
        num_t = feeds["prompt"].shape[1] + feeds["encoder-states"].shape[1] + feeds["suffix"].shape[1]
        result = {"scores": np.zeros((n_rows, 1, vocab_size), np.float32),
                  "prefix-length": np.zeros(n_rows, np.int32)}
        for _, _, key, value in names:
            result[key] = np.zeros((n_rows, num_heads, num_t, cfg.head_dim), np.float32)
            result[value] = np.zeros_like(result[key])
        for n in range(n_rows):
            x = embed(feeds["prompt"][n, :feeds["prompt-size"][n]],
                      feeds["encoder-states"][n, :feeds["encoder-states-size"][n]],
                      feeds["suffix"][n, :feeds["suffix-size"][n]])
            logits, new = run(x)
            count = x.shape[0]
            result["scores"][n, 0] = log_softmax(logits[-1])
            result["prefix-length"][n] = count
            for (_, _, key, value), (k, v) in zip(names, new):
                result[key][n, :, :count] = k
                result[value][n, :, :count] = v
        return result

    def oracle(labels, prompt, encoder_states, suffix):
        x = embed(list(prompt), encoder_states, list(suffix))
        count = x.shape[0]
        if count == 0:
            raise ValueError("an empty prompted sequence has no next-label scores")
        full = np.concatenate([x, w["tok_emb"][np.asarray(labels, np.int64)].reshape(-1, model_dim)], 0)
        logits, _ = run(full)
        return log_softmax(logits[count - 1:])

    prefill = ReferenceModel(
        model=model, oracle=prefill_oracle, vocab_size=vocab_size, hidden_dim=model_dim,
        num_layers=num_layers, num_heads=num_heads, head_dim=cfg.head_dim,
        states=dict(step.states), time_axis=2,
    )
    return PrefillPair(prefill=prefill, step=step, oracle=oracle)


# -- Optimum seq2seq pair --------------------------------------------------------------------------


def _seq2seq_layers(g: GraphBuilder, w, cfg: _Config, x: str, self_valid: str, states, cross,
                    cross_valid: str) -> str:
    """Decoder layers with precomputed cross K/V ``cross[i] = (key, value)`` [N, H, S, Dh];
    ``states[i] = (past_k, past_v, present_k, present_v)``; returns the logits name [N, Q, V]."""
    heads, head_dim = cfg.num_heads, cfg.head_dim
    masked = g.const(cfg.masked_logit, np.float32)
    scale = g.const(1 / np.sqrt(head_dim), np.float32)

    def split(t: str) -> str:
        return g.op("Transpose", g.reshape(t, [0, 0, heads, head_dim]), perm=[0, 2, 1, 3])

    def attend(q: str, keys: str, values: str, valid: str) -> str:
        keys_t = g.op("Transpose", keys, perm=[0, 1, 3, 2])
        logits = g.op("Where", valid, g.op("MatMul", g.op("Mul", q, scale), keys_t), masked)
        att = g.op("MatMul", g.op("Softmax", logits, axis=-1), values)
        return g.reshape(g.op("Transpose", att, perm=[0, 2, 1, 3]), [0, 0, heads * head_dim])

    for i, (past_k, past_v, present_k, present_v) in enumerate(states):
        h = g.layer_norm(x, w, f"self_ln_{i}")
        q = split(g.linear(h, w, f"self_q_{i}"))
        g.op("Concat", past_k, split(g.linear(h, w, f"self_k_{i}")), axis=2, out=present_k)
        g.op("Concat", past_v, split(g.linear(h, w, f"self_v_{i}")), axis=2, out=present_v)
        x = g.op("Add", x, g.linear(attend(q, present_k, present_v, self_valid), w, f"self_o_{i}"))
        h = g.layer_norm(x, w, f"cross_ln_{i}")
        q = split(g.linear(h, w, f"cross_query_{i}"))
        x = g.op("Add", x, g.linear(attend(q, cross[i][0], cross[i][1], cross_valid), w, f"cross_out_{i}"))
        h = g.op("Relu", g.linear(g.layer_norm(x, w, f"ffn_ln_{i}"), w, f"ffn1_{i}"))
        x = g.op("Add", x, g.linear(h, w, f"ffn2_{i}"))
    return g.linear(g.layer_norm(x, w, "final_ln"), w, "out", out="logits")


def build_optimum_pair(
    seed: int = 0,
    *,
    vocab_size: int = 12,
    model_dim: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    ffn_dim: int = 64,
    encoder_dim: int = 32,
    max_positions: int = 256,
) -> PrefillPair:
    """An Optimum-style encoder–decoder export: ``decoder_model`` (the prefill) and
    ``decoder_with_past_model`` (the step model), float32 ``logits`` (raw), see the module
    docstring. Weights are those of ``build_transformer_decoder(seed)``; the cross-attention
    keys/values are projected from ``encoder_hidden_states`` inside ``decoder_model``."""
    cfg = _config(vocab_size, model_dim, num_layers, num_heads, ffn_dim, encoder_dim, max_positions)
    w = cast_all(_decoder_weights(seed, cfg), np.float32)
    i64 = np.int64
    dec = [(f"present.{i}.decoder.key", f"present.{i}.decoder.value") for i in range(num_layers)]
    enc = [(f"present.{i}.encoder.key", f"present.{i}.encoder.value") for i in range(num_layers)]
    kv_shape = ["batch_size", num_heads, "past_decoder_sequence_length", cfg.head_dim]
    enc_shape = ["batch_size", num_heads, "encoder_sequence_length_out", cfg.head_dim]

    def cross_valid_of(g: GraphBuilder) -> str:
        return g.unsqueeze(g.op("Cast", "encoder_attention_mask", to=onnx_type(bool)), [1, 2])

    # decoder_model: the whole start prompt at once, cross K/V projected here
    g = GraphBuilder()
    one = g.const(1, i64)
    num_l = g.dim("input_ids", 1)
    positions = g.op("Range", g.const(0, i64), num_l, one)
    x = g.op("Add", g.op("Gather", g.weight("tok_emb", w["tok_emb"]), "input_ids"),
             g.op("Gather", g.weight("pos_emb", w["pos_emb"]), positions))
    t = g.unsqueeze(positions, [0])
    causal = g.op("LessOrEqual", g.unsqueeze(t, [0]), g.unsqueeze(g.op("Transpose", t, perm=[1, 0]), [0]))
    self_valid = g.unsqueeze(causal, [0])  # [1, 1, L, L]
    cross = []
    for i, (key, value) in enumerate(enc):
        for kind, out in (("key", key), ("value", value)):
            proj = g.reshape(g.linear("encoder_hidden_states", w, f"cross_{kind}_{i}"),
                             [0, 0, num_heads, cfg.head_dim])
            g.op("Transpose", proj, perm=[0, 2, 1, 3], out=out)
        cross.append((key, value))
    empty = _empty_past(g, "input_ids", cfg)
    states = [(empty, empty, k, v) for k, v in dec]
    _seq2seq_layers(g, w, cfg, x, self_valid, states, cross, cross_valid_of(g))
    outputs = [("logits", np.float32, ["batch_size", "decoder_sequence_length", vocab_size])]
    for (k, v), (ek, ev) in zip(dec, enc):
        shape = ["batch_size", num_heads, "decoder_sequence_length", cfg.head_dim]
        outputs += [(k, np.float32, shape), (v, np.float32, shape),
                    (ek, np.float32, enc_shape), (ev, np.float32, enc_shape)]
    decoder_model = g.build(
        [("input_ids", i64, ["batch_size", "decoder_sequence_length"]),
         ("encoder_hidden_states", np.float32, ["batch_size", "encoder_sequence_length", encoder_dim]),
         ("encoder_attention_mask", i64, ["batch_size", "encoder_sequence_length"])],
        outputs, name="reference-optimum-decoder-model")

    # decoder_with_past_model: one token; position = valid past positions
    g = GraphBuilder()
    one = g.const(1, i64)
    position = g.op("Sub", g.op("ReduceSum", "attention_mask", g.const([1], i64), keepdims=1), one)  # [N, 1]
    x = g.op("Add", g.op("Gather", g.weight("tok_emb", w["tok_emb"]), "input_ids"),
             g.op("Gather", g.weight("pos_emb", w["pos_emb"]), position))
    self_valid = g.unsqueeze(g.op("Cast", "attention_mask", to=onnx_type(bool)), [1, 2])
    states = [(f"past_key_values.{i}.decoder.key", f"past_key_values.{i}.decoder.value", k, v)
              for i, (k, v) in enumerate(dec)]
    cross = [(f"past_key_values.{i}.encoder.key", f"past_key_values.{i}.encoder.value") for i in range(num_layers)]
    _seq2seq_layers(g, w, cfg, x, self_valid, states, cross, cross_valid_of(g))
    past_enc_shape = ["batch_size", num_heads, "encoder_sequence_length", cfg.head_dim]
    inputs = [("input_ids", i64, ["batch_size", 1]),
              ("attention_mask", i64, ["batch_size", "past_decoder_sequence_length + 1"]),
              ("encoder_attention_mask", i64, ["batch_size", "encoder_sequence_length"])]
    outputs = [("logits", np.float32, ["batch_size", 1, vocab_size])]
    step_states = {}
    for (pk, pv, k, v), (ck, cv) in zip(states, cross):
        inputs += [(pk, np.float32, kv_shape), (pv, np.float32, kv_shape),
                   (ck, np.float32, past_enc_shape), (cv, np.float32, past_enc_shape)]
        present = ["batch_size", num_heads, "past_decoder_sequence_length + 1", cfg.head_dim]
        outputs += [(k, np.float32, present), (v, np.float32, present)]
        step_states.update({pk: k, pv: v})
    with_past = g.build(inputs, outputs, name="reference-optimum-decoder-with-past-model")

    def project(encoder_states):
        """Per layer cross (k, v) [1, H, S, Dh] of unpadded encoder states [S, E]."""
        states = np.asarray(encoder_states, np.float32)[None]
        return [tuple(_heads(linear(states, w, f"cross_{kind}_{i}"), cfg) for kind in ("key", "value"))
                for i in range(num_layers)]

    def forward(tokens, past, self_valid, cross, cross_valid, positions):
        x = w["tok_emb"][tokens] + w["pos_emb"][positions]
        return _forward(w, cfg, x, past, self_valid, cross, cross_valid)

    def decoder_oracle(feeds: Feeds) -> Feeds:
        ids = feeds["input_ids"]
        n_rows, num = ids.shape
        hidden = feeds["encoder_hidden_states"].astype(np.float32)
        cross = [tuple(_heads(linear(hidden, w, f"cross_{kind}_{i}"), cfg) for kind in ("key", "value"))
                 for i in range(num_layers)]
        empty = np.zeros((n_rows, num_heads, 0, cfg.head_dim), np.float32)
        causal = np.tril(np.ones((num, num), bool))[None]
        logits, new = forward(ids, [(empty, empty)] * num_layers, causal, cross,
                              feeds["encoder_attention_mask"].astype(bool), np.arange(num)[None])
        result = {"logits": logits}
        for (k, v), (ek, ev), (nk, nv), (ck, cv) in zip(dec, enc, new, cross):
            result.update({k: nk, v: nv, ek: ck, ev: cv})
        return result

    def with_past_oracle(feeds: Feeds) -> Feeds:
        mask = feeds["attention_mask"].astype(bool)
        positions = mask.sum(1, keepdims=True) - 1
        past = [(feeds[pk], feeds[pv]) for pk, pv, _, _ in states]
        cross_kv = [(feeds[ck], feeds[cv]) for ck, cv in cross]
        logits, new = forward(feeds["input_ids"], past, mask[:, None], cross_kv,
                              feeds["encoder_attention_mask"].astype(bool), positions)
        result = {"logits": logits}
        for (pk, pv, k, v), (nk, nv) in zip(states, new):
            result[k] = np.concatenate([feeds[pk], nk], 2)
            result[v] = np.concatenate([feeds[pv], nv], 2)
        return result

    def oracle(labels, prompt, encoder_states, suffix):
        if suffix:
            raise ValueError("the Optimum pair takes no suffix prompt")
        tokens = np.asarray([*prompt, *labels], np.int64)[None]
        num = tokens.shape[1]
        if not prompt:
            raise ValueError("the Optimum pair needs at least one start label")
        empty = np.zeros((1, num_heads, 0, cfg.head_dim), np.float32)
        cross = project(encoder_states)
        valid = np.ones((1, len(encoder_states)), bool)
        logits, _ = forward(tokens, [(empty, empty)] * num_layers, np.tril(np.ones((num, num), bool))[None],
                            cross, valid, np.arange(num)[None])
        return log_softmax(logits[0, len(prompt) - 1:])

    common = dict(vocab_size=vocab_size, hidden_dim=model_dim, num_layers=num_layers,
                  num_heads=num_heads, head_dim=cfg.head_dim, time_axis=2)
    prefill = ReferenceModel(model=decoder_model, oracle=decoder_oracle, **common)
    step = ReferenceModel(model=with_past, oracle=with_past_oracle, states=step_states, **common)
    return PrefillPair(prefill=prefill, step=step, oracle=oracle)
