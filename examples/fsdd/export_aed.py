#!/usr/bin/env python
"""Export the FSDD attention encoder-decoder to ONNX: an encoder that also precomputes every
decoder layer's cross-attention keys/values, and a RASR-convention decoder step model.

    python examples/fsdd/export_aed.py [--checkpoint examples/fsdd/exp/aed/checkpoint.pt]
                                       [--output-dir examples/fsdd/exp/aed]

- ``aed-encoder.onnx``: ``features`` float32 [batch, time, 40] + ``features-size`` int32 [batch]
  -> ``encoder-states`` [batch, encoder-time, 128], ``encoder-states-size`` int32 [batch], per
  decoder layer i ``cross-key-{i}``, ``cross-value-{i}`` float32 [batch, heads, encoder-time, 32],
  and ``log-probs`` [batch, encoder-time, 12] (the auxiliary CTC head, for joint CTC/attention);
- ``aed-decoder.onnx``: ``token`` int32 [batch, 1], ``prefix-length`` int32 [batch], per layer
  ``past-key-{i}``, ``past-value-{i}`` [batch, heads, time, 32] (right-aligned: the last
  prefix-length positions are valid), the per-utterance ``cross-key-{i}``, ``cross-value-{i}``
  and ``encoder-states-size`` -> ``scores`` [batch, 1, 12] (log-probabilities) and
  ``present-key-{i}``, ``present-value-{i}`` [batch, heads, time + 1, 32]; ``STATE_`` and
  ``UTTERANCE_`` metadata pair them (the layout of ``gpudecode.testing.transformer``).

Checks: onnxruntime matches PyTorch (encoder on a padded batch and each utterance alone; the
decoder step by step from an empty history, and with left-padded histories), and ``gpudecode
inspect`` reads both models.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from fsdd_export import export, padded_batch, parse_export_args
from fsdd_common import LICENSE_NOTE, load_hdf5_split
from fsdd_models import AedModel, AedOptions
from train_aed import decoder_io


class OnnxEncoder(torch.nn.Module):
    def __init__(self, model: AedModel):
        super().__init__()
        self.model = model

    def forward(self, features, features_size):
        states, sizes = self.model.encoder(features, features_size.long())
        out = [states, sizes.int()]
        for layer in self.model.decoder.layers:
            out += list(layer.cross_kv(states))
        out.append(self.model.ctc_head(states).log_softmax(dim=-1))
        return tuple(out)


class OnnxDecoderStep(torch.nn.Module):
    def __init__(self, model: AedModel):
        super().__init__()
        self.decoder = model.decoder

    def forward(self, token, prefix_length, encoder_states_size, *tensors):
        n = len(self.decoder.layers)
        past = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(n)]
        cross = [(tensors[2 * n + 2 * i], tensors[2 * n + 2 * i + 1]) for i in range(n)]
        log_probs, presents = self.decoder.step(token[:, 0].long(), prefix_length.long(), past, cross,
                                                encoder_states_size.long())
        out = [log_probs[:, None]]
        for k, v in presents:
            out += [k, v]
        return tuple(out)


def main(argv=None) -> None:
    args = parse_export_args(argv, __doc__, "aed", output=None, data_help="dev features for the checks")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # gpudecode from this checkout
    import onnxruntime as ort

    from gpudecode.inspect import describe_model

    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    opts = AedOptions(**ckpt["options"])
    model = AedModel(opts)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    common = {"license": LICENSE_NOTE, "vocabulary": json.dumps(ckpt["vocabulary"]),
              "options": json.dumps(ckpt["options"]),
              "trained": json.dumps({k: ckpt.get(k) for k in ("epoch", "step", "dev_loss", "dev_wer")})}
    layers, heads = opts.dec_layers, opts.dec_heads
    head_dim, e_dim, v = opts.dec_dim // heads, opts.encoder["model_dim"], opts.num_labels
    cross = [f"cross-{kind}-{i}" for i in range(layers) for kind in ("key", "value")]
    past = [f"past-{kind}-{i}" for i in range(layers) for kind in ("key", "value")]
    present = [f"present-{kind}-{i}" for i in range(layers) for kind in ("key", "value")]
    paths = {"encoder": out / "aed-encoder.onnx", "decoder": out / "aed-decoder.onnx"}

    _, dev_feats, dev_labels = load_hdf5_split(args.data / "dev" / "feats.h5")
    feats, labels = dev_feats[: args.num_check_utterances], dev_labels[: args.num_check_utterances]
    x, lengths = padded_batch(feats)
    encoder = OnnxEncoder(model).eval()
    enc_outputs = ["encoder-states", "encoder-states-size", *cross, "log-probs"]
    dynamic = {"features": {0: "batch", 1: "time"}, "features-size": {0: "batch"},
               "encoder-states": {0: "batch", 1: "encoder-time"}, "encoder-states-size": {0: "batch"},
               "log-probs": {0: "batch", 1: "encoder-time"}, **{c: {0: "batch", 2: "encoder-time"} for c in cross}}
    export(encoder, (torch.from_numpy(x), torch.from_numpy(lengths)), paths["encoder"], ["features", "features-size"],
           enc_outputs, dynamic,
           {**common, "model": "fsdd aed encoder", "front_end": json.dumps(ckpt["front_end"])}, args.opset,
           {"encoder-states": [None, None, e_dim], "log-probs": [None, None, v],
            **{c: [None, heads, None, head_dim] for c in cross}})

    n, t, s = 3, 2, 5
    example = (torch.zeros(n, 1, dtype=torch.int32), torch.ones(n, dtype=torch.int32),
               torch.full((n,), s, dtype=torch.int32), *(torch.zeros(n, heads, t, head_dim) for _ in past),
               *(torch.zeros(n, heads, s, head_dim) for _ in cross))
    dynamic = {"token": {0: "batch"}, "prefix-length": {0: "batch"}, "encoder-states-size": {0: "batch"},
               "scores": {0: "batch"}, **{p: {0: "batch", 2: "time"} for p in past},
               **{p: {0: "batch", 2: "present-time"} for p in present},
               **{c: {0: "batch", 2: "encoder-time"} for c in cross}}
    metadata = {**common, "model": "fsdd aed decoder", **{f"STATE_{p}": q for p, q in zip(past, present)},
                **{f"UTTERANCE_{c}": c for c in cross},
                "max_positions": str(opts.max_positions)}  # learned positions: search.max_labels is checked
    export(OnnxDecoderStep(model).eval(), example, paths["decoder"],
           ["token", "prefix-length", "encoder-states-size", *past, *cross], ["scores", *present], dynamic, metadata,
           args.opset, {"scores": [None, 1, v], **{p: [None, heads, None, head_dim] for p in present}})

    sessions = {k: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for k, p in paths.items()}
    diffs = {}
    enc = dict(zip(enc_outputs, sessions["encoder"].run(None, {"features": x, "features-size": lengths})))
    with torch.no_grad():
        ref = dict(zip(enc_outputs, (t.numpy() for t in encoder(torch.from_numpy(x), torch.from_numpy(lengths)))))
    sizes = enc["encoder-states-size"]
    assert sizes.dtype == np.int32 and np.array_equal(sizes, ref["encoder-states-size"])
    batch_diff = 0.0
    for k in enc_outputs:
        if k == "encoder-states-size":
            continue
        for i, size in enumerate(sizes):  # time is axis 2 of the cross K/V, axis 1 otherwise
            rows = (slice(None), slice(0, size)) if k.startswith("cross") else (slice(0, size),)
            batch_diff = max(batch_diff, float(np.abs(enc[k][i][rows] - ref[k][i][rows]).max()))
    diffs["encoder (batch)"] = batch_diff
    alone_diff = 0.0
    for i, f in enumerate(feats):
        alone = dict(zip(enc_outputs, sessions["encoder"].run(None, {"features": f[None],
                                                                      "features-size": lengths[i:i + 1]})))
        size = int(sizes[i])
        alone_diff = max(alone_diff, float(np.abs(alone["encoder-states"][0, :size]
                                                  - enc["encoder-states"][i, :size]).max()))
    diffs["encoder (alone)"] = alone_diff

    # decoder: teacher-forced sequence of each check utterance, step by step from an empty history
    # (and again with 3 junk positions of left padding), vs PyTorch's full-sequence decoder
    dec_in, dec_out = decoder_io(labels, list(range(len(labels))))
    with torch.no_grad():
        expected = model.decoder(dec_in, torch.from_numpy(enc["encoder-states"]), torch.from_numpy(sizes).long()).numpy()
    rng = np.random.default_rng(0)
    for pad in (0, 3):
        feeds = {p: rng.normal(size=(len(labels), heads, pad, head_dim)).astype(np.float32) for p in past}
        feeds.update({c: enc[c] for c in cross})
        diff = 0.0
        for step in range(dec_in.shape[1]):
            result = sessions["decoder"].run(None, {"token": dec_in[:, step: step + 1].numpy().astype(np.int32),
                                                    "prefix-length": np.full(len(labels), step, np.int32),
                                                    "encoder-states-size": sizes, **feeds})
            valid = (dec_out[:, step] != -100).numpy()
            diff = max(diff, float(np.abs(result[0][valid, 0] - expected[valid, step]).max()))
            feeds.update(dict(zip(past, result[1:])))
        diffs[f"decoder (left padding {pad})"] = diff
    for path in paths.values():
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    for key, value in diffs.items():
        print(f"onnxruntime vs PyTorch, {key}: max |diff| {value:.2e}")
    if max(diffs.values()) > 1e-3:
        raise SystemExit("ONNX export does not match PyTorch (or depends on the padding)")
    for path in paths.values():
        print(describe_model(path))


if __name__ == "__main__":
    main()
