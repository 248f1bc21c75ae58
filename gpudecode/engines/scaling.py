"""Throughput of the Ray engine: pools of different sizes on the same utterances, and the ratio.

    python -m gpudecode.engines.scaling CONFIG --utterances 2000 --pools 1x1,2x1 --output out/scaling
    python -m gpudecode.engines.scaling CONFIG --utterances 2000 --pools 1x1,2x0.5 ...   # one GPU, shared

``--pools``: ``WORKERSxGPUS_PER_WORKER`` per run; every run is compared with the first. The
config's features are repeated (as ``.npy``) up to ``--utterances``. Reported per pool: wall
utterances/s (start-up and model loading included) and steady utterances/s (from the first
result to the last, which is what a long pseudo-labelling job sees); results as JSON. Every
pool's output must equal the first pool's labels (the run fails otherwise). ``--repeats N``
runs the pools N times in turn (1x1, 2x1, 1x1, 2x1, ...) and reports each pool's median ratio
against the first pool of the same round, so one slow round does not decide the figure.
A Ray connection made before (``ray.init`` in the calling process) is used and left open.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from gpudecode.config import load_config
from gpudecode.engines.base import import_ray
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


def _run_pool(config_path, overrides, features: Path, folder: Path, pool: str) -> dict:
    workers, gpus = pool.split("x")
    shutil.rmtree(folder, ignore_errors=True)
    arrivals: list[tuple[float, int]] = []
    run_config = load_config(config_path, [
        *overrides, f"io.features.path={features}", f"io.output={folder}", "io.formats=[jsonl]",
        "runtime.engine.type=ray", f"runtime.engine.workers={int(workers)}",
        f"runtime.engine.gpus_per_worker={float(gpus)}"])
    summary = run_decode(run_config, progress=lambda done, *_: arrivals.append((time.perf_counter(), done)))
    (t0, n0), (t1, n1) = arrivals[0], arrivals[-1]
    return {"pool": pool, "workers": int(workers), "gpus_per_worker": float(gpus),
            "utterances": summary.decoded, "seconds": summary.seconds,
            "wall_utt_per_s": summary.utterances_per_second,
            "steady_utt_per_s": (n1 - n0) / (t1 - t0) if t1 > t0 else None,
            "workers_seen": {name: w.describe() for name, w in summary.workers.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--utterances", type=int, default=2000)
    parser.add_argument("--pools", default="1x1,2x1", help="WORKERSxGPUS_PER_WORKER, comma-separated")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all pools; ratios are medians")
    parser.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS or a new local one)")
    parser.add_argument("--output", default="out/scaling")
    parser.add_argument("-o", "--override", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    ray = import_ray()
    output = Path(args.output).resolve()  # overrides resolve relative paths against the config
    config = load_config(args.config, args.overrides)
    features = _repeat_features(config, args.utterances, output / "features")
    pools = args.pools.split(",")
    connected = ray.is_initialized()
    if not connected:
        ray.init(address=args.address, include_dashboard=False)
    runs = []
    try:
        for round_ in range(args.repeats):
            for pool in pools:
                folder = output / f"pool-{pool}"
                run = {"round": round_, **_run_pool(args.config, args.overrides, features, folder, pool)}
                base = next((r for r in reversed(runs) if r["round"] == round_ and r["pool"] == pools[0]), run)
                run["wall_ratio"] = run["wall_utt_per_s"] / base["wall_utt_per_s"]
                if run["steady_utt_per_s"] and base["steady_utt_per_s"]:
                    run["steady_ratio"] = run["steady_utt_per_s"] / base["steady_utt_per_s"]
                runs.append(run)
                if pool != pools[0] and _labels(folder) != _labels(output / f"pool-{pools[0]}"):
                    raise SystemExit(f"pool {pool}: labels differ from pool {pools[0]}")
                print(f"round {round_} {pool:>8}: {run['wall_utt_per_s']:8.1f} utt/s wall ({run['wall_ratio']:.2f}×), "
                      f"{run['steady_utt_per_s'] or 0:8.1f} utt/s steady ({run.get('steady_ratio', 0):.2f}×)",
                      flush=True)
    finally:
        if not connected:
            ray.shutdown()
    medians = {}
    for pool in pools:
        mine = [r for r in runs if r["pool"] == pool]
        steady = [r["steady_ratio"] for r in mine if "steady_ratio" in r]
        medians[pool] = {"wall_ratio": statistics.median(r["wall_ratio"] for r in mine),
                         "steady_ratio": statistics.median(steady) if steady else None}
        print(f"{pool:>8}: median over {len(mine)} round(s): wall {medians[pool]['wall_ratio']:.2f}×, "
              f"steady {medians[pool]['steady_ratio'] or 0:.2f}×")
    result = {"runs": runs, "median_ratios": medians}
    (output / "scaling.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
