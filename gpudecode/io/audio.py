"""Audio files (wav, flac via soundfile) turned into log-mel features by ``LogMelFrontEnd`` (or
Whisper's, ``WhisperFrontEnd``, for ``models.front_end.type: whisper``).

The source is one audio file, a folder of audio files (id = file stem), or a list file with one
``<path>`` or ``<id> <path>`` per line (Kaldi ``wav.scp`` style; relative paths resolve against
the list file's folder; blank lines and ``#`` comments are ignored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gpudecode import defaults
from gpudecode.io.errors import FeatureError
from gpudecode.io.features import FeatureSource, sorted_files
from gpudecode.io.frontend import LogMelFrontEnd
from gpudecode.io.whisper_frontend import WhisperFrontEnd


def make_front_end(front_end: Any = None):
    """The front end of ``models.front_end`` (or its mapping, or a front end itself): by ``type``,
    ``log-mel`` (the default) or ``whisper``."""
    if isinstance(front_end, (LogMelFrontEnd, WhisperFrontEnd)):
        return front_end
    kind = front_end.get("type") if isinstance(front_end, dict) else getattr(front_end, "type", None)
    if isinstance(front_end, dict):
        front_end = {k: v for k, v in front_end.items() if k != "type"}
    return WhisperFrontEnd(front_end) if kind == "whisper" else LogMelFrontEnd(front_end)


def read_audio_list(path: Path) -> dict[str, Path]:
    """``{id: audio path}`` from a list file (see the module docstring)."""
    files: dict[str, Path] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise FeatureError(f"cannot read audio list: {exc}", path=path) from exc
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(maxsplit=1)
        file = Path(parts[-1])
        utt_id = parts[0] if len(parts) == 2 else file.stem
        if utt_id in files:
            raise FeatureError(f"line {number}: duplicate utterance id", path=path,
                               utterance_id=utt_id)
        files[utt_id] = file if file.is_absolute() else path.parent / file
    return files


class AudioSource(FeatureSource):
    format = "audio"

    def __init__(self, path, front_end: Any = None, **kwargs):
        super().__init__(path, **kwargs)
        import soundfile  # noqa: F401  (fail early when it is missing)

        self.front_end = make_front_end(front_end)
        if self.num_features is None:
            self.num_features = self.front_end.num_features
            self._features_from = "num_mel_bins of the front end"
        if self.path.is_dir():
            files = sorted_files(self.path, defaults.AUDIO_EXTENSIONS)
            self._files: dict[str, Path] = {}
            for file in files:
                if file.stem in self._files:
                    raise FeatureError(f"two audio files with the id {file.stem!r}: "
                                       f"{self._files[file.stem].name}, {file.name}",
                                       path=self.path)
                self._files[file.stem] = file
        elif self.path.suffix.lower() in defaults.AUDIO_EXTENSIONS:
            self._files = {self.path.stem: self.path}
        elif self.path.is_file():
            self._files = read_audio_list(self.path)
        else:
            raise FeatureError("does not exist", path=self.path)

    def _keys(self) -> list[str]:
        return list(self._files)

    def _source_of(self, utt_id: str) -> Path:
        return self._files[utt_id]

    def _check_info(self, utt_id: str):
        import soundfile

        file = self._files[utt_id]
        if not file.is_file():
            raise FeatureError("audio file does not exist", path=file, utterance_id=utt_id)
        try:
            info = soundfile.info(str(file))
        except Exception as exc:
            raise FeatureError(f"cannot read audio: {exc}", path=file,
                               utterance_id=utt_id) from exc
        expected = self.front_end.options.sample_rate_hz
        if info.samplerate != expected:
            raise FeatureError(f"sample rate {info.samplerate} Hz; the front end expects "
                               f"{expected} Hz (resample the audio or set "
                               f"models.front_end.sample_rate_hz)", path=file,
                               utterance_id=utt_id)
        if info.channels != 1:
            raise FeatureError(f"{info.channels} channels; expected mono audio", path=file,
                               utterance_id=utt_id)
        return info

    def _num_frames(self, utt_id: str) -> int:
        return self._frames_of(utt_id, self._check_info(utt_id).frames)

    def _frames_of(self, utt_id: str, num_samples: int) -> int:
        """Feature frames of ``num_samples`` samples; a recording shorter than one analysis window
        is an error naming both lengths."""
        options = self.front_end.options
        frames = options.num_frames(num_samples)
        if frames < 1:
            window = getattr(options, "window_samples", None)
            span = (f"one frame needs {window} samples ({options.window_ms:g} ms at "
                    f"{options.sample_rate_hz} Hz)" if window else "the front end needs more")
            raise FeatureError(f"{num_samples} samples: too short for one feature frame; {span}",
                               path=self._files[utt_id], utterance_id=utt_id)
        return frames

    def _load(self, utt_id: str) -> np.ndarray:
        import soundfile

        self._frames_of(utt_id, self._check_info(utt_id).frames)
        samples, _ = soundfile.read(str(self._files[utt_id]), dtype="float32", always_2d=False)
        return self.front_end(samples)
