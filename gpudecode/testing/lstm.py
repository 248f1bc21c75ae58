"""Reference LSTM language model step model (cells from MatMul/Add/Sigmoid/Tanh, gates i, f, g, o)."""

from __future__ import annotations

import numpy as np

from gpudecode.testing._graph import GraphBuilder, cast_all, linear, log_softmax, random_linear, sigmoid
from gpudecode.testing.reference import Feeds, ReferenceModel


def build_lstm_lm(
    seed: int = 0,
    *,
    vocab_size: int = 12,
    embed_dim: int = 16,
    hidden_dim: int = 32,
    num_layers: int = 2,
    stacked: bool = False,
    dtype=np.float32,
) -> ReferenceModel:
    """LSTM LM step model; ``stacked`` only changes how the states are laid out (same weights).

    Inputs: ``token`` [N,1] int32, ``token-length`` [N] int32 (unused); per layer i ``lstm-h-{i}``,
    ``lstm-c-{i}`` [N,H], or with ``stacked`` ``lstm-h``, ``lstm-c`` [L,N,H].
    Outputs: ``scores`` [N,1,V] log-softmax; ``new-lstm-h-{i}``, ``new-lstm-c-{i}`` [N,H] (or
    ``new-lstm-h``, ``new-lstm-c`` [L,N,H]). The initial state is zeros.
    """
    dtype = np.dtype(dtype)
    hid = hidden_dim
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {"emb": rng.normal(size=(vocab_size, embed_dim))}
    for i in range(num_layers):
        random_linear(rng, weights, f"input_{i}", embed_dim if i == 0 else hid, 4 * hid)
        random_linear(rng, weights, f"recurrent_{i}", hid, 4 * hid)
    random_linear(rng, weights, "out", hid, vocab_size)
    weights = cast_all(weights, dtype)

    if stacked:
        states = {"lstm-h": "new-lstm-h", "lstm-c": "new-lstm-c"}
        state_shape = [num_layers, "batch", hid]
    else:
        states = {f"lstm-{k}-{i}": f"new-lstm-{k}-{i}" for i in range(num_layers) for k in "hc"}
        state_shape = ["batch", hid]

    g = GraphBuilder()
    x = g.op("Squeeze", g.op("Gather", g.weight("emb", weights["emb"]), "token"), g.const([1], np.int64))
    new_h, new_c = [], []
    for i in range(num_layers):
        if stacked:
            index = g.const(i, np.int64)
            h, c = g.op("Gather", "lstm-h", index, axis=0), g.op("Gather", "lstm-c", index, axis=0)
        else:
            h, c = f"lstm-h-{i}", f"lstm-c-{i}"
        gates = g.op("Add", g.linear(x, weights, f"input_{i}"), g.linear(h, weights, f"recurrent_{i}"))
        gi, gf, gg, go = g.ops("Split", [gates, g.const([hid] * 4, np.int64)], 4, axis=1)
        gi, gf, go, gg = g.op("Sigmoid", gi), g.op("Sigmoid", gf), g.op("Sigmoid", go), g.op("Tanh", gg)
        out_h, out_c = (None, None) if stacked else (f"new-lstm-h-{i}", f"new-lstm-c-{i}")
        c = g.op("Add", g.op("Mul", gf, c), g.op("Mul", gi, gg), out=out_c)
        x = g.op("Mul", go, g.op("Tanh", c), out=out_h)
        new_h.append(x)
        new_c.append(c)
    if stacked:
        g.op("Concat", *(g.unsqueeze(t, [0]) for t in new_h), axis=0, out="new-lstm-h")
        g.op("Concat", *(g.unsqueeze(t, [0]) for t in new_c), axis=0, out="new-lstm-c")
    g.op("LogSoftmax", g.unsqueeze(g.linear(x, weights, "out"), [1]), axis=-1, out="scores")

    inputs = [("token", np.int32, ["batch", 1]), ("token-length", np.int32, ["batch"])]
    inputs += [(name, dtype, state_shape) for name in states]
    outputs = [("scores", dtype, ["batch", 1, vocab_size])]
    outputs += [(name, dtype, state_shape) for name in states.values()]
    model = g.build(
        inputs, outputs, name="reference-lstm-lm", metadata={f"STATE_{k}": v for k, v in states.items()}
    )

    w32 = cast_all(weights, np.float32)

    def step(x: np.ndarray, hs: list[np.ndarray], cs: list[np.ndarray]):
        """x [N,E], hs/cs per layer [N,H] float32 -> logits [N,V], new hs, new cs."""
        new_hs, new_cs = [], []
        for i in range(num_layers):
            gates = linear(x, w32, f"input_{i}") + linear(hs[i], w32, f"recurrent_{i}")
            gi, gf, gg, go = np.split(gates, 4, axis=1)
            c = sigmoid(gf) * cs[i] + sigmoid(gi) * np.tanh(gg)
            x = sigmoid(go) * np.tanh(c)
            new_hs.append(x)
            new_cs.append(c)
        return linear(x, w32, "out"), new_hs, new_cs

    def oracle(feeds: Feeds) -> Feeds:
        if stacked:
            hs, cs = list(feeds["lstm-h"].astype(np.float32)), list(feeds["lstm-c"].astype(np.float32))
        else:
            hs = [feeds[f"lstm-h-{i}"].astype(np.float32) for i in range(num_layers)]
            cs = [feeds[f"lstm-c-{i}"].astype(np.float32) for i in range(num_layers)]
        logits, hs, cs = step(w32["emb"][feeds["token"][:, 0]], hs, cs)
        result = {"scores": log_softmax(logits)[:, None].astype(dtype)}
        if stacked:
            result["new-lstm-h"] = np.stack(hs).astype(dtype)
            result["new-lstm-c"] = np.stack(cs).astype(dtype)
        else:
            for i in range(num_layers):
                result[f"new-lstm-h-{i}"] = hs[i].astype(dtype)
                result[f"new-lstm-c-{i}"] = cs[i].astype(dtype)
        return result

    def sequence_log_probs(tokens: list[int], encoder_inputs: Feeds | None) -> np.ndarray:
        if encoder_inputs:
            raise ValueError("the LSTM LM takes no encoder_inputs")
        hs = [np.zeros((1, hid), np.float32) for _ in range(num_layers)]
        cs = [np.zeros((1, hid), np.float32) for _ in range(num_layers)]
        rows = []
        for token in tokens:
            logits, hs, cs = step(w32["emb"][[token]], hs, cs)
            rows.append(log_softmax(logits[0]))
        return np.stack(rows) if rows else np.zeros((0, vocab_size), np.float32)

    return ReferenceModel(
        model=model, oracle=oracle, dtype=dtype, vocab_size=vocab_size, num_layers=num_layers,
        hidden_dim=hid, states=states, time_axis=None, sequence_oracle=sequence_log_probs,
    )
