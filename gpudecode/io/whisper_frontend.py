"""Whisper's log-mel front end (``models.front_end.type: whisper``), in numpy.

What Hugging Face's ``WhisperFeatureExtractor`` computes for one recording: the samples padded
with zeros (or cut) to ``chunk_s`` seconds (30: 480,000 samples at 16 kHz), a centred STFT
(reflect padding, periodic Hann window of ``n_fft`` 400 samples, hop 160), the power spectrum
without the last frame, Slaney-style mel filters (Slaney mel scale, Slaney area normalisation:
``mel_filter_bank(..., norm="slaney", mel_scale="slaney")``, 0–8 kHz), ``log10`` of the mel
energies clamped at 1e-10, floored at the utterance's maximum minus 8, then ``(x + 4) / 4``.
The result is [3000, num_mel_bins] (time-major, as every front end here); a channels-first
encoder (``models.encoder.layout``) gets it transposed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np


@dataclass(frozen=True, kw_only=True)
class WhisperOptions:
    """Whisper's feature settings (``WhisperFeatureExtractor``'s defaults)."""

    sample_rate_hz: int = 16000
    num_mel_bins: int = 80  # 128 for large-v3
    n_fft: int = 400
    hop_samples: int = 160
    chunk_s: float = 30.0

    @classmethod
    def from_any(cls, options: Any) -> WhisperOptions:
        """From ``WhisperOptions``, a mapping or an object with these attributes (the config's
        front-end section: its ``sample_rate_hz`` and ``num_mel_bins``)."""
        if isinstance(options, cls):
            return options
        names = [f.name for f in fields(cls)]
        if options is None:
            return cls()
        if isinstance(options, Mapping):
            return cls(**{k: v for k, v in options.items() if k in names})
        return cls(**{n: getattr(options, n) for n in names if hasattr(options, n)})

    @property
    def chunk_samples(self) -> int:
        return int(round(self.chunk_s * self.sample_rate_hz))

    @property
    def frames(self) -> int:
        """Feature frames per recording: 3000 for 30 s at hop 160."""
        return self.chunk_samples // self.hop_samples

    def num_frames(self, num_samples: int) -> int:  # noqa: ARG002 - every recording gives the same
        return self.frames


def _hz_to_mel(freq):
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    freq = np.asarray(freq, dtype=np.float64)
    mels = 3.0 * freq / 200.0
    logstep = 27.0 / np.log(6.4)
    return np.where(freq >= 1000.0, 15.0 + np.log(np.maximum(freq, 1e-12) / 1000.0) * logstep, mels)


def _mel_to_hz(mels):
    mels = np.asarray(mels, dtype=np.float64)
    logstep = np.log(6.4) / 27.0
    return np.where(mels >= 15.0, 1000.0 * np.exp(logstep * (mels - 15.0)), 200.0 * mels / 3.0)


def whisper_mel_filters(options: WhisperOptions) -> np.ndarray:
    """[n_fft // 2 + 1, num_mel_bins] triangular filters with Slaney normalisation, 0 Hz to Nyquist."""
    bins = options.n_fft // 2 + 1
    mel_points = np.linspace(_hz_to_mel(0.0), _hz_to_mel(options.sample_rate_hz / 2), options.num_mel_bins + 2)
    filter_freqs = _mel_to_hz(mel_points)
    fft_freqs = np.linspace(0, options.sample_rate_hz // 2, bins)
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    enorm = 2.0 / (filter_freqs[2:options.num_mel_bins + 2] - filter_freqs[:options.num_mel_bins])
    return filters * enorm[None, :]  # (Whisper's lowest filters may cover no FFT bin, as in HF's)


class WhisperFrontEnd:
    """Callable: samples ``(num_samples,)`` -> Whisper log-mel features ``(3000, num_mel_bins)``
    float32 (recordings longer than 30 s are cut, as the feature extractor cuts them)."""

    def __init__(self, options: Any = None):
        self.options = WhisperOptions.from_any(options)
        self.filters = whisper_mel_filters(self.options)
        n = self.options.n_fft
        self.window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)  # periodic Hann

    @property
    def num_features(self) -> int:
        return self.options.num_mel_bins

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        opts = self.options
        samples = np.asarray(samples, dtype=np.float64).reshape(-1)[:opts.chunk_samples]
        padded = np.zeros(opts.chunk_samples, dtype=np.float64)
        padded[:samples.shape[0]] = samples
        half = opts.n_fft // 2
        centred = np.pad(padded, half, mode="reflect")
        num = 1 + (centred.shape[0] - opts.n_fft) // opts.hop_samples
        starts = np.arange(num) * opts.hop_samples
        frames = centred[starts[:, None] + np.arange(opts.n_fft)[None, :]] * self.window
        spectrum = np.fft.rfft(frames, n=opts.n_fft, axis=1)[:-1]  # the last frame dropped
        power = spectrum.real ** 2 + spectrum.imag ** 2  # [T, bins]
        log_spec = np.log10(np.maximum(power @ self.filters, 1e-10))
        log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
        return ((log_spec + 4.0) / 4.0).astype(np.float32)
