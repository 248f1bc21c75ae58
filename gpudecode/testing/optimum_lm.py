"""A reference Optimum decoder-only pair: ``decoder_model`` (the prefill) + ``decoder_with_past_model``.

``decoder_model``: ``input_ids`` [N, L] int64, ``attention_mask`` [N, L] int64 (1 over each row's
first positions: prompts padded at the end), ``position_ids`` [N, L] int64 -> ``logits`` [N, L, V]
(raw) and per layer ``present.{i}.key`` / ``.value`` [N, H, L, Dh] (no past inputs), as Optimum
exports a decoder-only model's first call. The step model is
``build_transformer_lm(seed, convention="huggingface")`` with the same weights. The pair's oracle
runs the whole prompt + labels without a cache.
"""

from __future__ import annotations

import numpy as np

from gpudecode.testing._graph import GraphBuilder, cast_all, log_softmax, onnx_type
from gpudecode.testing.prefill import PrefillPair, _empty_past
from gpudecode.testing.reference import Feeds, ReferenceModel
from gpudecode.testing.transformer import _Config, _decoder_weights, _forward, _graph_layers, build_transformer_lm


def build_optimum_lm(
    seed: int = 0,
    *,
    vocab_size: int = 12,
    model_dim: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    ffn_dim: int = 64,
    max_positions: int = 256,
) -> PrefillPair:
    """The decoder-only pair of the module docstring (float32)."""
    step = build_transformer_lm(seed, convention="huggingface", vocab_size=vocab_size, model_dim=model_dim,
                                num_layers=num_layers, num_heads=num_heads, ffn_dim=ffn_dim,
                                max_positions=max_positions)
    cfg = _Config(vocab_size=vocab_size, model_dim=model_dim, num_layers=num_layers, num_heads=num_heads,
                  ffn_dim=ffn_dim, encoder_dim=model_dim, max_positions=max_positions,
                  dtype=np.dtype(np.float32))
    w = _decoder_weights(seed, cfg)  # the step model's weights (same seed and config)

    i64 = np.int64
    g = GraphBuilder()
    x = g.op("Gather", g.weight("tok_emb", w["tok_emb"]), "input_ids")  # [N, L, D]
    x = g.op("Add", x, g.op("Gather", g.weight("pos_emb", w["pos_emb"]), "position_ids"))
    num_l = g.dim("input_ids", 1)
    t = g.unsqueeze(g.op("Range", g.const(0, i64), num_l, g.const(1, i64)), [0])  # [1, L]
    keys = g.unsqueeze(t, [0])  # [1, 1, L]
    queries = g.unsqueeze(g.op("Transpose", t, perm=[1, 0]), [0])  # [1, L, 1]
    causal = g.op("LessOrEqual", keys, queries)  # [1, L, L]
    inside = g.unsqueeze(g.op("Cast", "attention_mask", to=onnx_type(bool)), [1])  # [N, 1, L]
    self_valid = g.unsqueeze(g.op("And", causal, inside), [1])  # [N, 1, L, L]
    empty = _empty_past(g, "input_ids", cfg)
    names = [(empty, empty, f"present.{i}.key", f"present.{i}.value") for i in range(num_layers)]
    _graph_layers(g, w, cfg, x, self_valid, names, "bhtd", None, out="logits")
    state_shape = ["batch_size", num_heads, "sequence_length", cfg.head_dim]
    inputs = [("input_ids", i64, ["batch_size", "sequence_length"]),
              ("attention_mask", i64, ["batch_size", "sequence_length"]),
              ("position_ids", i64, ["batch_size", "sequence_length"])]
    outputs = [("logits", np.float32, ["batch_size", "sequence_length", vocab_size])]
    for _, _, key, value in names:
        outputs += [(key, np.float32, state_shape), (value, np.float32, state_shape)]
    model = g.build(inputs, outputs, name="reference-optimum-decoder-model")

    w32 = cast_all(w, np.float32)

    def prefill_oracle(feeds: Feeds) -> Feeds:
        """Each row's valid prefix (``attention_mask`` ones) run alone, no cache; padded positions 0."""
        ids, mask, pos = (np.asarray(feeds[k], np.int64) for k in ("input_ids", "attention_mask", "position_ids"))
        n_rows, length = ids.shape
        result = {"logits": np.zeros((n_rows, length, vocab_size), np.float32)}
        for _, _, key, value in names:
            result[key] = np.zeros((n_rows, num_heads, length, cfg.head_dim), np.float32)
            result[value] = np.zeros_like(result[key])
        empty = np.zeros((1, num_heads, 0, cfg.head_dim), np.float32)
        for n in range(n_rows):
            count = int(mask[n].sum())
            x = (w32["tok_emb"][ids[n, :count]] + w32["pos_emb"][pos[n, :count]])[None]
            logits, new = _forward(w32, cfg, x, [(empty, empty)] * num_layers, np.tril(np.ones((count, count), bool))[None])
            result["logits"][n, :count] = logits[0]
            for (_, _, key, value), (k, v) in zip(names, new):
                result[key][n, :, :count] = k[0]
                result[value][n, :, :count] = v[0]
        return result

    def oracle(labels, prompt, encoder_states, suffix):
        if encoder_states is not None or suffix:
            raise ValueError("a decoder-only pair takes a prompt alone")
        if not prompt:
            raise ValueError("an empty prompt has no next-label scores")
        rows = step.sequence_log_probs([*prompt, *labels])
        return log_softmax(rows[len(prompt) - 1:])  # rows are log-probs already; idempotent

    prefill = ReferenceModel(model=model, oracle=prefill_oracle, vocab_size=vocab_size, hidden_dim=model_dim,
                             num_layers=num_layers, num_heads=num_heads, head_dim=cfg.head_dim,
                             states=dict(step.states), time_axis=2)
    return PrefillPair(prefill=prefill, step=step, oracle=oracle)


#: The example files :func:`write_optimum_lm_example` writes (``configs/lm-generate.yaml`` decodes them).
EXAMPLE_FILES = ("lm-decoder-model.onnx", "lm-decoder-with-past-model.onnx")


def write_optimum_lm_example(folder) -> list:
    """Writes the pair of :func:`build_optimum_lm` (seed 0, 12 labels as ``examples/models/vocab.txt``)
    as ``lm-decoder-model.onnx`` (the prefill) and ``lm-decoder-with-past-model.onnx`` into ``folder``;
    returns their paths."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pair = build_optimum_lm(0)
    return [pair.prefill.save(folder / EXAMPLE_FILES[0]), pair.step.save(folder / EXAMPLE_FILES[1])]
