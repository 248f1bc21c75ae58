#!/usr/bin/env python
"""Train the FSDD attention encoder-decoder (the CTC model's encoder + a 2-layer transformer
decoder with cross-attention) on the HDF5 features of make_data.py.

    python examples/fsdd/train_aed.py [--data examples/fsdd/data] [--exp examples/fsdd/exp/aed]
        [--init-encoder examples/fsdd/exp/ctc/checkpoint.pt]

The decoder reads ``</s> y1 ... yn`` and predicts ``y1 ... yn </s>`` (cross-entropy with label
smoothing); the encoder starts from the trained CTC model's encoder and CTC head (``--init-encoder
none``: random) and keeps an auxiliary CTC loss (``--ctc-weight``). Writes ``--exp``/checkpoint.pt
(the best dev decoder loss) and ``--exp``/log.jsonl (losses in nats per utterance without
smoothing, dev greedy errors). Stops after ``--epochs`` or ``--max-minutes``. ``--hold-out-speaker``,
``--keep-by`` and the ``--aug-*`` augmentations work as in train_ctc.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch
from fsdd_augment import Augment
from fsdd_common import (
    BLANK,
    DEFAULT_DATA_DIR,
    RECIPE_DIR,
    SENTENCE_END,
    VOCABULARY,
    load_training_data,
    resolve,
)
from fsdd_models import AedModel, AedOptions, load_init_encoder, noam_schedule, prefixed_state
from train_ctc import add_training_options, batches, collate, edit_distance, train_epochs

END = VOCABULARY.index(SENTENCE_END)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="make_data.py's --out")
    p.add_argument("--exp", type=Path, default=RECIPE_DIR / "exp" / "aed", help="output folder")
    p.add_argument("--init-encoder", default=str(RECIPE_DIR / "exp" / "ctc" / "checkpoint.pt"),
                   help="CTC checkpoint whose encoder and CTC head start the model; 'none': random")
    p.add_argument("--ctc-weight", type=float, default=0.3, help="weight of the auxiliary CTC loss")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--max-minutes", type=float, default=None, help="wall-clock limit")
    p.add_argument("--max-train-utterances", type=int, default=None)
    p.add_argument("--max-dev-utterances", type=int, default=None)
    p.add_argument("--batch-frames", type=int, default=20000,
                   help="at most this many padded feature frames per batch")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (Adam)")
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--grad-clip", type=float, default=5.0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    add_training_options(p)
    for f in fields(AedOptions):
        if f.name not in ("encoder", "num_labels", "sentence"):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    args.data, args.exp = resolve(args.data), resolve(args.exp)
    args.augment = Augment.from_args(args)
    return args


def decoder_io(labels: list[np.ndarray], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs ``</s> y1 .. yn`` (B, L) padded with ``</s>``; targets ``y1 .. yn </s>`` padded with -100."""
    length = max(labels[i].shape[0] for i in ids) + 1
    x = torch.full((len(ids), length), END, dtype=torch.long)
    y = torch.full((len(ids), length), -100, dtype=torch.long)
    for row, i in enumerate(ids):
        n = labels[i].shape[0]
        x[row, 1: n + 1] = torch.from_numpy(labels[i])
        y[row, :n] = torch.from_numpy(labels[i])
        y[row, n] = END
    return x, y


@torch.no_grad()
def greedy(model: AedModel, states, lengths, max_labels: int) -> list[list[int]]:
    """Greedy decoding by re-running the decoder on the growing prefixes (fine for ≤ 12 labels)."""
    b = states.shape[0]
    tokens = torch.full((b, 1), END, dtype=torch.long, device=states.device)
    done = torch.zeros(b, dtype=torch.bool, device=states.device)
    for _ in range(max_labels):
        best = model.decoder(tokens, states, lengths)[:, -1].argmax(dim=-1)
        best = torch.where(done, torch.full_like(best, END), best)
        tokens = torch.cat([tokens, best[:, None]], dim=1)
        done |= best == END
        if bool(done.all()):
            break
    return [[int(t) for t in row[1:] if t != END] for row in tokens.cpu().tolist()]


@torch.no_grad()
def evaluate(model, feats, labels, batch_frames, device) -> dict:
    model.eval()
    total_loss, errors, words = 0.0, 0, 0
    for ids in batches([f.shape[0] for f in feats], batch_frames, None):
        x, x_len, _, _ = collate(feats, labels, ids, device)
        states, out_len = model.encoder(x, x_len)
        dec_in, dec_out = (t.to(device) for t in decoder_io(labels, ids))
        log_probs = model.decoder(dec_in, states, out_len)
        total_loss += float(torch.nn.functional.nll_loss(log_probs.flatten(0, 1), dec_out.flatten(),
                                                         ignore_index=-100, reduction="sum"))
        for i, hyp in zip(ids, greedy(model, states, out_len, model.opts.max_positions - 1)):
            errors += edit_distance(labels[i].tolist(), hyp)
            words += labels[i].shape[0]
    model.train()
    return {"dev_loss": total_loss / len(feats), "dev_errors": errors, "dev_words": words,
            "dev_wer": errors / max(words, 1)}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    blank = VOCABULARY.index(BLANK)
    train_feats, train_labels, dev_feats, dev_labels, stats = load_training_data(
        args.data, args.max_train_utterances, args.max_dev_utterances, args.hold_out_speaker)

    init, encoder_opts = load_init_encoder(args.init_encoder, train_feats[0].shape[1], len(VOCABULARY))
    opts = AedOptions(encoder=encoder_opts, num_labels=len(VOCABULARY), sentence=END,
                      **{f.name: getattr(args, f.name) for f in fields(AedOptions)
                         if f.name not in ("encoder", "num_labels", "sentence")})
    model = AedModel(opts, stats["mean"], stats["std"])
    if init:
        model.encoder.load_state_dict(prefixed_state(init["state_dict"], "encoder."))
        model.ctc_head.load_state_dict(prefixed_state(init["state_dict"], "head."))
    model.to(args.device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{len(train_feats)} train / {len(dev_feats)} dev utterances; {num_params} parameters (with the CTC "
          f"head); encoder from {args.init_encoder}; device {args.device}, {torch.get_num_threads()} threads", flush=True)
    if args.augment.active:
        print(f"augmentation: {args.augment}", flush=True)
    aug_rng = np.random.default_rng(args.seed)

    optimiser = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    schedule = noam_schedule(optimiser, args.warmup_steps)
    ctc = torch.nn.CTCLoss(blank=blank, reduction="sum", zero_infinity=True)

    def batch_loss(ids):
        feats = args.augment.batch(train_feats, ids, aug_rng)
        x, x_len, y_flat, y_len = collate(feats, train_labels, ids, args.device)
        states, out_len = model.encoder(x, x_len)
        dec_in, dec_out = (t.to(args.device) for t in decoder_io(train_labels, ids))
        log_probs = model.decoder(dec_in, states, out_len)
        flat_lp, flat_y = log_probs.flatten(0, 1), dec_out.flatten()
        ce = torch.nn.functional.nll_loss(flat_lp, flat_y, ignore_index=-100, reduction="sum")
        valid = flat_y != -100
        smooth = -flat_lp[valid].mean(dim=-1).sum()
        loss = (1 - args.label_smoothing) * ce + args.label_smoothing * smooth
        if args.ctc_weight > 0:
            ctc_lp = model.ctc_head(states).log_softmax(-1)
            loss = (1 - args.ctc_weight) * loss + args.ctc_weight * ctc(ctc_lp.transpose(0, 1), y_flat, out_len, y_len)
        return loss, ce

    train_epochs(args, list(model.parameters()), optimiser, schedule, [f.shape[0] for f in train_feats], batch_loss,
                 lambda: evaluate(model, dev_feats, dev_labels, args.batch_frames, args.device),
                 lambda: {"model": "aed", "options": opts.to_dict(), "state_dict": model.state_dict()},
                 keep_by=args.keep_by)


if __name__ == "__main__":
    sys.exit(main())
