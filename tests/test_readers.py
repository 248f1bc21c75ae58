"""Feature readers, the log-mel front end, bucketing and bad-input errors (all on generated
data in tmp_path)."""

from __future__ import annotations

import re

import h5py
import kaldiio
import numpy as np
import pytest
import soundfile

from gpudecode.io import (
    FeatureError,
    BatchSizing,
    FrontEndError,
    LogMelFrontEnd,
    LogMelOptions,
    bucket_by_length,
    detect_format,
    mel_filterbank,
    open_features,
)
from gpudecode.io.frontend import hz_to_mel, mel_to_hz

NUM_F = 5


@pytest.fixture
def utts() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = {"utt-a": 7, "utt-b": 3, "utt-c": 12, "utt-d": 1}
    return {k: rng.normal(size=(n, NUM_F)).astype(np.float32) for k, n in lengths.items()}


def _write_npy_dir(folder, utts):
    folder.mkdir()
    for k, v in utts.items():
        np.save(folder / f"{k}.npy", v)
    return folder


def _write_hdf5(path, utts, *, two_columns=False):
    lengths = np.array([len(v) for v in utts.values()], dtype=np.int32)
    with h5py.File(path, "w") as f:
        f["inputs"] = np.concatenate(list(utts.values()))
        f["seqLengths"] = np.stack([lengths, lengths], axis=1) if two_columns else lengths
        f["seqTags"] = np.array([k.encode() for k in utts], dtype="S")
    return path


def _write_ark(path, utts):
    kaldiio.save_ark(str(path), dict(utts))
    return path


def _write_scp(tmp_path, utts):
    with kaldiio.WriteHelper(f"ark,scp:{tmp_path / 'feats.ark'},{tmp_path / 'feats.scp'}") as w:
        for k, v in utts.items():
            w(k, v)
    return tmp_path / "feats.scp"


def _write_npz(path, utts):
    np.savez(path, **utts)
    return path


WRITERS = {
    "npy-dir": lambda tmp, u: _write_npy_dir(tmp / "feats", u),
    "npz": lambda tmp, u: _write_npz(tmp / "feats.npz", u),
    "hdf5": lambda tmp, u: _write_hdf5(tmp / "feats.hdf5", u),
    "kaldi-ark": lambda tmp, u: _write_ark(tmp / "feats.ark", u),
    "kaldi-scp": _write_scp,
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_reader_round_trip(tmp_path, utts, fmt):
    path = WRITERS[fmt](tmp_path, utts)
    assert detect_format(path) == fmt
    with open_features(path) as source:
        assert source.format == fmt
        read = {u.id: u.features for u in source}
        assert source.lengths() == {k: len(v) for k, v in utts.items()}
        np.testing.assert_array_equal(source.read("utt-c").features, utts["utt-c"])
    assert set(read) == set(utts)
    # File order is kept: a folder is read by file name, containers in stored order.
    assert list(read) == (sorted(utts) if fmt == "npy-dir" else list(utts))
    for k, v in utts.items():
        assert read[k].dtype == np.float32 and read[k].flags.c_contiguous
        np.testing.assert_array_equal(read[k], v)


def test_hdf5_two_column_seq_lengths(tmp_path, utts):
    path = _write_hdf5(tmp_path / "f.h5", utts, two_columns=True)
    with open_features(path, "hdf5") as source:
        assert [u.num_frames for u in source] == [len(v) for v in utts.values()]


def test_explicit_format_overrides_suffix(tmp_path, utts):
    path = _write_npz(tmp_path / "feats.npz", utts)
    renamed = path.rename(tmp_path / "feats.bin")
    with pytest.raises(FeatureError, match="cannot tell the feature format"):
        open_features(renamed)
    with open_features(renamed, format="npz") as source:
        assert len(source) == len(utts)


def test_float64_and_int_features_become_float32(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    np.save(folder / "a.npy", np.ones((3, 2), dtype=np.float64))
    np.save(folder / "b.npy", np.ones((2, 2), dtype=np.int16))
    assert [u.features.dtype for u in open_features(folder)] == [np.float32, np.float32]


# --- bucketing ------------------------------------------------------------------------------

def test_bucket_by_length_sorts_and_cuts():
    lengths = {"a": 5, "b": 9, "c": 1, "d": 9, "e": 3}
    assert bucket_by_length(lengths, 2) == [["b", "d"], ["a", "e"], ["c"]]
    assert bucket_by_length(list(lengths.items()), 3, longest_first=False) == [
        ["c", "e", "a"], ["b", "d"]]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        bucket_by_length(lengths, 0)


def _cut_is_forced(batch: list[int], following: int | None, sizing: BatchSizing, first: bool) -> bool:
    """Brute force: the batch holds its limits, and taking the next utterance would break one."""
    cap = min(sizing.first or sizing.utterances, sizing.utterances) if first else sizing.utterances

    def fits(lengths):
        return len(lengths) <= cap and (sizing.frames is None or len(lengths) == 1
                                        or len(lengths) * max(lengths) <= sizing.frames)

    return fits(batch) and (following is None or not fits(batch + [following]))


@pytest.mark.parametrize("sizing", [BatchSizing(4), BatchSizing(4, frames=40), BatchSizing(100, frames=64),
                                    BatchSizing(5, frames=30, first=2), BatchSizing(3, first=8)])
def test_batches_by_frames_are_maximal_runs_of_the_sorted_ids(sizing):
    rng = np.random.default_rng(7)
    lengths = {f"u{i:02d}": int(n) for i, n in enumerate(rng.integers(1, 40, size=37))}
    lengths["long"] = 90  # over any frame budget here: alone in its batch
    batches = bucket_by_length(lengths, sizing)
    flat = [u for b in batches for u in b]
    assert flat == bucket_by_length(lengths, len(lengths))[0]  # the same order as one batch
    for k, batch in enumerate(batches):
        following = lengths[batches[k + 1][0]] if k + 1 < len(batches) else None
        assert _cut_is_forced([lengths[u] for u in batch], following, sizing, first=k == 0), (k, batch)
    assert bucket_by_length(lengths, BatchSizing(4)) == bucket_by_length(lengths, 4)
    with pytest.raises(ValueError, match="frames must be >= 1"):
        BatchSizing(4, frames=0)


def test_batches_are_bucketed_and_skip_done_ids(tmp_path, utts):
    source = open_features(_write_npy_dir(tmp_path / "f", utts))
    batches = list(source.batches(2, exclude={"utt-a"}))
    assert [[u.id for u in b] for b in batches] == [["utt-c", "utt-b"], ["utt-d"]]
    lengths = [u.num_frames for b in batches for u in b]
    assert lengths == sorted(lengths, reverse=True)


# --- bad input ------------------------------------------------------------------------------

def test_wrong_feature_dimension_names_file_and_utterance(tmp_path, utts):
    folder = _write_npy_dir(tmp_path / "f", utts)
    with pytest.raises(FeatureError, match=r"utt-a\.npy: utterance 'utt-a': features have "
                                           r"dimension 5; expected 4 \(num_features\)"):
        list(open_features(folder, num_features=4))


def test_dimension_must_agree_across_utterances(tmp_path, utts):
    utts["utt-z"] = np.zeros((4, NUM_F + 1), np.float32)
    path = _write_hdf5(tmp_path / "f.h5", {k: v for k, v in utts.items() if k != "utt-z"})
    np.savez(tmp_path / "f.npz", **utts)
    with pytest.raises(FeatureError, match=r"f\.npz: utterance 'utt-z': features have dimension "
                                           r"6; expected 5 \(as in utterance 'utt-a'\)"):
        list(open_features(tmp_path / "f.npz"))
    assert len(list(open_features(path))) == 4


@pytest.mark.parametrize("bad,kind", [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf")])
def test_nan_inf_frames(tmp_path, utts, bad, kind):
    utts["utt-c"][3, 2] = bad
    utts["utt-c"][8, 0] = bad
    path = _write_ark(tmp_path / "f.ark", utts)
    with pytest.raises(FeatureError, match=rf"f\.ark: utterance 'utt-c': {kind} in frame 3 of 12 "
                                           r"\(2 frame\(s\) with NaN/Inf\)"):
        list(open_features(path))


def test_zero_length_utterance(tmp_path, utts):
    utts["utt-b"] = np.zeros((0, NUM_F), np.float32)
    path = _write_npz(tmp_path / "f.npz", utts)
    with pytest.raises(FeatureError, match=r"utterance 'utt-b': empty utterance: zero frames"):
        list(open_features(path))


def test_skip_mode_leaves_bad_utterances_out(tmp_path, utts):
    utts["utt-b"] = np.zeros((0, NUM_F), np.float32)
    utts["utt-d"] = np.full((2, NUM_F), np.nan, np.float32)
    source = open_features(_write_npz(tmp_path / "f.npz", utts), on_error="skip")
    assert [u.id for u in source] == ["utt-a", "utt-c"]
    assert [e.utterance_id for e in source.skipped] == ["utt-b", "utt-d"]


def test_one_dimensional_array_is_rejected(tmp_path):
    np.savez(tmp_path / "f.npz", a=np.zeros(10, np.float32))
    with pytest.raises(FeatureError, match=r"utterance 'a': features have shape \(10,\); "
                                           r"expected \(frames, features\)"):
        list(open_features(tmp_path / "f.npz"))


def test_missing_path(tmp_path):
    with pytest.raises(FeatureError, match=r"nowhere\.h5: does not exist"):
        open_features(tmp_path / "nowhere.h5")


def test_unreadable_npy_file(tmp_path, utts):
    folder = _write_npy_dir(tmp_path / "f", utts)
    (folder / "utt-b.npy").write_bytes(b"this is not numpy")
    source = open_features(folder)
    with pytest.raises(FeatureError, match=r"utt-b\.npy: utterance 'utt-b': cannot read"):
        source.lengths()
    with pytest.raises(FeatureError, match=r"utt-b\.npy: utterance 'utt-b': cannot read"):
        source.read("utt-b")


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".ark"])
def test_corrupt_container_file(tmp_path, suffix):
    path = tmp_path / f"broken{suffix}"
    path.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(FeatureError, match=re.escape(str(path)) + r": cannot read"):
        list(open_features(path))


def test_hdf5_missing_dataset_and_bad_lengths(tmp_path, utts):
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["inputs"] = np.zeros((3, 2), np.float32)
    with pytest.raises(FeatureError, match=r"a\.h5: missing dataset\(s\) \['seqLengths', "
                                           r"'seqTags'\]"):
        open_features(tmp_path / "a.h5")
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["inputs"] = np.zeros((3, 2), np.float32)
        f["seqLengths"] = np.array([2, 2])
        f["seqTags"] = np.array([b"x", b"y"])
    with pytest.raises(FeatureError, match=r"b\.h5: seqLengths sum to 4 frames but inputs has 3"):
        open_features(tmp_path / "b.h5")


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FeatureError, match="neither .npy nor audio"):
        open_features(tmp_path / "empty")
    with pytest.raises(FeatureError, match=r"no utterances found \(format npy-dir\)"):
        open_features(tmp_path / "empty", format="npy-dir").ids()


# --- log-mel front end and audio ------------------------------------------------------------

def test_mel_filters_of_the_digit_setup_are_all_non_empty():
    opts = LogMelOptions(sample_rate_hz=8000, fft_size=256, num_mel_bins=40, low_freq_hz=20)
    weights = mel_filterbank(opts)
    assert weights.shape == (40, 129)
    assert (weights.max(axis=1) > 0).all()


def test_empty_mel_filter_is_rejected_with_the_bin_and_fixes():
    opts = LogMelOptions(sample_rate_hz=8000, window_ms=16, fft_size=128, num_mel_bins=80,
                         low_freq_hz=20)
    with pytest.raises(FrontEndError, match=r"mel filter 0 of 80 .* has all-zero weights.*"
                                            r"bin spacing 62\.50 Hz.*num_mel_bins.*fft_size"):
        mel_filterbank(opts)
    with pytest.raises(FrontEndError, match="mel filter"):
        LogMelFrontEnd(opts)


def test_front_end_rejects_inconsistent_options():
    with pytest.raises(FrontEndError, match="fft_size=128 is shorter than the window"):
        mel_filterbank(LogMelOptions(sample_rate_hz=16000, fft_size=128))
    with pytest.raises(FrontEndError, match=r"high_freq_hz=5000"):
        mel_filterbank(LogMelOptions(sample_rate_hz=8000, high_freq_hz=5000))


def _reference_log_mel(samples, opts: LogMelOptions) -> np.ndarray:
    """Frame by frame, filter by filter: the slow and obvious computation."""
    win, hop, n_fft = opts.window_samples, opts.hop_samples, opts.padded_fft_size
    window = np.hanning(win)
    freqs = np.arange(n_fft // 2 + 1) * opts.sample_rate_hz / n_fft
    edges = mel_to_hz(np.linspace(hz_to_mel(opts.low_freq_hz), hz_to_mel(opts.nyquist_hz),
                                  opts.num_mel_bins + 2))
    out = []
    for start in range(0, len(samples) - win + 1, hop):
        frame = np.zeros(n_fft)
        frame[:win] = samples[start:start + win] * window
        power = np.abs(np.fft.fft(frame)[: n_fft // 2 + 1]) ** 2
        row = []
        for m in range(opts.num_mel_bins):
            lo, mid, hi = (hz_to_mel(edges[m]), hz_to_mel(edges[m + 1]), hz_to_mel(edges[m + 2]))
            energy = 0.0
            for k, f in enumerate(freqs):
                mel = hz_to_mel(f)
                if lo < mel < hi:
                    weight = (mel - lo) / (mid - lo) if mel <= mid else (hi - mel) / (hi - mid)
                    energy += weight * power[k]
            row.append(np.log(max(energy, opts.log_floor)))
        out.append(row)
    return np.array(out)


def test_log_mel_matches_the_slow_reference():
    opts = LogMelOptions(sample_rate_hz=8000, fft_size=256, num_mel_bins=12, low_freq_hz=20)
    samples = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    feats = LogMelFrontEnd(opts)(samples)
    assert feats.shape == (opts.num_frames(1000), 12) == (1 + (1000 - 200) // 80, 12)
    np.testing.assert_allclose(feats, _reference_log_mel(samples, opts), rtol=1e-5, atol=1e-4)


def test_pure_tone_peaks_in_the_mel_bin_around_its_frequency():
    opts = LogMelOptions(sample_rate_hz=8000, fft_size=256, num_mel_bins=40, low_freq_hz=20)
    t = np.arange(8000) / 8000
    feats = LogMelFrontEnd(opts)(np.sin(2 * np.pi * 1000 * t))
    peak = int(np.bincount(feats.argmax(axis=1)).argmax())
    edges = mel_to_hz(np.linspace(hz_to_mel(20), hz_to_mel(4000), 42))
    assert edges[peak] < 1000 < edges[peak + 2]


def test_normalisation(tmp_path):
    samples = np.random.default_rng(2).normal(size=4000)
    opts = {"sample_rate_hz": 8000, "fft_size": 256, "num_mel_bins": 10}
    feats = LogMelFrontEnd(LogMelOptions(**opts, normalisation="utterance"))(samples)
    np.testing.assert_allclose(feats.mean(axis=0), 0, atol=1e-4)
    np.testing.assert_allclose(feats.std(axis=0), 1, atol=1e-3)
    raw = LogMelFrontEnd(LogMelOptions(**opts))(samples)
    np.savez(tmp_path / "stats.npz", mean=np.full(10, 2.0), std=np.full(10, 4.0))
    glob = LogMelFrontEnd({**opts, "normalisation": "global", "stats_file": tmp_path / "stats.npz"})
    np.testing.assert_allclose(glob(samples), (raw - 2.0) / 4.0, rtol=1e-5, atol=1e-5)
    np.savez(tmp_path / "bad.npz", mean=np.zeros(3), std=np.ones(3))
    with pytest.raises(FrontEndError, match=r"bad\.npz: mean has shape \(3,\); expected \(10,\)"):
        LogMelFrontEnd({**opts, "normalisation": "global", "stats_file": tmp_path / "bad.npz"})


AUDIO_OPTS = LogMelOptions(sample_rate_hz=8000, fft_size=256, num_mel_bins=40, low_freq_hz=20)


def _write_audio(folder, lengths, sample_rate=8000):
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(3)
    signals = {}
    for i, (name, n) in enumerate(lengths.items()):
        signals[name] = (0.1 * rng.normal(size=n)).astype(np.float32)
        suffix = ".flac" if i % 2 else ".wav"
        soundfile.write(folder / f"{name}{suffix}", signals[name], sample_rate,
                        subtype="FLOAT" if suffix == ".wav" else "PCM_24")
    return signals


def test_audio_folder_list_and_single_file(tmp_path):
    signals = _write_audio(tmp_path / "wavs", {"one": 2400, "two": 4000, "three": 800})
    source = open_features(tmp_path / "wavs", front_end=AUDIO_OPTS)
    assert source.format == "audio"
    feats = {u.id: u.features for u in source}
    assert sorted(feats) == ["one", "three", "two"]
    assert source.lengths() == {k: AUDIO_OPTS.num_frames(len(s)) for k, s in signals.items()}
    expected = LogMelFrontEnd(AUDIO_OPTS)(signals["one"])  # wav written as float: exact
    np.testing.assert_allclose(feats["one"], expected, rtol=1e-6)
    assert feats["two"].shape == (AUDIO_OPTS.num_frames(4000), 40)

    listing = tmp_path / "wav.scp"
    listing.write_text("# id path\nfirst wavs/two.flac\n\nwavs/one.wav\n")
    assert detect_format(listing) == "audio"
    listed = {u.id: u.features for u in open_features(listing, front_end=AUDIO_OPTS)}
    assert list(listed) == ["first", "one"]
    np.testing.assert_array_equal(listed["first"], feats["two"])

    single = open_features(tmp_path / "wavs" / "one.wav", front_end=AUDIO_OPTS)
    assert [u.id for u in single] == ["one"]


def test_audio_bad_inputs(tmp_path):
    _write_audio(tmp_path / "a", {"short": 100, "ok": 1000})
    with pytest.raises(FeatureError, match=r"short\.wav: utterance 'short': 100 samples: too short for one feature frame"):
        list(open_features(tmp_path / "a", front_end=AUDIO_OPTS))
    _write_audio(tmp_path / "b", {"fast": 3000}, sample_rate=16000)
    with pytest.raises(FeatureError, match=r"fast\.wav: utterance 'fast': sample rate 16000 Hz; "
                                           r"the front end expects 8000 Hz"):
        list(open_features(tmp_path / "b", front_end=AUDIO_OPTS))
    listing = tmp_path / "list.txt"
    listing.write_text("gone a/missing.wav\n")
    with pytest.raises(FeatureError, match=r"missing\.wav: utterance 'gone': audio file does "
                                           r"not exist"):
        list(open_features(listing, front_end=AUDIO_OPTS))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "junk.wav").write_bytes(b"RIFF nonsense")
    with pytest.raises(FeatureError, match=r"junk\.wav: utterance 'junk': cannot read audio"):
        list(open_features(tmp_path / "c", front_end=AUDIO_OPTS))
    with pytest.raises(FeatureError, match=r"features have dimension 40; expected 13"):
        list(open_features(tmp_path / "a" / "ok.flac", front_end=AUDIO_OPTS, num_features=13))
