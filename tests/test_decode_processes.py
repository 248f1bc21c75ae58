"""Several decoding processes sharing the device (``runtime.processes``,
``gpudecode.engines.processes``): the single-process run's lines (in batch-finishing order), the
same messages for bad input, nothing lost or duplicated when the run or one of its processes is
killed; one process by default."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpudecode import defaults
from gpudecode.cli import main
from gpudecode.config import ConfigError, load_config
from gpudecode.engines.processes import plan_batches
from gpudecode.io.features import BatchSizing
from tests.test_cli_decode import records, resume_and_compare, slow_config, wait_for_lines
from tests.test_overlap import NUM_UTTS, corpus, outputs
from tests.test_ray_engine import _descendants, _kill_survivors

ROOT = Path(__file__).resolve().parent.parent
AED = ROOT / "configs" / "random-aed.yaml"
CTC = ROOT / "configs" / "ctc.yaml"


def decode(*args):
    return CliRunner().invoke(main, ["decode", *map(str, args)])


def sorted_lines(files: dict[str, bytes]) -> dict[str, list[bytes]]:
    return {name: sorted(data.splitlines()) for name, data in files.items()}


@pytest.mark.parametrize("config, formats", [(AED, "text,jsonl"), (CTC, "text,jsonl,ctm")])
def test_two_and_three_processes_write_the_single_process_lines(tmp_path, config, formats):
    folder = corpus(tmp_path)
    runs = {}
    for processes in (1, 2, 3):
        out = tmp_path / f"p{processes}"
        result = decode(config, "--features", folder, "--output", out, "-o", "search.batch_size=2",
                        "-o", f"runtime.processes={processes}", "-o", f"io.formats=[{formats}]")
        assert result.exit_code == 0, result.output
        assert f"utterances decoded      {NUM_UTTS}" in result.output
        runs[processes] = outputs(out)
    reference = sorted_lines(runs[1])
    files = {"text": "text", "jsonl": "nbest.jsonl", "ctm": "hyp.ctm"}
    assert len(reference["text"]) == NUM_UTTS
    assert all(reference[files[f]] for f in formats.split(","))
    for processes in (2, 3):
        assert sorted_lines(runs[processes]) == reference, processes


def test_the_run_records_its_processes_and_their_mean_times(tmp_path):
    folder = corpus(tmp_path)
    timings = tmp_path / "timings.json"
    result = decode(AED, "--features", folder, "--output", tmp_path / "o", "-o", "search.batch_size=2",
                    "-o", "runtime.processes=2", "--timings", timings)
    assert result.exit_code == 0, result.output
    run = json.loads(timings.read_text())
    t = run["timings"]
    assert run["decoded"] == NUM_UTTS and t["processes"] == 2
    assert t["started_at"] <= t["decoding_at"] <= t["first_result_at"] <= t["finished_at"]
    assert 0 < t["search_s"] < t["finished_at"] - t["started_at"]


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_bad_utterance_gives_the_single_process_message_and_lines(tmp_path, policy):
    folder = corpus(tmp_path, np.full((18, 16), np.nan, np.float32))
    seen = {}
    for processes in (1, 2):
        out = tmp_path / f"{policy}-{processes}"
        result = decode(AED, "--features", folder, "--output", out, "-o", "search.batch_size=2",
                        "-o", f"io.on_bad_input={policy}", "-o", f"runtime.processes={processes}")
        assert (result.exit_code == 0) == (policy == "skip"), result.output
        message = [line for line in result.output.splitlines() if "u05" in line]
        assert message, result.output
        seen[processes] = message[-1:], sorted(
            (out / "text").read_text().splitlines()) if policy == "skip" else None
    assert seen[1] == seen[2]
    if policy == "skip":
        assert len(seen[2][1]) == NUM_UTTS - 1 and not any(line.startswith("u05") for line in seen[2][1])


def test_resume_after_killing_the_run_mid_way_leaves_no_process_and_loses_nothing(tmp_path):
    config = slow_config(tmp_path)
    command = [sys.executable, "-m", "gpudecode", "decode", str(config), "-o", "runtime.processes=2"]
    full = subprocess.run([*command, "--output", str(tmp_path / "full")], cwd=ROOT, capture_output=True, text=True)
    assert full.returncode == 0, full.stderr
    process = subprocess.Popen([*command, "--output", str(tmp_path / "cut")], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_lines(tmp_path / "cut" / "nbest.jsonl", 3)
    below = _descendants(process.pid)
    assert len(below) == 2, below  # the two decoding processes
    process.send_signal(signal.SIGKILL)
    process.wait()
    try:
        deadline = time.monotonic() + 30  # their input ends with the run: they exit
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in below):
            time.sleep(0.05)
        assert not any(Path(f"/proc/{pid}").exists() for pid in below)
    finally:
        _kill_survivors(below)
    resume_and_compare(command, tmp_path / "cut", tmp_path / "full")


def test_a_killed_decoding_process_stops_the_run_and_resume_completes_it(tmp_path):
    config = slow_config(tmp_path)
    command = [sys.executable, "-m", "gpudecode", "decode", str(config), "-o", "runtime.processes=2"]
    process = subprocess.Popen([*command, "--output", str(tmp_path / "cut")], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_lines(tmp_path / "cut" / "nbest.jsonl", 2)
    victim = min(_descendants(process.pid))
    os.kill(victim, signal.SIGKILL)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "decoding process" in err and "ended unexpectedly" in err and "--resume" in err, err[-2000:]
    resumed = subprocess.run([*command, "--output", str(tmp_path / "cut"), "--resume"], cwd=ROOT,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    _, n_got = records(tmp_path / "cut")
    assert n_got == 24


def test_the_plan_gives_each_process_several_batches_and_every_utterance_once():
    lengths = [(f"u{i:03d}", 10 + i % 37) for i in range(1000)]
    sizing = BatchSizing(1024, 262_144, 32)
    batches = plan_batches(lengths, sizing, 4)
    assert sorted(u for b in batches for u in b) == sorted(u for u, _ in lengths)
    assert len(batches[0]) == 32  # the first batch stays small: the first results come early
    assert len(batches) >= defaults.BATCHES_PER_PROCESS * 4
    assert max(map(len, batches)) <= -(-1000 // (defaults.BATCHES_PER_PROCESS * 4))
    assert plan_batches(lengths, sizing, 1)[1:] != batches[1:]
    few = plan_batches(lengths[:3], BatchSizing(16), 4)
    assert sorted(u for b in few for u in b) == ["u000", "u001", "u002"]


def test_one_process_by_default_on_every_device(tmp_path):
    config = load_config(AED)
    assert config.runtime.processes == 1
    assert load_config(AED, ["runtime.device=cuda"]).runtime.processes == 1
    timings = tmp_path / "timings.json"
    result = decode(AED, "--features", corpus(tmp_path), "--output", tmp_path / "o", "--timings", timings)
    assert result.exit_code == 0, result.output
    assert json.loads(timings.read_text())["timings"]["processes"] == 1
    with pytest.raises(ConfigError, match="runtime.processes"):
        load_config(AED, ["runtime.processes=0"])


def test_processes_on_ray_or_with_prompts_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="runtime.processes.*runtime.engine.workers"):
        load_config(AED, ["runtime.processes=2", "runtime.engine.type=ray"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"u{i:02d} 1 2\n" for i in range(NUM_UTTS)))
    result = decode(AED, "--features", corpus(tmp_path), "--prompts", prompts, "--output", tmp_path / "o",
                    "-o", "runtime.processes=2")
    assert result.exit_code == 1 and "runtime.processes" in result.output and "prompts" in result.output


@pytest.mark.gpu
@pytest.mark.parametrize("config", [AED, CTC])
def test_on_cuda_four_processes_give_the_single_process_nbest(tmp_path, config):
    """On CUDA the n-best lists of one process: the same labels, scores within float32 noise (the
    pool cuts smaller batches, and CUDA's sums depend on the batch's padding)."""
    folder = corpus(tmp_path)
    runs = {}
    for processes in (1, 4):
        out = tmp_path / f"p{processes}"
        result = decode(config, "--features", folder, "--output", out, "-o", "search.batch_size=2",
                        "-o", "runtime.device=cuda", "-o", f"runtime.processes={processes}")
        assert result.exit_code == 0, result.output
        runs[processes] = {r["id"]: r for r in map(json.loads, (out / "nbest.jsonl").read_text().splitlines())}
    assert len(runs[1]) == NUM_UTTS and set(runs[4]) == set(runs[1])
    for utt, record in runs[1].items():
        other = runs[4][utt]["nbest"]
        assert [h["labels"] for h in other] == [h["labels"] for h in record["nbest"]], utt
        assert np.allclose([h["score"] for h in other], [h["score"] for h in record["nbest"]], rtol=0, atol=1e-4)
