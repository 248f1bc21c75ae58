#!/usr/bin/env python
"""Export the FSDD transformer LM to ONNX as a RASR-convention step model (``recurrent-lm``
scorer with the ``transformer`` state manager).

    python examples/fsdd/export_tlm.py [--checkpoint examples/fsdd/exp/tlm/checkpoint.pt]
                                       [--output examples/fsdd/exp/tlm/transformer-lm.onnx]

One new token per step, the KV cache as state variables (the layout of
``gpudecode.testing.transformer.build_transformer_lm``): inputs ``token`` int32 [batch, 1],
``prefix-length`` int32 [batch] (the number of valid history positions; the new token sits at
that position) and per layer i ``past-key-{i}``, ``past-value-{i}`` float32 [batch, 4, time, 32],
right-aligned (only the last prefix-length of the time positions are valid); outputs ``scores``
float32 [batch, 1, 12] (log-probabilities of the next label) and ``present-key-{i}``,
``present-value-{i}`` [batch, 4, time + 1, 32], paired by ``STATE_<input>`` = ``<output>``
metadata. The first step feeds ``</s>`` with an empty history (time 0, prefix-length 0).

Checks (assertions): onnxruntime, run step by step from an empty history and again with three
junk positions of left padding, matches PyTorch's full-sequence log-probs on dev sentences; a
sequence longer than the learned positions matches too; ``gpudecode inspect`` recognises the
model as a RASR step model with four KV state variables on time axis 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from export_lm import LM_LICENSE_NOTE
from fsdd_common import read_text
from fsdd_export import export, parse_export_args
from train_lm import batch_tensors, sentences_of
from train_tlm import TransformerLm, TransformerLmOptions

TOLERANCE = 1e-4


class OnnxTlmStep(torch.nn.Module):
    def __init__(self, model: TransformerLm):
        super().__init__()
        self.model = model

    def forward(self, token, prefix_length, *past):
        n = self.model.opts.num_layers
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(n)]
        log_probs, presents = self.model.step(token[:, 0].long(), prefix_length.long(), pairs)
        out = [log_probs[:, None]]
        for k, v in presents:
            out += [k, v]
        return tuple(out)


def step_by_step(session, x: np.ndarray, past_names: list[str], state_shape: tuple[int, int], pad: int,
                 rng: np.random.Generator) -> np.ndarray:
    """onnxruntime log-probs (B, L, V): tokens ``x`` (B, L) fed one per step, the history
    starting with ``pad`` junk positions that prefix-length excludes."""
    heads, head_dim = state_shape
    feeds = {p: rng.normal(size=(x.shape[0], heads, pad, head_dim)).astype(np.float32) for p in past_names}
    rows = []
    for t in range(x.shape[1]):
        result = session.run(None, {"token": x[:, t: t + 1].astype(np.int32),
                                    "prefix-length": np.full(x.shape[0], t, np.int32), **feeds})
        rows.append(result[0][:, 0])
        feeds = dict(zip(past_names, result[1:]))
    return np.stack(rows, axis=1)


def main(argv=None) -> None:
    args = parse_export_args(argv, __doc__, "tlm", output="transformer-lm.onnx",
                             data_help="dev sentences for the checks", checked="sentences", num_checked=32)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # gpudecode from this checkout
    import onnx
    import onnxruntime as ort

    from gpudecode.inspect import describe_model
    from gpudecode.session.discovery import discover_step_model
    from gpudecode.session.tensors import from_onnx_model

    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    opts = TransformerLmOptions(**{**ckpt["options"], "never_predicted": tuple(ckpt["options"]["never_predicted"])})
    model = TransformerLm(opts)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    layers, heads, v = opts.num_layers, opts.num_heads, opts.num_labels
    head_dim = opts.model_dim // heads
    past = [f"past-{kind}-{i}" for i in range(layers) for kind in ("key", "value")]
    present = [f"present-{kind}-{i}" for i in range(layers) for kind in ("key", "value")]
    args.output.parent.mkdir(parents=True, exist_ok=True)

    n, t = 3, 2
    example = (torch.zeros(n, 1, dtype=torch.int32), torch.full((n,), t, dtype=torch.int32),
               *(torch.zeros(n, heads, t, head_dim) for _ in past))
    dynamic = {"token": {0: "batch"}, "prefix-length": {0: "batch"}, "scores": {0: "batch"},
               **{p: {0: "batch", 2: "time"} for p in past}, **{p: {0: "batch", 2: "present-time"} for p in present}}
    metadata = {f"STATE_{p}": q for p, q in zip(past, present)}
    metadata.update({"license": LM_LICENSE_NOTE, "vocabulary": json.dumps(ckpt["vocabulary"]),
                     "model": "fsdd transformer lm", "options": json.dumps(ckpt["options"]),
                     "trained": json.dumps({k: ckpt.get(k) for k in ("epoch", "dev_ppl")})})
    export(OnnxTlmStep(model).eval(), example, args.output, ["token", "prefix-length", *past], ["scores", *present],
           dynamic, metadata, args.opset, {"scores": [None, 1, v], **{p: [None, heads, None, head_dim] for p in present}})

    # onnxruntime step by step (a padded batch of dev sentences) vs PyTorch's full-sequence model
    session = ort.InferenceSession(str(args.output), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    sentences = sentences_of(list(read_text(args.data / "dev" / "text").values())[: args.num_check_sentences])
    x, y = batch_tensors(sentences)
    with torch.no_grad():
        expected = model(x).numpy()
    valid = (y != -100).numpy()
    diffs = {}
    for pad in (0, 3):
        got = step_by_step(session, x.numpy(), past, (heads, head_dim), pad, rng)
        diffs[f"{len(sentences)} dev sentences, left padding {pad}"] = float(np.abs(got - expected)[valid].max())
    # longer than the learned positions (they are clamped, in PyTorch and in the graph alike)
    long = torch.from_numpy(rng.integers(1, v, size=(2, opts.max_positions + 8)))
    with torch.no_grad():
        expected_long = model(long).numpy()
    got = step_by_step(session, long.numpy(), past, (heads, head_dim), 0, rng)
    diffs[f"{long.shape[1]} random tokens"] = float(np.abs(got - expected_long).max())
    # the scores are normalised log-probabilities and blank is never predicted
    assert np.allclose(np.exp(got).sum(-1), 1.0, atol=1e-4) and (got[..., 0] < -1e3).all()

    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.2f} MB, "
          f"{sum(p.numel() for p in model.parameters())} parameters)")
    for key, value in diffs.items():
        print(f"onnxruntime step by step vs PyTorch full sequence, {key}: max |diff| {value:.2e}")
    if max(diffs.values()) > TOLERANCE:
        raise SystemExit("ONNX export does not match PyTorch (or depends on the padding)")

    print(describe_model(args.output))
    spec = discover_step_model(from_onnx_model(onnx.load(str(args.output)), str(args.output)), vocab_size=v)
    assert spec.convention == "rasr" and spec.scores_output == "scores", spec
    assert spec.hypothesis_inputs == {"token": "token", "prefix-length": "prefix-length"}, spec.hypothesis_inputs
    assert {s.input_name: s.output_name for s in spec.state_variables} == dict(zip(past, present)), spec
    assert all(s.batch_axis == 0 and s.time_axis == 2 for s in spec.state_variables), spec.state_variables
    assert not spec.utterance_inputs, spec.utterance_inputs


if __name__ == "__main__":
    main()
