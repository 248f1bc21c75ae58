"""The FSDD connected-digit recipe (examples/fsdd/): front-end settings, grammar, data script.

The data tests need the FSDD recordings at ``../shared/data/fsdd/recordings`` (beside the
repository root) and are skipped without them. Training is not tested here (no torch in CI).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpudecode.io import open_features
from gpudecode.io.frontend import FrontEndError, LogMelOptions, mel_filterbank

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO_ROOT / "examples" / "fsdd"
FSDD_DIR = REPO_ROOT.parent / "shared" / "data" / "fsdd"
if str(RECIPE_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPE_DIR))

import fsdd_common
import fsdd_grammar as grammar

needs_fsdd = pytest.mark.skipif(
    not (FSDD_DIR / "recordings").is_dir(),
    reason=f"FSDD recordings not found at {FSDD_DIR / 'recordings'} (the shared data folder "
           f"beside the repository root)")


# --- front end ---------------------------------------------------------------------------------

def test_front_end_has_no_empty_mel_filter_at_8khz():
    opts = LogMelOptions(**fsdd_common.FRONT_END)
    assert (opts.sample_rate_hz, opts.num_mel_bins, opts.padded_fft_size) == (8000, 40, 256)
    weights = mel_filterbank(opts)  # raises on an empty filter
    assert weights.shape == (40, 129)
    assert (weights.max(axis=1) > 0).all()


def test_front_end_options_are_valid_config_keys():
    from gpudecode.config import FrontEndConfig

    config = FrontEndConfig(**fsdd_common.FRONT_END)
    assert LogMelOptions.from_any(config) == LogMelOptions(**fsdd_common.FRONT_END)


@pytest.mark.parametrize("num_mel_bins, fft_size, window_ms, message", [
    (80, 128, 16.0, "all-zero weights"),    # 62.5 Hz FFT bins, narrow low filters
    (64, 128, 16.0, "all-zero weights"),
    (100, 256, 25.0, "all-zero weights"),
    (80, 128, 25.0, "shorter than the window"),  # 200 samples do not fit a 128-point FFT
])
def test_too_many_mel_bins_at_8khz_are_rejected(num_mel_bins, fft_size, window_ms, message):
    opts = LogMelOptions(**{**fsdd_common.FRONT_END, "num_mel_bins": num_mel_bins,
                            "fft_size": fft_size, "window_ms": window_ms})
    with pytest.raises(FrontEndError, match=message):
        mel_filterbank(opts)


# --- grammar -----------------------------------------------------------------------------------

def test_grammar_generates_only_valid_strings_of_1_to_10_digits():
    rng = np.random.default_rng(0)
    seen_categories, seen_lengths = set(), set()
    for _ in range(5000):
        category, digits = grammar.sample(rng)
        assert digits.isdigit() and 1 <= len(digits) <= 10, (category, digits)
        low, high = grammar.CATEGORIES[category].num_digits
        assert low <= len(digits) <= high, (category, digits)
        assert grammar.CATEGORIES[category].is_valid(digits), (category, digits)
        assert grammar.is_valid(digits)
        assert grammar.words_to_digits(grammar.digits_to_words(digits)) == digits
        seen_categories.add(category)
        seen_lengths.add(len(digits))
    assert seen_categories == set(grammar.CATEGORIES)
    assert seen_lengths == set(range(1, 11))


@pytest.mark.parametrize("category, digits", [
    ("date", "3002"), ("date", "0013"), ("time24", "2460"), ("time24", "1275"),
    ("time12", "1330"), ("phone", "1234567890"), ("phone_local", "0123456"),
    ("account", "666123456"), ("year", "2100"), ("amount", "012"), ("count", "07"),
])
def test_grammar_validators_reject_invalid_items(category, digits):
    assert not grammar.CATEGORIES[category].is_valid(digits)


def test_grammar_language_bounds():
    assert not grammar.is_valid("")
    assert not grammar.is_valid("12345678901")
    assert grammar.is_valid("2412")  # 24 Dec (date); 4 digits are also a pin


def test_grammar_is_deterministic():
    first = [grammar.sample(np.random.default_rng(7)) for _ in range(3)]
    assert first == [grammar.sample(np.random.default_rng(7)) for _ in range(3)]


# --- make_data.py ------------------------------------------------------------------------------

def _make_data(out: Path, seed: int = 3) -> Path:
    subprocess.run(
        [sys.executable, str(RECIPE_DIR / "make_data.py"), "--recordings",
         str(FSDD_DIR / "recordings"), "--out", str(out), "--seed", str(seed), "--num-train", "12",
         "--num-dev", "5", "--num-test", "6", "--num-lm-sentences", "20", "--wav-splits", "test"],
        check=True, capture_output=True, text=True, cwd=REPO_ROOT)
    return out


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    if not (FSDD_DIR / "recordings").is_dir():
        pytest.skip(f"FSDD recordings not found at {FSDD_DIR / 'recordings'}")
    return _make_data(tmp_path_factory.mktemp("fsdd") / "data")


def _read_hdf5(path: Path) -> dict[str, np.ndarray]:
    import h5py

    with h5py.File(path, "r") as f:
        return {k: f[k][...] for k in ("inputs", "seqLengths", "seqTags", "targets/data/classes")}


@needs_fsdd
def test_make_data_is_deterministic(tiny_data, tmp_path):
    again = _make_data(tmp_path / "again")
    for name in ("vocab.txt", "front_end.json", "lm_text.txt"):
        assert (again / name).read_bytes() == (tiny_data / name).read_bytes(), name
    for split in fsdd_common.SPLITS:
        for name in ("text", "manifest.jsonl", "feats.ark"):
            assert (again / split / name).read_bytes() == (tiny_data / split / name).read_bytes()
        a, b = _read_hdf5(again / split / "feats.h5"), _read_hdf5(tiny_data / split / "feats.h5")
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{split}/feats.h5:{key}")
    other = _make_data(tmp_path / "other", seed=4)
    assert (other / "train" / "text").read_text() != (tiny_data / "train" / "text").read_text()


@needs_fsdd
def test_make_data_keeps_splits_disjoint_by_recording_index(tiny_data):
    used = {}
    for split, indices in fsdd_common.SPLITS.items():
        records = [json.loads(line) for line in
                   (tiny_data / split / "manifest.jsonl").read_text().splitlines()]
        used[split] = {name for r in records for name in r["recordings"]}
        for record in records:
            assert len(record["recordings"]) == len(record["digits"])
            for name, digit in zip(record["recordings"], record["digits"]):
                rec_digit, speaker, index = name.removesuffix(".wav").split("_")
                assert rec_digit == digit and speaker == record["speaker"]
                assert int(index) in indices, f"{name} in the {split} split"
            assert grammar.CATEGORIES[record["category"]].is_valid(record["digits"])
    assert not used["train"] & used["dev"]
    assert not used["train"] & used["test"]
    assert not used["dev"] & used["test"]


@needs_fsdd
@pytest.mark.parametrize("split", list(fsdd_common.SPLITS))
def test_make_data_features_read_back_with_transcript_ids(tiny_data, split):
    folder = tiny_data / split
    refs = fsdd_common.read_text(folder / "text")
    vocab = (tiny_data / "vocab.txt").read_text().split()
    assert vocab == list(fsdd_common.VOCABULARY)
    sources = ["feats.h5", "feats.ark", "feats.scp"] + (["wav.scp"] if split == "test" else [])
    reference = None
    for name in sources:
        front_end = json.loads((tiny_data / "front_end.json").read_text())
        source = open_features(folder / name, front_end=front_end)
        assert source.ids() == list(refs), name
        feats = {u.id: u.features for u in source}
        assert all(f.shape[1] == 40 and f.dtype == np.float32 for f in feats.values())
        if reference is None:
            reference = feats
        else:  # ark, scp and the wav files through the front end give the HDF5 features
            for utt_id, f in feats.items():
                np.testing.assert_allclose(f, reference[utt_id], atol=1e-5, err_msg=name)
    data = _read_hdf5(folder / "feats.h5")
    labels = np.split(data["targets/data/classes"], np.cumsum(data["seqLengths"][:, 1])[:-1])
    for (utt_id, words), label in zip(refs.items(), labels):
        assert [vocab[i] for i in label] == words, utt_id
        assert 1 <= len(words) <= 10
        assert grammar.is_valid(grammar.words_to_digits(words))


# --- leave-one-speaker-out folds (make_data.py --test-speaker) ---------------------------------

FOLD_SPEAKER = "theo"


def _manifest(folder: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (folder / split / "manifest.jsonl").read_text().splitlines()]


def _used(records: list[dict]) -> list[tuple[str, int]]:
    """(speaker, recording index) of every recording the records use, from the file names."""
    out = []
    for record in records:
        for name in record["recordings"]:
            _, speaker, index = name.removesuffix(".wav").split("_")
            out.append((speaker, int(index)))
    return out


@pytest.fixture(scope="module")
def fold_data(tmp_path_factory) -> Path:
    if not (FSDD_DIR / "recordings").is_dir():
        pytest.skip(f"FSDD recordings not found at {FSDD_DIR / 'recordings'}")
    out = tmp_path_factory.mktemp("fsdd-fold") / "data"
    subprocess.run(
        [sys.executable, str(RECIPE_DIR / "make_data.py"), "--recordings", str(FSDD_DIR / "recordings"),
         "--out", str(out), "--test-speaker", FOLD_SPEAKER, "--num-train", "40", "--num-dev", "24",
         "--num-test", "10", "--num-lm-sentences", "0", "--wav-splits", ""],
        check=True, capture_output=True, text=True, cwd=REPO_ROOT)
    return out


def test_fold_rule_speakers_and_indices():
    speakers = ["george", "jackson", "nicolas", "theo", "yweweler"]
    assert fsdd_common.split_speakers("test", speakers, "theo") == ["theo"]
    assert fsdd_common.split_speakers("train", speakers, "theo") == ["george", "jackson", "nicolas", "yweweler"]
    assert fsdd_common.split_speakers("dev", speakers, "theo") == ["george", "jackson", "nicolas", "yweweler"]
    assert fsdd_common.split_speakers("test", speakers) == speakers
    assert list(fsdd_common.split_indices("test", "theo")) == list(range(50))
    assert list(fsdd_common.split_indices("dev", "theo")) == list(range(10))
    assert list(fsdd_common.split_indices("train", "theo")) == list(range(10, 50))
    assert [list(fsdd_common.split_indices(s)) for s in ("train", "dev", "test")] == [
        list(range(10, 50)), list(range(5, 10)), list(range(5))]
    with pytest.raises(ValueError, match="not one of"):
        fsdd_common.split_speakers("test", speakers, "bob")


@needs_fsdd
def test_fold_test_split_is_spoken_only_by_the_test_speaker(fold_data):
    records = _manifest(fold_data, "test")
    assert len(records) == 10
    assert {r["speaker"] for r in records} == {FOLD_SPEAKER}
    assert all(utt_id.endswith(f"-{FOLD_SPEAKER}") for utt_id in fsdd_common.read_text(fold_data / "test" / "text"))
    used = _used(records)
    assert {speaker for speaker, _ in used} == {FOLD_SPEAKER}
    assert all(0 <= index <= 49 for _, index in used)
    assert any(index >= 10 for _, index in used)  # every index, not only FSDD's test 0-4


@needs_fsdd
@pytest.mark.parametrize("split, low, high", [("train", 10, 49), ("dev", 0, 9)])
def test_fold_train_and_dev_never_hear_the_test_speaker(fold_data, split, low, high):
    records = _manifest(fold_data, split)
    used = _used(records)
    assert FOLD_SPEAKER not in {r["speaker"] for r in records}
    assert FOLD_SPEAKER not in {speaker for speaker, _ in used}
    assert {speaker for speaker, _ in used} == {"george", "jackson", "nicolas", "yweweler"}
    assert all(low <= index <= high for _, index in used), sorted({i for _, i in used})
    if split == "dev":  # the fold's dev also takes indices 0-4 (the seen-speaker split's test)
        assert any(index < 5 for _, index in used)


@needs_fsdd
def test_fold_splits_share_no_recording(fold_data):
    used = {split: set(_used(_manifest(fold_data, split))) for split in ("train", "dev", "test")}
    assert not used["train"] & used["dev"]
    assert not used["train"] & used["test"]
    assert not used["dev"] & used["test"]


@needs_fsdd
def test_without_test_speaker_the_index_split_rule_holds(tiny_data):
    expected = {"train": range(10, 50), "dev": range(5, 10), "test": range(0, 5)}
    for split, indices in expected.items():
        used = _used(_manifest(tiny_data, split))
        assert all(index in indices for _, index in used), split
    assert len({r["speaker"] for r in _manifest(tiny_data, "train")}) > 1


@needs_fsdd
def test_unknown_test_speaker_is_refused(tmp_path):
    result = subprocess.run(
        [sys.executable, str(RECIPE_DIR / "make_data.py"), "--recordings", str(FSDD_DIR / "recordings"),
         "--out", str(tmp_path / "data"), "--test-speaker", "nobody", "--num-train", "2", "--num-dev", "1",
         "--num-test", "1", "--num-lm-sentences", "0"],
        capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode != 0
    assert "--test-speaker nobody: not a speaker" in result.stderr
