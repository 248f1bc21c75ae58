"""``open_features``: pick the reader for a path (or the one named by ``format``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpudecode import defaults
from gpudecode.io.errors import FeatureError
from gpudecode.io.features import FeatureSource

log = logging.getLogger(__name__)

_SUFFIX_FORMATS = {
    ".npz": "npz",
    ".h5": "hdf5",
    ".hdf5": "hdf5",
    ".hdf": "hdf5",
    ".ark": "kaldi-ark",
    ".scp": "kaldi-scp",
    ".wav": "audio",
    ".flac": "audio",
    ".list": "audio",
    ".lst": "audio",
    ".txt": "audio",
}


def detect_format(path: str | Path) -> str:
    """The feature format of ``path``: a folder holds ``.npy`` files (``npy-dir``) or audio;
    files go by suffix; an ``.scp`` that lists audio files is an audio list."""
    path = Path(path)
    if not path.exists():
        raise FeatureError("does not exist", path=path)
    if path.is_dir():
        return _folder_format(path)
    fmt = _SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise FeatureError(
            f"cannot tell the feature format from the suffix {path.suffix!r}; set "
            f"io.features.format to one of {', '.join(defaults.FEATURE_FORMATS[1:])}",
            path=path)
    if fmt == "kaldi-scp" and _lists_audio(path):
        return "audio"
    return fmt


def _folder_counts(folder: Path) -> dict[str, int]:
    """Files per feature suffix (``.npy``, ``.wav``, ``.flac``) directly in ``folder``."""
    counts: dict[str, int] = {}
    for file in folder.iterdir():
        suffix = file.suffix.lower()
        if file.is_file() and (suffix == ".npy" or suffix in defaults.AUDIO_EXTENSIONS):
            counts[suffix] = counts.get(suffix, 0) + 1
    return counts


def _format_of_suffix(suffix: str) -> str:
    return "npy-dir" if suffix == ".npy" else "audio"


def _folder_format(folder: Path) -> str:
    """``npy-dir`` or ``audio``; a folder holding both is an error listing what it holds."""
    counts = _folder_counts(folder)
    formats = {_format_of_suffix(suffix) for suffix in counts}
    if len(formats) > 1:
        held = ", ".join(f"{counts[s]} {s} file(s) ({_format_of_suffix(s)})" for s in sorted(counts))
        raise FeatureError(
            f"folder holds several feature formats: {held}; a run decodes one: move the others "
            "out, or set io.features.format (npy-dir or audio) to decode that one alone",
            path=folder)
    if not formats:
        raise FeatureError("folder holds neither .npy nor audio (.wav, .flac) files", path=folder)
    return formats.pop()


def _lists_audio(scp: Path) -> bool:
    try:
        with open(scp, encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if parts and not parts[0].startswith("#"):
                    return Path(parts[-1]).suffix.lower() in defaults.AUDIO_EXTENSIONS
    except (OSError, UnicodeDecodeError):
        return False
    return False


def open_features(path: str | Path, format: str = "auto", front_end: Any = None, *,
                  num_features: int | None = None,
                  on_error: str = defaults.ON_BAD_INPUT) -> FeatureSource:
    """Open a feature source.

    ``format``: one of ``defaults.FEATURE_FORMATS`` (``auto`` detects it from the path).
    ``front_end``: options of the log-mel front end for audio (``LogMelOptions``, the config's
    ``models.front_end``, a mapping, or a ready ``LogMelFrontEnd``); defaults when ``None``.
    ``num_features``: the expected feature dimension F; when ``None`` the first utterance
    read fixes it. ``on_error``: ``stop`` raises ``FeatureError`` on a bad utterance, ``skip``
    leaves it out (see ``FeatureSource.skipped``).
    """
    from gpudecode.io.audio import AudioSource
    from gpudecode.io.hdf5 import Hdf5Source
    from gpudecode.io.kaldi import KaldiArkSource, KaldiScpSource
    from gpudecode.io.npy_dir import NpyDirSource
    from gpudecode.io.npz import NpzSource

    if format not in defaults.FEATURE_FORMATS:
        raise ValueError(f"unknown feature format {format!r}; valid: "
                         f"{', '.join(defaults.FEATURE_FORMATS)}")
    path = Path(path)
    if not path.exists():
        raise FeatureError("does not exist", path=path)
    if format == "auto":
        format = detect_format(path)
    elif path.is_dir() and format in ("npy-dir", "audio"):
        ignored = {s: n for s, n in _folder_counts(path).items() if _format_of_suffix(s) != format}
        if ignored:
            log.warning("%s: format %s decodes this folder's %s files only; ignored: %s", path, format,
                        ".npy" if format == "npy-dir" else "audio",
                        ", ".join(f"{n} {s} file(s)" for s, n in sorted(ignored.items())))
    kwargs = {"num_features": num_features, "on_error": on_error}
    if format == "audio":
        return AudioSource(path, front_end, **kwargs)
    readers = {"npy-dir": NpyDirSource, "npz": NpzSource, "hdf5": Hdf5Source,
               "kaldi-ark": KaldiArkSource, "kaldi-scp": KaldiScpSource}
    return readers[format](path, **kwargs)
