#!/usr/bin/env python
"""Tuning CTC training on leave-one-speaker-out folds: loso.py's folds and steps with extra
train_ctc.py options, each configuration in its own folder, chosen on the folds' dev figures.

    python examples/fsdd/loso_tune.py train --config NAME --speakers george,jackson \\
        --max-minutes 9 -- --aug-tempo 0.1 --aug-mel-shift 1.5
    python examples/fsdd/loso_tune.py test --config NAME --speakers george,jackson --max-minutes 9 -- ...

``train`` trains one fold after another (``EXP/NAME/<speaker>/ctc``; the fold data of loso.py at
``OUT/<speaker>``, waited for when another run is still building it) and writes
``EXP/NAME/dev.json``: per fold the kept checkpoint's dev greedy WER (the fold's dev split: the
training speakers' held-out recordings) and the mean. It never reads a fold's test split.
``test`` (for the chosen configuration only) exports each fold's checkpoint and decodes its test
split with loso.py's systems, writing ``EXP/NAME/ctc-loso.json`` and ``.md`` as loso.py does.
Options after ``--`` go to train_ctc.py. Reuses loso.py by import; training and export run under
``--torch-python``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import loso
from fsdd_common import DEFAULT_DATA_DIR, RECIPE_DIR, resolve


def parse_args(argv=None) -> argparse.Namespace:
    argv, extra = loso.split_extra(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("stage", choices=("train", "test"))
    p.add_argument("--config", required=True, help="a name for the options after --")
    p.add_argument("--speakers", required=True, help="comma-separated test speakers (folds)")
    p.add_argument("--out", type=Path, default=DEFAULT_DATA_DIR / "loso", help="loso.py's fold data")
    p.add_argument("--exp", type=Path, default=RECIPE_DIR / "exp" / "loso-tune")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--torch-python", default=sys.executable)
    p.add_argument("--wait-minutes", type=float, default=60, help="how long to wait for a fold's data")
    args = p.parse_args(argv)
    args.extra, args.out = extra, resolve(args.out)
    args.exp = resolve(args.exp) / args.config
    return args


def family(args) -> loso.Family:
    """loso.py's CTC family with the configuration's training options added."""
    ctc = loso.FAMILIES["ctc"]
    return dataclasses.replace(ctc, train_args=(*ctc.train_args, *args.extra))


def wait_for_fold(fold: Path, minutes: float) -> None:
    """Returns once ``fold`` has its dev split and statistics (another run may be writing it)."""
    deadline = time.monotonic() + 60 * minutes
    while not ((fold / "stats.npz").is_file() and (fold / "dev" / "text").is_file()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{fold}: no fold data after {minutes} minutes (run loso.py first)")
        print(f"waiting for {fold}", flush=True)
        time.sleep(60)
    time.sleep(5)  # the split files are written before the statistics; let the writer finish


def train(args, speakers: list[str]) -> None:
    fam, results = family(args), {"config": args.config, "train_options": args.extra, "folds": []}
    for speaker in speakers:
        fold, exp = args.out / speaker, args.exp / speaker / "ctc"
        wait_for_fold(fold, args.wait_minutes)
        command = [args.torch_python, str(RECIPE_DIR / fam.train_script), "--data", str(fold), "--exp", str(exp),
                   "--threads", str(args.threads), *fam.train_args]
        if args.max_minutes is not None:
            command += ["--max-minutes", str(args.max_minutes)]
        record = {"speaker": speaker, "train_command": shlex.join(command)}
        if (exp / "checkpoint.pt").is_file():
            record["reused"] = True
        else:
            record["train_seconds"] = round(loso.run(command, exp / "logs" / "train.log"), 1)
        record.update(loso.last_records(exp / "log.jsonl"))
        results["folds"].append(record)
        results["mean_dev_greedy_wer"] = (sum(f["kept_dev_greedy_wer"] for f in results["folds"])
                                          / len(results["folds"]))
        args.exp.mkdir(parents=True, exist_ok=True)
        (args.exp / "dev.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"{args.config} {speaker}: dev greedy WER {100 * record['kept_dev_greedy_wer']:.2f} % "
              f"(epoch {record['kept_epoch']} of {record['epochs_run']})", flush=True)


def test(args, speakers: list[str]) -> None:
    fam = family(args)
    run_args = argparse.Namespace(out=args.out, exp=args.exp, recordings=None, threads=args.threads,
                                  max_minutes=args.max_minutes, torch_python=args.torch_python, reuse=True,
                                  extra=[], decode_only=False)
    settings = shlex.join([fam.train_script, *fam.train_args, "--threads", str(args.threads),
                           *(["--max-minutes", str(args.max_minutes)] if args.max_minutes is not None else [])])
    results = {"family": fam.name, "config": args.config, "train_settings": settings,
               "reduced": args.max_minutes is not None, "folds": []}
    for speaker in speakers:
        if not (args.exp / speaker / "ctc" / "checkpoint.pt").is_file():
            raise SystemExit(f"{speaker}: no checkpoint in {args.exp / speaker / 'ctc'} (run the train stage)")
        results["folds"].append(loso.run_fold(speaker, fam, run_args))
        results["summary"] = loso.summary(results["folds"])
        (args.exp / "ctc-loso.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        (args.exp / "ctc-loso.md").write_text(loso.markdown(results), encoding="utf-8")
    print(loso.markdown(results))


def main(argv=None) -> None:
    args = parse_args(argv)
    speakers = args.speakers.split(",")
    (train if args.stage == "train" else test)(args, speakers)


if __name__ == "__main__":
    main()
