#!/usr/bin/env python
"""Leave-one-speaker-out evaluation of an FSDD model family: per speaker, a fold's data, the
recipe's own training and export, and the toolkit's decoding of the fold's test split.

    python examples/fsdd/loso.py --family ctc [--speakers george,theo] [--threads 1] [--jobs 5] \
        [-- EXTRA TRAINING OPTIONS]

For each speaker NAME (default: every speaker of the recordings):

1. ``make_data.py --test-speaker NAME --out OUT/NAME`` (test spoken only by NAME; train and dev
   by the other speakers; ``--num-lm-sentences 0 --wav-splits ''``: the LMs need no folds and
   decoding reads ``test/feats.h5``; the features are the same either way);
2. the family's training script with the settings of the shipped model (``FAMILIES``), plus
   ``--threads``, the options after ``--`` and, only when given, ``--max-minutes`` (a reduced
   run: recorded in the results and the table's header); the transducer and AED families start
   from the fold's CTC checkpoint under the same ``--exp`` (``EXP/NAME/ctc``: run ``--family
   ctc`` first);
3. its export script;
4. ``python -m gpudecode decode CONFIG --features OUT/NAME/test/feats.h5 --references
   OUT/NAME/test/text -o models.encoder.path=...`` for each system of the family (the shipped
   configs, their models replaced by the fold's), reading the ``wer.json`` it writes.

Writes ``--results`` (JSON: every fold, every system, the commands and times) after each fold and
``--table`` (markdown: every fold, the mean and the worst fold). ``--jobs N`` runs N folds at
once (build the fold data first, or give ``--reuse``, when two runs share ``--out``). Training
and export run under ``--torch-python`` (needs torch; a GPU when there is one), data and decoding
under this interpreter.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fsdd_common import DEFAULT_DATA_DIR, DEFAULT_RECORDINGS, RECIPE_DIR, REPO_ROOT, resolve

CONFIGS = REPO_ROOT / "configs"


@dataclass(frozen=True)
class System:
    """One decoding of a fold's test split: a shipped config and extra ``-o`` overrides."""

    name: str
    config: Path
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """How the recipe trains, exports and decodes one model family. ``train_args`` are the
    settings of the shipped model (examples/fsdd/README.md); ``model_overrides(exp)`` points a
    config at the fold's exported models; ``init_from`` names the family whose fold checkpoint
    starts the encoder (``--init-encoder``)."""

    name: str
    train_script: str
    train_args: tuple[str, ...]
    export_script: str
    export_args: tuple[str, ...]
    systems: tuple[System, ...]
    model_overrides: object = None
    init_from: str | None = None


def _ctc_overrides(exp: Path) -> list[str]:
    return [f"models.encoder.path={exp / 'ctc-encoder.onnx'}"]


def _transducer_overrides(exp: Path) -> list[str]:
    return [f"models.encoder.path={exp / 'transducer-encoder.onnx'}",
            f"models.transducer.prediction={exp / 'transducer-prediction.onnx'}",
            f"models.transducer.joint={exp / 'transducer-joint.onnx'}"]


def _aed_overrides(exp: Path) -> list[str]:
    """The AED configs' encoder and their first scorer, the decoder."""
    return [f"models.encoder.path={exp / 'aed-encoder.onnx'}", f"scorers.0.model={exp / 'aed-decoder.onnx'}"]


FAMILIES: dict[str, Family] = {
    # The CTC recipe: `python examples/fsdd/train_ctc.py` with its defaults (60 epochs, no time
    # cap; the plain recipe, "before"), then export_ctc.py. The shipped model's options come
    # after `--` (examples/fsdd/README.md, "The shipped models").
    "ctc": Family(
        name="ctc", train_script="train_ctc.py", train_args=(),
        export_script="export_ctc.py", export_args=("--output", "{exp}/ctc-encoder.onnx"),
        systems=(System("greedy", CONFIGS / "fsdd-ctc.yaml", ("search.beam_size=1",)),
                 System("beam", CONFIGS / "fsdd-ctc.yaml"),
                 System("beam+LM", CONFIGS / "fsdd-ctc-lm.yaml")),
        model_overrides=_ctc_overrides),
    # The transducer recipe: train_transducer.py --topology one-symbol (30 epochs) from the CTC
    # checkpoint, then export_transducer.py.
    "transducer": Family(
        name="transducer", train_script="train_transducer.py", train_args=(),
        export_script="export_transducer.py", export_args=("--output-dir", "{exp}"),
        systems=(System("greedy", CONFIGS / "fsdd-transducer.yaml", ("search.type=transducer-greedy",)),
                 System("beam", CONFIGS / "fsdd-transducer.yaml"),
                 System("beam+LM", CONFIGS / "fsdd-transducer-lm.yaml")),
        model_overrides=_transducer_overrides, init_from="ctc"),
    # The AED recipe: train_aed.py from the CTC checkpoint (30 epochs), then export_aed.py.
    "aed": Family(
        name="aed", train_script="train_aed.py", train_args=(),
        export_script="export_aed.py", export_args=("--output-dir", "{exp}"),
        systems=(System("greedy", CONFIGS / "fsdd-aed.yaml", ("search.beam_size=1",)),
                 System("beam", CONFIGS / "fsdd-aed.yaml"),
                 System("beam+LM", CONFIGS / "fsdd-aed-lm.yaml"),
                 System("beam+CTC", CONFIGS / "fsdd-aed-ctc.yaml"),
                 System("beam+CTC+LM", CONFIGS / "example.yaml")),
        model_overrides=_aed_overrides, init_from="ctc"),
}


def split_extra(argv=None) -> tuple[list[str], list[str]]:
    """(the arguments before ``--``, the training options after it) of ``argv`` (default: sys.argv)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    return argv[:cut], argv[cut + 1:]


def parse_args(argv=None) -> argparse.Namespace:
    argv, extra = split_extra(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="ctc")
    p.add_argument("--speakers", default=None,
                   help="comma-separated test speakers (default: every speaker of --recordings)")
    p.add_argument("--recordings", type=Path, default=DEFAULT_RECORDINGS)
    p.add_argument("--out", type=Path, default=DEFAULT_DATA_DIR / "loso", help="fold data: OUT/<speaker>")
    p.add_argument("--exp", type=Path, default=RECIPE_DIR / "exp" / "loso",
                   help="models and decodes: EXP/<speaker>/<family>")
    p.add_argument("--results", type=Path, default=None, help="default: EXP/<family>-loso.json")
    p.add_argument("--table", type=Path, default=None, help="default: EXP/<family>-loso.md")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for training")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="training time cap per fold (a reduced run; default: the recipe's settings)")
    p.add_argument("--torch-python", default=sys.executable, help="interpreter with torch")
    p.add_argument("--jobs", type=int, default=1, help="folds run at once")
    p.add_argument("--reuse", action="store_true",
                   help="keep a fold's data, checkpoint or export that already exists")
    p.add_argument("--decode-only", action="store_true",
                   help="only decode: each fold's exported models and training log must be in EXP already")
    p.add_argument("--render-only", action="store_true", help="only rewrite --table from --results")
    args = p.parse_args(argv)
    args.extra = extra
    args.recordings, args.out, args.exp = resolve(args.recordings), resolve(args.out), resolve(args.exp)
    args.results = resolve(args.results) if args.results else args.exp / f"{args.family}-loso.json"
    args.table = resolve(args.table) if args.table else args.exp / f"{args.family}-loso.md"
    return args


def speakers_of(recordings: Path) -> list[str]:
    """Speakers named by ``{digit}_{speaker}_{index}.wav`` files, sorted."""
    return sorted({path.name.split("_")[1] for path in recordings.glob("*_*_*.wav")})


def run(command: list[str], log: Path, env: dict | None = None) -> float:
    """Runs ``command`` (stdout and stderr to ``log``); its wall seconds. Raises on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print("+", shlex.join(command), flush=True)
    started = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if code:
        raise SystemExit(f"exit status {code}: {shlex.join(command)} (log: {log})")
    return time.perf_counter() - started


def last_records(log_jsonl: Path) -> dict:
    """The training log's summary: epochs run, minutes, and the kept checkpoint's epoch record (the
    last dev record marked ``kept``; a log without the marks: the best dev-loss epoch)."""
    epochs = [r for r in map(json.loads, log_jsonl.read_text().splitlines()) if "dev_loss" in r]
    marked = [r for r in epochs if r.get("kept")]
    best = marked[-1] if marked else min(epochs, key=lambda r: r["dev_loss"])
    return {"epochs_run": epochs[-1]["epoch"], "train_minutes_logged": epochs[-1]["minutes"],
            "kept_epoch": best["epoch"], "kept_dev_loss": best["dev_loss"],
            "kept_dev_greedy_wer": best.get("dev_wer")}


def decode(system: System, family: Family, fold: Path, exp: Path, log_dir: Path) -> dict:
    """Decodes the fold's test split with one system; the toolkit's wer.json plus seconds."""
    output = exp / "decode" / system.name.replace("+", "-")
    overrides = [*family.model_overrides(exp), *system.overrides]
    command = [sys.executable, "-m", "gpudecode", "decode", str(system.config),
               "--features", str(fold / "test" / "feats.h5"), "--references", str(fold / "test" / "text"),
               "--output", str(output)]
    for item in overrides:
        command += ["-o", item]
    seconds = run(command, log_dir / f"decode-{system.name.replace('+', '-')}.log")
    wer = json.loads((output / "wer.json").read_text(encoding="utf-8"))
    errors = wer["substitutions"] + wer["deletions"] + wer["insertions"]
    return {"system": system.name, "config": str(system.config.relative_to(REPO_ROOT)),
            "overrides": overrides, "errors": errors, "wer": wer["wer"], "words": wer["num_ref_words"],
            "utterances": wer["num_utterances"], "sub": wer["substitutions"], "del": wer["deletions"],
            "ins": wer["insertions"], "decode_seconds": round(seconds, 1)}


def run_fold(speaker: str, family: Family, args) -> dict:
    """Data, training, export and decoding of one fold; its record."""
    fold, exp = args.out / speaker, args.exp / speaker / family.name
    record: dict = {"speaker": speaker, "data": str(fold), "exp": str(exp)}
    recipe = str(RECIPE_DIR)
    if not ((args.reuse or args.decode_only) and (fold / "test" / "text").is_file()
            and (fold / "stats.npz").is_file()):
        record["data_seconds"] = round(run(
            [sys.executable, f"{recipe}/make_data.py", "--recordings", str(args.recordings),
             "--test-speaker", speaker, "--out", str(fold), "--num-lm-sentences", "0", "--wav-splits", ""],
            exp / "logs" / "make_data.log"), 1)
    if not args.decode_only:
        train = [args.torch_python, f"{recipe}/{family.train_script}", "--data", str(fold), "--exp", str(exp),
                 "--threads", str(args.threads), *family.train_args, *args.extra]
        if family.init_from:
            init = args.exp / speaker / family.init_from / "checkpoint.pt"
            if not init.is_file():
                raise SystemExit(f"{speaker}: no {family.init_from} checkpoint at {init} (run --family "
                                 f"{family.init_from} with the same --exp first)")
            train += ["--init-encoder", str(init)]
        if args.max_minutes is not None:
            train += ["--max-minutes", str(args.max_minutes)]
        record["train_command"] = shlex.join(train)
        if not (args.reuse and (exp / "checkpoint.pt").is_file()):
            record["train_seconds"] = round(run(train, exp / "logs" / "train.log"), 1)
        export = [args.torch_python, f"{recipe}/{family.export_script}", "--checkpoint", str(exp / "checkpoint.pt"),
                  "--data", str(fold), *(a.format(exp=exp) for a in family.export_args)]
        record["export_seconds"] = round(run(export, exp / "logs" / "export.log"), 1)
    record.update(last_records(exp / "log.jsonl"))
    record["systems"] = [decode(s, family, fold, exp, exp / "logs") for s in family.systems]
    return record


def summary(folds: list[dict]) -> dict:
    """Per system: the mean of the fold WERs and errors, and the worst fold (highest WER)."""
    out = {}
    for i, system in enumerate(s["system"] for s in folds[0]["systems"]):
        rows = [f["systems"][i] for f in folds]
        worst = max(range(len(folds)), key=lambda k: rows[k]["wer"])
        out[system] = {"mean_wer": sum(r["wer"] for r in rows) / len(rows),
                       **{f"mean_{k}": sum(r[k] for r in rows) / len(rows) for k in ("errors", "sub", "del", "ins")},
                       "worst_speaker": folds[worst]["speaker"], "worst_wer": rows[worst]["wer"],
                       "worst_errors": rows[worst]["errors"]}
    return out


def cell(wer: float, errors: float, sub: float, dele: float, ins: float, digits: int = 0) -> str:
    f = f"{{:.{digits}f}}"
    return f"{100 * wer:.2f} % · {f.format(errors)} ({f.format(sub)} / {f.format(dele)} / {f.format(ins)})"


def markdown(results: dict) -> str:
    """Every fold, the mean and the worst fold: WER · errors (sub / del / ins) per system."""
    folds = results["folds"]
    systems = [s["system"] for s in folds[0]["systems"]]
    lines = [f"Family `{results['family']}`; training: `{results['train_settings']}`.", "",
             "| test speaker | words | " + " | ".join(systems)
             + " | train min (epochs, kept) | kept dev greedy WER |",
             "|---|---:|" + "---:|" * len(systems) + "---:|---:|"]
    for f in folds:
        cells = [cell(s["wer"], s["errors"], s["sub"], s["del"], s["ins"]) for s in f["systems"]]
        lines.append(f"| {f['speaker']} | {f['systems'][0]['words']} | " + " | ".join(cells)
                     + f" | {f['train_minutes_logged']:.1f} ({f['epochs_run']}, {f['kept_epoch']})"
                     + f" | {100 * f['kept_dev_greedy_wer']:.2f} % |")
    mean = results["summary"]
    lines.append("| **mean** | | " + " | ".join(
        cell(mean[s]["mean_wer"], mean[s]["mean_errors"], mean[s]["mean_sub"], mean[s]["mean_del"],
             mean[s]["mean_ins"], 1) for s in systems) + " | | |")
    lines.append("| **worst** | | " + " | ".join(
        f"{100 * mean[s]['worst_wer']:.2f} % · {mean[s]['worst_errors']} ({mean[s]['worst_speaker']})"
        for s in systems) + " | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    family = FAMILIES[args.family]
    if args.render_only:
        args.table.write_text(markdown(json.loads(args.results.read_text(encoding="utf-8"))), encoding="utf-8")
        print(args.table.read_text(encoding="utf-8"))
        return
    all_speakers = speakers_of(args.recordings)
    speakers = args.speakers.split(",") if args.speakers else all_speakers
    unknown = set(speakers) - set(all_speakers)
    if unknown:
        raise SystemExit(f"--speakers: {sorted(unknown)} not among {all_speakers}")
    settings = shlex.join([family.train_script, *family.train_args, *args.extra, "--threads", str(args.threads),
                           *(["--max-minutes", str(args.max_minutes)] if args.max_minutes is not None else [])])
    results = {"family": family.name, "train_settings": settings, "reduced": args.max_minutes is not None,
               "folds": []}
    started = time.perf_counter()

    def fold(speaker: str) -> dict:
        fold_started = time.perf_counter()
        record = run_fold(speaker, family, args)
        record["fold_seconds"] = round(time.perf_counter() - fold_started, 1)
        return record

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for record in pool.map(fold, speakers):
            results["folds"].append(record)
            results["summary"] = summary(results["folds"])
            results["total_seconds"] = round(time.perf_counter() - started, 1)
            args.results.parent.mkdir(parents=True, exist_ok=True)
            args.results.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
            args.table.write_text(markdown(results), encoding="utf-8")
            print(markdown(results), flush=True)
    print(f"wrote {args.results} and {args.table}")


if __name__ == "__main__":
    main()
