"""HDF5 in RETURNN's layout: ``inputs`` ``(sum T, F)`` with all utterances concatenated,
``seqLengths`` ``(U,)`` or ``(U, k)`` (first column: frames of ``inputs``), ``seqTags`` ``(U,)``
strings (the utterance ids)."""

from __future__ import annotations

import numpy as np

from gpudecode.io.errors import FeatureError
from gpudecode.io.features import FeatureSource


class Hdf5Source(FeatureSource):
    format = "hdf5"

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        import h5py

        if not self.path.exists():
            raise FeatureError("file does not exist", path=self.path)
        try:
            self._file = h5py.File(self.path, "r")
        except OSError as exc:
            raise FeatureError(f"cannot read as HDF5: {exc}", path=self.path) from exc
        missing = [k for k in ("inputs", "seqLengths", "seqTags") if k not in self._file]
        if missing:
            self._file.close()
            raise FeatureError(
                f"missing dataset(s) {missing} (RETURNN layout: inputs, seqLengths, seqTags); "
                f"found {sorted(self._file.keys()) if self._file else []}", path=self.path)
        self._inputs = self._file["inputs"]
        lengths = np.asarray(self._file["seqLengths"][...])
        if lengths.ndim == 2:
            lengths = lengths[:, 0]
        if lengths.ndim != 1:
            raise FeatureError(f"seqLengths has shape {lengths.shape}; expected (U,) or (U, k)",
                               path=self.path)
        tags = [t.decode() if isinstance(t, bytes) else str(t) for t in self._file["seqTags"][...]]
        if len(tags) != len(lengths):
            raise FeatureError(f"{len(tags)} seqTags but {len(lengths)} seqLengths",
                               path=self.path)
        if self._inputs.ndim != 2:
            raise FeatureError(f"inputs has shape {self._inputs.shape}; expected (sum T, F)",
                               path=self.path)
        if int(lengths.sum()) != self._inputs.shape[0]:
            raise FeatureError(f"seqLengths sum to {int(lengths.sum())} frames but inputs has "
                               f"{self._inputs.shape[0]}", path=self.path)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        self._spans = {tag: (int(offsets[i]), int(offsets[i + 1])) for i, tag in enumerate(tags)}
        self._tags = tags

    def _keys(self) -> list[str]:
        return self._tags

    def _load(self, utt_id: str) -> np.ndarray:
        start, end = self._spans[utt_id]
        return self._inputs[start:end]

    def _num_frames(self, utt_id: str) -> int:
        start, end = self._spans[utt_id]
        return end - start

    def close(self) -> None:
        self._file.close()
