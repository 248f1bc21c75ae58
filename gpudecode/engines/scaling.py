"""Throughput of the Ray engine: pools of different sizes on the same utterances, and the ratio.

    python -m gpudecode.engines.scaling CONFIG --utterances 2000 --pools 1x1,2x1 --output out/scaling
    python -m gpudecode.engines.scaling CONFIG --utterances 2000 --pools 1x1,2x0.5 ...   # one GPU, shared

``--pools``: ``WORKERSxGPUS_PER_WORKER`` per run; every run is compared with the first. The
config's features are repeated (as ``.npy``) up to ``--utterances``. Reported per pool: wall
utterances/s (start-up and model loading included) and steady utterances/s (from the first
result to the last, which is what a long pseudo-labelling job sees); results as JSON. Every
pool's output must equal the first pool's labels (the run fails otherwise).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from gpudecode.config import load_config
from gpudecode.engines import import_ray
from gpudecode.io import open_features
from gpudecode.run import run_decode


def _repeat_features(config, count: int, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    feats = config.io.features
    with open_features(feats.path, feats.format, config.models.front_end, num_features=feats.num_features) as source:
        originals = [u.features for u in source]
    for i in range(count):
        np.save(folder / f"s{i:06d}.npy", originals[i % len(originals)])
    return folder


def _labels(output: Path) -> dict[str, list]:
    records = (json.loads(line) for line in (output / "nbest.jsonl").read_text().splitlines())
    return {r["id"]: [h["labels"] for h in r["nbest"]] for r in records}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--utterances", type=int, default=2000)
    parser.add_argument("--pools", default="1x1,2x1", help="WORKERSxGPUS_PER_WORKER, comma-separated")
    parser.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS or a new local one)")
    parser.add_argument("--output", default="out/scaling")
    parser.add_argument("-o", "--override", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    ray = import_ray()
    output = Path(args.output).resolve()  # overrides resolve relative paths against the config
    config = load_config(args.config, args.overrides)
    features = _repeat_features(config, args.utterances, output / "features")
    ray.init(address=args.address, include_dashboard=False)
    runs = []
    try:
        for pool in args.pools.split(","):
            workers, gpus = pool.split("x")
            folder = output / f"pool-{pool}"
            shutil.rmtree(folder, ignore_errors=True)
            arrivals: list[tuple[float, int]] = []
            run_config = load_config(args.config, [
                *args.overrides, f"io.features.path={features}", f"io.output={folder}", "io.formats=[jsonl]",
                "runtime.engine.type=ray", f"runtime.engine.workers={int(workers)}",
                f"runtime.engine.gpus_per_worker={float(gpus)}"])
            summary = run_decode(run_config,
                                 progress=lambda done, total: arrivals.append((time.perf_counter(), done)))
            (t0, n0), (t1, n1) = arrivals[0], arrivals[-1]
            runs.append({"pool": pool, "workers": int(workers), "gpus_per_worker": float(gpus),
                         "utterances": summary.decoded, "seconds": summary.seconds,
                         "wall_utt_per_s": summary.utterances_per_second,
                         "steady_utt_per_s": (n1 - n0) / (t1 - t0) if t1 > t0 else None,
                         "workers_seen": {name: w.describe() for name, w in summary.workers.items()}})
            if len(runs) > 1 and _labels(folder) != _labels(output / f"pool-{runs[0]['pool']}"):
                raise SystemExit(f"pool {pool}: labels differ from pool {runs[0]['pool']}")
    finally:
        ray.shutdown()
    for run in runs:
        base = runs[0]
        run["wall_ratio"] = run["wall_utt_per_s"] / base["wall_utt_per_s"]
        if run["steady_utt_per_s"] and base["steady_utt_per_s"]:
            run["steady_ratio"] = run["steady_utt_per_s"] / base["steady_utt_per_s"]
        print(f"{run['pool']:>8}: {run['wall_utt_per_s']:8.1f} utt/s wall ({run['wall_ratio']:.2f}×), "
              f"{run['steady_utt_per_s'] or 0:8.1f} utt/s steady ({run.get('steady_ratio', 0):.2f}×)")
    (output / "scaling.json").write_text(json.dumps(runs, indent=2))
    return {"runs": runs}


if __name__ == "__main__":
    main()
