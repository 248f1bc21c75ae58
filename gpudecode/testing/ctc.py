"""Reference CTC encoder (frame stacking, Linear+tanh, residual feed-forward blocks, log-softmax)
and brute-force CTC oracles (every alignment enumerated) for tests."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np

from gpudecode.testing._graph import (
    GraphBuilder,
    cast_all,
    frame_encoder,
    linear,
    log_softmax,
    random_frame_encoder,
    random_linear,
)
from gpudecode.testing.reference import Feeds, ReferenceModel


def build_ctc_encoder(
    seed: int = 0,
    *,
    num_features: int = 16,
    vocab_size: int = 8,
    blank: int = 0,
    subsampling: int = 2,
    model_dim: int = 32,
    num_layers: int = 1,
    blank_bias: float = 1.0,
    dtype=np.float32,
) -> ReferenceModel:
    """A CTC encoder: features -> frame log-probabilities over ``vocab_size`` labels incl. blank.

    Inputs: ``features`` [U, T, F] float, ``features-size`` [U] int32.
    Outputs: ``log-probs`` [U, T', V] (log-softmax; T' = ceil(T / s)) and ``log-probs-size`` [U]
    int32 = ceil(features-size / s). Features at and beyond ``features-size`` are zeroed first;
    rows at and beyond ``log-probs-size`` hold the log-softmax of those zeros (a search ignores
    them). ``num_layers`` residual feed-forward blocks of width ``model_dim`` (the bench pins 12
    layers, d = 512); ``blank_bias`` is added to the blank logit (CTC models favour blank).
    """
    dtype = np.dtype(dtype)
    s, num_f, dim = subsampling, num_features, model_dim
    if subsampling < 1 or not 0 <= blank < vocab_size:
        raise ValueError(f"need subsampling >= 1 and 0 <= blank < vocab_size, got {subsampling=}, "
                         f"{blank=}, {vocab_size=}")
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    random_frame_encoder(rng, weights, s * num_f, dim, num_layers)
    random_linear(rng, weights, "out", dim, vocab_size)
    weights["out.w"] = weights["out.w"] * 3.0  # peaky posteriors, as trained CTC models have
    weights["out.b"][blank] += blank_bias
    weights = cast_all(weights, dtype)

    g = GraphBuilder()
    h = g.frame_encoder("features", "features-size", weights, s, num_f, num_layers, dtype)  # [U, T', D]
    g.op("LogSoftmax", g.linear(h, weights, "out"), axis=-1, out="log-probs")
    g.op("Div", g.op("Add", "features-size", g.const(s - 1, np.int32)), g.const(s, np.int32),
         out="log-probs-size")
    model = g.build(
        [("features", dtype, ["batch", "time", num_f]), ("features-size", np.int32, ["batch"])],
        [("log-probs", dtype, ["batch", "encoder-time", vocab_size]), ("log-probs-size", np.int32, ["batch"])],
        name="reference-ctc-encoder",
    )

    w32 = cast_all(weights, np.float32)

    def oracle(feeds: Feeds) -> Feeds:
        size = feeds["features-size"].astype(np.int64)
        h = frame_encoder(feeds["features"], size, w32, s, num_layers)
        return {"log-probs": log_softmax(linear(h, w32, "out")).astype(dtype),
                "log-probs-size": ((size + s - 1) // s).astype(np.int32)}

    return ReferenceModel(model=model, oracle=oracle, dtype=dtype, vocab_size=vocab_size,
                          hidden_dim=dim, num_layers=num_layers)


# --- brute-force oracles (float64, every alignment) -----------------------------------------------
def collapse(alignment, blank: int = 0) -> tuple[int, ...]:
    """The label sequence of a CTC alignment: repeats merged, blanks dropped."""
    labels, previous = [], None
    for a in alignment:
        if a != blank and a != previous:
            labels.append(int(a))
        previous = a
    return tuple(labels)


def ctc_sequence_log_probs(log_probs: np.ndarray, blank: int = 0) -> dict[tuple[int, ...], float]:
    """log P(y | x) for every label sequence y with an alignment, by enumerating all V^T
    alignments of ``log_probs`` [T, V] (keep T and V tiny)."""
    num_frames, vocab_size = log_probs.shape
    lp = log_probs.astype(np.float64)
    probs: dict[tuple[int, ...], float] = defaultdict(float)
    for alignment in itertools.product(range(vocab_size), repeat=num_frames):
        probs[collapse(alignment, blank)] += float(np.exp(lp[np.arange(num_frames), list(alignment)].sum()))
    return {y: float(np.log(p)) for y, p in probs.items() if p > 0}


def ctc_prefix_log_probs(log_probs: np.ndarray, blank: int = 0) -> dict[tuple[int, ...], float]:
    """log P(y is a prefix of the output | x): the sum over all alignments whose label sequence
    starts with y (the empty prefix has log-prob 0)."""
    sums: dict[tuple[int, ...], float] = defaultdict(float)
    for y, logp in ctc_sequence_log_probs(log_probs, blank).items():
        for k in range(len(y) + 1):
            sums[y[:k]] += float(np.exp(logp))
    return {y: float(np.log(p)) for y, p in sums.items()}


def best_path(log_probs: np.ndarray, blank: int = 0) -> tuple[list[int], float, list[int]]:
    """Greedy CTC written plainly: (labels, best-path log-prob, first frame of each label)."""
    labels, frames, previous, total = [], [], None, 0.0
    for t, row in enumerate(log_probs):
        a = int(np.argmax(row))
        total += float(row[a])
        if a != blank and a != previous:
            labels.append(a)
            frames.append(t)
        previous = a
    return labels, total, frames
