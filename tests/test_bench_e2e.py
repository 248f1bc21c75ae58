"""`gpudecode bench e2e` on the CPU: every field, consistent figures, the n-best of a plain decode,
and the repeated corpus (N× the utterances under distinct ids)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
from click.testing import CliRunner

from gpudecode.bench.e2e import PARTS, E2eOptions, format_table, repeated_corpus
from gpudecode.cli import main
from gpudecode.io.readers import open_features

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "fsdd-ctc.yaml"  # its own corpus: the 8 bundled test recordings (audio)
AUDIO = ROOT / "examples" / "fsdd-model" / "test-audio"
ROW_FIELDS = {"config", "device", "utterances", "audio_s", "total_s", "startup_s", "imports_s", "sessions_s",
              "steady_s", "first_result_s", "utterances_per_s", "utterances_per_s_total", "rtfx", "breakdown_s",
              "breakdown_share", "gpu_utilisation_pct", "processes", "command", "output", "warm_up_s"}


def _nbest(folder: Path) -> dict[str, dict]:
    lines = (folder / "nbest.jsonl").read_text(encoding="utf-8").splitlines()
    return {entry["id"]: entry for entry in map(json.loads, lines)}


def _bench(tmp: Path, *extra: str) -> dict:
    result = CliRunner().invoke(main, ["bench", "e2e", str(CONFIG), "--devices", "cpu", "--output", str(tmp),
                                       "--results", str(tmp / "results"), *extra])
    assert result.exit_code == 0, result.output
    assert "| fsdd-ctc.yaml | cpu | " in result.output
    return json.loads((tmp / "e2e.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def once(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    return tmp, _bench(tmp)


def test_every_field_and_consistent_figures(once):
    _, results = once
    (row,) = results["rows"]
    assert set(row) == ROW_FIELDS
    assert row["device"] == "cpu" and row["utterances"] == 8 and row["gpu_utilisation_pct"] is None and row["processes"] == 1
    assert set(row["breakdown_s"]) == set(PARTS) == set(row["breakdown_share"])
    # audio seconds against the recordings themselves (the front end's frames: within one 10 ms shift each)
    audio = sum(soundfile.info(str(f)).duration for f in AUDIO.glob("*.wav"))
    assert abs(row["audio_s"] - audio) <= 8 * 0.03
    assert row["rtfx"] == pytest.approx(row["audio_s"] / row["steady_s"])
    assert row["utterances_per_s"] == pytest.approx(8 / row["steady_s"])
    measured = [row["breakdown_s"][p] for p in PARTS if p != "other"]
    assert min(measured) >= 0 and row["breakdown_s"]["front end"] > 0  # audio input: the front end runs
    assert sum(measured) <= row["total_s"] + 1e-3
    assert sum(row["breakdown_s"].values()) == pytest.approx(row["total_s"])
    assert row["startup_s"] == pytest.approx(row["imports_s"] + row["sessions_s"])
    assert 0 < row["startup_s"] < row["first_result_s"] <= row["total_s"]
    assert row["startup_s"] + row["steady_s"] <= row["total_s"] + 1e-3
    assert results["ratios"] == {}  # one device
    assert results["warm_up"] > 0 and row["warm_up_s"] > 0  # an untimed run came first
    assert "fsdd-ctc.yaml" in format_table(results)


def test_nbest_equals_a_plain_decode(once, tmp_path):
    tmp, _ = once
    plain = CliRunner().invoke(main, ["decode", str(CONFIG), "--output", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    benched = _nbest(tmp / "results" / "fsdd-ctc" / "cpu")
    assert len(benched) == 8 and benched == _nbest(tmp_path / "plain")


def test_repeat_gives_n_times_the_utterances_under_distinct_ids(once, tmp_path):
    _, single = once
    results = _bench(tmp_path, "--repeat", "2", "--warm-up", "0")
    (row,) = results["rows"]
    assert row["utterances"] == 16 and row["warm_up_s"] is None and results["warm_up"] == 0
    assert row["audio_s"] == pytest.approx(2 * single["rows"][0]["audio_s"])
    repeated = _nbest(tmp_path / "results" / "fsdd-ctc" / "cpu")
    originals = {p.stem for p in AUDIO.glob("*.wav")}
    assert set(repeated) == {f"{u}-r{k}" for u in originals for k in (1, 2)}
    for utt, entry in repeated.items():  # the same utterance decodes the same under each id
        twin = repeated[utt[:-1] + ("2" if utt.endswith("1") else "1")]
        assert entry["nbest"] == twin["nbest"]


def test_repeated_corpus_of_an_archive_format_is_one_copy_listed_n_times(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"u{i}": rng.standard_normal((5 + i, 4)).astype(np.float32) for i in range(3)}
    np.savez(tmp_path / "feats.npz", **arrays)
    path, format = repeated_corpus(tmp_path / "feats.npz", "auto", 3, tmp_path / "view")
    assert format == "kaldi-scp"
    assert len(list((tmp_path / "view").glob("*.ark"))) == 1
    with open_features(path, format) as source:
        read = {u.id: u.features for u in source}
    assert list(read) == [f"{u}-r{k}" for k in (1, 2, 3) for u in arrays]
    for utt, features in read.items():
        np.testing.assert_array_equal(features, arrays[utt.rsplit("-r", 1)[0]])
    assert repeated_corpus(tmp_path / "feats.npz", "auto", 1, tmp_path / "none") == ((tmp_path / "feats.npz"), "npz")
    path, format = repeated_corpus(tmp_path / "feats.npz", "auto", 1, tmp_path / "head", limit=2)
    with open_features(path, format) as source:
        assert [u.id for u in source] == ["u0-r1", "u1-r1"]


def test_the_warm_up_corpus_of_audio_is_its_first_recordings(tmp_path):
    path, format = repeated_corpus(AUDIO, "auto", 1, tmp_path / "head", limit=3)
    listed = path.read_text(encoding="utf-8").splitlines()
    assert format == "audio" and len(listed) == 3
    assert [line.split()[0] for line in listed] == [f"{p.stem}-r1" for p in sorted(AUDIO.glob("*.wav"))[:3]]


def test_options_are_checked():
    with pytest.raises(ValueError, match="repeat"):
        E2eOptions(configs=("a.yaml",), repeat=0)
    with pytest.raises(ValueError, match="devices"):
        E2eOptions(configs=("a.yaml",), devices=("tpu",))
    with pytest.raises(ValueError, match="warm_up"):
        E2eOptions(configs=("a.yaml",), warm_up=-1)
