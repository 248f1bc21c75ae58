"""`gpudecode decode` reads every feature format and runs every bundled config."""

import json
from pathlib import Path

import h5py
import kaldiio
import numpy as np
import pytest
import soundfile
from click.testing import CliRunner

from gpudecode.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "random-aed.yaml"


def nbest(folder):
    return {r["id"]: [(h["labels"], round(h["score"], 4)) for h in r["nbest"]]
            for r in map(json.loads, (folder / "nbest.jsonl").read_text().splitlines())}


def write_npz(tmp, utts):
    np.savez(tmp / "feats.npz", **utts)
    return tmp / "feats.npz"


def write_hdf5(tmp, utts):
    with h5py.File(tmp / "feats.hdf5", "w") as f:
        f["inputs"] = np.concatenate(list(utts.values()))
        f["seqLengths"] = np.array([len(v) for v in utts.values()], np.int32)
        f["seqTags"] = np.array([k.encode() for k in utts], dtype="S")
    return tmp / "feats.hdf5"


def write_ark(tmp, utts):
    kaldiio.save_ark(str(tmp / "feats.ark"), dict(utts))
    return tmp / "feats.ark"


def write_scp(tmp, utts):
    with kaldiio.WriteHelper(f"ark,scp:{tmp / 'f.ark'},{tmp / 'f.scp'}") as writer:
        for key, value in utts.items():
            writer(key, value)
    return tmp / "f.scp"


@pytest.mark.parametrize("writer", [write_npz, write_hdf5, write_ark, write_scp])
def test_every_feature_format_decodes_like_the_npy_folder(tmp_path, writer):
    utts = {p.stem: np.load(p) for p in sorted((ROOT / "examples" / "features").glob("*.npy"))}
    reference = CliRunner().invoke(main, ["decode", str(EXAMPLE), "--output", str(tmp_path / "npy")])
    assert reference.exit_code == 0, reference.output
    path = writer(tmp_path, utts)
    result = CliRunner().invoke(main, ["decode", str(EXAMPLE), "--features", str(path), "--output", str(tmp_path / "x")])
    assert result.exit_code == 0, result.output
    assert nbest(tmp_path / "x") == nbest(tmp_path / "npy")


def test_audio_files_go_through_the_log_mel_front_end(tmp_path):
    audio = tmp_path / "audio"
    audio.mkdir()
    rng = np.random.default_rng(0)
    for i, seconds in enumerate((0.4, 0.7)):
        t = np.arange(int(8000 * seconds)) / 8000
        wave = 0.3 * np.sin(2 * np.pi * (300 + 200 * i) * t) + 0.01 * rng.standard_normal(t.size)
        soundfile.write(audio / f"tone{i}.wav", wave.astype(np.float32), 8000)
    result = CliRunner().invoke(main, ["decode", str(EXAMPLE), "--features", str(audio), "--output", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    decoded = nbest(tmp_path / "o")
    assert sorted(decoded) == ["tone0", "tone1"] and all(len(v) == 4 for v in decoded.values())
    assert "real-time factor" in result.output


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_bundled_config_decodes(tmp_path, config):
    result = CliRunner().invoke(main, ["decode", str(config), "--output", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    records = nbest(tmp_path / "out")
    from gpudecode.config import load_config

    io = load_config(config).io
    if io.features is None:  # text generation: the prompt file's entries are the utterances
        ids = [line.split()[0] for line in io.prompts.read_text().splitlines() if line.split() and line[0] != "#"]
        assert sorted(records) == sorted(ids)
        return
    features = io.features.path
    assert sorted(records) == sorted(p.stem for p in features.iterdir() if p.suffix in (".npy", ".wav"))


def test_continuous_batching_from_the_config_gives_the_static_results(tmp_path):
    static = CliRunner().invoke(main, ["decode", str(EXAMPLE), "--output", str(tmp_path / "static")])
    continuous = CliRunner().invoke(main, ["decode", str(EXAMPLE), "--output", str(tmp_path / "continuous"),
                                           "-o", "search.max_active_utterances=1", "-o", "search.admission_order=input"])
    assert static.exit_code == 0 and continuous.exit_code == 0, continuous.output
    assert nbest(tmp_path / "continuous") == nbest(tmp_path / "static")


def test_ctc_decode_writes_ctm_times_from_emission_frames(tmp_path):
    result = CliRunner().invoke(main, ["decode", str(ROOT / "configs" / "ctc.yaml"), "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "nbest.jsonl").read_text().splitlines())}
    ctm = [line.split() for line in (tmp_path / "hyp.ctm").read_text().splitlines()]
    for utt, record in records.items():
        best = record["nbest"][0]
        rows = [row for row in ctm if row[0] == utt]
        words = [w for w in best["words"].split()]
        assert [row[4] for row in rows] == words and len(best["frames"]) == len(best["labels"])
        # encoder frame × 10 ms hop × subsampling 2
        expected = [round(0.02 * f, 3) for f, token in zip(best["frames"], best["tokens"])]
        assert [float(row[2]) for row in rows] == pytest.approx(expected[: len(rows)], abs=1e-6)
        assert set(best["scores"]) == {"ctc", "lm"}


def test_references_give_wer_with_error_counts(tmp_path):
    out = tmp_path / "out"
    CliRunner().invoke(main, ["decode", str(ROOT / "configs" / "ctc-greedy.yaml"), "--output", str(out)])
    hyps = dict(line.split(" ", 1) for line in (out / "text").read_text().splitlines())
    references = tmp_path / "refs.txt"
    # the first utterance's hypothesis minus its first word: exactly one deletion
    words = hyps["example-0"].split()
    references.write_text(f"example-0 {' '.join(words[1:])}\n")
    result = CliRunner().invoke(main, ["decode", str(ROOT / "configs" / "ctc-greedy.yaml"), "--output",
                                       str(tmp_path / "scored"), "--references", str(references)])
    assert result.exit_code == 0, result.output
    n = len(words) - 1
    assert f"({1} errors / {n} words: 0 sub, 0 del, 1 ins)" in result.output
    assert json.loads((tmp_path / "scored" / "wer.json").read_text())["insertions"] == 1
