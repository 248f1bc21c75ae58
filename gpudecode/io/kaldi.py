"""Kaldi archives (``.ark``) and script files (``.scp``) through kaldiio."""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

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
    """An ``.scp`` (``<id> <ark-path>:<offset>`` per line), read lazily by kaldiio. Frame counts
    come from the matrix headers alone where the entry is a plain ``<ark-path>:<offset>``."""

    format = "kaldi-scp"

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        import kaldiio  # noqa: F401  (a missing kaldiio fails here, not per utterance)

        if not self.path.is_file():
            raise FeatureError("file does not exist", path=self.path)
        try:
            self._entries = _read_scp(self.path)
        except Exception as exc:
            raise FeatureError(f"cannot read as a Kaldi script file: {exc}",
                               path=self.path) from exc
        self._order = list(self._entries)
        self._ark: tuple[str, BinaryIO] | None = None  # the archive open while lengths() reads

    def _keys(self) -> list[str]:
        return self._order

    def _load(self, utt_id: str) -> np.ndarray:
        import kaldiio

        return kaldiio.load_mat(self._entries[utt_id])

    def _num_frames(self, utt_id: str) -> int:
        located = _ark_offset(self._entries[utt_id])
        rows = None if located is None else self._header_rows(*located)
        return super()._num_frames(utt_id) if rows is None else rows

    def lengths(self) -> dict[str, int]:
        """Frames per utterance id, from the matrix headers (one archive open at a time)."""
        try:
            return super().lengths()
        finally:
            self.close()

    def close(self) -> None:
        """Close the archive that reading headers left open."""
        if self._ark is not None:
            self._ark[1].close()
            self._ark = None

    def _header_rows(self, ark: str, offset: int) -> int | None:
        """Rows from the matrix header at ``offset`` of ``ark`` (None: not a known header)."""
        if self._ark is None or self._ark[0] != ark:
            self.close()
            self._ark = (ark, open(ark, "rb", buffering=0))
            if hasattr(os, "posix_fadvise"):  # a few bytes per matrix: no read-ahead of the rest
                os.posix_fadvise(self._ark[1].fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        fd = self._ark[1]
        if hasattr(os, "pread"):
            return _matrix_rows(os.pread(fd.fileno(), _HEADER_BYTES, offset))
        fd.seek(offset)
        return _matrix_rows(fd.read(_HEADER_BYTES))


def _read_scp(path) -> dict[str, str]:
    """Entry per id, as ``kaldiio.load_scp`` reads a script file (a later line for an id wins)."""
    entries = {}
    with open(path, encoding="utf-8") as fd:
        for line in fd:
            parts = line.split(None, 1)
            if len(parts) != 2:
                raise ValueError(f"Invalid line is found:\n>   {line}")
            entries[parts[0]] = parts[1].rstrip()
    return entries


def _ark_offset(entry: str) -> tuple[str, int] | None:
    """``(ark-path, offset)`` of a plain ``<ark-path>:<offset>`` entry; None for anything else
    (a pipe, standard input, a range ``[...]``, no offset)."""
    ark, _, offset = entry.rpartition(":")
    if not (offset.isascii() and offset.isdigit()) or ark in ("", "-") or "[" in entry:
        return None
    if ark.strip().startswith("|") or ark.strip().endswith("|"):
        return None
    return ark, int(offset)


# "\0B", the type token and its space, then (FM/DM) "\4" rows "\4" cols or (CM*) 4 floats/ints.
_HEADER_BYTES = 2 + 4 + 16
_COMPRESSED = (b"CM ", b"CM2 ", b"CM3 ")


def _matrix_rows(header: bytes) -> int | None:
    """Rows of the binary Kaldi matrix whose first bytes are ``header`` (little-endian):
    ``FM``/``DM`` (``\\4`` rows ``\\4`` cols) or compressed ``CM``/``CM2``/``CM3`` (a global
    header: min, range, rows, cols); None for anything else (text, vectors, audio, …)."""
    if header[:2] != b"\0B":
        return None
    if header[2:5] in (b"FM ", b"DM "):
        if header[5:6] != b"\4" or header[10:11] != b"\4":
            return None
        rows = struct.unpack_from("<i", header, 6)[0]
    else:
        token = next((t for t in _COMPRESSED if header[2:2 + len(t)] == t), None)
        if token is None or len(header) < 2 + len(token) + 16:
            return None
        rows = struct.unpack_from("<i", header, 2 + len(token) + 8)[0]
    return rows if rows >= 0 else None
