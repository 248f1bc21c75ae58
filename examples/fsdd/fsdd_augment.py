"""Training augmentations of raw log-mel features ``(T, F)`` for the FSDD recipe (numpy only):
tempo (the time axis resampled), a mel-axis shift (a vocal-tract-length stand-in), gain and noise.
The trainers apply :class:`Augment` per training utterance (``--aug-*``, :func:`add_arguments`);
all are off by default."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Augment:
    """Per-utterance augmentations of raw log-mel features ``(T, F)``; 0 turns one off."""

    tempo: float = 0.0      # frames resampled by a factor in [1 - tempo, 1 + tempo]
    mel_shift: float = 0.0  # mel axis shifted by [-mel_shift, mel_shift] bins
    gain: float = 0.0       # constant in [-gain, gain] added (log power: a level change)
    noise: float = 0.0      # Gaussian noise std

    @property
    def active(self) -> bool:
        return any((self.tempo, self.mel_shift, self.gain, self.noise))

    def __call__(self, feats: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``feats`` augmented (a new float32 array; ``feats`` itself when all are off)."""
        if not self.active:
            return feats
        x = feats
        if self.tempo:
            x = change_tempo(x, rng.uniform(1 - self.tempo, 1 + self.tempo))
        if self.mel_shift:
            x = shift_mel(x, rng.uniform(-self.mel_shift, self.mel_shift))
        if self.gain:
            x = x + np.float32(rng.uniform(-self.gain, self.gain))
        if self.noise:
            x = x + rng.normal(0.0, self.noise, x.shape).astype(np.float32)
        return np.ascontiguousarray(x, dtype=np.float32)

    def batch(self, feats, ids, rng: np.random.Generator) -> dict:
        """``{i: feats[i] augmented}`` for the utterances ``ids`` of a batch (the arrays themselves
        when all are off)."""
        return {i: self(feats[i], rng) for i in ids}

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Augment:
        """The augmentations of the ``--aug-*`` options of :func:`add_arguments`."""
        return cls(tempo=args.aug_tempo, mel_shift=args.aug_mel_shift, gain=args.aug_gain,
                   noise=args.aug_noise)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trainers' ``--aug-*`` options (0 turns one off)."""
    p.add_argument("--aug-tempo", type=float, default=0.0,
                   help="tempo factor drawn from [1 - x, 1 + x] per utterance (0: off)")
    p.add_argument("--aug-mel-shift", type=float, default=0.0,
                   help="mel-axis shift drawn from [-x, x] bins per utterance, interpolated (0: off)")
    p.add_argument("--aug-gain", type=float, default=0.0,
                   help="constant drawn from [-x, x] added to the log-mel features (0: off)")
    p.add_argument("--aug-noise", type=float, default=0.0,
                   help="std of Gaussian noise added to the log-mel features (0: off)")


def interpolate_rows(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Rows of ``x`` at fractional ``positions`` (clamped to the ends), linearly interpolated."""
    positions = np.clip(positions, 0, x.shape[0] - 1)
    low = np.floor(positions).astype(np.int64)
    high = np.minimum(low + 1, x.shape[0] - 1)
    w = (positions - low).astype(np.float32)[:, None]
    return (1 - w) * x[low] + w * x[high]


def change_tempo(feats: np.ndarray, factor: float) -> np.ndarray:
    """``(T, F)`` -> ``(round(T / factor), F)``: the same speech ``factor`` times faster."""
    t = feats.shape[0]
    n = max(1, round(t / factor))
    return interpolate_rows(feats, (np.arange(n) + 0.5) * (t / n) - 0.5)


def shift_mel(feats: np.ndarray, shift: float) -> np.ndarray:
    """Mel bin ``k`` takes the value of bin ``k - shift`` (positive: formants move up)."""
    f = feats.shape[1]
    return interpolate_rows(feats.T, np.arange(f) - shift).T
