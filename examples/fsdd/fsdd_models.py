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
    # Subtract each utterance's mean log-mel vector (over its real frames) inside the model, so
    # a constant channel or gain offset cancels; the front end stays ``normalisation: none``.
    utterance_mean: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def load_init_encoder(path: str, num_features: int, num_labels: int) -> tuple[dict | None, dict]:
    """(the CTC checkpoint at ``path`` or None for "none", its encoder options — or the defaults)."""
    init = None if path.lower() == "none" else torch.load(path, map_location="cpu", weights_only=False)
    options = init["options"] if init else EncoderOptions(num_features=num_features, num_labels=num_labels).to_dict()
    return init, options


def prefixed_state(state_dict: dict, prefix: str) -> dict:
    """The entries of ``state_dict`` under ``prefix`` (e.g. "encoder."), without it."""
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def noam_schedule(optimiser, warmup_steps: int):
    """Linear warm-up over ``warmup_steps``, then inverse square-root decay."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda step: min((step + 1) / warmup_steps, (warmup_steps / (step + 1)) ** 0.5))


def subsampled_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after the two stride-2, kernel-3 convolutions without padding."""
    return torch.div(torch.div(lengths - 1, 2, rounding_mode="floor") - 1, 2,
                     rounding_mode="floor")


def utterance_means(features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``(B, 1, F)`` mean of each utterance's real frames (padded frames excluded)."""
    real = (torch.arange(features.shape[1], device=features.device)[None, :] < lengths[:, None])
    real = real.to(features.dtype)[:, :, None]
    return (features * real).sum(dim=1, keepdim=True) / real.sum(dim=1, keepdim=True).clamp(min=1)


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
        if self.opts.utterance_mean:
            features = features - utterance_means(features, lengths) + self.mean
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


# --- transducer -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TransducerOptions:
    """The encoder's options (``encoder``, as ``EncoderOptions.to_dict()``) plus the prediction
    network (embedding, LSTM layers, output width P) and the joint network (width J)."""

    encoder: dict
    num_labels: int = 12
    blank: int = 0
    pred_embed_dim: int = 64
    pred_hidden_dim: int = 128
    pred_num_layers: int = 1
    pred_dim: int = 128
    joint_dim: int = 128
    pred_dropout: float = 0.1

    def to_dict(self) -> dict:
        return asdict(self)


class PredictionNetwork(nn.Module):
    """Labels -> prediction vectors: embedding -> LSTM (gates i, f, g, o) -> linear to P.
    Starts from blank and a zero state."""

    def __init__(self, opts: TransducerOptions):
        super().__init__()
        self.opts = opts
        self.embed = nn.Embedding(opts.num_labels, opts.pred_embed_dim)
        self.lstm = nn.LSTM(opts.pred_embed_dim, opts.pred_hidden_dim, num_layers=opts.pred_num_layers,
                            batch_first=True)
        self.dropout = nn.Dropout(opts.pred_dropout)
        self.out = nn.Linear(opts.pred_hidden_dim, opts.pred_dim)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        """``labels`` (B, U) -> (B, U + 1, P): the output after blank, blank + y1, ..."""
        start = torch.full_like(labels[:, :1], self.opts.blank)
        x = self.dropout(self.embed(torch.cat([start, labels], dim=1)))
        h, _ = self.lstm(x)
        return self.out(self.dropout(h))

    def step(self, token: torch.Tensor, hs: list[torch.Tensor], cs: list[torch.Tensor]):
        """``token`` (N,) int64, per layer (N, H) states -> (N, P), new hs, new cs (eval mode)."""
        x = self.embed(token)
        new_hs, new_cs = [], []
        for i in range(self.opts.pred_num_layers):
            w_ih, w_hh = getattr(self.lstm, f"weight_ih_l{i}"), getattr(self.lstm, f"weight_hh_l{i}")
            b = getattr(self.lstm, f"bias_ih_l{i}") + getattr(self.lstm, f"bias_hh_l{i}")
            gi, gf, gg, go = (x @ w_ih.t() + hs[i] @ w_hh.t() + b).chunk(4, dim=-1)
            c = torch.sigmoid(gf) * cs[i] + torch.sigmoid(gi) * torch.tanh(gg)
            x = torch.sigmoid(go) * torch.tanh(c)
            new_hs.append(x)
            new_cs.append(c)
        return self.out(x), new_hs, new_cs


class JointNetwork(nn.Module):
    """log_softmax(Linear(tanh(Linear(encoder frame) + Linear(prediction)))) over all labels."""

    def __init__(self, opts: TransducerOptions):
        super().__init__()
        self.enc = nn.Linear(opts.encoder["model_dim"], opts.joint_dim)
        self.pred = nn.Linear(opts.pred_dim, opts.joint_dim)
        self.out = nn.Linear(opts.joint_dim, opts.num_labels)

    def forward(self, encoder_frame: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.enc(encoder_frame) + self.pred(prediction))).log_softmax(dim=-1)

    def grid(self, encoder_states: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
        """(B, T', E) x (B, U + 1, P) -> log-probs (B, T', U + 1, V)."""
        hidden = self.enc(encoder_states)[:, :, None] + self.pred(predictions)[:, None]
        return self.out(torch.tanh(hidden)).log_softmax(dim=-1)


class TransducerModel(nn.Module):
    def __init__(self, opts: TransducerOptions, mean=None, std=None):
        super().__init__()
        self.opts = opts
        self.encoder = Encoder(EncoderOptions(**opts.encoder), mean, std)
        self.prediction = PredictionNetwork(opts)
        self.joint = JointNetwork(opts)

    def forward(self, features, lengths, labels):
        """-> joint log-probs (B, T', U + 1, V), encoder lengths (B,)."""
        states, out_lengths = self.encoder(features, lengths)
        return self.joint.grid(states, self.prediction(labels)), out_lengths


def rnnt_loss(log_probs: torch.Tensor, labels: torch.Tensor, frame_lengths: torch.Tensor,
              label_lengths: torch.Tensor, blank: int = 0) -> torch.Tensor:
    """Transducer negative log-likelihood per utterance (B,), by the forward algorithm.

    ``log_probs`` (B, T, U + 1, V) joint log-probs, ``labels`` (B, U) (padding: any label),
    lengths (B,). Every alignment emits any number of labels per frame and ends each frame with
    blank (Graves 2012). One vectorised step per frame: within a frame, the label recursion
    ``alpha[t, u] = logaddexp(alpha[t-1, u] + blank[t-1, u], alpha[t, u-1] + y[t, u-1])`` is a
    log-cumsum-exp over u of the arrivals from frame t-1 shifted by the cumulative label scores.
    """
    b, t_max, u1, _ = log_probs.shape
    blank_lp = log_probs[..., blank]  # (B, T, U+1)
    if u1 > 1:
        index = labels[:, None, :, None].expand(b, t_max, u1 - 1, 1)
        emit_lp = log_probs[:, :, :-1].gather(-1, index).squeeze(-1)  # (B, T, U)
    else:
        emit_lp = log_probs.new_zeros(b, t_max, 0)
    cum = torch.cat([log_probs.new_zeros(b, t_max, 1), emit_lp.cumsum(-1)], dim=-1)  # (B, T, U+1)
    alphas = [cum[:, 0]]
    for t in range(1, t_max):
        arrive = alphas[-1] + blank_lp[:, t - 1]
        alphas.append(cum[:, t] + torch.logcumsumexp(arrive - cum[:, t], dim=-1))
    alpha = torch.stack(alphas, dim=1)  # (B, T, U+1)
    rows = torch.arange(b, device=log_probs.device)
    last_t, last_u = frame_lengths.long() - 1, label_lengths.long()
    return -(alpha[rows, last_t, last_u] + blank_lp[rows, last_t, last_u])


# --- attention encoder-decoder --------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class AedOptions:
    """The encoder's options (``encoder``, as ``EncoderOptions.to_dict()``) plus a pre-LN
    transformer decoder with learned positions; ``sentence`` (``</s>``) begins and ends."""

    encoder: dict
    num_labels: int = 12
    sentence: int = 1
    dec_layers: int = 2
    dec_dim: int = 128
    dec_heads: int = 4
    dec_ff_dim: int = 256
    max_positions: int = 32
    dropout: float = 0.1

    def to_dict(self) -> dict:
        return asdict(self)


MASKED = -1e9


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, L, D) -> (B, H, L, D / H)."""
    b, length, d = x.shape
    return x.view(b, length, num_heads, d // num_heads).transpose(1, 2)


def _attend(q, k, v, valid):
    """q (B, H, Q, Dh), k/v (B, H, K, Dh), valid broadcastable to (B, H, Q, K) -> (B, Q, H * Dh)."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    weights = torch.where(valid, scores, torch.full_like(scores, MASKED)).softmax(dim=-1)
    out = weights @ v
    return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)


class DecoderLayer(nn.Module):
    def __init__(self, opts: AedOptions):
        super().__init__()
        d, e = opts.dec_dim, opts.encoder["model_dim"]
        self.heads = opts.dec_heads
        self.self_norm, self.cross_norm, self.ff_norm = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_q, self.self_k, self.self_v, self.self_out = (nn.Linear(d, d) for _ in range(4))
        self.cross_q, self.cross_out = nn.Linear(d, d), nn.Linear(d, d)
        self.cross_k, self.cross_v = nn.Linear(e, d), nn.Linear(e, d)
        self.ff = nn.Sequential(nn.Linear(d, opts.dec_ff_dim), nn.ReLU(), nn.Dropout(opts.dropout),
                                nn.Linear(opts.dec_ff_dim, d))
        self.dropout = nn.Dropout(opts.dropout)

    def cross_kv(self, encoder_states: torch.Tensor):
        """(B, S, E) -> key, value (B, H, S, Dh): what the exported encoder precomputes."""
        return _heads(self.cross_k(encoder_states), self.heads), _heads(self.cross_v(encoder_states), self.heads)

    def forward(self, x, self_k, self_v, self_valid, cross_k, cross_v, cross_valid):
        """x (B, Q, D) the queries; self_k/v (B, H, K, Dh) include the queries' own keys."""
        q = _heads(self.self_q(self.self_norm(x)), self.heads)
        x = x + self.dropout(self.self_out(_attend(q, self_k, self_v, self_valid)))
        q = _heads(self.cross_q(self.cross_norm(x)), self.heads)
        x = x + self.dropout(self.cross_out(_attend(q, cross_k, cross_v, cross_valid)))
        return x + self.dropout(self.ff(self.ff_norm(x)))

    def self_kv(self, x):
        h = self.self_norm(x)
        return _heads(self.self_k(h), self.heads), _heads(self.self_v(h), self.heads)


class AttentionDecoder(nn.Module):
    def __init__(self, opts: AedOptions):
        super().__init__()
        self.opts = opts
        self.embed = nn.Embedding(opts.num_labels, opts.dec_dim)
        self.positions = nn.Embedding(opts.max_positions, opts.dec_dim)
        self.layers = nn.ModuleList(DecoderLayer(opts) for _ in range(opts.dec_layers))
        self.norm = nn.LayerNorm(opts.dec_dim)
        self.out = nn.Linear(opts.dec_dim, opts.num_labels)
        self.dropout = nn.Dropout(opts.dropout)

    def forward(self, tokens, encoder_states, encoder_lengths):
        """Teacher forcing: ``tokens`` (B, L) from ``</s>`` -> log-probs (B, L, V) of the next label."""
        length = tokens.shape[1]
        x = self.dropout(self.embed(tokens) + self.positions(torch.arange(length, device=tokens.device))[None])
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()[None, None]
        cross_valid = (torch.arange(encoder_states.shape[1], device=tokens.device)[None]
                       < encoder_lengths[:, None])[:, None, None]
        for layer in self.layers:
            k, v = layer.self_kv(x)
            ck, cv = layer.cross_kv(encoder_states)
            x = layer(x, k, v, causal, ck, cv, cross_valid)
        return self.out(self.norm(x)).log_softmax(dim=-1)

    def step(self, token, prefix_length, past, cross, encoder_lengths):
        """One label per hypothesis, RASR convention. ``token`` (N,), ``prefix_length`` (N,) the
        number of valid past positions (right-aligned in the T positions of ``past``),
        ``past``/``cross``: per layer (key, value) (N, H, T, Dh) / (N, H, S, Dh) -> log-probs
        (N, V) and per layer the present (key, value) (N, H, T + 1, Dh)."""
        x = (self.embed(token) + self.positions(prefix_length))[:, None]  # (N, 1, D)
        num_t1 = past[0][0].shape[2] + 1
        distance = torch.arange(num_t1 - 1, -1, -1, device=token.device)  # T - t for t in 0..T
        self_valid = (distance[None] <= prefix_length[:, None])[:, None, None]  # (N, 1, 1, T+1)
        num_s = cross[0][0].shape[2]
        cross_valid = (torch.arange(num_s, device=token.device)[None] < encoder_lengths[:, None])[:, None, None]
        presents = []
        for layer, (past_k, past_v), (ck, cv) in zip(self.layers, past, cross):
            k, v = layer.self_kv(x)
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            presents.append((k, v))
            x = layer(x, k, v, self_valid, ck, cv, cross_valid)
        return self.out(self.norm(x))[:, 0].log_softmax(dim=-1), presents


class AedModel(nn.Module):
    """Encoder (as the CTC model's) + attention decoder; the CTC head is an auxiliary loss."""

    def __init__(self, opts: AedOptions, mean=None, std=None):
        super().__init__()
        self.opts = opts
        self.encoder = Encoder(EncoderOptions(**opts.encoder), mean, std)
        self.decoder = AttentionDecoder(opts)
        self.ctc_head = nn.Linear(opts.encoder["model_dim"], opts.num_labels)


def one_symbol_rnnt_loss(log_probs: torch.Tensor, labels: torch.Tensor, frame_lengths: torch.Tensor,
                         label_lengths: torch.Tensor, blank: int = 0) -> torch.Tensor:
    """Transducer negative log-likelihood (B,) where every frame emits exactly one symbol: a label
    (then the next frame, without a blank) or blank — the topology of k2's modified transducer and
    of ``gpudecode``'s transducer search with ``max_symbols_per_frame: 1``. Needs T >= U.

    ``alpha[t + 1, u] = logaddexp(alpha[t, u] + blank[t, u], alpha[t, u - 1] + y[t, u - 1])``.
    A label's frame is never visited again after it is emitted, so the joint need not tell an
    already-emitted label from a repetition of it (which a CTC-initialised, spiky encoder
    cannot); the standard topology (:func:`rnnt_loss`) made such a model delete repeated digits.
    """
    b, t_max, u1, _ = log_probs.shape
    blank_lp = log_probs[..., blank]  # (B, T, U+1)
    if u1 > 1:
        index = labels[:, None, :, None].expand(b, t_max, u1 - 1, 1)
        emit_lp = log_probs[:, :, :-1].gather(-1, index).squeeze(-1)  # (B, T, U)
    else:
        emit_lp = log_probs.new_zeros(b, t_max, 0)
    impossible = torch.full((b, 1), -1e30, dtype=log_probs.dtype, device=log_probs.device)
    alpha = torch.cat([log_probs.new_zeros(b, 1), impossible.expand(b, u1 - 1)], dim=1)  # before frame 0
    alphas = []
    for t in range(t_max):
        stay = alpha + blank_lp[:, t]
        move = torch.cat([impossible, alpha[:, :-1] + emit_lp[:, t]], dim=1)
        alpha = torch.logaddexp(stay, move)
        alphas.append(alpha)  # after frame t
    alpha = torch.stack(alphas, dim=1)  # (B, T, U+1)
    rows = torch.arange(b, device=log_probs.device)
    return -alpha[rows, frame_lengths.long() - 1, label_lengths.long()]
