"""PyTorch models of the FSDD recipe (training code only; the library never imports it).

Shapes: ``B`` utterances, ``T`` feature frames, ``F`` features, ``T'`` encoder frames
(``T' = ((T - 1) // 2 - 1) // 2``, 4x subsampling), ``D`` model width, ``V`` labels.

The encoder takes raw log-mel features (the front end's ``normalisation: none``) and holds the
training features' mean and std as buffers, so an exported model needs no statistics file.
Padded frames never change the output of real frames (attention masks padded keys; the
convolutions see only real frames for real outputs), so batch composition does not change
results.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class EncoderOptions:
    num_features: int = 40
    num_labels: int = 12
    model_dim: int = 128
    num_heads: int = 4
    ff_dim: int = 256
    num_layers: int = 3
    conv_channels: int = 64
    dropout: float = 0.1
    # SpecAugment while training: masks per utterance and their maximum widths.
    num_freq_masks: int = 2
    freq_mask_width: int = 5
    num_time_masks: int = 2
    time_mask_width: int = 20

    def to_dict(self) -> dict:
        return asdict(self)


def subsampled_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after the two stride-2, kernel-3 convolutions without padding."""
    return torch.div(torch.div(lengths - 1, 2, rounding_mode="floor") - 1, 2,
                     rounding_mode="floor")


def sinusoidal_positions(num_frames: int | torch.Tensor, dim: int,
                         device: torch.device) -> torch.Tensor:
    """``(T', D)`` sinusoidal position encodings, computed for a dynamic length."""
    position = torch.arange(num_frames, device=device, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32)
                         * (-math.log(10000.0) / dim))
    angles = position * inv_freq[None, :]
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """``x`` (B, T', D), ``key_mask`` (B, T') bool, True for real frames -> (B, T', D)."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (B, H, T', T')
        scores = scores.masked_fill(~key_mask[:, None, None, :], -1e4)
        weights = self.dropout(scores.softmax(dim=-1))
        return self.out((weights @ v).transpose(1, 2).reshape(b, t, -1))


class EncoderLayer(nn.Module):
    """Pre-LayerNorm transformer layer."""

    def __init__(self, opts: EncoderOptions):
        super().__init__()
        d = opts.model_dim
        self.norm_attn, self.norm_ff = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(d, opts.num_heads, opts.dropout)
        self.ff = nn.Sequential(nn.Linear(d, opts.ff_dim), nn.ReLU(), nn.Dropout(opts.dropout),
                                nn.Linear(opts.ff_dim, d))
        self.dropout = nn.Dropout(opts.dropout)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.norm_attn(x), key_mask))
        return x + self.dropout(self.ff(self.norm_ff(x)))


class Encoder(nn.Module):
    """Raw log-mel features -> encoder states: normalise, conv 4x subsampling, transformer."""

    def __init__(self, opts: EncoderOptions, mean=None, std=None):
        super().__init__()
        self.opts = opts
        f = opts.num_features
        self.register_buffer("mean", torch.zeros(f) if mean is None
                             else torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.ones(f) if std is None
                             else torch.as_tensor(std, dtype=torch.float32))
        c = opts.conv_channels
        self.conv = nn.Sequential(nn.Conv2d(1, c, 3, stride=2), nn.ReLU(),
                                  nn.Conv2d(c, c, 3, stride=2), nn.ReLU())
        sub_f = ((f - 1) // 2 - 1) // 2
        self.project = nn.Linear(c * sub_f, opts.model_dim)
        self.dropout = nn.Dropout(opts.dropout)
        self.layers = nn.ModuleList(EncoderLayer(opts) for _ in range(opts.num_layers))
        self.norm = nn.LayerNorm(opts.model_dim)

    def spec_augment(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Zero random frequency bands and time spans of normalised features ``(B, T, F)``."""
        o = self.opts
        b, t, f = x.shape
        keep = torch.ones_like(x, dtype=torch.bool)
        freq = torch.arange(f, device=x.device)
        frames = torch.arange(t, device=x.device)
        for _ in range(o.num_freq_masks):
            width = torch.randint(0, o.freq_mask_width + 1, (b, 1), device=x.device)
            start = (torch.rand(b, 1, device=x.device) * (f - width)).long()
            keep &= ~((freq >= start) & (freq < start + width))[:, None, :]
        for _ in range(o.num_time_masks):
            width = torch.randint(0, o.time_mask_width + 1, (b, 1), device=x.device)
            width = torch.minimum(width, lengths[:, None] // 5)
            start = (torch.rand(b, 1, device=x.device) * (lengths[:, None] - width)).long()
            keep &= ((frames < start) | (frames >= start + width))[:, :, None]
        return x * keep

    def forward(self, features: torch.Tensor, lengths: torch.Tensor):
        """``features`` (B, T, F) float, ``lengths`` (B,) int -> states (B, T', D), (B,) int."""
        x = (features - self.mean) / self.std
        if self.training:
            x = self.spec_augment(x, lengths)
        x = self.conv(x.unsqueeze(1))  # (B, C, T', F')
        b, c, t, f = x.shape
        x = self.project(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        x = x * math.sqrt(self.opts.model_dim) + sinusoidal_positions(t, self.opts.model_dim,
                                                                      x.device)
        x = self.dropout(x)
        out_lengths = subsampled_lengths(lengths)
        key_mask = torch.arange(t, device=x.device)[None, :] < out_lengths[:, None]
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.norm(x), out_lengths


class CtcModel(nn.Module):
    """Encoder + linear CTC head. ``forward`` -> log-probs (B, T', V), lengths (B,)."""

    def __init__(self, opts: EncoderOptions, mean=None, std=None):
        super().__init__()
        self.encoder = Encoder(opts, mean, std)
        self.head = nn.Linear(opts.model_dim, opts.num_labels)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor):
        states, out_lengths = self.encoder(features, lengths)
        return self.head(states).log_softmax(dim=-1), out_lengths


# --- LSTM language model ------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LstmLmOptions:
    num_labels: int = 12
    embed_dim: int = 64
    hidden_dim: int = 128
    num_layers: int = 2
    dropout: float = 0.2
    #: labels the LM never predicts (CTC/transducer blank): their logit is pushed to -1e4
    never_predicted: tuple[int, ...] = (0,)

    def to_dict(self) -> dict:
        return asdict(self)


class LstmLm(nn.Module):
    """Embedding -> ``num_layers`` LSTM layers (gates i, f, g, o, as ``nn.LSTM``) -> linear ->
    log-softmax over all labels; the labels in ``never_predicted`` get log-probability ≈ -1e4.

    ``forward(tokens (B, L))`` -> log-probs (B, L, V) of the next label after each prefix, from a
    zero initial state. ``step(token (N,), hs, cs)`` is one step with explicit per-layer states
    ``(N, H)`` each (the export's graph)."""

    def __init__(self, opts: LstmLmOptions):
        super().__init__()
        self.opts = opts
        self.embed = nn.Embedding(opts.num_labels, opts.embed_dim)
        self.lstm = nn.LSTM(opts.embed_dim, opts.hidden_dim, num_layers=opts.num_layers,
                            batch_first=True, dropout=opts.dropout if opts.num_layers > 1 else 0.0)
        self.dropout = nn.Dropout(opts.dropout)
        self.out = nn.Linear(opts.hidden_dim, opts.num_labels)
        mask = torch.zeros(opts.num_labels)
        mask[list(opts.never_predicted)] = -1e4
        self.register_buffer("mask", mask)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.embed(tokens))
        h, _ = self.lstm(x)
        return (self.out(self.dropout(h)) + self.mask).log_softmax(dim=-1)

    def step(self, token: torch.Tensor, hs: list[torch.Tensor], cs: list[torch.Tensor]):
        """``token`` (N,) int64, per layer ``hs[i]``, ``cs[i]`` (N, H) -> log-probs (N, V), new
        hs, new cs (eval mode: no dropout)."""
        x = self.embed(token)
        new_hs, new_cs = [], []
        for i in range(self.opts.num_layers):
            w_ih, w_hh = getattr(self.lstm, f"weight_ih_l{i}"), getattr(self.lstm, f"weight_hh_l{i}")
            b = getattr(self.lstm, f"bias_ih_l{i}") + getattr(self.lstm, f"bias_hh_l{i}")
            gates = x @ w_ih.t() + hs[i] @ w_hh.t() + b
            gi, gf, gg, go = gates.chunk(4, dim=-1)
            c = torch.sigmoid(gf) * cs[i] + torch.sigmoid(gi) * torch.tanh(gg)
            x = torch.sigmoid(go) * torch.tanh(c)
            new_hs.append(x)
            new_cs.append(c)
        return (self.out(x) + self.mask).log_softmax(dim=-1), new_hs, new_cs
