"""One ``.npz`` archive; each array is one utterance and its key is the id."""

from __future__ import annotations

import zipfile

import numpy as np

from gpudecode.io.errors import FeatureError
from gpudecode.io.features import FeatureSource


class NpzSource(FeatureSource):
    format = "npz"

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        try:
            self._npz = np.load(self.path, allow_pickle=False)
        except FileNotFoundError as exc:
            raise FeatureError("file does not exist", path=self.path) from exc
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise FeatureError(f"cannot read as .npz: {exc}", path=self.path) from exc
        if not isinstance(self._npz, np.lib.npyio.NpzFile):
            raise FeatureError("not an .npz archive (a single array; use a folder of .npy "
                               "files or an .npz)", path=self.path)

    def _keys(self) -> list[str]:
        return list(self._npz.files)

    def _load(self, utt_id: str) -> np.ndarray:
        return self._npz[utt_id]

    def close(self) -> None:
        self._npz.close()
