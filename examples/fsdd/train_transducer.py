#!/usr/bin/env python
"""Train the FSDD transducer (the CTC model's encoder + LSTM prediction network + joint network)
on the HDF5 features of make_data.py, with a pure-PyTorch RNN-T loss.

    python examples/fsdd/train_transducer.py [--data examples/fsdd/data]
        [--exp examples/fsdd/exp/transducer] [--init-encoder examples/fsdd/exp/ctc/checkpoint.pt]

With ``--topology one-symbol`` (the default) every frame emits exactly one label or blank
(decode with ``max_symbols_per_frame: 1``); ``standard`` is Graves' topology. The encoder starts
from the trained CTC model's encoder (CTC pre-training; ``--init-encoder none`` trains from
scratch) and keeps an auxiliary CTC loss (``--ctc-weight``) through the CTC head, which is not
exported. Writes ``--exp``/checkpoint.pt (the best dev transducer loss) and ``--exp``/log.jsonl
(train loss, dev loss in nats per utterance, dev greedy errors). Stops after
``--epochs`` or ``--max-minutes``, whichever comes first. ``--hold-out-speaker``, ``--keep-by`` and
the ``--aug-*`` augmentations work as in train_ctc.py.
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
    VOCABULARY,
    load_training_data,
    resolve,
)
from fsdd_models import (
    TransducerModel,
    TransducerOptions,
    load_init_encoder,
    noam_schedule,
    one_symbol_rnnt_loss,
    prefixed_state,
    rnnt_loss,
)
from train_ctc import add_training_options, batches, collate, edit_distance, train_epochs

#: loss and greedy decoding's labels per frame of each topology
TOPOLOGIES = {"one-symbol": (one_symbol_rnnt_loss, 1), "standard": (rnnt_loss, 3)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="make_data.py's --out")
    p.add_argument("--exp", type=Path, default=RECIPE_DIR / "exp" / "transducer", help="output folder")
    p.add_argument("--init-encoder", default=str(RECIPE_DIR / "exp" / "ctc" / "checkpoint.pt"),
                   help="CTC checkpoint whose encoder (and CTC head) start the model; 'none': random")
    p.add_argument("--ctc-weight", type=float, default=0.3, help="weight of the auxiliary CTC loss")
    p.add_argument("--topology", choices=TOPOLOGIES, default="one-symbol",
                   help="one-symbol: each frame emits one label or blank (decode with max_symbols_per_frame 1); "
                        "standard: any number of labels per frame, each frame ends with blank")
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
    for f in fields(TransducerOptions):
        if f.name not in ("encoder", "num_labels", "blank"):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    args.data, args.exp = resolve(args.data), resolve(args.exp)
    args.augment = Augment.from_args(args)
    return args


def padded_labels(labels: list[np.ndarray], ids: list[int]) -> torch.Tensor:
    u = max(max(labels[i].shape[0] for i in ids), 1)
    y = torch.zeros(len(ids), u, dtype=torch.long)
    for row, i in enumerate(ids):
        y[row, : labels[i].shape[0]] = torch.from_numpy(labels[i])
    return y


@torch.no_grad()
def greedy(model: TransducerModel, states: torch.Tensor, lengths: torch.Tensor, blank: int,
           max_symbols_per_frame: int = 3) -> list[list[int]]:
    """Batched greedy decoding: per frame up to ``max_symbols_per_frame`` labels, then the next
    frame (as the toolkit's transducer-greedy search)."""
    b = states.shape[0]
    pred = model.prediction
    hid, layers = pred.opts.pred_hidden_dim, pred.opts.pred_num_layers
    hs = [states.new_zeros(b, hid) for _ in range(layers)]
    cs = [states.new_zeros(b, hid) for _ in range(layers)]
    out, hs, cs = pred.step(torch.full((b,), blank, dtype=torch.long, device=states.device), hs, cs)
    hyps: list[list[int]] = [[] for _ in range(b)]
    for t in range(states.shape[1]):
        active = t < lengths
        for _ in range(max_symbols_per_frame):
            best = model.joint(states[:, t], out).argmax(dim=-1)
            emit = active & (best != blank)
            if not bool(emit.any()):
                break
            for i in torch.nonzero(emit).flatten().tolist():
                hyps[i].append(int(best[i]))
            new_out, new_hs, new_cs = pred.step(best, hs, cs)
            keep = emit[:, None]
            out = torch.where(keep, new_out, out)
            hs = [torch.where(keep, n, o) for n, o in zip(new_hs, hs)]
            cs = [torch.where(keep, n, o) for n, o in zip(new_cs, cs)]
            active = emit
    return hyps


@torch.no_grad()
def evaluate(model, feats, labels, batch_frames, blank, topology: str, device) -> dict:
    loss_fn, max_symbols = TOPOLOGIES[topology]
    model.eval()
    total_loss, errors, words = 0.0, 0, 0
    for ids in batches([f.shape[0] for f in feats], batch_frames, None):
        x, x_len, _, y_len = collate(feats, labels, ids, device)
        y = padded_labels(labels, ids).to(device)
        states, out_len = model.encoder(x, x_len)
        log_probs = model.joint.grid(states, model.prediction(y))
        total_loss += float(loss_fn(log_probs, y, out_len, y_len, blank).sum())
        for i, hyp in zip(ids, greedy(model, states, out_len, blank, max_symbols)):
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
    opts = TransducerOptions(encoder=encoder_opts, num_labels=len(VOCABULARY), blank=blank,
                             **{f.name: getattr(args, f.name) for f in fields(TransducerOptions)
                                if f.name not in ("encoder", "num_labels", "blank")})
    model = TransducerModel(opts, stats["mean"], stats["std"])
    ctc_head = torch.nn.Linear(encoder_opts["model_dim"], len(VOCABULARY))
    if init:
        model.encoder.load_state_dict(prefixed_state(init["state_dict"], "encoder."))
        ctc_head.load_state_dict(prefixed_state(init["state_dict"], "head."))
    model.to(args.device)
    ctc_head.to(args.device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{len(train_feats)} train / {len(dev_feats)} dev utterances; {num_params} parameters (without the "
          f"CTC head); encoder from {args.init_encoder}; device {args.device}, {torch.get_num_threads()} threads",
          flush=True)
    if args.augment.active:
        print(f"augmentation: {args.augment}", flush=True)
    aug_rng = np.random.default_rng(args.seed)

    params = list(model.parameters()) + list(ctc_head.parameters())
    optimiser = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.98))
    schedule = noam_schedule(optimiser, args.warmup_steps)
    ctc = torch.nn.CTCLoss(blank=blank, reduction="sum", zero_infinity=True)
    loss_fn = TOPOLOGIES[args.topology][0]

    def batch_loss(ids):
        feats = args.augment.batch(train_feats, ids, aug_rng)
        x, x_len, y_flat, y_len = collate(feats, train_labels, ids, args.device)
        y = padded_labels(train_labels, ids).to(args.device)
        states, out_len = model.encoder(x, x_len)
        log_probs = model.joint.grid(states, model.prediction(y))
        loss = loss_fn(log_probs, y, out_len, y_len, blank).sum()
        total = loss
        if args.ctc_weight > 0:
            ctc_lp = ctc_head(states).log_softmax(-1)
            total = (1 - args.ctc_weight) * loss + args.ctc_weight * ctc(ctc_lp.transpose(0, 1), y_flat, out_len, y_len)
        return total, loss

    train_epochs(args, params, optimiser, schedule, [f.shape[0] for f in train_feats], batch_loss,
                 lambda: evaluate(model, dev_feats, dev_labels, args.batch_frames, blank, args.topology,
                                  args.device),
                 lambda: {"model": "transducer", "options": opts.to_dict(), "state_dict": model.state_dict(),
                          "topology": args.topology},
                 evaluate_first=True, keep_by=args.keep_by)


if __name__ == "__main__":
    sys.exit(main())
