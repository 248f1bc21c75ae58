#!/usr/bin/env python
"""Train the FSDD transformer language model on ``lm_text.txt`` (sentences of the digit language).

    python examples/fsdd/train_tlm.py [--data examples/fsdd/data] [--exp examples/fsdd/exp/tlm]

A decoder-only, causal, pre-LayerNorm transformer (``TransformerLm`` below: 2 layers, d 128,
4 heads, FF 256, learned positions). Sentences, dev perplexity and checkpoint choice are those
of ``train_lm.py`` (the LSTM LM): every sentence is ``</s> w1 ... wn </s>``, the model predicts
each word and the final sentence-end from the words before it, starting from ``</s>`` at
position 0 with an empty history; dev perplexity is per predicted label of the dev reference
transcripts (``dev/text``), including the final ``</s>``. Adam with a linear warm-up, then (as
train_lm.py) the learning rate halved whenever the dev perplexity does not improve. Writes
``--exp``/checkpoint.pt (the best dev-perplexity model) and ``--exp``/log.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from fsdd_common import DEFAULT_DATA_DIR, RECIPE_DIR, VOCABULARY, resolve
from fsdd_models import _heads
from torch import nn
from train_lm import load_sentences, perplexity, train_epoch

MASKED = -1e9  # attention logit of a masked key


@dataclass(frozen=True, kw_only=True)
class TransformerLmOptions:
    num_labels: int = 12
    model_dim: int = 128
    num_heads: int = 4
    ff_dim: int = 256
    num_layers: int = 2
    #: learned positions; later positions reuse the last one (sentences have <= 12 labels)
    max_positions: int = 32
    dropout: float = 0.1
    #: labels the LM never predicts (CTC/transducer blank): their logit is pushed to -1e4
    never_predicted: tuple[int, ...] = (0,)

    def to_dict(self) -> dict:
        return asdict(self)


class TransformerLmLayer(nn.Module):
    """Pre-LayerNorm causal self-attention + ReLU feed-forward."""

    def __init__(self, opts: TransformerLmOptions):
        super().__init__()
        d = opts.model_dim
        self.heads = opts.num_heads
        self.scale = 1 / math.sqrt(d // opts.num_heads)
        self.attn_norm, self.ff_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.ff = nn.Sequential(nn.Linear(d, opts.ff_dim), nn.ReLU(), nn.Dropout(opts.dropout),
                                nn.Linear(opts.ff_dim, d))
        self.dropout = nn.Dropout(opts.dropout)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Q, D) -> this layer's key, value (B, H, Q, Dh) of the queries' positions."""
        h = self.attn_norm(x)
        return _heads(self.k(h), self.heads), _heads(self.v(h), self.heads)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x (B, Q, D); keys/values (B, H, K, Dh) include the queries' own; valid broadcastable
        to (B, H, Q, K) -> (B, Q, D)."""
        q = _heads(self.q(self.attn_norm(x)), self.heads)
        scores = (q * self.scale) @ keys.transpose(-1, -2)
        weights = torch.where(valid, scores, torch.full_like(scores, MASKED)).softmax(dim=-1)
        att = weights @ values
        att = att.transpose(1, 2).reshape(att.shape[0], att.shape[2], -1)
        x = x + self.dropout(self.out(att))
        return x + self.dropout(self.ff(self.ff_norm(x)))


class TransformerLm(nn.Module):
    """Token embedding + learned positions -> ``num_layers`` causal layers -> LayerNorm ->
    linear -> log-softmax over all labels; the labels in ``never_predicted`` get ≈ -1e4.

    ``forward(tokens (B, L))`` -> log-probs (B, L, V) of the next label after each prefix (the
    first token at position 0). ``step(token (N,), prefix_length (N,), past)`` is one step of the
    RASR step model (the export's graph): ``past`` per layer (key, value) (N, H, T, Dh), of which
    only the last ``prefix_length`` positions are valid (right-aligned); the new token sits at
    position ``prefix_length``."""

    def __init__(self, opts: TransformerLmOptions):
        super().__init__()
        self.opts = opts
        self.embed = nn.Embedding(opts.num_labels, opts.model_dim)
        self.positions = nn.Embedding(opts.max_positions, opts.model_dim)
        self.layers = nn.ModuleList(TransformerLmLayer(opts) for _ in range(opts.num_layers))
        self.norm = nn.LayerNorm(opts.model_dim)
        self.out = nn.Linear(opts.model_dim, opts.num_labels)
        self.dropout = nn.Dropout(opts.dropout)
        mask = torch.zeros(opts.num_labels)
        mask[list(opts.never_predicted)] = -1e4
        self.register_buffer("mask", mask)

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        return (self.out(self.norm(x)) + self.mask).log_softmax(dim=-1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device).clamp(max=self.opts.max_positions - 1)
        x = self.dropout(self.embed(tokens) + self.positions(positions)[None])
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()[None, None]
        for layer in self.layers:
            k, v = layer.kv(x)
            x = layer(x, k, v, causal)
        return self._scores(x)

    def step(self, token: torch.Tensor, prefix_length: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]]):
        """-> log-probs (N, V) and per layer the present (key, value) (N, H, T + 1, Dh) (eval mode)."""
        position = prefix_length.clamp(max=self.opts.max_positions - 1)
        x = (self.embed(token) + self.positions(position))[:, None]  # (N, 1, D)
        num_t1 = past[0][0].shape[2] + 1
        distance = torch.arange(num_t1 - 1, -1, -1, device=token.device)  # T - t for t in 0..T
        valid = (distance[None] <= prefix_length[:, None])[:, None, None]  # (N, 1, 1, T + 1)
        presents = []
        for layer, (past_k, past_v) in zip(self.layers, past):
            k, v = layer.kv(x)
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            presents.append((k, v))
            x = layer(x, k, v, valid)
        return self._scores(x)[:, 0], presents


def learning_rate(args: argparse.Namespace, peak: float, step: int, total_steps: int) -> float:
    """Linear warm-up to ``peak``, then constant (plateau) or cosine decay to 0 at ``total_steps``."""
    if step < args.warmup_steps:
        return peak * step / args.warmup_steps
    if args.schedule == "plateau":
        return peak
    progress = (step - args.warmup_steps) / max(total_steps - args.warmup_steps, 1)
    return peak * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="make_data.py's --out")
    p.add_argument("--exp", type=Path, default=RECIPE_DIR / "exp" / "tlm", help="output folder")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--max-minutes", type=float, default=None, help="stop after the epoch that passes this")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=300, help="linear warm-up to --lr")
    p.add_argument("--schedule", choices=("plateau", "cosine"), default="plateau",
                   help="after the warm-up: (as train_lm.py) the peak halved whenever the dev perplexity "
                   "does not improve, or cosine decay to 0 at the last epoch (overfits here)")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    for f in fields(TransformerLmOptions):
        if f.name not in ("num_labels", "never_predicted"):
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    args.data, args.exp = resolve(args.data), resolve(args.exp)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    train, dev = load_sentences(args.data)
    opts = TransformerLmOptions(num_labels=len(VOCABULARY), **{
        f.name: getattr(args, f.name) for f in fields(TransformerLmOptions)
        if f.name not in ("num_labels", "never_predicted")})
    model = TransformerLm(opts)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{len(train)} train / {len(dev)} dev sentences; {num_params} parameters; "
          f"{torch.get_num_threads()} threads", flush=True)
    optimiser = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    peak = args.lr  # the warm-up's target; halved on a dev plateau
    args.exp.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    best, step = float("inf"), 0
    total_steps = args.epochs * math.ceil(len(train) / args.batch_size)

    def warm_up_or_decay() -> None:
        nonlocal step
        step += 1
        for group in optimiser.param_groups:
            group["lr"] = learning_rate(args, peak, step, total_steps)

    with open(args.exp / "log.jsonl", "w", encoding="utf-8") as log:
        for epoch in range(1, args.epochs + 1):
            train_ppl = train_epoch(model, optimiser, train, rng, args.batch_size, args.grad_clip, warm_up_or_decay)
            dev_ppl = perplexity(model, dev)
            minutes = (time.perf_counter() - started) / 60
            record = {"epoch": epoch, "step": step, "minutes": round(minutes, 2),
                      "train_ppl": round(train_ppl, 4), "dev_ppl": round(dev_ppl, 4),
                      "lr": optimiser.param_groups[0]["lr"]}
            print(json.dumps(record), flush=True)
            log.write(json.dumps(record) + "\n")
            log.flush()
            if dev_ppl < best:
                best = dev_ppl
                torch.save({"model": "transformer-lm", "options": opts.to_dict(), "state_dict": model.state_dict(),
                            "vocabulary": list(VOCABULARY), "epoch": epoch, "dev_ppl": dev_ppl,
                            "num_parameters": num_params}, args.exp / "checkpoint.pt")
            elif args.schedule == "plateau" and step >= args.warmup_steps:
                peak /= 2
            if args.max_minutes is not None and minutes >= args.max_minutes:
                print(f"stopping: {minutes:.1f} minutes >= --max-minutes", flush=True)
                break
    print(f"best dev perplexity {best:.4f}; {(time.perf_counter() - started) / 60:.2f} minutes", flush=True)


if __name__ == "__main__":
    sys.exit(main())
