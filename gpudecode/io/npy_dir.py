"""A folder of ``.npy`` files, one utterance each; the id is the file stem."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gpudecode.io.errors import FeatureError
from gpudecode.io.features import FeatureSource, sorted_files


class NpyDirSource(FeatureSource):
    format = "npy-dir"

    def _keys(self) -> list[str]:
        if not self.path.is_dir():
            raise FeatureError("not a folder (expected a folder of .npy files)", path=self.path)
        return [p.stem for p in sorted_files(self.path, (".npy",))]

    def _source_of(self, utt_id: str) -> Path:
        return self.path / f"{utt_id}.npy"

    def _load(self, utt_id: str) -> np.ndarray:
        return np.load(self._source_of(utt_id), allow_pickle=False)

    def _num_frames(self, utt_id: str) -> int:
        try:  # the header only
            shape = np.load(self._source_of(utt_id), mmap_mode="r", allow_pickle=False).shape
        except Exception as exc:
            raise FeatureError(f"cannot read: {type(exc).__name__}: {exc}",
                               path=self._source_of(utt_id), utterance_id=utt_id) from exc
        return int(shape[0]) if shape else 0
