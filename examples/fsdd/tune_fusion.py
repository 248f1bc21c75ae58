#!/usr/bin/env python
"""Grid search of the LM scale and length reward of a fusion config on the dev split.

    python examples/fsdd/tune_fusion.py configs/fsdd-ctc-lm.yaml \
        --scales 0.2 0.4 0.6 --rewards 0 0.5 1 [--lm-scorer 0 --reward-scorer 1]

Decodes ``--features`` (default: the dev split's HDF5 features) once per grid point with
``gpudecode``'s own run (the same code as ``gpudecode decode``), scores against ``--references``
(default: dev/text) and prints the error counts, best first; ``--out`` gets one output folder per
point and ``grid.json``. Never point it at the test split: test is reported once, not tuned on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

from fsdd_common import DEFAULT_DATA_DIR, REPO_ROOT, resolve


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("config", type=Path)
    p.add_argument("--features", type=Path, default=DEFAULT_DATA_DIR / "dev" / "feats.h5")
    p.add_argument("--references", type=Path, default=DEFAULT_DATA_DIR / "dev" / "text")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: a temporary one)")
    p.add_argument("--scales", type=float, nargs="+", required=True, help="LM scales")
    p.add_argument("--rewards", type=float, nargs="+", default=[0.0], help="length rewards per label")
    p.add_argument("--lm-scorer", type=int, default=0, help="index of the LM in the config's scorers")
    p.add_argument("--reward-scorer", type=int, default=1,
                   help="index of the length-reward scorer (its options.reward is set; scale stays)")
    p.add_argument("-o", "--override", action="append", default=[], help="further key.path=value")
    args = p.parse_args(argv)
    if "test" in {part for part in resolve(args.features).parts}:
        p.error("--features: tune on dev, never on test")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from gpudecode.config import load_config
    from gpudecode.run import run_decode

    out = resolve(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fsdd-tune-"))
    results = []
    for scale, reward in itertools.product(args.scales, args.rewards):
        folder = out / f"scale{scale:g}-reward{reward:g}"
        overrides = [f"io.features.path={resolve(args.features)}", f"io.references={resolve(args.references)}",
                     f"io.output={folder}", "io.formats=[text]", f"scorers.{args.lm_scorer}.scale={scale}",
                     f"scorers.{args.reward_scorer}.options.reward={reward}", *args.override]
        summary = run_decode(load_config(args.config, overrides), resume=folder.exists())
        w = summary.wer
        row = {"scale": scale, "reward": reward, "errors": w["substitutions"] + w["deletions"] + w["insertions"],
               "sub": w["substitutions"], "del": w["deletions"], "ins": w["insertions"], "words": w["num_ref_words"]}
        results.append(row)
        print(json.dumps(row), flush=True)
    (out / "grid.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"\nbest first ({out}):")
    for row in sorted(results, key=lambda r: (r["errors"], r["scale"], abs(r["reward"])))[:10]:
        print(f"  scale {row['scale']:<5g} reward {row['reward']:<5g} {row['errors']:4d} errors "
              f"({row['sub']} sub / {row['del']} del / {row['ins']} ins of {row['words']})")


if __name__ == "__main__":
    main()
