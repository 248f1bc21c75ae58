#!/usr/bin/env python
"""Train the FSDD LSTM language model on ``lm_text.txt`` (sentences of the digit language).

    python examples/fsdd/train_lm.py [--data examples/fsdd/data] [--exp examples/fsdd/exp/lm]

Every sentence is ``</s> w1 ... wn </s>``: the model predicts each word and the final
sentence-end from the words before it, starting from ``</s>`` (the toolkit's sentence-begin for
this vocabulary) and a zero state. Dev perplexity is measured on the reference transcripts of
the dev split (``dev/text``), per predicted label including the final ``</s>``. Writes
``--exp``/checkpoint.pt (the best dev-perplexity model) and ``--exp``/log.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch
from fsdd_common import (
    DEFAULT_DATA_DIR,
    RECIPE_DIR,
    SENTENCE_END,
    VOCABULARY,
    read_text,
    resolve,
)
from fsdd_models import LstmLm, LstmLmOptions

END = VOCABULARY.index(SENTENCE_END)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="make_data.py's --out")
    p.add_argument("--exp", type=Path, default=RECIPE_DIR / "exp" / "lm", help="output folder")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (halved when "
                   "the dev perplexity does not improve)")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    for f in fields(LstmLmOptions):
        if f.name not in ("num_labels", "never_predicted"):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    args.data, args.exp = resolve(args.data), resolve(args.exp)
    return args


def sentences_of(lines) -> list[list[int]]:
    """``</s> w1 ... wn </s>`` label sequences."""
    return [[END, *(VOCABULARY.index(w) for w in words), END] for words in lines]


def batch_tensors(sentences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs (B, L) padded with </s>, targets (B, L) padded with -100 (ignored)."""
    length = max(len(s) for s in sentences) - 1
    x = torch.full((len(sentences), length), END, dtype=torch.long)
    y = torch.full((len(sentences), length), -100, dtype=torch.long)
    for i, s in enumerate(sentences):
        x[i, : len(s) - 1] = torch.tensor(s[:-1])
        y[i, : len(s) - 1] = torch.tensor(s[1:])
    return x, y


def load_sentences(data: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(train sentences of ``lm_text.txt``, dev reference sentences of ``dev/text``)."""
    train = sentences_of(line.split() for line in
                         (data / "lm_text.txt").read_text(encoding="utf-8").splitlines() if line.strip())
    return train, sentences_of(read_text(data / "dev" / "text").values())


def train_epoch(model, optimiser, train: list[list[int]], rng: random.Random, batch_size: int, grad_clip: float,
                before_step=None) -> float:
    """One pass over ``train`` in a shuffled order; ``before_step()`` runs before each update.
    Returns the training perplexity."""
    order = list(range(len(train)))
    rng.shuffle(order)
    total, count = 0.0, 0
    for start in range(0, len(order), batch_size):
        if before_step is not None:
            before_step()
        x, y = batch_tensors([train[i] for i in order[start: start + batch_size]])
        loss = torch.nn.functional.nll_loss(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimiser.step()
        n = int((y != -100).sum())
        total, count = total + loss.item() * n, count + n
    return math.exp(total / count)


@torch.no_grad()
def perplexity(model: LstmLm, sentences: list[list[int]], batch_size: int = 256) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(sentences), batch_size):
        x, y = batch_tensors(sentences[start: start + batch_size])
        log_probs = model(x)
        total += float(torch.nn.functional.nll_loss(log_probs.flatten(0, 1), y.flatten(),
                                                    ignore_index=-100, reduction="sum"))
        count += int((y != -100).sum())
    model.train()
    return math.exp(total / count)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    train, dev = load_sentences(args.data)
    opts = LstmLmOptions(num_labels=len(VOCABULARY), **{f.name: getattr(args, f.name) for f in fields(LstmLmOptions)
                                                        if f.name not in ("num_labels", "never_predicted")})
    model = LstmLm(opts)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{len(train)} train / {len(dev)} dev sentences; {num_params} parameters; "
          f"{torch.get_num_threads()} threads", flush=True)
    optimiser = torch.optim.Adam(model.parameters(), lr=args.lr)
    args.exp.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    best = float("inf")
    with open(args.exp / "log.jsonl", "w", encoding="utf-8") as log:
        for epoch in range(1, args.epochs + 1):
            train_ppl = train_epoch(model, optimiser, train, rng, args.batch_size, args.grad_clip)
            dev_ppl = perplexity(model, dev)
            record = {"epoch": epoch, "minutes": round((time.perf_counter() - started) / 60, 2),
                      "train_ppl": round(train_ppl, 4), "dev_ppl": round(dev_ppl, 4),
                      "lr": optimiser.param_groups[0]["lr"]}
            print(json.dumps(record), flush=True)
            log.write(json.dumps(record) + "\n")
            log.flush()
            if dev_ppl < best:
                best = dev_ppl
                torch.save({"model": "lstm-lm", "options": opts.to_dict(), "state_dict": model.state_dict(),
                            "vocabulary": list(VOCABULARY), "epoch": epoch, "dev_ppl": dev_ppl},
                           args.exp / "checkpoint.pt")
            else:
                for group in optimiser.param_groups:
                    group["lr"] /= 2
    print(f"best dev perplexity {best:.4f}; {(time.perf_counter() - started) / 60:.2f} minutes", flush=True)


if __name__ == "__main__":
    sys.exit(main())
