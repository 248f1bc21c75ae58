#!/usr/bin/env python
"""Train the FSDD CTC model (conv 4x subsampling + transformer encoder + CTC head) on the
HDF5 features of make_data.py.

    python examples/fsdd/train_ctc.py [--data examples/fsdd/data] [--exp examples/fsdd/exp/ctc]

Writes ``--exp``/checkpoint.pt (the best dev-loss model, or with ``--keep-by dev-wer`` the lowest
dev greedy WER: weights, options, vocabulary, front end) and ``--exp``/log.jsonl (one record per logged step and per epoch: train loss, dev loss,
dev greedy WER). Losses are CTC negative log-likelihoods in nats per utterance. Stops after
``--epochs`` or ``--max-minutes``, whichever comes first.

Optional augmentations of the training features (all off by default; ``Augment``): tempo
(``--aug-tempo``), a mel-axis shift standing in for vocal-tract length (``--aug-mel-shift``), gain
(``--aug-gain``) and feature noise (``--aug-noise``); stronger SpecAugment through the
``--num-*-masks`` / ``--*-mask-width`` options, per-utterance mean normalisation inside the model
through ``--utterance-mean`` (exported with the model; the front end stays ``normalisation: none``).

``--hold-out-speaker NAME`` (a dev speaker the model never heard): training drops NAME's
utterances, the dev set (checkpoint choice, dev WER) is NAME's utterances of the train split, and
the normalisation statistics come from the kept training features instead of stats.npz.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch
from fsdd_common import (
    BLANK,
    DEFAULT_DATA_DIR,
    RECIPE_DIR,
    VOCABULARY,
    load_training_data,
    resolve,
)
import fsdd_augment
from fsdd_augment import Augment
from fsdd_models import CtcModel, EncoderOptions, noam_schedule


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="make_data.py's --out")
    p.add_argument("--exp", type=Path, default=RECIPE_DIR / "exp" / "ctc", help="output folder")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--max-minutes", type=float, default=None, help="wall-clock limit")
    p.add_argument("--max-train-utterances", type=int, default=None,
                   help="use only the first N training utterances (smoke runs)")
    p.add_argument("--max-dev-utterances", type=int, default=None)
    p.add_argument("--batch-frames", type=int, default=20000,
                   help="at most this many padded feature frames per batch")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (Adam)")
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--grad-clip", type=float, default=5.0)
    p.add_argument("--log-every", type=int, default=10, help="steps between train-loss logs")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_training_options(p)
    for f in fields(EncoderOptions):
        if f.name not in ("num_features", "num_labels"):
            name = f"--{f.name.replace('_', '-')}"
            if isinstance(f.default, bool):
                p.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default)
            else:
                p.add_argument(name, type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    args.data, args.exp = resolve(args.data), resolve(args.exp)
    args.augment = Augment.from_args(args)
    return args


def add_training_options(p: argparse.ArgumentParser) -> None:
    """What every FSDD trainer takes: --device, --keep-by, --hold-out-speaker and the ``--aug-*``
    perturbations (``args.augment = Augment.from_args(args)`` after parsing)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--keep-by", choices=sorted(KEEP_BY), default="dev-loss",
                   help="the dev figure that picks the kept checkpoint (lower is better; the earlier on ties)")
    p.add_argument("--hold-out-speaker", default=None, metavar="NAME",
                   help="train without NAME's utterances and use them (from the train split) as the "
                        "dev set, in place of the dev split: a speaker the model never heard")
    fsdd_augment.add_arguments(p)


def batches(lengths: list[int], batch_frames: int, rng: random.Random | None) -> list[list[int]]:
    """Utterance indices in batches of similar length with at most ``batch_frames`` padded
    frames each; shuffled (batch order) when ``rng`` is given."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, current = [], []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > batch_frames:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    if rng is not None:
        rng.shuffle(out)
    return out


def collate(feats: list[np.ndarray], labels: list[np.ndarray], ids: list[int], device):
    lengths = torch.tensor([feats[i].shape[0] for i in ids])
    x = torch.zeros(len(ids), int(lengths.max()), feats[ids[0]].shape[1])
    for row, i in enumerate(ids):
        x[row, : feats[i].shape[0]] = torch.from_numpy(feats[i])
    y = torch.from_numpy(np.concatenate([labels[i] for i in ids]))
    y_lengths = torch.tensor([labels[i].shape[0] for i in ids])
    return x.to(device), lengths.to(device), y.to(device), y_lengths.to(device)


def edit_distance(ref: list[int], hyp: list[int]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, start=1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def greedy(log_probs: torch.Tensor, lengths: torch.Tensor, blank: int) -> list[list[int]]:
    best = log_probs.argmax(dim=-1).cpu().numpy()
    out = []
    for row, n in zip(best, lengths.cpu().numpy()):
        seq = row[:n]
        keep = np.ones(n, dtype=bool)
        keep[1:] = seq[1:] != seq[:-1]
        out.append([int(s) for s in seq[keep] if s != blank])
    return out


@torch.no_grad()
def evaluate(model, feats, labels, batch_frames, device, blank) -> dict:
    model.eval()
    ctc = torch.nn.CTCLoss(blank=blank, reduction="sum", zero_infinity=True)
    total_loss, errors, words = 0.0, 0, 0
    for ids in batches([f.shape[0] for f in feats], batch_frames, None):
        x, x_len, y, y_len = collate(feats, labels, ids, device)
        log_probs, out_len = model(x, x_len)
        total_loss += float(ctc(log_probs.transpose(0, 1), y, out_len, y_len))
        for i, hyp in zip(ids, greedy(log_probs, out_len, blank)):
            errors += edit_distance(labels[i].tolist(), hyp)
            words += labels[i].shape[0]
    model.train()
    return {"dev_loss": total_loss / len(feats), "dev_errors": errors, "dev_words": words,
            "dev_wer": errors / max(words, 1)}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    vocab = (args.data / "vocab.txt").read_text(encoding="utf-8").split()
    if tuple(vocab) != VOCABULARY:
        raise SystemExit(f"{args.data / 'vocab.txt'}: {vocab}; expected {list(VOCABULARY)}")
    blank = VOCABULARY.index(BLANK)
    train_feats, train_labels, dev_feats, dev_labels, stats = load_training_data(
        args.data, args.max_train_utterances, args.max_dev_utterances, args.hold_out_speaker)
    if args.hold_out_speaker:
        print(f"held-out dev speaker {args.hold_out_speaker}: {len(dev_feats)} of its train-split "
              f"utterances as dev, {len(train_feats)} other utterances trained on; normalisation "
              f"stats from those", flush=True)
    opts = EncoderOptions(num_features=train_feats[0].shape[1], num_labels=len(VOCABULARY),
                          **{f.name: getattr(args, f.name) for f in fields(EncoderOptions)
                             if f.name not in ("num_features", "num_labels")})
    model = CtcModel(opts, stats["mean"], stats["std"]).to(args.device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{len(train_feats)} train / {len(dev_feats)} dev utterances; {num_params} parameters; "
          f"device {args.device}, {torch.get_num_threads()} threads", flush=True)
    if args.augment.active:
        print(f"augmentation: {args.augment}", flush=True)

    optimiser = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    schedule = noam_schedule(optimiser, args.warmup_steps)
    ctc = torch.nn.CTCLoss(blank=blank, reduction="sum", zero_infinity=True)

    aug_rng = np.random.default_rng(args.seed)

    def batch_loss(ids):
        feats = args.augment.batch(train_feats, ids, aug_rng)
        x, x_len, y, y_len = collate(feats, train_labels, ids, args.device)
        log_probs, out_len = model(x, x_len)
        loss = ctc(log_probs.transpose(0, 1), y, out_len, y_len)
        return loss, loss

    train_epochs(args, list(model.parameters()), optimiser, schedule, [f.shape[0] for f in train_feats], batch_loss,
                 lambda: evaluate(model, dev_feats, dev_labels, args.batch_frames, args.device, blank),
                 lambda: {"model": "ctc", "options": opts.to_dict(), "state_dict": model.state_dict()},
                 keep_by=args.keep_by)


#: ``--keep-by``: the dev record's figure that picks the kept checkpoint
KEEP_BY = {"dev-loss": "dev_loss", "dev-wer": "dev_wer"}


def train_epochs(args, params, optimiser, schedule, train_lengths, batch_loss, evaluate_dev, checkpoint, *,
                 evaluate_first: bool = False, keep_by: str = "dev-loss") -> None:
    """The epoch loop of the FSDD trainers: batches of ``--batch-frames`` frames, one optimiser
    step each (``batch_loss(ids)`` -> (loss to minimise, loss to log), both summed over the
    batch; gradients of ``params`` clipped to ``--grad-clip``), a train-loss record every
    ``--log-every`` steps, a dev record (``evaluate_dev()``) per epoch (and before the first
    with ``evaluate_first``), ``--exp``/checkpoint.pt (``checkpoint()`` + vocabulary, front end,
    epoch, step and the dev figures) at each new lowest dev figure of ``keep_by`` (:data:`KEEP_BY`:
    the dev loss, or the dev greedy WER; the dev record says ``kept``), and ``--max-minutes``.
    Records go to stdout and ``--exp``/log.jsonl."""
    args.exp.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    kept_figure = KEEP_BY[keep_by]
    best_kept, step, out_of_time = float("inf"), 0, False
    with open(args.exp / "log.jsonl", "w", encoding="utf-8") as log:

        def write(record):
            print(json.dumps(record), flush=True)
            log.write(json.dumps(record) + "\n")

        def dev_record(epoch, kept_if_best: bool = True):
            """The dev figures of ``epoch``, logged with ``kept``: whether this epoch's checkpoint is
            the one kept now (a new lowest figure of ``keep_by``)."""
            nonlocal best_kept
            result = evaluate_dev()
            kept = kept_if_best and result[kept_figure] < best_kept
            if kept:
                best_kept = result[kept_figure]
            write({"epoch": epoch, "step": step, "minutes": round((time.perf_counter() - started) / 60, 2),
                   **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}, "kept": kept})
            return result, kept

        if evaluate_first:
            dev_record(0, kept_if_best=False)
        for epoch in range(1, args.epochs + 1):
            window_loss, window_utts = 0.0, 0
            for ids in batches(train_lengths, args.batch_frames, rng):
                loss, logged = batch_loss(ids)
                optimiser.zero_grad()
                (loss / len(ids)).backward()
                torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
                optimiser.step()
                schedule.step()
                step += 1
                window_loss, window_utts = window_loss + logged.item(), window_utts + len(ids)
                minutes = (time.perf_counter() - started) / 60
                if step % args.log_every == 0:
                    write({"step": step, "epoch": epoch, "minutes": round(minutes, 2),
                           "train_loss": round(window_loss / window_utts, 3), "lr": schedule.get_last_lr()[0]})
                    window_loss, window_utts = 0.0, 0
                if args.max_minutes is not None and minutes >= args.max_minutes:
                    out_of_time = True
                    break
            result, kept = dev_record(epoch)
            log.flush()
            if kept:
                torch.save({**checkpoint(), "vocabulary": list(VOCABULARY),
                            "front_end": json.loads((args.data / "front_end.json").read_text()),
                            "epoch": epoch, "step": step, **result}, args.exp / "checkpoint.pt")
            if out_of_time:
                print(f"stopped after {args.max_minutes} minutes", flush=True)
                break


if __name__ == "__main__":
    sys.exit(main())
