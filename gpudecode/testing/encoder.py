"""Reference encoder: frame stacking, Linear+tanh, one residual feed-forward, cross-attention K/V."""

from __future__ import annotations

import numpy as np

from gpudecode.testing._graph import GraphBuilder, cast_all, linear, masked_frames, random_linear, stacked_frames
from gpudecode.testing.reference import Feeds, ReferenceModel
from gpudecode.testing.transformer import cross_projection_weights


def build_encoder(
    seed: int = 0,
    *,
    num_features: int = 16,
    model_dim: int = 32,
    subsampling: int = 2,
    num_decoder_layers: int = 2,
    num_heads: int = 2,
    decoder_dim: int | None = None,
    dtype=np.float32,
) -> ReferenceModel:
    """Encoder with the decoder's cross-attention keys/values bundled.

    Inputs: ``features`` [U, T, F] float, ``features-size`` [U] int32.
    Outputs: ``encoder-states`` [U, T', E] with T' = ceil(T / s) (zero rows at and beyond the
    size), ``encoder-states-size`` [U] int32 = ceil(features-size / s), and per decoder layer i
    ``cross-key-{i}``, ``cross-value-{i}`` [U, H, T', Dh] with H * Dh = ``decoder_dim``
    (default ``model_dim``). Features at and beyond ``features-size`` are ignored.

    The cross projections are drawn like those of ``build_transformer_decoder`` with the same seed,
    so this encoder + a "precomputed" decoder == an "encoder-states" decoder fed ``encoder-states``.
    """
    dtype = np.dtype(dtype)
    s, num_f, dim = subsampling, num_features, model_dim
    decoder_dim = model_dim if decoder_dim is None else decoder_dim
    if subsampling < 1 or decoder_dim % num_heads:
        raise ValueError(f"need subsampling >= 1 and decoder_dim % num_heads == 0, got "
                         f"{subsampling=}, {decoder_dim=}, {num_heads=}")
    head_dim = decoder_dim // num_heads

    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    random_linear(rng, weights, "in", s * num_f, dim)
    random_linear(rng, weights, "ff1", dim, 2 * dim)
    random_linear(rng, weights, "ff2", 2 * dim, dim)
    weights.update(cross_projection_weights(seed, num_decoder_layers, dim, decoder_dim))
    weights = cast_all(weights, dtype)

    g = GraphBuilder()
    x = g.stacked_frames("features", "features-size", s, num_f, dtype)  # [U, T', s*F]
    h = g.op("Tanh", g.linear(x, weights, "in"))
    h = g.op("Add", h, g.linear(g.op("Relu", g.linear(h, weights, "ff1")), weights, "ff2"))
    out_size = g.op("Div", g.op("Add", "features-size", g.const(s - 1, np.int32)), g.const(s, np.int32),
                    out="encoder-states-size")
    states = g.masked_frames(h, out_size, dtype, out="encoder-states")
    outputs = [
        ("encoder-states", dtype, ["batch", "encoder-time", dim]),
        ("encoder-states-size", np.int32, ["batch"]),
    ]
    for i in range(num_decoder_layers):
        for kind in ("key", "value"):
            proj = g.reshape(g.linear(states, weights, f"cross_{kind}_{i}"), [0, 0, num_heads, head_dim])
            g.op("Transpose", proj, perm=[0, 2, 1, 3], out=f"cross-{kind}-{i}")
            outputs.append((f"cross-{kind}-{i}", dtype, ["batch", num_heads, "encoder-time", head_dim]))
    model = g.build(
        [("features", dtype, ["batch", "time", num_f]), ("features-size", np.int32, ["batch"])],
        outputs,
        name="reference-encoder",
    )

    w32 = cast_all(weights, np.float32)

    def oracle(feeds: Feeds) -> Feeds:
        size = feeds["features-size"].astype(np.int64)
        x = stacked_frames(feeds["features"], size, s)
        h = np.tanh(linear(x, w32, "in"))
        h = h + linear(np.maximum(linear(h, w32, "ff1"), 0), w32, "ff2")
        out_size = (size + s - 1) // s
        h = masked_frames(h, out_size)
        h = h.astype(dtype).astype(np.float32)  # the model hands fp16 states to its projections
        result = {"encoder-states": h.astype(dtype), "encoder-states-size": out_size.astype(np.int32)}
        for i in range(num_decoder_layers):
            for kind in ("key", "value"):
                proj = linear(h, w32, f"cross_{kind}_{i}").reshape(*h.shape[:2], num_heads, head_dim)
                result[f"cross-{kind}-{i}"] = proj.transpose(0, 2, 1, 3).astype(dtype)
        return result

    return ReferenceModel(
        model=model,
        oracle=oracle,
        dtype=dtype,
        hidden_dim=dim,
        num_layers=num_decoder_layers,
        num_heads=num_heads,
        head_dim=head_dim,
    )

