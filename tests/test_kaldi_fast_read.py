"""Uncompressed binary matrices (``FM``/``DM``) of Kaldi archives are read straight from the
archive, bit for bit what kaldiio loads; every other entry, and an archive cut short, still goes
through kaldiio as before."""

from __future__ import annotations

import kaldiio
import numpy as np
import pytest

from gpudecode.io.errors import FeatureError
from gpudecode.io.features import check_features
from gpudecode.io.kaldi import KaldiArkSource, KaldiScpSource, _MatrixReader, _plain_matrix
from gpudecode.io.readers import open_features

SHAPES = [(7, 3), (1, 5), (12, 1), (1, 1), (300, 40), (0, 4)]


def _matrices(dtype, seed=0) -> dict[str, np.ndarray]:
    """Matrices of every shape in ``SHAPES``, one holding -0.0, NaN and +-Inf."""
    rng = np.random.default_rng(seed)
    utts = {f"m{i}": rng.standard_normal(shape).astype(dtype) for i, shape in enumerate(SHAPES)}
    utts["m0"][0, :] = [-0.0, np.nan, np.inf]
    utts["m0"][1, 0] = -np.inf
    return utts


def _others() -> dict[str, dict]:
    """Entries that are not uncompressed binary matrices: name -> (utterances, save_ark options)."""
    rng = np.random.default_rng(7)
    compressed = {f"c{i}": rng.standard_normal((n, 6)).astype(np.float32) for i, n in enumerate((9, 1, 40))}
    return {
        "cm": (compressed, {"compression_method": 2}),  # CM
        "cm2": (compressed, {"compression_method": 3}),  # CM2
        "cm3": (compressed, {"compression_method": 5}),  # CM3
        "fv": ({"v": rng.standard_normal(9).astype(np.float32)}, {}),
        "dv": ({"v": rng.standard_normal(4)}, {}),
        "text": ({"t": rng.standard_normal((3, 2)).astype(np.float32)}, {"text": True}),
    }


def _entries(scp) -> dict[str, str]:
    return dict(line.split(None, 1) for line in scp.read_text().splitlines())


def _save(tmp_path, name, utts, **kwargs):
    ark, scp = tmp_path / f"{name}.ark", tmp_path / f"{name}.scp"
    kaldiio.save_ark(str(ark), utts, scp=str(scp), **kwargs)
    return ark, scp


def _assert_identical(got, expected):
    """Same type, dtype, shape, flags that matter and bytes (NaN payloads and -0.0 included)."""
    assert type(got) is type(expected) is np.ndarray
    assert got.dtype == expected.dtype and got.dtype.str == expected.dtype.str
    assert got.shape == expected.shape
    assert got.flags.writeable == expected.flags.writeable
    assert got.flags.c_contiguous == expected.flags.c_contiguous
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matrices_equal_kaldiio_bit_for_bit(tmp_path, loads, dtype):
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path / 'm.ark'},{tmp_path / 'm.scp'}") as writer:
        for key, mat in _matrices(dtype).items():
            writer(key, mat)
    entries = _entries(tmp_path / "m.scp")
    expected = {key: kaldiio.load_mat(entry) for key, entry in entries.items()}
    from_ark = dict(kaldiio.load_ark(str(tmp_path / "m.ark")))
    loads.clear()
    with KaldiScpSource(tmp_path / "m.scp") as scp_source, KaldiArkSource(tmp_path / "m.ark") as ark_source:
        for key, want in expected.items():
            _assert_identical(want, from_ark[key])  # the two oracles agree
            _assert_identical(scp_source._load(key), want)
            _assert_identical(ark_source._load(key), want)
    assert loads == []  # every matrix read without kaldiio
    assert expected["m4"].shape == (300, 40) and expected["m5"].shape == (0, 4)


@pytest.mark.parametrize("cols", [40, 3, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_read_and_iteration_give_what_kaldiio_gives(tmp_path, loads, dtype, cols):
    rng = np.random.default_rng(cols)
    utts = {f"u{n}": rng.standard_normal((n, cols)).astype(dtype) for n in (7, 1, 300, 2)}
    ark, scp = _save(tmp_path, "m", utts)
    expected = {key: check_features(kaldiio.load_mat(entry), path=scp, utterance_id=key, num_features=None)
                for key, entry in _entries(scp).items()}
    loads.clear()
    for source in (open_features(scp), open_features(ark)):
        assert type(source) in (KaldiScpSource, KaldiArkSource)
        with source:
            got = {utt.id: utt.features for utt in source}
            assert list(got) == list(expected)
            for key, want in expected.items():
                _assert_identical(got[key], want)
                _assert_identical(source.read(key).features, want)
    assert loads == []


def test_other_entries_go_through_kaldiio_unchanged(tmp_path, loads):
    scp = tmp_path / "all.scp"
    lines, arks = [], {}
    for name, (utts, options) in _others().items():
        arks[name], part = _save(tmp_path, name, utts, **options)
        lines += [f"{name}-{key} {entry}" for key, entry in _entries(part).items()]
    fast = _entries(_save(tmp_path, "fm", _matrices(np.float32))[1])
    lines += [f"fm-{key} {entry}" for key, entry in fast.items()]
    ark, offset = fast["m4"].rsplit(":", 1)
    routed = {"range": f"{fast['m4']}[3:11]", "range-cols": f"{fast['m4']}[:,0:1]",
              "pipe": f"tail -c +{int(offset) + 1} {ark} |"}
    lines += [f"{key} {entry}" for key, entry in routed.items()]
    scp.write_text("\n".join(lines) + "\n")
    entries = _entries(scp)
    expected = {key: kaldiio.load_mat(entry) for key, entry in entries.items()}
    assert expected["range"].shape == (9, 40) and expected["pipe"].shape == (300, 40)
    loads.clear()
    with KaldiScpSource(scp) as source:
        for key, want in expected.items():
            _assert_identical(source._load(key), want)
    assert sorted(loads) == sorted(e for k, e in entries.items() if not k.startswith("fm-"))
    for name, (utts, _) in _others().items():  # an archive read as such: kaldiio for each
        loads.clear()
        loaded = dict(kaldiio.load_ark(str(arks[name])))
        with KaldiArkSource(arks[name]) as ark_source:
            for key in utts:
                _assert_identical(ark_source._load(key), loaded[key])
        assert len(loads) == len(utts)


def test_the_reader_takes_plain_matrices_only(tmp_path):
    reader = _MatrixReader()
    fast = _entries(_save(tmp_path, "fm", _matrices(np.float64))[1])
    ark, offset = fast["m1"].rsplit(":", 1)
    _assert_identical(reader.read(ark, int(offset)), kaldiio.load_mat(fast["m1"]))
    for name, (_, options) in _others().items():
        for entry in _entries(_save(tmp_path, name, _others()[name][0], **options)[1]).values():
            other_ark, other_offset = entry.rsplit(":", 1)
            assert reader.read(other_ark, int(other_offset)) is None, name
    assert reader.read(ark, int(offset) - 1) is None  # not at a header
    assert reader.read(str(tmp_path / "nope.ark"), 0) is None  # kaldiio reports the missing file
    reader.close()


@pytest.mark.parametrize("header,layout", [
    (b"\0BFM \4\x05\0\0\0\4\x03\0\0\0", (np.dtype("<f4"), 5, 3)),
    (b"\0BDM \4\x00\x01\0\0\4\x03\0\0\0" + b"\0" * 7, (np.dtype("<f8"), 256, 3)),
    (b"\0BFM \4\0\0\0\0\4\0\0\0\0", (np.dtype("<f4"), 0, 0)),
    (b"\0BFV \4\x05\0\0\0", None),  # a vector
    (b"\0BCM2 " + bytes(8) + b"\x02\0\0\0\x03\0\0\0", None),  # compressed
    (b"\0BFM \4\x05\0\0\0\4\x03\0", None),  # cut short
    (b"\0BFM \x08\x05\0\0\0\4\x03\0\0\0", None),  # not a 4-byte size
    (b"\0BFM \4\x05\0\0\0\4\xff\xff\xff\xff", None),  # negative cols
    (b"\0BFM \4\xff\xff\xff\xff\4\x03\0\0\0", None),  # negative rows
    (b"\0bFM \4\x05\0\0\0\4\x03\0\0\0", None),  # not binary
    (b"", None),
])
def test_plain_matrix(header, layout):
    assert _plain_matrix(header) == layout


def _kaldiio_error(entry) -> str:
    """The message ``read`` gives for what kaldiio raises on ``entry``."""
    with pytest.raises(Exception) as raised:
        kaldiio.load_mat(entry)
    return f"cannot read: {type(raised.value).__name__}: {raised.value}"


@pytest.mark.parametrize("cut", ["data", "header"])
@pytest.mark.parametrize("opened_first", [False, True])
def test_an_archive_cut_short_fails_as_kaldiio_does(tmp_path, loads, cut, opened_first):
    utts = {k: v for k, v in _matrices(np.float32, seed=5).items() if k not in ("m0", "m5")}
    ark, scp = _save(tmp_path, "m", utts)
    entries = _entries(scp)
    last = list(utts)[-1]  # (300, 40): 48,000 bytes of data after a 15-byte header
    offset = int(entries[last].rsplit(":", 1)[1])
    scp_source, ark_source = KaldiScpSource(scp), KaldiArkSource(ark)  # the index wants it whole
    if opened_first:  # the archive is open (its size read) before it is cut: a short pread
        scp_source.read(list(utts)[0])
        ark_source.read(list(utts)[0])
    with open(ark, "r+b") as fd:
        fd.truncate(offset + (15 + 4 * 100 + 2 if cut == "data" else 9))
    message = _kaldiio_error(entries[last])
    loads.clear()
    for source in (scp_source, ark_source):
        with pytest.raises(FeatureError) as raised:
            source.read(last)
        assert raised.value.problem == message and raised.value.path == str(source.path)
        assert raised.value.utterance_id == last
    assert loads == [entries[last]] * 2  # no garbage from the fast path: kaldiio said it
    for key in list(utts)[:-1]:  # the rest still reads
        _assert_identical(scp_source._load(key), kaldiio.load_mat(entries[key]))
    scp_source.close()
    ark_source.close()


def test_a_missing_archive_fails_as_before(tmp_path, loads):
    _, scp = _save(tmp_path, "m", _matrices(np.float32))
    bad = tmp_path / "bad.scp"
    entry = f"{tmp_path / 'nope.ark'}:12"
    bad.write_text(scp.read_text() + f"gone {entry}\n")
    with KaldiScpSource(bad) as source, pytest.raises(FeatureError) as raised:
        source.read("gone")
    assert raised.value.problem == _kaldiio_error(entry)
    assert "FileNotFoundError" in raised.value.problem and entry in loads


def test_archives_switch_and_close(tmp_path, loads, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative archive paths, as kaldiio resolves them
    kaldiio.save_ark("a.ark", _matrices(np.float32, 1), scp="a.scp")
    kaldiio.save_ark("b.ark", _matrices(np.float64, 2), scp="b.scp")
    a, b = (tmp_path / "a.scp").read_text().splitlines(), (tmp_path / "b.scp").read_text().splitlines()
    mixed = tmp_path / "mixed.scp"
    mixed.write_text("".join(f"a{x}\nb{y}\n" for x, y in zip(a, b)))  # alternating archives
    expected = {key: kaldiio.load_mat(entry) for key, entry in _entries(mixed).items()}
    loads.clear()
    source = KaldiScpSource("mixed.scp")
    for _ in range(2):
        for key, want in expected.items():
            _assert_identical(source._load(key), want)
    held = source._matrices._ark[1]
    assert not held.closed and held.name == "b.ark"
    source.lengths()  # closes what it opened, and the matrix archive with it
    assert held.closed and source._matrices._ark is None
    _assert_identical(source._load("am3"), expected["am3"])  # reopened
    held = source._matrices._ark[1]
    source.close()
    assert held.closed and source._matrices._ark is None
    assert loads == []

    ark_source = KaldiArkSource("a.ark")
    with ark_source:
        _assert_identical(ark_source._load("m2"), expected["am2"])
        held = ark_source._matrices._ark[1]
    assert held.closed and ark_source._matrices._ark is None
