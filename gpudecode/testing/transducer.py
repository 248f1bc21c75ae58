"""Reference transducer (RNN-T) models and brute-force transducer oracles for tests.

Four ONNX models, each with a plain-numpy ``oracle``:

- :func:`build_transducer_encoder`: ``features`` [U,T,F] + ``features-size`` [U] ->
  ``encoder-states`` [U,T',E] + ``encoder-states-size`` [U] (frame stacking, Linear+tanh,
  residual feed-forward blocks; the bench pins 12 layers, d = 512, 4× subsampling);
- :func:`build_prediction_network`: an LSTM step model, ``token`` [N,1] int32 + per layer
  ``pred-h-{i}`` / ``pred-c-{i}`` [N,H] (``STATE_`` metadata) -> ``prediction`` [N,1,P] and the new
  states — shaped like an LSTM LM, so the ``lstm-cpu`` / ``lstm-cuda`` state managers drive it;
- :func:`build_stateless_prediction_network`: ``labels`` [N,k] int32 (the last k labels, blank
  padded) -> ``prediction`` [N,P]; no states;
- :func:`build_joint_network`: ``encoder-frame`` [N,E] + ``prediction`` [N,P] -> ``log-probs``
  [N,V] (log-softmax over the labels including blank).

The oracles below enumerate every alignment of the search topology: per frame up to
``max_symbols_per_frame`` labels, then blank (which moves to the next frame) — or, after the
last allowed label, the next frame without a blank (k2's modified beam search when the limit is 1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import numpy as np

from gpudecode.testing._graph import (
    GraphBuilder,
    cast_all,
    frame_encoder,
    linear,
    log_softmax,
    masked_frames,
    random_frame_encoder,
    random_linear,
    sigmoid,
)
from gpudecode.testing.reference import Feeds, ReferenceModel


# --- encoder ---------------------------------------------------------------------------------------
def build_transducer_encoder(
    seed: int = 0,
    *,
    num_features: int = 16,
    model_dim: int = 32,
    encoder_dim: int | None = None,
    subsampling: int = 2,
    num_layers: int = 1,
    dtype=np.float32,
) -> ReferenceModel:
    """A transducer encoder: features -> encoder states of width ``encoder_dim`` (default
    ``model_dim``); T' = ceil(T / s), ``encoder-states-size`` = ceil(features-size / s). Features at
    and beyond ``features-size`` are zeroed first; state rows at and beyond the size are zero."""
    dtype = np.dtype(dtype)
    s, num_f, dim = subsampling, num_features, model_dim
    out_dim = model_dim if encoder_dim is None else encoder_dim
    if subsampling < 1:
        raise ValueError(f"need subsampling >= 1, got {subsampling}")
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    random_frame_encoder(rng, weights, s * num_f, dim, num_layers)
    random_linear(rng, weights, "out", dim, out_dim)
    weights = cast_all(weights, dtype)

    g = GraphBuilder()
    h = g.frame_encoder("features", "features-size", weights, s, num_f, num_layers, dtype)  # [U, T', D]
    h = g.op("Tanh", g.linear(h, weights, "out"))
    out_size = g.op("Div", g.op("Add", "features-size", g.const(s - 1, np.int32)), g.const(s, np.int32),
                    out="encoder-states-size")
    g.masked_frames(h, out_size, dtype, out="encoder-states")
    model = g.build(
        [("features", dtype, ["batch", "time", num_f]), ("features-size", np.int32, ["batch"])],
        [("encoder-states", dtype, ["batch", "encoder-time", out_dim]),
         ("encoder-states-size", np.int32, ["batch"])],
        name="reference-transducer-encoder",
    )
    w32 = cast_all(weights, np.float32)

    def oracle(feeds: Feeds) -> Feeds:
        size = feeds["features-size"].astype(np.int64)
        h = frame_encoder(feeds["features"], size, w32, s, num_layers)
        h = np.tanh(linear(h, w32, "out"))
        out_size = (size + s - 1) // s
        h = masked_frames(h, out_size)
        return {"encoder-states": h.astype(dtype), "encoder-states-size": out_size.astype(np.int32)}

    return ReferenceModel(model=model, oracle=oracle, dtype=dtype, hidden_dim=out_dim, num_layers=num_layers)


# --- prediction networks ---------------------------------------------------------------------------
def build_prediction_network(
    seed: int = 0,
    *,
    vocab_size: int = 5,
    embed_dim: int = 8,
    hidden_dim: int = 16,
    output_dim: int = 16,
    num_layers: int = 1,
    dtype=np.float32,
) -> ReferenceModel:
    """LSTM prediction network step model (gates i, f, g, o; initial state zeros).

    Inputs: ``token`` [N,1] int32 (blank starts a sequence), per layer ``pred-h-{i}``,
    ``pred-c-{i}`` [N,H]. Outputs: ``prediction`` [N,1,P] = tanh(Linear(h_top)) and
    ``new-pred-h-{i}``, ``new-pred-c-{i}`` [N,H]. ``sequence_log_probs`` is not meaningful here;
    use :attr:`ReferenceModel.sequence_oracle` via :func:`prediction_outputs`.
    """
    dtype = np.dtype(dtype)
    hid = hidden_dim
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {"emb": rng.normal(size=(vocab_size, embed_dim))}
    for i in range(num_layers):
        random_linear(rng, weights, f"input_{i}", embed_dim if i == 0 else hid, 4 * hid)
        random_linear(rng, weights, f"recurrent_{i}", hid, 4 * hid)
    random_linear(rng, weights, "out", hid, output_dim)
    weights = cast_all(weights, dtype)
    states = {f"pred-{k}-{i}": f"new-pred-{k}-{i}" for i in range(num_layers) for k in "hc"}

    g = GraphBuilder()
    x = g.op("Squeeze", g.op("Gather", g.weight("emb", weights["emb"]), "token"), g.const([1], np.int64))
    for i in range(num_layers):
        gates = g.op("Add", g.linear(x, weights, f"input_{i}"), g.linear(f"pred-h-{i}", weights, f"recurrent_{i}"))
        gi, gf, gg, go = g.ops("Split", [gates, g.const([hid] * 4, np.int64)], 4, axis=1)
        gi, gf, go, gg = g.op("Sigmoid", gi), g.op("Sigmoid", gf), g.op("Sigmoid", go), g.op("Tanh", gg)
        c = g.op("Add", g.op("Mul", gf, f"pred-c-{i}"), g.op("Mul", gi, gg), out=f"new-pred-c-{i}")
        x = g.op("Mul", go, g.op("Tanh", c), out=f"new-pred-h-{i}")
    g.op("Tanh", g.unsqueeze(g.linear(x, weights, "out"), [1]), out="prediction")
    inputs = [("token", np.int32, ["batch", 1])] + [(name, dtype, ["batch", hid]) for name in states]
    outputs = [("prediction", dtype, ["batch", 1, output_dim])]
    outputs += [(name, dtype, ["batch", hid]) for name in states.values()]
    model = g.build(inputs, outputs, name="reference-prediction-network",
                    metadata={f"STATE_{k}": v for k, v in states.items()})
    w32 = cast_all(weights, np.float32)

    def step(tokens: np.ndarray, hs, cs):
        x = w32["emb"][tokens]
        new_hs, new_cs = [], []
        for i in range(num_layers):
            gates = linear(x, w32, f"input_{i}") + linear(hs[i], w32, f"recurrent_{i}")
            gi, gf, gg, go = np.split(gates, 4, axis=1)
            c = sigmoid(gf) * cs[i] + sigmoid(gi) * np.tanh(gg)
            x = sigmoid(go) * np.tanh(c)
            new_hs.append(x)
            new_cs.append(c)
        return np.tanh(linear(x, w32, "out")), new_hs, new_cs

    def oracle(feeds: Feeds) -> Feeds:
        hs = [feeds[f"pred-h-{i}"].astype(np.float32) for i in range(num_layers)]
        cs = [feeds[f"pred-c-{i}"].astype(np.float32) for i in range(num_layers)]
        out, hs, cs = step(feeds["token"][:, 0], hs, cs)
        result = {"prediction": out[:, None].astype(dtype)}
        for i in range(num_layers):
            result[f"new-pred-h-{i}"] = hs[i].astype(dtype)
            result[f"new-pred-c-{i}"] = cs[i].astype(dtype)
        return result

    def sequence_outputs(tokens: list[int], encoder_inputs: Feeds | None) -> np.ndarray:
        """[len(tokens), P]: the prediction output after feeding tokens[: p + 1]."""
        hs = [np.zeros((1, hid), np.float32) for _ in range(num_layers)]
        cs = [np.zeros((1, hid), np.float32) for _ in range(num_layers)]
        rows = []
        for token in tokens:
            out, hs, cs = step(np.array([token]), hs, cs)
            rows.append(out[0])
        return np.stack(rows) if rows else np.zeros((0, output_dim), np.float32)

    return ReferenceModel(model=model, oracle=oracle, dtype=dtype, vocab_size=vocab_size,
                          hidden_dim=hid, num_layers=num_layers, states=states, time_axis=None,
                          sequence_oracle=sequence_outputs)


def build_stateless_prediction_network(
    seed: int = 0,
    *,
    vocab_size: int = 5,
    context_size: int = 2,
    embed_dim: int = 8,
    output_dim: int = 16,
    blank: int = 0,
    dtype=np.float32,
) -> ReferenceModel:
    """Stateless prediction network (k2's stateless decoder): the last ``context_size`` labels.

    Input ``labels`` [N,k] int32, oldest first, blank-padded at the start of a sequence.
    Output ``prediction`` [N,P] = tanh(Linear(concatenated embeddings)).
    ``sequence_oracle(labels, None)`` gives [1, P] for the label sequence ``labels`` (its last k
    labels, padded with ``blank``).
    """
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {"emb": rng.normal(size=(vocab_size, embed_dim))}
    random_linear(rng, weights, "out", context_size * embed_dim, output_dim)
    weights = cast_all(weights, dtype)
    g = GraphBuilder()
    x = g.reshape(g.op("Gather", g.weight("emb", weights["emb"]), "labels"), [0, context_size * embed_dim])
    g.op("Tanh", g.linear(x, weights, "out"), out="prediction")
    model = g.build([("labels", np.int32, ["batch", context_size])],
                    [("prediction", dtype, ["batch", output_dim])], name="reference-stateless-prediction")
    w32 = cast_all(weights, np.float32)

    def forward(labels: np.ndarray) -> np.ndarray:
        x = w32["emb"][labels].reshape(labels.shape[0], context_size * embed_dim)
        return np.tanh(linear(x, w32, "out"))

    def oracle(feeds: Feeds) -> Feeds:
        return {"prediction": forward(feeds["labels"].astype(np.int64)).astype(dtype)}

    def sequence_outputs(labels: list[int], encoder_inputs: Feeds | None) -> np.ndarray:
        context = ([blank] * context_size + list(labels))[-context_size:]
        return forward(np.array([context]))

    return ReferenceModel(model=model, oracle=oracle, dtype=dtype, vocab_size=vocab_size,
                          hidden_dim=output_dim, sequence_oracle=sequence_outputs)


# --- joint network ----------------------------------------------------------------------------------
def build_joint_network(
    seed: int = 0,
    *,
    encoder_dim: int = 16,
    prediction_dim: int = 16,
    joint_dim: int = 16,
    vocab_size: int = 5,
    blank: int = 0,
    blank_bias: float = 0.0,
    sharpness: float = 2.0,
    dtype=np.float32,
) -> ReferenceModel:
    """Joint network: log_softmax(sharpness · Linear(tanh(Linear(e) + Linear(p)))) over V labels
    including blank (``blank_bias`` is added to the blank logit).

    Inputs ``encoder-frame`` [N,E], ``prediction`` [N,P]; output ``log-probs`` [N,V].
    """
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    weights: dict[str, np.ndarray] = {}
    random_linear(rng, weights, "enc", encoder_dim, joint_dim)
    random_linear(rng, weights, "pred", prediction_dim, joint_dim)
    random_linear(rng, weights, "out", joint_dim, vocab_size)
    weights["out.w"] = weights["out.w"] * sharpness
    weights["out.b"] = weights["out.b"] * sharpness
    weights["out.b"][blank] += blank_bias
    weights = cast_all(weights, dtype)
    g = GraphBuilder()
    hidden = g.op("Tanh", g.op("Add", g.linear("encoder-frame", weights, "enc"), g.linear("prediction", weights, "pred")))
    g.op("LogSoftmax", g.linear(hidden, weights, "out"), axis=-1, out="log-probs")
    model = g.build([("encoder-frame", dtype, ["batch", encoder_dim]), ("prediction", dtype, ["batch", prediction_dim])],
                    [("log-probs", dtype, ["batch", vocab_size])], name="reference-joint-network")
    w32 = cast_all(weights, np.float32)

    def forward(encoder_frame: np.ndarray, prediction: np.ndarray) -> np.ndarray:
        hidden = np.tanh(linear(encoder_frame.astype(np.float32), w32, "enc")
                         + linear(prediction.astype(np.float32), w32, "pred"))
        return log_softmax(linear(hidden, w32, "out"))

    def oracle(feeds: Feeds) -> Feeds:
        return {"log-probs": forward(feeds["encoder-frame"], feeds["prediction"]).astype(dtype)}

    return ReferenceModel(model=model, oracle=oracle, dtype=dtype, vocab_size=vocab_size,
                          hidden_dim=joint_dim, sequence_oracle=None)


# --- brute-force oracles (float64 sums, every alignment) --------------------------------------------
#: ``frame_log_probs(t, labels)``: [V] log-probabilities of the joint at frame t after ``labels``.
FrameLogProbs = Callable[[int, tuple[int, ...]], np.ndarray]


def transducer_log_probs_fn(encoder_states: np.ndarray, prediction: Callable[[tuple[int, ...]], np.ndarray],
                            joint: ReferenceModel) -> FrameLogProbs:
    """A memoised ``frame_log_probs`` for one utterance: ``encoder_states`` [T,E],
    ``prediction(labels)`` -> [P] (the prediction output after ``labels``), the joint's oracle."""
    cache: dict[tuple[int, tuple[int, ...]], np.ndarray] = {}
    pred_cache: dict[tuple[int, ...], np.ndarray] = {}

    def frame_log_probs(t: int, labels: tuple[int, ...]) -> np.ndarray:
        key = (t, labels)
        if key not in cache:
            if labels not in pred_cache:
                pred_cache[labels] = np.asarray(prediction(labels), np.float32).reshape(-1)
            feeds = {"encoder-frame": encoder_states[t][None].astype(np.float32),
                     "prediction": pred_cache[labels][None]}
            cache[key] = joint.oracle(feeds)["log-probs"][0].astype(np.float64)
        return cache[key]

    return frame_log_probs


def lstm_prediction_fn(reference: ReferenceModel, blank: int = 0) -> Callable[[tuple[int, ...]], np.ndarray]:
    """``labels -> [P]``: the LSTM prediction network's output after blank + ``labels``."""
    return lambda labels: reference.sequence_oracle([blank, *labels], None)[-1]


def stateless_prediction_fn(reference: ReferenceModel) -> Callable[[tuple[int, ...]], np.ndarray]:
    """``labels -> [P]``: the stateless prediction network's output for the context of ``labels``."""
    return lambda labels: reference.sequence_oracle(list(labels), None)[0]


def transducer_alignments(num_frames: int, frame_log_probs: FrameLogProbs, *, max_symbols_per_frame: int,
                          blank: int = 0) -> list[tuple[tuple[int, ...], float, tuple[int, ...]]]:
    """Every alignment of the topology: (labels, log-prob, frame of each label).

    Per frame up to ``max_symbols_per_frame`` labels; blank leaves the frame, and so does the
    last allowed label (without a blank).
    """
    result = []

    def walk(t: int, emitted: int, labels: tuple[int, ...], frames: tuple[int, ...], logp: float) -> None:
        if t == num_frames:
            result.append((labels, logp, frames))
            return
        row = frame_log_probs(t, labels)
        walk(t + 1, 0, labels, frames, logp + float(row[blank]))
        for c in range(len(row)):
            if c == blank:
                continue
            if emitted + 1 < max_symbols_per_frame:
                walk(t, emitted + 1, labels + (c,), frames + (t,), logp + float(row[c]))
            else:
                walk(t + 1, 0, labels + (c,), frames + (t,), logp + float(row[c]))

    walk(0, 0, (), (), 0.0)
    return result


def transducer_sequence_scores(num_frames: int, frame_log_probs: FrameLogProbs, *, max_symbols_per_frame: int,
                               blank: int = 0, recombination: str = "sum"
                               ) -> dict[tuple[int, ...], tuple[float, tuple[int, ...]]]:
    """label sequence -> (log-sum-exp (``"sum"``) or max (``"max"``) over its alignments, the
    frames of its best alignment)."""
    grouped: dict[tuple[int, ...], list[tuple[float, tuple[int, ...]]]] = defaultdict(list)
    for labels, logp, frames in transducer_alignments(num_frames, frame_log_probs,
                                                      max_symbols_per_frame=max_symbols_per_frame, blank=blank):
        grouped[labels].append((logp, frames))
    scores = {}
    for labels, paths in grouped.items():
        values = np.array([p for p, _ in paths])
        best = int(np.argmax(values))
        total = float(values.max()) if recombination == "max" else float(np.logaddexp.reduce(values))
        scores[labels] = (total, paths[best][1])
    return scores


def transducer_greedy(num_frames: int, frame_log_probs: FrameLogProbs, *, max_symbols_per_frame: int,
                      blank: int = 0) -> tuple[list[int], float, list[int]]:
    """Greedy decoding written plainly: (labels, log-prob of the path, frame of each label).
    Equal maxima go to the lower label."""
    labels: list[int] = []
    frames: list[int] = []
    total = 0.0
    for t in range(num_frames):
        for emitted in range(max_symbols_per_frame):
            row = frame_log_probs(t, tuple(labels))
            best = int(np.argmax(row))
            total += float(row[best])
            if best == blank:
                break
            labels.append(best)
            frames.append(t)
    return labels, total, frames
