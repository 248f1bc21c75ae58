"""`decode --engine ray`: a local Ray cluster with 2 CPU workers against the single-process run.

Identical output (the same records per utterance id), a worker killed mid-shard,
the driver killed mid-run and resumed, resume across engines both ways, the error without Ray.
"""

import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.config import ConfigError, load_config
from gpudecode.engines import EngineError
from gpudecode.engines.ray_engine import KILL_WORKER_ENV
from gpudecode.run import run_decode

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "random-aed.yaml"
NUM_UTTS = 24


# --- the cluster: 2 CPUs, its own temp folder; everything it started is gone afterwards ---------

def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def _descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every process below ``pid`` (the start time guards against pid reuse)."""
    children, found, todo = _children(), {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                found[child] = (Path("/proc") / str(child) / "stat").read_text().rsplit(")", 1)[1].split()[19]
            except (OSError, IndexError):
                continue
            todo.append(child)
    return found


def _kill_survivors(processes: dict[int, str]) -> None:
    for pid, started in processes.items():
        try:
            if (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19] == started:
                os.kill(pid, signal.SIGKILL)
        except (OSError, IndexError):
            pass


@pytest.fixture(autouse=True)
def watchdog():
    """A test stuck on a broken cluster (actors that never start) ends the session after 180 s,
    printing every thread's traceback, instead of blocking CI until its own timeout."""
    faulthandler.dump_traceback_later(180, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def cluster():
    """A new local Ray cluster with 2 CPUs; yields its address. Afterwards ``ray.shutdown()``,
    then any process it started that is still alive (a stray raylet or worker) is killed by pid."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="gdray", dir="/tmp")  # short: Ray's socket paths live here
    context = ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir)
    try:
        yield context.address_info["gcs_address"]
    finally:
        started = _descendants(os.getpid())
        ray.shutdown()
        time.sleep(0.5)
        _kill_survivors(started)
        shutil.rmtree(temp_dir, ignore_errors=True)


# --- data and comparison ----------------------------------------------------------------------

def make_config(folder: Path, *, batch_size: int) -> Path:
    """The example model plus a scorer that only adds time, on NUM_UTTS random utterances."""
    features = folder / "features"
    if not features.exists():
        features.mkdir(parents=True)
        rng = np.random.default_rng(11)
        for i in range(NUM_UTTS):
            np.save(features / f"u{i:02d}.npy", rng.standard_normal((16 + i % 7, 16)).astype(np.float32))
    config = yaml.safe_load(EXAMPLE.read_text())
    config["models"]["encoder"]["path"] = str(ROOT / "examples/models/encoder.onnx")
    config["models"]["vocabulary"]["path"] = str(ROOT / "examples/models/vocab.txt")
    config["scorers"][0]["model"] = str(ROOT / "examples/models/decoder.onnx")
    config["scorers"].append({"type": "tests.slow_scorer:SlowScorer", "name": "slow", "scale": 1.0,
                              "options": {"vocab_size": 12, "seconds": 0.01}})
    config["search"].update(batch_size=batch_size, max_labels_per_input=0.5)
    config["io"] = {"features": {"path": str(features)}, "formats": ["text", "jsonl"]}
    config["runtime"]["engine"] = {"workers": 2, "batches_per_shard": 2}
    path = folder / f"batch{batch_size}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def records(folder: Path) -> tuple[dict, int]:
    parsed = [json.loads(line) for line in (folder / "nbest.jsonl").read_text().splitlines()]
    return {r["id"]: r for r in parsed}, len(parsed)


def assert_identical(got_folder: Path, expected_folder: Path) -> None:
    """Every utterance exactly once, with the same records as the expected run
    (same label sequences, every score within 1e-4)."""
    got, num_got = records(got_folder)
    expected, _ = records(expected_folder)
    assert num_got == len(got) == NUM_UTTS, (num_got, len(got))  # no duplicate lines
    assert got.keys() == expected.keys()
    for utt, record in expected.items():
        mine = got[utt]
        assert [h["labels"] for h in mine["nbest"]] == [h["labels"] for h in record["nbest"]], utt
        assert [h["words"] for h in mine["nbest"]] == [h["words"] for h in record["nbest"]], utt
        for a, b in zip(mine["nbest"], record["nbest"]):
            assert abs(a["score"] - b["score"]) <= 1e-4, utt
            assert a["scores"].keys() == b["scores"].keys()
            assert all(abs(a["scores"][k] - b["scores"][k]) <= 1e-4 for k in a["scores"]), utt
    text = sorted((got_folder / "text").read_text().splitlines())
    assert text == sorted((expected_folder / "text").read_text().splitlines())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Configs for batch sizes 1 and 3, each with its single-process reference output."""
    folder = tmp_path_factory.mktemp("ray-data")
    configs = {size: make_config(folder, batch_size=size) for size in (1, 3)}
    for size, config in configs.items():
        summary = run_decode(load_config(config, [f"io.output={folder / f'local{size}'}"]))
        assert summary.decoded == NUM_UTTS
    return folder, configs


def row(output: str, key: str) -> str:
    """The value of one summary row (``key  value``) in the command's output."""
    found = [line[len(key):].strip() for line in output.splitlines() if line.startswith(key + "  ")]
    assert len(found) == 1, (key, output)
    return found[0]


def decode(*args):
    return CliRunner().invoke(main, ["decode", *map(str, args)])


class Stop(Exception):
    pass


def stop_after(count: int):
    def progress(done: int, total: int, *_) -> None:
        if done >= count:
            raise Stop
    return progress


# --- tests ------------------------------------------------------------------------------------

def test_two_ray_workers_give_the_single_process_output(cluster, data, tmp_path):
    folder, configs = data
    # shards slow enough (~1 s each) that the later of the two actors to start still gets some:
    # with 10 ms steps the first one ready could take all four before the other had loaded
    slow = len(yaml.safe_load(configs[3].read_text())["scorers"]) - 1
    result = decode(configs[3], "--engine", "ray", "--workers", "2", "--output", tmp_path / "ray",
                    "-o", f"scorers[{slow}].options.seconds=0.05")
    assert result.exit_code == 0, result.output
    assert_identical(tmp_path / "ray", folder / "local3")
    got, _ = records(tmp_path / "ray")
    expected, _ = records(folder / "local3")
    assert got == expected  # the same batches on the same code path: the very same records
    assert row(result.output, "engine") == "ray, 2 worker(s) × (1 CPU)"
    assert row(result.output, "worker processes") == "2"
    workers = [line for line in result.output.splitlines()
               if line.startswith("worker ") and not line.startswith("worker processes")]
    assert len(workers) == 2 and all(" utt in " in line for line in workers), result.output
    resolved = yaml.safe_load((tmp_path / "ray" / "config.resolved.yaml").read_text())
    assert resolved["runtime"]["engine"]["type"] == "ray" and resolved["runtime"]["engine"]["workers"] == 2


def test_ctc_on_ray_writes_the_same_ctm_as_the_local_run(cluster, tmp_path):
    config = ROOT / "configs" / "ctc-greedy.yaml"
    local = decode(config, "--output", tmp_path / "local")
    assert local.exit_code == 0, local.output
    on_ray = decode(config, "--engine", "ray", "--workers", "2", "--output", tmp_path / "ray")
    assert on_ray.exit_code == 0, on_ray.output
    ctm = {name: sorted((tmp_path / name / "hyp.ctm").read_text().splitlines()) for name in ("local", "ray")}
    assert ctm["ray"] == ctm["local"] and len(ctm["local"]) > 10


def test_prompts_on_ray_give_the_local_output(cluster, tmp_path):
    """Text generation from a prompt file (no encoder, no features), and features with prompts."""
    config = ROOT / "configs" / "lm-generate.yaml"
    local = decode(config, "--output", tmp_path / "local")
    assert local.exit_code == 0, local.output
    on_ray = decode(config, "--engine", "ray", "--workers", "2", "-o", "search.batch_size=1", "--output", tmp_path / "ray")
    assert on_ray.exit_code == 0, on_ray.output
    got, count = records(tmp_path / "ray")
    expected, _ = records(tmp_path / "local")
    assert got == expected and count == 4
    ids = sorted(p.stem for p in (ROOT / "examples" / "features").glob("*.npy"))
    (tmp_path / "prompts.txt").write_text("".join(f"{u} {3 + i} 4\n" for i, u in enumerate(ids)))
    prefix = ROOT / "configs" / "prefix-lm.yaml"
    local = decode(prefix, "--prompts", tmp_path / "prompts.txt", "--output", tmp_path / "local2")
    on_ray = decode(prefix, "--prompts", tmp_path / "prompts.txt", "--engine", "ray", "--workers", "2",
                    "--output", tmp_path / "ray2")
    assert local.exit_code == 0 and on_ray.exit_code == 0, on_ray.output
    assert records(tmp_path / "ray2")[0] == records(tmp_path / "local2")[0]


def test_a_worker_killed_mid_shard_is_restarted_and_nothing_is_lost(cluster, data, tmp_path, monkeypatch):
    folder, configs = data
    marker = tmp_path / "killed"
    # The first worker to have decoded 3 utterances SIGKILLs itself inside its first shard
    # (4 one-utterance batches per shard), before the shard's results are returned.
    monkeypatch.setenv(KILL_WORKER_ENV, f"3:{marker}")
    statuses = []
    config = load_config(configs[1], [f"io.output={tmp_path / 'ray'}", "runtime.engine.type=ray",
                                      "runtime.engine.batches_per_shard=4"])
    summary = run_decode(config, on_status=lambda workers: statuses.append(dict(workers)))
    killed = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)  # really dead
    assert summary.decoded == NUM_UTTS
    assert_identical(tmp_path / "ray", folder / "local1")
    assert killed not in [int(name.rsplit(":", 1)[1]) for name in summary.workers]  # its shard came from another
    assert statuses and sum(w.decoded for w in summary.workers.values()) == NUM_UTTS + summary.duplicates


def test_resume_after_killing_the_driver_mid_run(cluster, data, tmp_path):
    folder, configs = data
    output = tmp_path / "cut"
    command = [sys.executable, "-m", "gpudecode", "decode", str(configs[1]), "--engine", "ray",
               "--address", cluster, "--workers", "2", "--output", str(output),
               "-o", "runtime.engine.batches_per_shard=1", "-o", "scorers.1.options.seconds=0.03"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    nbest = output / "nbest.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None and (
            not nbest.exists() or len(nbest.read_text().splitlines()) < 3):
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    _, stderr = process.communicate()
    assert process.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    _, written = records(output)
    assert 3 <= written < NUM_UTTS, written  # really interrupted mid-run
    # the slow scorer's sleep changes no result, but it is a scorer option: --force accepts the change
    result = decode(configs[1], "--engine", "ray", "--output", output, "--resume", "--force")
    assert result.exit_code == 0, result.output
    assert row(result.output, "resumed (already done)") == str(written)
    assert row(result.output, "utterances decoded") == str(NUM_UTTS - written)
    assert_identical(output, folder / "local1")


def test_resume_across_engines_both_ways(cluster, data, tmp_path):
    folder, configs = data
    # started on Ray, stopped after 5 utterances, finished in one process
    ray_first = tmp_path / "ray-first"
    with pytest.raises(Stop):
        run_decode(load_config(configs[1], [f"io.output={ray_first}", "runtime.engine.type=ray",
                                            "runtime.engine.batches_per_shard=1"]), progress=stop_after(5))
    _, written = records(ray_first)
    assert 5 <= written < NUM_UTTS
    summary = run_decode(load_config(configs[1], [f"io.output={ray_first}"]), resume=True)
    assert (summary.resumed, summary.decoded) == (written, NUM_UTTS - written)
    assert_identical(ray_first, folder / "local1")
    # started in one process, stopped after 7 utterances, finished on Ray (whose pool must be
    # free again after the interrupted run above)
    local_first = tmp_path / "local-first"
    with pytest.raises(Stop):
        run_decode(load_config(configs[1], [f"io.output={local_first}"]), progress=stop_after(7))
    _, written = records(local_first)
    assert written == 7
    result = decode(configs[1], "--engine", "ray", "--output", local_first, "--resume")
    assert result.exit_code == 0, result.output
    assert row(result.output, "resumed (already done)") == "7" and row(result.output, "engine").startswith("ray")
    assert_identical(local_first, folder / "local1")


def test_pool_that_does_not_fit_the_cluster_and_engine_keys(cluster, data, tmp_path):
    _, configs = data
    config = load_config(configs[1], [f"io.output={tmp_path / 'big'}", "runtime.engine.type=ray",
                                      "runtime.engine.workers=3"])
    with pytest.raises(EngineError, match=r"3 worker\(s\) of 1 CPU each do not fit the Ray cluster \(2 CPU, 0 GPU\)"):
        run_decode(config)
    result = decode(configs[1], "--engine", "ray", "--gpus-per-worker", "1", "--output", tmp_path / "gpu")
    assert result.exit_code == 1 and "1 CPU, 1 GPU each do not fit the Ray cluster (2 CPU, 0 GPU)" in result.output
    result = decode(configs[1], "--engine", "ray", "--gpus-per-worker", "1.5", "--output", tmp_path / "x")
    assert result.exit_code == 1 and "runtime.engine.gpus_per_worker: 1.5 GPUs per worker" in result.output
    with pytest.raises(ConfigError, match="runtime.engine.gpus_per_worker: runtime.device is cuda"):
        load_config(configs[1], ["runtime.engine.type=ray", "runtime.device=cuda",
                                 "runtime.engine.gpus_per_worker=0"])
    with pytest.raises(ConfigError, match="runtime.engine.type: invalid choice 'spark'; valid choices: local, ray"):
        load_config(configs[1], ["runtime.engine.type=spark"])
    engine = load_config(configs[1], ["runtime.engine.address=10.1.2.3:6379"]).runtime.engine
    assert (engine.type, engine.address, engine.workers) == ("local", "10.1.2.3:6379", 2)


def test_without_ray_the_error_names_the_extra_and_local_never_imports_ray(data, tmp_path, monkeypatch):
    _, configs = data
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    result = decode(configs[1], "--engine", "ray", "--output", tmp_path / "none")
    assert result.exit_code == 1
    assert "needs Ray" in result.output and "pip install 'gpudecode[ray]'" in result.output
    script = ("import sys; from gpudecode.cli import main\n"
              "try: main(['decode', sys.argv[1], '--output', sys.argv[2]])\n"
              "except SystemExit as exit: assert exit.code == 0, exit.code\n"
              "assert 'ray' not in sys.modules, 'the local engine imported ray'")
    run = subprocess.run([sys.executable, "-c", script, str(EXAMPLE), str(tmp_path / "local")], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "local" / "nbest.jsonl").exists()


def test_when_retries_are_used_up_the_error_says_to_resume(cluster, data, tmp_path, monkeypatch):
    # Last on purpose: after a failed run Ray Data may hold the dead worker's restarted actor
    # (and its CPU) for a while (~15-20 s here) before the pool is gone.
    _, configs = data
    monkeypatch.setenv(KILL_WORKER_ENV, f"1:{tmp_path / 'killed'}")
    config = load_config(configs[1], [f"io.output={tmp_path / 'ray'}", "runtime.engine.type=ray",
                                      "runtime.engine.max_task_retries=0"])
    with pytest.raises(EngineError, match=r"(?s)runtime.engine.max_task_retries 0.*run again with --resume"):
        run_decode(config)
    assert (tmp_path / "killed").exists()
    _, written = records(tmp_path / "ray")
    assert written < NUM_UTTS


def test_scaling_tool_compares_pools_on_the_running_cluster(cluster, tmp_path):
    """`python -m gpudecode.engines.scaling` on CPU workers: two rounds of 1 vs 2 workers on the
    example's features repeated to 12 utterances; the same labels in every pool, one ratio per
    run against the first pool of its round, medians over the rounds, and the caller's Ray
    connection left open."""
    import ray

    from gpudecode.engines import scaling

    result = scaling.main([str(EXAMPLE), "--utterances", "12", "--pools", "1x0,2x0", "--repeats", "2",
                           "--output", str(tmp_path / "scaling")])
    runs = result["runs"]
    assert [(r["round"], r["pool"]) for r in runs] == [(0, "1x0"), (0, "2x0"), (1, "1x0"), (1, "2x0")]
    assert all(r["utterances"] == 12 for r in runs)
    for first, second in ((runs[0], runs[1]), (runs[2], runs[3])):
        assert first["wall_ratio"] == 1.0
        assert second["wall_ratio"] == pytest.approx(second["wall_utt_per_s"] / first["wall_utt_per_s"])
    medians = result["median_ratios"]
    assert medians["2x0"]["wall_ratio"] == pytest.approx((runs[1]["wall_ratio"] + runs[3]["wall_ratio"]) / 2)
    assert json.loads((tmp_path / "scaling" / "scaling.json").read_text())["median_ratios"] == medians
    assert len(list((tmp_path / "scaling" / "features").glob("*.npy"))) == 12
    assert ray.is_initialized()
