"""Training augmentations of raw log-mel features ``(T, F)`` for the FSDD recipe (numpy only):
tempo (the time axis resampled), a mel-axis shift (a vocal-tract-length stand-in), gain and noise.
``train_ctc.py`` applies :class:`Augment` per training utterance; all are off by default."""

from __future__ import annotations

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
