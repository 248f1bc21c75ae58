"""The numba-compiled batch copy of :meth:`gpudecode.io.kaldi._MatrixReader.read_padded` (imported
only where numba is): a batch's float32 matrices copied from a memory-mapped archive into their
padded rows in one call that runs without the GIL, so a reader thread takes the GIL once a batch
instead of once a matrix."""

from __future__ import annotations

import numpy as np
from numba import njit

@njit(cache=True, inline="always")
def _int32_at(archive, at):
    """The little-endian int32 at byte ``at`` of ``archive`` (uint8)."""
    value = (np.int64(archive[at]) | (np.int64(archive[at + 1]) << 8) | (np.int64(archive[at + 2]) << 16)
             | (np.int64(archive[at + 3]) << 24))
    return value - (np.int64(1) << 32) if value >= (np.int64(1) << 31) else value


@njit(cache=True, nogil=True)
def copy_float32_matrices(archive, offsets, rows, cols, token, out):
    """Row i of ``out`` [U, W] (the uint8 view of a padded float32 batch, W = T_max · cols · 4):
    the data of the float32 matrix of ``rows[i]`` × ``cols`` whose header starts at byte
    ``offsets[i]`` of ``archive`` (uint8): ``token`` (uint8, "\\0BFM "), then "\\4" rows "\\4"
    cols as little-endian int32; zeros after the data. Returns the first i whose header is not
    exactly that matrix's, or whose data passes the archive's end or the row (row i and those
    after it unwritten), else -1."""
    size = archive.shape[0]
    width = out.shape[1]
    sizes = token.shape[0]  # where the rows' size byte is
    header = sizes + 10
    for i in range(offsets.shape[0]):
        start = offsets[i]
        count = rows[i] * cols * 4
        if start < 0 or count > width or start + header + count > size:
            return i
        for k in range(sizes):
            if archive[start + k] != token[k]:
                return i
        if (archive[start + sizes] != 4 or archive[start + sizes + 5] != 4
                or _int32_at(archive, start + sizes + 1) != rows[i] or _int32_at(archive, start + sizes + 6) != cols):
            return i
        data = start + header
        row = out[i]
        row[:count] = archive[data:data + count]
        row[count:] = 0
    return -1
