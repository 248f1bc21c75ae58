#!/usr/bin/env python
"""Export the FSDD CTC model to ONNX in gpudecode's encoder convention and check it.

    python examples/fsdd/export_ctc.py [--checkpoint examples/fsdd/exp/ctc/checkpoint.pt]
                                       [--output examples/fsdd/exp/ctc/ctc-encoder.onnx]

Inputs ``features`` float32 [batch, time, 40] (raw log-mel, front end ``normalisation: none``)
and ``features-size`` int32 [batch]; outputs ``log-probs`` float32 [batch, encoder-time, V] and
``log-probs-size`` int32 [batch]. Checks: onnxruntime matches PyTorch on a padded batch of dev
utterances, each utterance decoded alone matches its row of the batch, and ``gpudecode inspect``
reads the model. The vocabulary is written beside the model (``--output`` with ``-vocab.txt``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from fsdd_common import LICENSE_NOTE, load_hdf5_split
from fsdd_export import export, padded_batch, parse_export_args
from fsdd_models import CtcModel, EncoderOptions

INPUT_NAMES = ["features", "features-size"]
OUTPUT_NAMES = ["log-probs", "log-probs-size"]
CTC_IO_MAP = {"encoder-states": "log-probs", "encoder-states-size": "log-probs-size"}


class OnnxCtc(torch.nn.Module):
    """int32 sizes at the interface, as the toolkit's encoder convention has them."""

    def __init__(self, model: CtcModel):
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor, features_size: torch.Tensor):
        log_probs, sizes = self.model(features, features_size.long())
        return log_probs, sizes.int()


def main(argv=None) -> None:
    args = parse_export_args(argv, __doc__, "ctc", output="ctc-encoder.onnx",
                             data_help="make_data.py's --out (dev features for the checks)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # gpudecode from this checkout
    import onnxruntime as ort

    from gpudecode.inspect import describe_model

    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
    model = CtcModel(EncoderOptions(**ckpt["options"]))
    model.load_state_dict(ckpt["state_dict"])
    model.eval()
    wrapper = OnnxCtc(model).eval()

    _, dev_feats, _ = load_hdf5_split(args.data / "dev" / "feats.h5")
    feats = dev_feats[: args.num_check_utterances]
    x, lengths = padded_batch(feats)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"license": LICENSE_NOTE, "vocabulary": json.dumps(ckpt["vocabulary"]),
                "front_end": json.dumps(ckpt["front_end"]), "model": "fsdd ctc encoder",
                "options": json.dumps(ckpt["options"]),
                "trained": json.dumps({k: ckpt.get(k) for k in ("epoch", "step", "dev_loss", "dev_wer")})}
    export(wrapper, (torch.from_numpy(x), torch.from_numpy(lengths)), args.output, INPUT_NAMES, OUTPUT_NAMES,
           {"features": {0: "batch", 1: "time"}, "features-size": {0: "batch"},
            "log-probs": {0: "batch", 1: "encoder-time"}, "log-probs-size": {0: "batch"}},
           metadata, args.opset)
    vocab_path = args.output.with_name(args.output.stem + "-vocab.txt")
    vocab_path.write_text("\n".join(ckpt["vocabulary"]) + "\n", encoding="utf-8")

    session = ort.InferenceSession(str(args.output), providers=["CPUExecutionProvider"])
    onnx_log_probs, onnx_sizes = session.run(None, {"features": x, "features-size": lengths})
    with torch.no_grad():
        torch_log_probs, torch_sizes = wrapper(torch.from_numpy(x), torch.from_numpy(lengths))
    assert onnx_sizes.dtype == np.int32 and np.array_equal(onnx_sizes, torch_sizes.numpy())
    batch_diff = 0.0
    for i, n in enumerate(onnx_sizes):
        batch_diff = max(batch_diff, float(np.abs(onnx_log_probs[i, :n]
                                                  - torch_log_probs[i, :n].numpy()).max()))
    alone_diff = 0.0
    for i, f in enumerate(feats):
        alone, alone_size = session.run(None, {"features": f[None],
                                               "features-size": lengths[i:i + 1]})
        n = int(alone_size[0])
        assert n == onnx_sizes[i]
        alone_diff = max(alone_diff, float(np.abs(alone[0, :n] - onnx_log_probs[i, :n]).max()))
    print(f"wrote {args.output} ({args.output.stat().st_size / 1e6:.2f} MB) and {vocab_path}")
    print(f"onnxruntime vs PyTorch, padded batch of {len(feats)}: max |diff| {batch_diff:.2e}")
    print(f"each utterance alone vs in the batch: max |diff| {alone_diff:.2e}")
    if batch_diff > 1e-3 or alone_diff > 1e-3:
        raise SystemExit("ONNX export does not match PyTorch (or depends on the padding)")
    print(describe_model(args.output, CTC_IO_MAP))


if __name__ == "__main__":
    main()
