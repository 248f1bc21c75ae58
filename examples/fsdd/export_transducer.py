#!/usr/bin/env python
"""Export the FSDD transducer to ONNX as the three models ``gpudecode``'s transducer search runs.

    python examples/fsdd/export_transducer.py [--checkpoint examples/fsdd/exp/transducer/checkpoint.pt]
                                              [--output-dir examples/fsdd/exp/transducer]

- ``transducer-encoder.onnx``: ``features`` float32 [batch, time, 40] (raw log-mel) +
  ``features-size`` int32 [batch] -> ``encoder-states`` float32 [batch, encoder-time, 128] +
  ``encoder-states-size`` int32 [batch];
- ``transducer-prediction.onnx``: ``token`` int32 [batch, 1] + per layer ``pred-h-{i}``,
  ``pred-c-{i}`` float32 [batch, H] -> ``prediction`` float32 [batch, 1, P] and
  ``new-pred-h-{i}``, ``new-pred-c-{i}`` (``STATE_`` metadata; the search feeds blank first);
- ``transducer-joint.onnx``: ``encoder-frame`` float32 [batch, 128] + ``prediction`` float32
  [batch, P] -> ``log-probs`` float32 [batch, 12] (log-softmax, blank included).

The metadata ``topology`` says how it was trained: ``one-symbol`` (decode with
``max_symbols_per_frame: 1``) or ``standard``.

Checks: onnxruntime matches PyTorch (encoder on a padded batch of dev utterances and each alone,
prediction network step by step, joint network), and ``gpudecode inspect`` reads each model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from fsdd_export import export, padded_batch, parse_export_args
from fsdd_common import LICENSE_NOTE, load_hdf5_split
from fsdd_models import TransducerModel, TransducerOptions


class OnnxEncoder(torch.nn.Module):
    def __init__(self, model: TransducerModel):
        super().__init__()
        self.encoder = model.encoder

    def forward(self, features, features_size):
        states, sizes = self.encoder(features, features_size.long())
        return states, sizes.int()


class OnnxPrediction(torch.nn.Module):
    def __init__(self, model: TransducerModel):
        super().__init__()
        self.prediction = model.prediction

    def forward(self, token, *states):
        out, hs, cs = self.prediction.step(token[:, 0].long(), list(states[0::2]), list(states[1::2]))
        result = [out.unsqueeze(1)]
        for h, c in zip(hs, cs):
            result += [h, c]
        return tuple(result)


class OnnxJoint(torch.nn.Module):
    def __init__(self, model: TransducerModel):
        super().__init__()
        self.joint = model.joint

    def forward(self, encoder_frame, prediction):
        return self.joint(encoder_frame, prediction)


def main(argv=None) -> None:
    args = parse_export_args(argv, __doc__, "transducer", output=None, data_help="dev features for the checks")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # gpudecode from this checkout
    import onnxruntime as ort

    from gpudecode.inspect import describe_model

    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    opts = TransducerOptions(**ckpt["options"])
    model = TransducerModel(opts)
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    common = {"license": LICENSE_NOTE, "vocabulary": json.dumps(ckpt["vocabulary"]),
              "options": json.dumps(ckpt["options"]), "topology": ckpt.get("topology", "standard"),
              "trained": json.dumps({k: ckpt.get(k) for k in ("epoch", "step", "dev_loss", "dev_wer")})}
    e_dim, p_dim, hid = opts.encoder["model_dim"], opts.pred_dim, opts.pred_hidden_dim
    states = [f"pred-{k}-{i}" for i in range(opts.pred_num_layers) for k in "hc"]
    paths = {k: out / f"transducer-{k}.onnx" for k in ("encoder", "prediction", "joint")}

    _, dev_feats, dev_labels = load_hdf5_split(args.data / "dev" / "feats.h5")
    feats, labels = dev_feats[: args.num_check_utterances], dev_labels[: args.num_check_utterances]
    x, lengths = padded_batch(feats)
    encoder = OnnxEncoder(model).eval()
    export(encoder, (torch.from_numpy(x), torch.from_numpy(lengths)), paths["encoder"],
           ["features", "features-size"], ["encoder-states", "encoder-states-size"],
           {"features": {0: "batch", 1: "time"}, "features-size": {0: "batch"},
            "encoder-states": {0: "batch", 1: "encoder-time"}, "encoder-states-size": {0: "batch"}},
           {**common, "model": "fsdd transducer encoder", "front_end": json.dumps(ckpt["front_end"])}, args.opset,
           {"encoder-states": [None, None, e_dim]})
    n = 3
    export(OnnxPrediction(model).eval(), (torch.zeros(n, 1, dtype=torch.int32), *(torch.zeros(n, hid) for _ in states)),
           paths["prediction"], ["token", *states], ["prediction", *(f"new-{s}" for s in states)],
           {name: {0: "batch"} for name in ["token", "prediction", *states, *(f"new-{s}" for s in states)]},
           {**common, "model": "fsdd transducer prediction network", **{f"STATE_{s}": f"new-{s}" for s in states}},
           args.opset, {"prediction": [None, 1, p_dim], **{f"new-{s}": [None, hid] for s in states}})
    export(OnnxJoint(model).eval(), (torch.zeros(n, e_dim), torch.zeros(n, p_dim)), paths["joint"],
           ["encoder-frame", "prediction"], ["log-probs"],
           {"encoder-frame": {0: "batch"}, "prediction": {0: "batch"}, "log-probs": {0: "batch"}},
           {**common, "model": "fsdd transducer joint network"}, args.opset, {"log-probs": [None, opts.num_labels]})

    sessions = {k: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for k, p in paths.items()}
    # encoder: padded batch vs PyTorch, and each utterance alone vs its row in the batch
    onnx_states, onnx_sizes = sessions["encoder"].run(None, {"features": x, "features-size": lengths})
    with torch.no_grad():
        torch_states, torch_sizes = encoder(torch.from_numpy(x), torch.from_numpy(lengths))
    assert onnx_sizes.dtype == np.int32 and np.array_equal(onnx_sizes, torch_sizes.numpy())
    diffs = {"encoder (batch)": 0.0, "encoder (alone)": 0.0}
    for i, size in enumerate(onnx_sizes):
        diffs["encoder (batch)"] = max(diffs["encoder (batch)"],
                                       float(np.abs(onnx_states[i, :size] - torch_states[i, :size].numpy()).max()))
        alone, _ = sessions["encoder"].run(None, {"features": feats[i][None], "features-size": lengths[i:i + 1]})
        diffs["encoder (alone)"] = max(diffs["encoder (alone)"], float(np.abs(alone[0, :size]
                                                                              - onnx_states[i, :size]).max()))
    # prediction network step by step vs the sequence model; joint on those outputs
    y = max(labels, key=len)[None]
    with torch.no_grad():
        expected = model.prediction(torch.from_numpy(y)).numpy()[0]  # (U+1, P)
    feeds = {s: np.zeros((1, hid), np.float32) for s in states}
    steps = []
    for token in [opts.blank, *y[0].tolist()]:
        result = sessions["prediction"].run(None, {"token": np.array([[token]], np.int32), **feeds})
        steps.append(result[0][0, 0])
        feeds = dict(zip(states, result[1:]))
    steps = np.stack(steps)
    diffs["prediction"] = float(np.abs(steps - expected).max())
    frames = onnx_states[0, : len(steps)]
    joint_onnx = sessions["joint"].run(None, {"encoder-frame": frames, "prediction": steps})[0]
    with torch.no_grad():
        joint_torch = model.joint(torch.from_numpy(frames), torch.from_numpy(steps)).numpy()
    diffs["joint"] = float(np.abs(joint_onnx - joint_torch).max())
    for key, path in paths.items():
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    for key, value in diffs.items():
        print(f"onnxruntime vs PyTorch, {key}: max |diff| {value:.2e}")
    if max(diffs.values()) > 1e-3:
        raise SystemExit("ONNX export does not match PyTorch (or depends on the padding)")
    for path in paths.values():
        print(describe_model(path))


if __name__ == "__main__":
    main()
