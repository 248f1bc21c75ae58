"""What the FSDD export scripts share: their arguments, the padded check batch, and the ONNX
export with metadata and fixed output dims."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from fsdd_common import DEFAULT_DATA_DIR, RECIPE_DIR, resolve


def parse_export_args(argv, doc: str, exp: str, *, output: str | None, data_help: str,
                      checked: str = "utterances", num_checked: int = 8) -> argparse.Namespace:
    """--checkpoint (default exp/``exp``/checkpoint.pt); --output, an ONNX file (default ``output``
    beside the checkpoint), or with ``output`` None --output-dir (default the checkpoint's folder);
    --data; --opset; --num-check-``checked``. Paths come back resolved."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=RECIPE_DIR / "exp" / exp / "checkpoint.pt")
    if output is None:
        p.add_argument("--output-dir", type=Path, default=None, help="default: the checkpoint's folder")
    else:
        p.add_argument("--output", type=Path, default=None, help=f"ONNX file (default: {output} beside the checkpoint)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help=data_help)
    p.add_argument("--opset", type=int, default=17)
    p.add_argument(f"--num-check-{checked}", type=int, default=num_checked)
    args = p.parse_args(argv)
    args.checkpoint, args.data = resolve(args.checkpoint), resolve(args.data)
    if output is None:
        args.output_dir = resolve(args.output_dir) if args.output_dir else args.checkpoint.parent
    else:
        args.output = resolve(args.output) if args.output else args.checkpoint.parent / output
    return args


def padded_batch(feats: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([f.shape[0] for f in feats], dtype=np.int32)
    x = np.zeros((len(feats), lengths.max(), feats[0].shape[1]), dtype=np.float32)
    for i, f in enumerate(feats):
        x[i, : f.shape[0]] = f
    return x, lengths


def export(module, example, path: Path, inputs: list[str], outputs: list[str], dynamic: dict, metadata: dict,
           opset: int, fixed_dims: dict[str, list[int]] | None = None) -> None:
    import onnx

    with torch.no_grad():
        torch.onnx.export(module, example, str(path), input_names=inputs, output_names=outputs,
                          opset_version=opset, dynamic_axes=dynamic, dynamo=False)
    proto = onnx.load(str(path))
    for output in proto.graph.output:  # the exporter gives some static dims odd symbolic names
        for axis, value in enumerate((fixed_dims or {}).get(output.name, [])):
            if value is not None:
                output.type.tensor_type.shape.dim[axis].Clear()
                output.type.tensor_type.shape.dim[axis].dim_value = value
    for key, value in metadata.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))
