"""`gpudecode decode`: the example config, outputs, overrides, resume after a kill, bad input."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.decoder import Decoder

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "random-aed.yaml"


def decode(*args):
    return CliRunner().invoke(main, ["decode", *map(str, args)])


def records(folder):
    lines = (Path(folder) / "nbest.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines]
    return {r["id"]: r for r in parsed}, len(parsed)


def test_example_config_decodes_and_matches_the_python_api(tmp_path):
    result = decode(EXAMPLE, "--output", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "utterances decoded      3" in result.output
    text = (tmp_path / "out" / "text").read_text().splitlines()
    assert sorted(line.split()[0] for line in text) == ["example-0", "example-1", "example-2"]
    by_id, count = records(tmp_path / "out")
    assert count == 3 and all(len(r["nbest"]) == 4 for r in by_id.values())
    resolved = yaml.safe_load((tmp_path / "out" / "config.resolved.yaml").read_text())
    assert resolved["search"]["beam_size"] == 4 and Path(resolved["models"]["encoder"]["path"]).is_absolute()
    features = {p.stem: np.load(p) for p in sorted((ROOT / "examples" / "features").glob("*.npy"))}
    api = Decoder.from_config(EXAMPLE).decode(features)
    for utt, nbest in api.items():
        assert [h.labels for h in nbest] == [h["labels"] for h in by_id[utt]["nbest"]]
        np.testing.assert_allclose([h.score for h in nbest], [h["score"] for h in by_id[utt]["nbest"]], atol=1e-6)


def test_the_batch_size_changes_no_result(tmp_path):
    """One utterance per search call and the device's default batch give the same n-best lists."""
    got = {}
    for name, overrides in (("default", []), ("one", ["-o", "search.batch_size=1"])):
        result = decode(EXAMPLE, "--output", tmp_path / name, *overrides)
        assert result.exit_code == 0, result.output
        got[name] = {u: r["nbest"] for u, r in records(tmp_path / name)[0].items()}
    assert got["default"] == got["one"] and len(got["one"]) == 3


def test_batching_by_frames_changes_no_result():
    """Batches cut by padded frames (with a small first batch) give the fixed batches' n-best lists."""
    features = {p.stem: np.load(p) for p in sorted((ROOT / "examples" / "features").glob("*.npy"))}
    frames = sorted(f.shape[0] for f in features.values())
    fixed = Decoder.from_config(EXAMPLE, ["search.batch_size=3"])
    by_frames = Decoder.from_config(EXAMPLE, [f"search.batch_frames={frames[-1] + frames[0]}"])
    assert by_frames.config.batch_sizing.frames == frames[-1] + frames[0]
    got, want = by_frames.decode(features), fixed.decode(features)
    assert list(got) == list(want)
    for utt in want:
        assert [h.labels for h in got[utt]] == [h.labels for h in want[utt]]
        np.testing.assert_allclose([h.score for h in got[utt]], [h.score for h in want[utt]], rtol=1e-6, atol=1e-6)


def test_the_python_api_threads_tuning_and_stats_into_the_search():
    """``search.tuning`` and a stats object reach the search: the same n-best with the stop test
    read late (on numpy too), its step loop measured and its reads counted."""
    from gpudecode.search.stats import SearchStats
    from gpudecode.search.tuning import SearchTuning

    features = {p.stem: np.load(p) for p in sorted((ROOT / "examples" / "features").glob("*.npy"))}
    plain = Decoder.from_config(EXAMPLE).decode(features)
    stats = SearchStats()
    lagged = Decoder.from_config(EXAMPLE, ["search.tuning.lagged_stop_test=true"], stats=stats)
    assert lagged.search_setup.tuning == SearchTuning(lagged_stop_test=True)
    got = lagged.decode(features)
    assert {u: [(h.labels, h.score) for h in n] for u, n in got.items()} == \
        {u: [(h.labels, h.score) for h in n] for u, n in plain.items()}
    assert stats.step_loop.count > 0 and stats.transfers > 0


def test_overrides_and_unknown_keys(tmp_path):
    result = decode(EXAMPLE, "--output", tmp_path / "o", "-o", "search.beam_size=1", "-o", "io.formats=[jsonl]")
    assert result.exit_code == 0, result.output
    by_id, _ = records(tmp_path / "o")
    assert all(len(r["nbest"]) == 1 for r in by_id.values())
    assert not (tmp_path / "o" / "text").exists()
    result = decode(EXAMPLE, "--output", tmp_path / "p", "-o", "search.beem_size=2")
    assert result.exit_code == 1
    assert "search.beem_size: unknown key" in result.output and "beam_size" in result.output


def test_existing_results_are_never_overwritten(tmp_path):
    assert decode(EXAMPLE, "--output", tmp_path).exit_code == 0
    before = (tmp_path / "nbest.jsonl").read_text()
    result = decode(EXAMPLE, "--output", tmp_path)
    assert result.exit_code == 1 and "already holds results for 3 utterance(s); pass --resume" in result.output
    assert (tmp_path / "nbest.jsonl").read_text() == before
    result = decode(EXAMPLE, "--output", tmp_path, "--resume")
    assert result.exit_code == 0 and "resumed (already done)  3" in result.output
    assert (tmp_path / "nbest.jsonl").read_text() == before


def slow_config(tmp_path, num_utts=24):
    features = tmp_path / "features"
    features.mkdir()
    rng = np.random.default_rng(0)
    for i in range(num_utts):
        np.save(features / f"u{i:02d}.npy", rng.standard_normal((20 + i % 5, 16)).astype(np.float32))
    config = yaml.safe_load(EXAMPLE.read_text())
    config["models"]["encoder"]["path"] = str(ROOT / "examples/models/encoder.onnx")
    config["models"]["vocabulary"]["path"] = str(ROOT / "examples/models/vocab.txt")
    config["scorers"][0]["model"] = str(ROOT / "examples/models/decoder.onnx")
    config["scorers"].append({"type": "tests.slow_scorer:SlowScorer", "name": "slow", "scale": 1.0,
                              "options": {"vocab_size": 12, "seconds": 0.01}})
    config["search"].update(batch_size=1, max_labels_per_input=0.5)
    config["io"] = {"features": {"path": str(features)}, "formats": ["text", "jsonl"]}
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def wait_for_lines(path: Path, count: int, timeout_s: float = 60) -> None:
    """Until ``path`` holds ``count`` lines (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (not path.exists() or len(path.read_text().splitlines()) < count):
        time.sleep(0.005)


def resume_and_compare(command: list[str], cut: Path, full: Path, num_utts: int = 24) -> None:
    """``cut`` holds part of the run (at least 3 utterances); resumed with ``command``, it holds
    the n-best lists of ``full``, every utterance once."""
    _, written = records(cut)
    assert 3 <= written < num_utts, written  # really interrupted mid-run
    resumed = subprocess.run([*command, "--output", str(cut), "--resume"], cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    expected, n_expected = records(full)
    got, n_got = records(cut)
    assert n_expected == n_got == num_utts  # every utterance exactly once
    assert got == expected


def test_resume_after_killing_the_process_mid_run(tmp_path):
    config = slow_config(tmp_path)
    command = [sys.executable, "-m", "gpudecode", "decode", str(config)]
    full = subprocess.run([*command, "--output", str(tmp_path / "full")], cwd=ROOT, capture_output=True, text=True)
    assert full.returncode == 0, full.stderr
    process = subprocess.Popen([*command, "--output", str(tmp_path / "cut")], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_lines(tmp_path / "cut" / "nbest.jsonl", 3)
    process.send_signal(signal.SIGKILL)
    process.wait()
    resume_and_compare(command, tmp_path / "cut", tmp_path / "full")
    text_lines = (tmp_path / "cut" / "text").read_text().splitlines()
    assert sorted(text_lines) == sorted((tmp_path / "full" / "text").read_text().splitlines())


def bad_features(tmp_path, name, array):
    folder = tmp_path / "bad"
    folder.mkdir(exist_ok=True)
    np.save(folder / "good.npy", np.ones((10, 16), np.float32))
    np.save(folder / f"{name}.npy", array)
    return folder


@pytest.mark.parametrize(
    "name, array, message",
    [
        ("narrow", np.ones((10, 15), np.float32), r"narrow.*15.*16|narrow.*16.*15"),
        ("nans", np.full((10, 16), np.nan, np.float32), r"nans.*NaN"),
        ("empty", np.ones((0, 16), np.float32), r"empty.*(empty|zero|no frames)"),
    ],
)
def test_bad_features_are_named_and_skip_keeps_the_rest(tmp_path, name, array, message):
    folder = bad_features(tmp_path, name, array)
    result = decode(EXAMPLE, "--features", folder, "--output", tmp_path / "stop")
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()[-1]) < 400
    import re

    assert re.search(message, result.output, re.I), result.output
    result = decode(EXAMPLE, "--features", folder, "--output", tmp_path / "skip", "-o", "io.on_bad_input=skip")
    assert result.exit_code == 0, result.output
    assert "skipped (bad input)     1" in result.output
    assert (tmp_path / "skip" / "text").read_text().split()[0] == "good"


def test_missing_files_corrupt_model_vocabulary_mismatch_and_cuda(tmp_path, no_gpu):
    result = decode(EXAMPLE, "--features", tmp_path / "nowhere", "--output", tmp_path / "a")
    assert result.exit_code == 1 and "io.features.path: does not exist" in result.output
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"not onnx")
    result = decode(EXAMPLE, "--output", tmp_path / "b", "-o", f"scorers.0.model={corrupt}")
    assert result.exit_code == 1 and "corrupt.onnx: ONNX Runtime cannot load the model" in result.output
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["<s>", "</s>", "<unk>", "a", "b"]) + "\n")
    result = decode(EXAMPLE, "--output", tmp_path / "c", "-o", f"models.vocabulary.path={vocab}")
    assert result.exit_code == 1
    assert "decoder.onnx: score output 'scores'" in result.output and "expected vocabulary size 5" in result.output
    result = decode(EXAMPLE, "--output", tmp_path / "d", "-o", "runtime.device=cuda")
    assert result.exit_code == 1 and "the GPU was requested but cannot be used" in result.output
    assert not (tmp_path / "d" / "text").exists()


class FakeOutOfMemory(RuntimeError):
    pass


FakeOutOfMemory.__name__ = "OutOfMemoryError"


def test_out_of_memory_splits_batches_and_names_the_utterance_that_never_fits(tmp_path, monkeypatch):
    calls = []
    original = Decoder.decode_batch

    def decode_batch(self, ids, features, **kwargs):
        calls.append(len(ids))
        if len(ids) > 1 or "example-0" in ids:
            raise FakeOutOfMemory("out of memory allocating 1 GiB")
        return original(self, ids, features, **kwargs)

    monkeypatch.setattr(Decoder, "decode_batch", decode_batch)
    result = decode(EXAMPLE, "--output", tmp_path / "skip", "-o", "io.on_bad_input=skip")
    assert result.exit_code == 0, result.output
    assert calls[0] == 3 and 1 in calls
    assert "batches split (out of GPU memory)  2" in result.output
    assert "utterance 'example-0' (48 frames) does not fit in GPU memory even alone" in result.output
    assert sorted(line.split()[0] for line in (tmp_path / "skip" / "text").read_text().splitlines()) == [
        "example-1", "example-2"]
    result = decode(EXAMPLE, "--output", tmp_path / "stop")
    assert result.exit_code == 1 and "utterance 'example-0' (48 frames) does not fit in GPU memory" in result.output
