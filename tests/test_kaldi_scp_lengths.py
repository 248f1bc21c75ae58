"""Frame counts of a Kaldi script file come from the matrix headers, without loading the
matrices, and equal what kaldiio loads; anything else falls back to loading."""

from __future__ import annotations

import kaldiio
import numpy as np
import pytest

from gpudecode.io.errors import FeatureError
from gpudecode.io.kaldi import KaldiScpSource, _matrix_rows

FRAMES = [7, 1, 30, 12, 0, 5]


def _utts(dtype, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"u{i}": rng.standard_normal((n, 3)).astype(dtype) for i, n in enumerate(FRAMES)}


def _entries(scp) -> dict[str, str]:
    return dict(line.split(None, 1) for line in scp.read_text().splitlines())


def _expected(scp) -> dict[str, int]:
    """The oracle: kaldiio loads each entry."""
    return {key: kaldiio.load_mat(entry.strip()).shape[0] for key, entry in _entries(scp).items()}


def _write(tmp_path, name, utts, **kwargs):
    ark, scp = tmp_path / f"{name}.ark", tmp_path / f"{name}.scp"
    kaldiio.save_ark(str(ark), utts, scp=str(scp), **kwargs)
    return scp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_binary_matrices_are_counted_from_their_headers(tmp_path, loads, dtype):
    scp = _write(tmp_path, "feats", _utts(dtype))
    expected = _expected(scp)
    loads.clear()
    source = KaldiScpSource(scp)
    assert source.lengths() == expected == dict(zip(_utts(dtype), FRAMES))
    assert loads == []  # no matrix was loaded
    assert source._ark is None  # the archive was closed
    assert source.read("u2").features.shape == (30, 3)  # loading still works


@pytest.mark.parametrize("method,token", [(2, b"CM "), (3, b"CM2 "), (5, b"CM3 ")])
def test_compressed_matrices_are_counted_from_their_headers(tmp_path, loads, method, token):
    utts = {k: v for k, v in _utts(np.float32).items() if len(v)}
    scp = _write(tmp_path, "cm", utts, compression_method=method)
    entry = _entries(scp)["u0"]
    ark, offset = entry.rsplit(":", 1)
    with open(ark, "rb") as fd:
        fd.seek(int(offset))
        assert fd.read(2 + len(token)) == b"\0B" + token  # the compressed type was written
    expected = _expected(scp)
    loads.clear()
    assert KaldiScpSource(scp).lengths() == expected
    assert loads == []


def test_entries_at_shared_offsets_and_repeated_ids(tmp_path, loads):
    scp = _write(tmp_path, "feats", _utts(np.float32))
    entries = _entries(scp)
    repeated = tmp_path / "repeated.scp"
    lines = [f"r{i}-{key} {entries[key]}" for i in range(3) for key in ("u2", "u0", "u2")]
    lines += [f"s{i} {entries['u3']}" for i in range(4)]
    repeated.write_text("\n".join(lines) + "\n")
    expected = _expected(repeated)
    loads.clear()
    lengths = KaldiScpSource(repeated).lengths()
    assert lengths == expected and lengths["s3"] == 12 and lengths["r2-u0"] == 7
    assert loads == []


def test_entries_over_several_archives_and_relative_paths(tmp_path, loads, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kaldiio.save_ark("a.ark", _utts(np.float32, 1), scp="a.scp")
    kaldiio.save_ark("b.ark", _utts(np.float64, 2), scp="b.scp")
    a, b = (tmp_path / "a.scp").read_text().splitlines(), (tmp_path / "b.scp").read_text().splitlines()
    mixed = tmp_path / "mixed.scp"
    mixed.write_text("".join(f"a{x}\nb{y}\n" for x, y in zip(a, b)))  # alternating archives
    expected = _expected(mixed)
    loads.clear()
    assert KaldiScpSource("mixed.scp").lengths() == expected
    assert loads == []


def test_other_entries_fall_back_to_loading(tmp_path, loads):
    binary = _entries(_write(tmp_path, "feats", _utts(np.float32)))
    text = _entries(_write(tmp_path, "text", _utts(np.float32), text=True))
    vectors = _entries(_write(tmp_path, "vec", {"v": np.arange(9, dtype=np.float32)}))
    ark, offset = binary["u2"].rsplit(":", 1)
    scp = tmp_path / "mixed.scp"
    fallback = {
        "text0": text["u0"], "text2": text["u2"],  # a text archive
        "range": f"{binary['u2']}[3:11]",  # rows 3..11
        "range-cols": f"{binary['u2']}[:,0:1]",
        "pipe": f"tail -c +{int(offset) + 1} {ark} |",
        "vector": vectors["v"],
    }
    direct = {"bin0": binary["u0"], "bin3": binary["u3"]}
    scp.write_text("".join(f"{k} {v}\n" for k, v in {**direct, **fallback}.items()))
    expected = _expected(scp)
    assert expected["range"] == 9 and expected["pipe"] == 30 and expected["vector"] == 9
    loads.clear()
    assert KaldiScpSource(scp).lengths() == expected
    assert sorted(loads) == sorted(fallback.values())  # each fallback loaded once, the rest none


def test_a_missing_archive_is_a_feature_error(tmp_path):
    scp = _write(tmp_path, "feats", _utts(np.float32))
    bad = tmp_path / "bad.scp"
    bad.write_text(scp.read_text() + f"gone {tmp_path / 'nope.ark'}:12\n")
    with pytest.raises(FeatureError, match=r"gone.*FileNotFoundError"):
        KaldiScpSource(bad).lengths()
    source = KaldiScpSource(bad, on_error="skip")
    assert set(source.lengths()) == set(_utts(np.float32)) and len(source.skipped) == 1


@pytest.mark.parametrize("header,rows", [
    (b"\0BFM \4\x05\0\0\0\4\x03\0\0\0", 5),
    (b"\0BDM \4\x00\x01\0\0\4\x03\0\0\0", 256),
    (b"\0BCM2 " + bytes(8) + b"\x02\0\0\0\x03\0\0\0", 2),
    (b"\0BFV \4\x05\0\0\0", None),  # a vector
    (b"\0B\4\x05\0\0\0", None),  # an int32 vector
    (b"\0BFM \4\x05\0", None),  # cut short
    (b"\0BFM \x08\x05\0\0\0\4\x03\0\0\0", None),  # not a 4-byte size
    (b"\0BFM \4\xff\xff\xff\xff\4\x03\0\0\0", None),  # negative rows
    (b" [\n 1 2 ]\n", None),  # text
    (b"", None),
])
def test_matrix_rows(header, rows):
    assert _matrix_rows(header) == rows
