"""Log-mel features from audio, in numpy: framing, window, rFFT power, mel filterbank, log.

The same code computes the features a bundled model was trained on and the features it decodes,
so the two cannot drift apart. Conventions (Kaldi-like): frames are cut without padding (the
last partial window is dropped), the mel scale is HTK's ``1127 ln(1 + f / 700)``, triangular
filters are built in the mel domain and evaluated at the FFT bin frequencies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from gpudecode import defaults
from gpudecode.sizes import next_power_of_two


class FrontEndError(ValueError):
    """A front-end configuration that cannot work (e.g. a mel filter without any FFT bin)."""


@dataclass(frozen=True, kw_only=True)
class LogMelOptions:
    """Options of the log-mel front end; the names match ``models.front_end`` in the config."""

    sample_rate_hz: int = defaults.SAMPLE_RATE_HZ
    window_ms: float = defaults.WINDOW_MS
    hop_ms: float = defaults.HOP_MS
    fft_size: int | None = defaults.FFT_SIZE
    num_mel_bins: int = defaults.NUM_MEL_BINS
    low_freq_hz: float = defaults.LOW_FREQ_HZ
    high_freq_hz: float | None = defaults.HIGH_FREQ_HZ
    log_floor: float = defaults.LOG_FLOOR
    window_type: str = defaults.WINDOW_TYPE
    preemphasis: float = defaults.PREEMPHASIS
    normalisation: str = defaults.NORMALISATION
    stats_file: Path | None = None

    @classmethod
    def from_any(cls, options: Any) -> LogMelOptions:
        """Accept ``LogMelOptions``, a mapping, or any object with these attributes (such as
        the config's ``FrontEndConfig``); unknown extra attributes are ignored."""
        if isinstance(options, cls):
            return options
        names = [f.name for f in fields(cls)]
        if isinstance(options, Mapping):
            unknown = set(options) - set(names) - {"frame_shift_ms"}
            if unknown:
                raise FrontEndError(
                    f"unknown front-end options {sorted(unknown)}; valid: {', '.join(names)}")
            return cls(**{k: v for k, v in options.items() if k in names})
        return cls(**{n: getattr(options, n) for n in names if hasattr(options, n)})

    @property
    def window_samples(self) -> int:
        return int(round(self.sample_rate_hz * self.window_ms / 1000.0))

    @property
    def hop_samples(self) -> int:
        return int(round(self.sample_rate_hz * self.hop_ms / 1000.0))

    @property
    def padded_fft_size(self) -> int:
        """``fft_size``, or the next power of two >= the window length."""
        if self.fft_size is not None:
            return self.fft_size
        return next_power_of_two(self.window_samples)

    @property
    def nyquist_hz(self) -> float:
        return self.sample_rate_hz / 2.0

    def num_frames(self, num_samples: int) -> int:
        """Frames cut from ``num_samples`` samples (the last partial window is dropped)."""
        if num_samples < self.window_samples:
            return 0
        return 1 + (num_samples - self.window_samples) // self.hop_samples


def hz_to_mel(freq_hz: np.ndarray | float) -> np.ndarray:
    return 1127.0 * np.log1p(np.asarray(freq_hz, dtype=np.float64) / 700.0)


def mel_to_hz(mel: np.ndarray | float) -> np.ndarray:
    return 700.0 * np.expm1(np.asarray(mel, dtype=np.float64) / 1127.0)


def mel_filterbank(options: LogMelOptions) -> np.ndarray:
    """Triangular mel filters, ``(num_mel_bins, fft_size // 2 + 1)`` float64.

    Raises ``FrontEndError`` when the options are inconsistent or when any filter has all-zero
    weights (no FFT bin falls inside its triangle); the message names the first such filter and
    how to fix it.
    """
    opts = options
    fft_size = opts.padded_fft_size
    high_hz = opts.nyquist_hz if opts.high_freq_hz is None else float(opts.high_freq_hz)
    if opts.num_mel_bins < 1:
        raise FrontEndError(f"num_mel_bins must be >= 1, got {opts.num_mel_bins}")
    if opts.window_samples < 1 or opts.hop_samples < 1:
        raise FrontEndError(
            f"window_ms={opts.window_ms} and hop_ms={opts.hop_ms} must each cover at least one "
            f"sample at sample_rate_hz={opts.sample_rate_hz}")
    if fft_size < opts.window_samples:
        raise FrontEndError(
            f"fft_size={fft_size} is shorter than the window ({opts.window_samples} samples = "
            f"{opts.window_ms} ms at {opts.sample_rate_hz} Hz); use fft_size >= "
            f"{opts.window_samples} or leave it unset")
    if not 0.0 <= opts.low_freq_hz < high_hz <= opts.nyquist_hz:
        raise FrontEndError(
            f"need 0 <= low_freq_hz < high_freq_hz <= Nyquist ({opts.nyquist_hz:g} Hz); got "
            f"low_freq_hz={opts.low_freq_hz:g}, high_freq_hz={high_hz:g}")
    num_fft_bins = fft_size // 2 + 1
    bin_mel = hz_to_mel(np.arange(num_fft_bins) * opts.sample_rate_hz / fft_size)
    edges_mel = np.linspace(hz_to_mel(opts.low_freq_hz), hz_to_mel(high_hz),
                            opts.num_mel_bins + 2)
    left, centre, right = edges_mel[:-2, None], edges_mel[1:-1, None], edges_mel[2:, None]
    rising = (bin_mel[None, :] - left) / (centre - left)
    falling = (right - bin_mel[None, :]) / (right - centre)
    weights = np.clip(np.minimum(rising, falling), 0.0, None)
    empty = np.flatnonzero(~(weights > 0.0).any(axis=1))
    if empty.size:
        first = int(empty[0])
        lo, mid, hi = mel_to_hz([edges_mel[first], edges_mel[first + 1], edges_mel[first + 2]])
        raise FrontEndError(
            f"mel filter {first} of {opts.num_mel_bins} ({lo:.1f}-{hi:.1f} Hz, centre "
            f"{mid:.1f} Hz) has all-zero weights: no FFT bin falls inside it (bin spacing "
            f"{opts.sample_rate_hz / fft_size:.2f} Hz = sample_rate_hz / fft_size); "
            f"{empty.size} filter(s) are empty. Use fewer mel bins (num_mel_bins), a larger "
            f"fft_size, or a higher low_freq_hz")
    return weights


def _window(options: LogMelOptions) -> np.ndarray:
    n = options.window_samples
    kind = options.window_type
    if kind == "hann":
        return np.hanning(n)
    if kind == "hamming":
        return np.hamming(n)
    if kind == "povey":
        return np.hanning(n) ** 0.85
    if kind == "rectangular":
        return np.ones(n)
    raise FrontEndError(
        f"unknown window_type {kind!r}; valid: {', '.join(defaults.WINDOW_TYPES)}")


class LogMelFrontEnd:
    """Callable: samples ``(num_samples,)`` -> log-mel features ``(T, num_mel_bins)`` float32.

    Filters, window and (for ``normalisation: global``) statistics are prepared once here, so a
    bad configuration fails before any audio is read.
    """

    def __init__(self, options: Any = None):
        self.options = LogMelOptions.from_any(LogMelOptions() if options is None else options)
        opts = self.options
        if opts.normalisation not in defaults.NORMALISATIONS:
            raise FrontEndError(f"unknown normalisation {opts.normalisation!r}; valid: "
                                f"{', '.join(defaults.NORMALISATIONS)}")
        self.filters = mel_filterbank(opts)  # (num_mel_bins, fft_size // 2 + 1)
        self.window = _window(opts)
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None
        if opts.normalisation == "global":
            self.mean, self.std = load_stats(opts.stats_file, opts.num_mel_bins)

    @property
    def num_features(self) -> int:
        return self.options.num_mel_bins

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        opts = self.options
        samples = np.asarray(samples, dtype=np.float64)
        num_frames = opts.num_frames(samples.shape[0])
        if num_frames == 0:
            return np.zeros((0, opts.num_mel_bins), dtype=np.float32)
        starts = np.arange(num_frames) * opts.hop_samples
        frames = samples[starts[:, None] + np.arange(opts.window_samples)[None, :]]
        if opts.preemphasis:
            frames = np.concatenate(
                [frames[:, :1] * (1.0 - opts.preemphasis),
                 frames[:, 1:] - opts.preemphasis * frames[:, :-1]], axis=1)
        spectrum = np.fft.rfft(frames * self.window, n=opts.padded_fft_size, axis=1)
        power = spectrum.real**2 + spectrum.imag**2  # (T, fft_size // 2 + 1)
        feats = np.log(np.maximum(power @ self.filters.T, opts.log_floor))
        if opts.normalisation == "utterance":
            feats = (feats - feats.mean(axis=0)) / (feats.std(axis=0) + 1e-5)
        elif opts.normalisation == "global":
            feats = (feats - self.mean) / self.std
        return feats.astype(np.float32)


def load_stats(path: Path | str | None, num_features: int) -> tuple[np.ndarray, np.ndarray]:
    """Global normalisation statistics: an ``.npz`` with ``mean`` and ``std``, each ``(F,)``."""
    if path is None:
        raise FrontEndError("normalisation 'global' needs stats_file (an .npz with mean and std)")
    try:
        with np.load(path) as stats:
            mean = np.asarray(stats["mean"], dtype=np.float64)
            std = np.asarray(stats["std"], dtype=np.float64)
    except (OSError, KeyError, ValueError) as exc:
        raise FrontEndError(
            f"{path}: cannot read normalisation statistics (an .npz with 'mean' and 'std' "
            f"arrays): {exc}") from exc
    for name, arr in (("mean", mean), ("std", std)):
        if arr.shape != (num_features,):
            raise FrontEndError(f"{path}: {name} has shape {arr.shape}; expected "
                                f"({num_features},) for num_mel_bins={num_features}")
    if not (std > 0).all():
        raise FrontEndError(f"{path}: std has non-positive entries")
    return mean, std
