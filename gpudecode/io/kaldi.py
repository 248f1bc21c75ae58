"""Kaldi archives (``.ark``) and script files (``.scp``) through kaldiio; uncompressed binary
matrices at a plain offset are read straight from the archive (``_MatrixReader``)."""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Sequence
from typing import BinaryIO

import numpy as np

from gpudecode.io.errors import FeatureError
from gpudecode.io.features import FeatureSource, PaddedBatch, Utterance


class KaldiArkSource(FeatureSource):
    """An ``.ark``: one sequential pass indexes the ids, frame counts and byte offsets; then
    each utterance is read on demand from its offset (``_MatrixReader``, else kaldiio)."""

    format = "kaldi-ark"

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        import kaldiio

        self._matrices = _MatrixReader()
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

        offset = self._offsets[utt_id]
        matrix = self._matrices.read(str(self.path), offset)
        return kaldiio.load_mat(f"{self.path}:{offset}") if matrix is None else matrix

    def _num_frames(self, utt_id: str) -> int:
        return self._frames[utt_id]

    def close(self) -> None:
        """Close the archive that reading matrices left open."""
        self._matrices.close()


class KaldiScpSource(FeatureSource):
    """An ``.scp`` (``<id> <ark-path>:<offset>`` per line), read lazily: uncompressed binary
    matrices of a plain ``<ark-path>:<offset>`` entry by ``_MatrixReader``, the rest by kaldiio.
    Frame counts come from the matrix headers alone where the entry is a plain one."""

    format = "kaldi-scp"

    def __init__(self, path, *, span_reads: bool = True, **kwargs):
        """``span_reads``: a batch read a stretch of its archive per ``os.preadv`` (else one a
        matrix; ``_MatrixReader``'s ``spans``)."""
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
        self._matrices = _MatrixReader(spans=span_reads)
        #: per id, (archive, offset, rows, cols) of a float32 matrix as its header said in lengths()
        self._float32: dict[str, tuple[str, int, int, int]] = {}
        self._headers: dict[tuple[str, int], bytes] = {}  # the headers lengths() read, by entry

    def _keys(self) -> list[str]:
        return self._order

    def _load(self, utt_id: str) -> np.ndarray:
        import kaldiio

        entry = self._entries[utt_id]
        located = _ark_offset(entry)
        matrix = None if located is None else self._matrices.read(*located)
        return kaldiio.load_mat(entry) if matrix is None else matrix

    def _num_frames(self, utt_id: str) -> int:
        located = _ark_offset(self._entries[utt_id])
        header = None if located is None else self._header(*located)
        rows = None if header is None else _matrix_rows(header)
        if rows is None:
            return super()._num_frames(utt_id)
        layout = _plain_matrix(header)
        if layout is not None and layout[0] == np.float32:
            self._float32[utt_id] = (*located, layout[1], layout[2])
        return rows

    def _read_batch(self, utt_ids: Sequence[str]) -> PaddedBatch:
        """The batch read straight into its padded array (:meth:`_MatrixReader.read_padded`) where
        every utterance is a float32 matrix whose header ``lengths()`` read; else, or where that
        read finds anything else (a changed header, data cut short, NaN/Inf, a wrong dimension),
        utterance by utterance as :meth:`FeatureSource._read_batch` does (its checks, messages and
        skips)."""
        located = [self._float32.get(utt_id) for utt_id in utt_ids]
        padded = None if None in located else self._matrices.read_padded(located, self.num_features)
        if padded is None:
            return super()._read_batch(utt_ids)
        if self.num_features is None:
            self.num_features = padded.shape[2]
            self._features_from = f"as in utterance {utt_ids[0]!r}"
        return PaddedBatch([Utterance(utt_id, padded[i, :where[2]])
                            for i, (utt_id, where) in enumerate(zip(utt_ids, located))], padded)

    def lengths(self) -> dict[str, int]:
        """Frames per utterance id, from the matrix headers (one archive open at a time)."""
        try:
            return super().lengths()
        finally:
            self.close()

    def close(self) -> None:
        """Close the archives that reading headers and matrices left open."""
        if self._ark is not None:
            self._ark[1].close()
            self._ark = None
        self._matrices.close()

    def _header(self, ark: str, offset: int) -> bytes:
        """The first bytes of the entry at ``offset`` of ``ark`` (read once per entry: a script
        may list one matrix under several ids)."""
        header = self._headers.get((ark, offset))
        if header is None:
            header = self._headers[(ark, offset)] = self._read_header(ark, offset)
        return header

    def _read_header(self, ark: str, offset: int) -> bytes:
        if self._ark is None or self._ark[0] != ark:
            self.close()
            self._ark = (ark, open(ark, "rb", buffering=0))
            if hasattr(os, "posix_fadvise"):  # a few bytes per matrix: no read-ahead of the rest
                os.posix_fadvise(self._ark[1].fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        fd = self._ark[1]
        if hasattr(os, "pread"):
            return os.pread(fd.fileno(), _HEADER_BYTES, offset)
        fd.seek(offset)
        return fd.read(_HEADER_BYTES)


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
# An uncompressed matrix: "\0B", "FM " or "DM ", "\4" rows "\4" cols; its data follows.
_PLAIN_HEADER_BYTES = 2 + 3 + 2 * 5
_PLAIN_DTYPES = {b"FM ": np.dtype("<f4"), b"DM ": np.dtype("<f8")}


def _plain_matrix(header: bytes) -> tuple[np.dtype, int, int] | None:
    """``(dtype, rows, cols)`` of the uncompressed binary matrix (``FM``/``DM``, little-endian)
    whose first bytes are ``header``; None for anything else, a header cut short or a negative
    size."""
    dtype = _PLAIN_DTYPES.get(header[2:5]) if header[:2] == b"\0B" else None
    if dtype is None or len(header) < _PLAIN_HEADER_BYTES:
        return None
    rows_size, rows, cols_size, cols = struct.unpack_from("<BiBi", header, 5)
    if rows_size != 4 or cols_size != 4 or rows < 0 or cols < 0:
        return None
    return dtype, rows, cols


def _matrix_rows(header: bytes) -> int | None:
    """Rows of the binary Kaldi matrix whose first bytes are ``header`` (little-endian):
    ``FM``/``DM`` (``\\4`` rows ``\\4`` cols) or compressed ``CM``/``CM2``/``CM3`` (a global
    header: min, range, rows, cols); None for anything else (text, vectors, audio, …)."""
    if header[:2] != b"\0B":
        return None
    if header[2:5] in _PLAIN_DTYPES:
        layout = _plain_matrix(header)
        return None if layout is None else layout[1]
    token = next((t for t in _COMPRESSED if header[2:2 + len(t)] == t), None)
    if token is None or len(header) < 2 + len(token) + 16:
        return None
    rows = struct.unpack_from("<i", header, 2 + len(token) + 8)[0]
    return rows if rows >= 0 else None


class _MatrixReader:
    """Reads uncompressed binary matrices (``FM``/``DM``) straight from archives, a header and
    a data ``os.pread`` each, keeping the last archive open (kaldiio opens the archive and parses
    in Python per matrix). One thread at a time reads through it.

    ``spans`` (default): :meth:`read_padded` reads a batch's matrices in file order with one
    ``os.preadv`` per stretch of the archive (headers into one buffer, data straight into the
    padded rows, the bytes between into a scratch buffer) instead of one per matrix: every call
    gives the GIL up and must take it back, a wait of up to the interpreter's switch interval while
    another thread (the decoding loop, the writer) runs Python."""

    def __init__(self, spans: bool = True):
        self._ark: tuple[str, BinaryIO, int] | None = None  # path, open file, size when opened
        self.spans = spans
        self._scratch: memoryview | None = None  # where the bytes between a span's matrices go
        self.span_batches = 0  # batches read a span at a time

    def read(self, ark: str, offset: int) -> np.ndarray | None:
        """The ``FM``/``DM`` matrix at ``offset`` of ``ark`` as ``kaldiio.load_mat`` gives it (a
        read-only array over the bytes read); None for anything else, data cut short, or a file
        that cannot be opened or read: the caller then loads it through kaldiio."""
        if not hasattr(os, "pread"):
            return None
        try:
            _, file, size = self._open(ark)
            layout = _plain_matrix(os.pread(file.fileno(), _PLAIN_HEADER_BYTES, offset))
            if layout is None:
                return None
            dtype, rows, cols = layout
            start, data_bytes = offset + _PLAIN_HEADER_BYTES, rows * cols * dtype.itemsize
            if start + data_bytes > size:  # cut short; checked first, as pread allocates the size
                return None
            data = os.pread(file.fileno(), data_bytes, start)
        except OSError:
            return None
        if len(data) != data_bytes:
            return None
        return np.frombuffer(data, dtype=dtype).reshape(rows, cols)

    def read_padded(self, located: Sequence[tuple[str, int, int, int]], num_features: int | None):
        """[U, T_max, F] float32, zero-padded (as ``pad_features`` pads what :meth:`read` gives):
        the float32 matrices ``(archive, offset, rows, cols)``, headers and data, the data straight
        into its row — a span of each archive per ``os.preadv`` (``spans``) or one a matrix. A
        matrix listed under several ids is read once. None where that cannot give exactly what
        reading them one by one and checking them gives: no ``preadv`` or a big-endian host,
        columns that differ (or differ from ``num_features``), an empty matrix, a header other than
        the expected one, data cut short, an error, or a NaN/Inf anywhere (the caller then reads
        them one by one, which names the utterance and the frame)."""
        if not located or not hasattr(os, "preadv") or sys.byteorder != "little":
            return None
        cols = {where[3] for where in located}
        num_cols = cols.pop()
        if cols or (num_features is not None and num_cols != num_features) or num_cols == 0:
            return None
        if min(where[2] for where in located) == 0:
            return None
        padded = np.zeros((len(located), max(where[2] for where in located), num_cols), np.float32)
        first: dict[tuple[str, int], int] = {}  # the row that reads each matrix
        copies = []  # (row, the row that read the same matrix)
        for i, (ark, offset, rows, _) in enumerate(located):
            j = first.setdefault((ark, offset), i)
            if j != i:
                if located[j][2] != rows:
                    return None
                copies.append((i, j))
        unique = sorted(first.values(), key=lambda i: located[i][:2])
        read = self._read_spans if self.spans else self._read_each
        if not read([(i, *located[i][:3]) for i in unique], num_cols, padded):
            return None
        if copies:
            to, of = np.array(copies).T
            padded[to] = padded[of]
        if not (np.isfinite(padded.max()) and np.isfinite(padded.min())):  # NaN and ±Inf reach one of them
            return None
        self.span_batches += self.spans
        return padded

    def _read_spans(self, matrices, num_cols: int, padded: np.ndarray) -> bool:
        """``matrices`` ``(row, archive, offset, rows)`` in file order read by one ``os.preadv``
        per stretch of an archive (up to :data:`_SPAN_BUFFERS` buffers, gaps up to
        :data:`_SPAN_GAP` bytes read into scratch); False where a header differs, data is cut
        short, matrices overlap or a read fails."""
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SPAN_GAP))
        headers = bytearray(_PLAIN_HEADER_BYTES * len(matrices))
        header_views = memoryview(headers)
        buffers: list[memoryview] = []
        span = [None, 0, 0]  # archive, where the span starts, where it ends
        try:
            for k, (i, ark, offset, rows) in enumerate(matrices):
                gap = offset - span[2]
                if ark != span[0] or gap < 0 or gap > _SPAN_GAP or len(buffers) + 3 > _SPAN_BUFFERS:
                    if buffers and not self._read_span(span, buffers):
                        return False
                    if ark == span[0] and gap < 0:  # overlapping matrices: not an archive kaldiio wrote
                        return False
                    buffers, span, gap = [], [ark, offset, offset], 0
                if gap:
                    buffers.append(self._scratch[:gap])
                buffers.append(header_views[k * _PLAIN_HEADER_BYTES:(k + 1) * _PLAIN_HEADER_BYTES])
                buffers.append(memoryview(padded[i, :rows]).cast("B"))
                span[2] = offset + _PLAIN_HEADER_BYTES + rows * num_cols * 4
            if buffers and not self._read_span(span, buffers):
                return False
        except OSError:
            return False
        return headers == b"".join(_float32_header(rows, num_cols) for _, _, _, rows in matrices)

    def _read_span(self, span, buffers) -> bool:
        """One ``os.preadv`` of ``buffers`` from ``span`` ``[archive, start, end]``; False where it
        reads less (the archive cut short)."""
        ark, start, end = span
        _, file, size = self._open(ark)
        return end <= size and os.preadv(file.fileno(), buffers, start) == end - start

    def _read_each(self, matrices, num_cols: int, padded: np.ndarray) -> bool:
        """``matrices`` ``(row, archive, offset, rows)`` read by one ``os.preadv`` a matrix, header
        and data, the data straight into its row; False where a header differs, data is cut short
        or a read fails."""
        header = bytearray(_PLAIN_HEADER_BYTES)
        try:
            for i, ark, offset, rows in matrices:
                _, file, size = self._open(ark)
                data_bytes = rows * num_cols * 4
                if offset + _PLAIN_HEADER_BYTES + data_bytes > size:
                    return False
                if os.preadv(file.fileno(), [header, memoryview(padded[i, :rows]).cast("B")], offset) != (
                        _PLAIN_HEADER_BYTES + data_bytes) or bytes(header) != _float32_header(rows, num_cols):
                    return False
        except OSError:
            return False
        return True

    def _open(self, ark: str) -> tuple[str, BinaryIO, int]:
        """``(path, open file, size)`` of ``ark``, kept open until another archive is read."""
        if self._ark is None or self._ark[0] != ark:
            self.close()
            file = open(ark, "rb", buffering=0)
            self._ark = (ark, file, os.fstat(file.fileno()).st_size)
        return self._ark

    def close(self) -> None:
        """Close the archive left open."""
        if self._ark is not None:
            self._ark[1].close()
            self._ark = None


#: buffers per ``os.preadv`` of a span (the system's limit, IOV_MAX, is 1,024 on Linux)
_SPAN_BUFFERS = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
#: the most bytes between two matrices that one span reads through (into scratch)
_SPAN_GAP = 1 << 20


#: the first bytes of an uncompressed float32 matrix's header (then "\4" rows "\4" cols)
_FLOAT32_MAGIC = b"\0BFM "


def _float32_header(rows: int, cols: int) -> bytes:
    """The header of an uncompressed float32 binary matrix of ``rows`` × ``cols``."""
    return _FLOAT32_MAGIC + struct.pack("<BiBi", 4, rows, 4, cols)
