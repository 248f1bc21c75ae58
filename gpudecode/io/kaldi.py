"""Kaldi archives (``.ark``) and script files (``.scp``) through kaldiio."""

from __future__ import annotations

import numpy as np

from gpudecode.io.errors import FeatureError
from gpudecode.io.features import FeatureSource


class KaldiArkSource(FeatureSource):
    """An ``.ark``: one sequential pass indexes the ids, frame counts and byte offsets; then
    each utterance is read on demand from its offset."""

    format = "kaldi-ark"

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        import kaldiio

        if not self.path.is_file():
            raise FeatureError("file does not exist", path=self.path)
        self._offsets: dict[str, int] = {}
        self._frames: dict[str, int] = {}
        self._order: list[str] = []
        try:
            with open(self.path, "rb") as fd:
                end = 0
                for key, mat in kaldiio.load_ark(fd):
                    if key in self._offsets:
                        raise FeatureError("duplicate utterance id", path=self.path,
                                           utterance_id=key)
                    # The next record starts where the previous ended: "<key> <data>".
                    self._offsets[key] = end + len(key.encode()) + 1
                    self._frames[key] = int(np.shape(mat)[0]) if np.ndim(mat) else 0
                    self._order.append(key)
                    end = fd.tell()
        except FeatureError:
            raise
        except Exception as exc:
            raise FeatureError(f"cannot read as a Kaldi archive: {type(exc).__name__}: {exc}",
                               path=self.path) from exc

    def _keys(self) -> list[str]:
        return self._order

    def _load(self, utt_id: str) -> np.ndarray:
        import kaldiio

        return kaldiio.load_mat(f"{self.path}:{self._offsets[utt_id]}")

    def _num_frames(self, utt_id: str) -> int:
        return self._frames[utt_id]


class KaldiScpSource(FeatureSource):
    """An ``.scp`` (``<id> <ark-path>:<offset>`` per line), read lazily by kaldiio."""

    format = "kaldi-scp"

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        import kaldiio

        if not self.path.is_file():
            raise FeatureError("file does not exist", path=self.path)
        try:
            self._table = kaldiio.load_scp(str(self.path))
            self._order = list(self._table.keys())
        except Exception as exc:
            raise FeatureError(f"cannot read as a Kaldi script file: {exc}",
                               path=self.path) from exc

    def _keys(self) -> list[str]:
        return self._order

    def _load(self, utt_id: str) -> np.ndarray:
        return self._table[utt_id]
