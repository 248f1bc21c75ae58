"""A script file's batches read straight into their padded arrays (``_MatrixReader.read_padded``)
equal the batches read utterance by utterance — kaldiio's matrices, checked and padded — and every
case the direct read cannot vouch for goes the per-utterance way, with its messages and skips.
Each test runs both direct reads: a ``preadv`` a matrix, and a ``preadv`` a stretch of the archive
(``span_reads``)."""

from __future__ import annotations

import kaldiio
import numpy as np
import pytest

from gpudecode.io.errors import FeatureError
from gpudecode.io.features import BatchSizing, check_features, pad_features
from gpudecode.io.kaldi import KaldiScpSource

SIZING = BatchSizing(utterances=3, frames=None, first=2)


@pytest.fixture(params=[False, True], ids=["preadv", "spans"])
def spans(request):
    """The direct reads of each source: one ``preadv`` a matrix, or one a stretch of the archive."""
    return request.param


def _save(tmp_path, utts, name="m", **kwargs):
    ark, scp = tmp_path / f"{name}.ark", tmp_path / f"{name}.scp"
    kaldiio.save_ark(str(ark), utts, scp=str(scp), **kwargs)
    return ark, scp


def _entries(scp) -> dict[str, str]:
    return dict(line.split(None, 1) for line in scp.read_text().splitlines())


def _oracle(scp, source_ids_batches):
    """Per batch: (ids, padded) from kaldiio's matrices, checked and padded one by one."""
    entries = _entries(scp)
    out = []
    for ids in source_ids_batches:
        feats = [check_features(kaldiio.load_mat(entries[u]), path=scp, utterance_id=u, num_features=None)
                 for u in ids]
        out.append((ids, pad_features(feats)))
    return out


class _CountingReads:
    """Stands in for one source's per-utterance reader: counts its reads (the direct batch read
    makes none)."""

    def __init__(self, reader):
        self.reader, self.calls = reader, 0

    def __call__(self, *args):
        self.calls += 1
        return self.reader(*args)


def _batches(source):
    counted = source._matrices.read = _CountingReads(source._matrices.read)  # this object's reader only
    batches = list(source.batches(SIZING))
    return batches, counted.calls


@pytest.mark.parametrize("cols", [40, 1])
def test_direct_batches_equal_the_per_utterance_ones(tmp_path, loads, cols, spans):
    rng = np.random.default_rng(cols)
    utts = {f"u{n}": rng.standard_normal((n, cols)).astype(np.float32) for n in (7, 1, 300, 2, 30, 30, 5)}
    utts["u7"][0, 0] = -0.0
    _, scp = _save(tmp_path, utts)
    lines = scp.read_text().splitlines()
    repeated = tmp_path / "repeated.scp"  # one matrix listed under several ids, as bench e2e --repeat does
    repeated.write_text("".join(f"{line.split()[0]}-r{k} {line.split()[1]}\n" for k in (1, 2) for line in lines))
    loads.clear()
    for path in (scp, repeated):
        with KaldiScpSource(path, span_reads=spans) as source:
            batches, per_utterance = _batches(source)
            assert source.num_features == cols
            # the span reads read every batch (they do not fall back unnoticed)
            assert source._matrices.span_batches == (len(batches) if spans else 0)
        assert per_utterance == 0 and loads == []  # every batch read directly
        expected = _oracle(path, [[u.id for u in batch] for batch in batches])
        assert sum(len(b) for b in batches) == len(_entries(path))
        for batch, (ids, padded) in zip(batches, expected):
            assert [u.id for u in batch] == ids
            assert batch.padded.dtype == np.float32 and batch.padded.tobytes() == padded.tobytes()
            for i, utt in enumerate(batch):
                want = padded[i, : utt.num_frames]
                assert utt.features.flags.c_contiguous and utt.features.base is batch.padded
                assert utt.features.tobytes() == want.tobytes()
        loads.clear()


def _mixed(tmp_path, bad: str):
    """An archive of float32 matrices and one ``bad`` entry among them."""
    rng = np.random.default_rng(3)
    utts = {f"u{i}": rng.standard_normal((n, 4)).astype(np.float32) for i, n in enumerate((9, 8, 7, 6))}
    if bad == "nan":
        utts["u1"][3, 2] = np.nan
    elif bad == "inf":
        utts["u2"][0, 0] = -np.inf
    elif bad == "float64":
        utts["u1"] = utts["u1"].astype(np.float64)
    elif bad == "cols":
        utts["u2"] = rng.standard_normal((7, 5)).astype(np.float32)
    elif bad == "empty":
        utts["u3"] = np.zeros((0, 4), np.float32)
    return utts


@pytest.mark.parametrize("bad", ["nan", "inf", "cols", "empty"])
@pytest.mark.parametrize("on_error", ["stop", "skip"])
def test_bad_utterances_go_the_per_utterance_way(tmp_path, bad, on_error, spans):
    utts = _mixed(tmp_path, bad)
    _, scp = _save(tmp_path, utts)
    bad_id = {"nan": "u1", "inf": "u2", "cols": "u2", "empty": "u3"}[bad]

    def run(source):
        try:
            return [[u.id for u in b] for b in source.batches(SIZING)], None
        except FeatureError as exc:
            return None, exc

    with KaldiScpSource(scp, on_error=on_error, span_reads=spans) as direct:
        got, error = run(direct)
        skipped = [str(e) for e in direct.skipped]
    # the oracle: the same source asked for its utterances one by one
    with KaldiScpSource(scp, on_error=on_error) as one_by_one:
        lengths = one_by_one.lengths()
        expected_error = expected_ids = None
        try:
            expected_ids = [u.id for u in (one_by_one._read_or_skip(k) for k in sorted(
                lengths, key=lambda k: -lengths[k])) if u is not None]
        except FeatureError as exc:
            expected_error = exc
        expected_skipped = [str(e) for e in one_by_one.skipped]
    if expected_error is not None:
        assert error is not None and str(error) == str(expected_error) and error.utterance_id == bad_id
    else:
        assert error is None and [u for b in got for u in b] == expected_ids and bad_id not in expected_ids
        assert skipped == expected_skipped and len(skipped) == 1


def test_float64_matrices_are_read_one_by_one(tmp_path, loads, spans):
    utts = _mixed(tmp_path, "float64")
    _, scp = _save(tmp_path, utts)
    loads.clear()
    with KaldiScpSource(scp, span_reads=spans) as source:
        batches, per_utterance = _batches(source)
    with_u1 = next(b for b in batches if "u1" in [u.id for u in b])
    assert per_utterance == len(with_u1)  # that batch one by one; the others directly
    expected = _oracle(scp, [[u.id for u in b] for b in batches])
    for batch, (_, padded) in zip(batches, expected):
        assert batch.padded.tobytes() == padded.tobytes()


def test_an_archive_changed_after_the_headers_were_read(tmp_path, loads, spans):
    rng = np.random.default_rng(5)
    utts = {f"u{n}": rng.standard_normal((n, 3)).astype(np.float32) for n in (6, 5, 4)}
    ark, scp = _save(tmp_path, utts)
    entries = _entries(scp)
    with KaldiScpSource(scp, span_reads=spans) as source:
        assert source.lengths()["u6"] == 6
        offset = int(entries["u6"].rsplit(":", 1)[1])
        with open(ark, "r+b") as fd:  # u6's header now says 5 rows (its first 5 rows stay valid data)
            fd.seek(offset + 6)
            fd.write(np.int32(5).tobytes())
        now = kaldiio.load_mat(entries["u6"])
        assert now.shape == (5, 3)
        loads.clear()
        batches, per_utterance = _batches(source)
    with_u6 = next(b for b in batches if "u6" in [u.id for u in b])
    assert per_utterance == len(with_u6) and loads == []  # that batch went one by one
    got = {u.id: u.features for b in batches for u in b}
    assert got["u6"].tobytes() == now.tobytes()  # what the archive holds now, not the 6 rows of before
    for key in ("u5", "u4"):
        assert got[key].tobytes() == utts[key].tobytes()


def test_a_batch_from_two_archives_is_read_a_span_of_each(tmp_path, loads):
    """A batch whose matrices lie in two archives, interleaved in the script, is read a span of
    each archive, and equals kaldiio's matrices."""
    rng = np.random.default_rng(7)
    first = {f"a{n}": rng.standard_normal((n, 2)).astype(np.float32) for n in (3, 6, 9)}
    second = {f"b{n}": rng.standard_normal((n, 2)).astype(np.float32) for n in (4, 7)}
    _, scp_a = _save(tmp_path, first, name="a")
    _, scp_b = _save(tmp_path, second, name="b")
    a, b = scp_a.read_text().splitlines(), scp_b.read_text().splitlines()
    both = tmp_path / "both.scp"
    both.write_text("\n".join([b[1], a[0], b[0], a[2], a[1]]) + "\n")
    loads.clear()
    with KaldiScpSource(both) as source:
        batches, per_utterance = _batches(source)
        spanned = source._matrices.span_batches
    archives = [{u.id[0] for u in batch} for batch in batches]
    assert per_utterance == 0 and loads == []  # every batch read directly
    assert {"a", "b"} in archives and spanned == len(batches)
    expected = _oracle(both, [[u.id for u in b] for b in batches])
    for batch, (_, padded) in zip(batches, expected):
        assert batch.padded.tobytes() == padded.tobytes()


def test_spans_split_at_the_buffer_limit_and_at_long_gaps(tmp_path, loads):
    """700 matrices in one batch (more than one ``preadv`` can take), every third listed, and one
    matrix beyond a gap longer than a span reads through: the batch equals kaldiio's matrices."""
    from gpudecode.io import kaldi

    rng = np.random.default_rng(11)
    utts = {f"u{k:04d}": rng.standard_normal((1 + k % 5, 3)).astype(np.float32) for k in range(2100)}
    utts["z"] = rng.standard_normal((kaldi._SPAN_GAP // 12 + 10, 3)).astype(np.float32)  # > _SPAN_GAP bytes
    utts["zz"] = rng.standard_normal((2, 3)).astype(np.float32)
    _, scp = _save(tmp_path, utts)
    lines = scp.read_text().splitlines()
    listed = tmp_path / "listed.scp"
    listed.write_text("\n".join(lines[:2100:3] + [lines[-1]]) + "\n")
    ids = [line.split()[0] for line in listed.read_text().splitlines()]
    assert len(ids) * 3 > kaldi._SPAN_BUFFERS
    loads.clear()
    with KaldiScpSource(listed) as source:
        source.lengths()
        batch = source._read_batch(ids)
        assert source._matrices.span_batches == 1 and loads == []
    (_, padded), = _oracle(listed, [ids])
    assert batch.padded.tobytes() == padded.tobytes()


@pytest.mark.parametrize("byte, value", [(0, 1), (1, ord("b")), (2, ord("D")), (4, 0), (5, 8), (6, 4), (10, 8),
                                         (11, 3)], ids=["binary", "B", "type", "space", "size", "rows",
                                                        "cols-size", "cols"])
def test_a_span_read_fails_on_any_header_byte_not_as_read(tmp_path, byte, value):
    """Two float32 matrices in one archive read as one span; any byte of the second's header
    changed (its token, either size byte, its rows or its columns), or its data cut short, and the
    read says so."""
    from gpudecode.io.kaldi import _float32_header, _MatrixReader

    first, second = np.arange(6, dtype=np.float32).reshape(3, 2), np.full((2, 2), 7, np.float32)
    archive = bytearray(b"x " + _float32_header(3, 2) + first.tobytes() + b"y " + _float32_header(2, 2)
                        + second.tobytes())
    offsets = [2, 2 + 15 + first.nbytes + 2]
    path = tmp_path / "m.ark"

    def read(data: bytes):
        path.write_bytes(data)
        reader = _MatrixReader()
        out = np.zeros((2, 3, 2), np.float32)
        ok = reader._read_spans([(0, str(path), offsets[0], 3), (1, str(path), offsets[1], 2)], 2, out)
        reader.close()
        return ok, out

    ok, out = read(bytes(archive))
    assert ok and out[0].tobytes() == first.tobytes() and out[1, :2].tobytes() == second.tobytes()
    changed = bytearray(archive)
    changed[offsets[1] + byte] = value
    assert not read(bytes(changed))[0]
    assert not read(bytes(archive[:-1]))[0]


def test_a_span_read_refuses_overlapping_matrices(tmp_path):
    """A second entry whose offset lies inside the first matrix's data (not an archive kaldiio
    writes): the span read says so instead of reading either."""
    from gpudecode.io.kaldi import _float32_header, _MatrixReader

    first = np.arange(12, dtype=np.float32).reshape(6, 2)
    path = tmp_path / "m.ark"
    path.write_bytes(b"x " + _float32_header(6, 2) + first.tobytes())
    reader = _MatrixReader()
    out = np.zeros((2, 6, 2), np.float32)
    assert not reader._read_spans([(0, str(path), 2, 6), (1, str(path), 2 + 15 + 8, 2)], 2, out)
    reader.close()
