"""Reading ahead (``runtime.prefetch_batches``) and the writer thread (``runtime.writer_queue``):
the same output files byte for byte, the same messages for bad inputs (stop and skip), nothing
lost or duplicated after an interrupt or a full disk; ``prefetched`` and ``WriterThread`` alone."""

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.config import ConfigError, load_config
from gpudecode.io.prefetch import prefetched
from gpudecode.io.writer_thread import WriterThread
from gpudecode.run import run_decode
from tests.test_cli_errors import faulty_disk, lines

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "random-aed.yaml"
NUM_UTTS = 12
#: (prefetch_batches, writer_queue, writer_process): both threads off (the reference), each alone,
#: both on; the writer process (``gpudecode.io.writer_process``) behind the loop and the thread
SETTINGS = [(0, 0, False), (2, 0, False), (0, 1, False), (2, 256, False), (1, 1, False), (0, 0, True), (2, 256, True)]


def decode(*args):
    return CliRunner().invoke(main, ["decode", *map(str, args)])


def corpus(tmp_path, bad: np.ndarray | None = None) -> Path:
    """12 utterances of 16 features, 8–30 frames; ``bad`` replaces u05 (a middle length)."""
    folder = tmp_path / "features"
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(3)
    for i in range(NUM_UTTS):
        np.save(folder / f"u{i:02d}.npy", rng.standard_normal((8 + 2 * i, 16)).astype(np.float32))
    if bad is not None:
        np.save(folder / "u05.npy", bad)
    return folder


def run_cli(folder, out, prefetch, queue, *extra, process=False):
    return decode(EXAMPLE, "--features", folder, "--output", out, "-o", "search.batch_size=2",
                  "-o", f"runtime.prefetch_batches={prefetch}", "-o", f"runtime.writer_queue={queue}",
                  "-o", f"runtime.writer_process={str(process).lower()}", *extra)


def outputs(out: Path) -> dict[str, bytes]:
    """The result files and the run's identity (the resolved config names the settings themselves)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "config.resolved.yaml"}


def test_same_files_byte_for_byte_with_and_without_the_threads(tmp_path):
    folder = corpus(tmp_path)
    results = {}
    for prefetch, queue, process in SETTINGS:
        out = tmp_path / f"out-{prefetch}-{queue}-{process}"
        result = run_cli(folder, out, prefetch, queue, process=process)
        assert result.exit_code == 0, result.output
        assert f"utterances decoded      {NUM_UTTS}" in result.output
        results[prefetch, queue, process] = outputs(out)
    reference = results[0, 0, False]
    assert {"text", "nbest.jsonl", "run-identity.json"} <= set(reference)
    assert len(reference["text"].splitlines()) == NUM_UTTS
    for setting, files in results.items():
        assert files == reference, setting


BAD = {"nan": np.full((18, 16), np.nan, np.float32), "narrow": np.ones((18, 15), np.float32)}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_input_mid_corpus_gives_the_same_messages_and_files(tmp_path, kind):
    folder = corpus(tmp_path, BAD[kind])
    for policy in ("stop", "skip"):
        seen = {}
        for prefetch, queue, process in SETTINGS:
            out = tmp_path / f"{policy}-{prefetch}-{queue}-{process}"
            result = run_cli(folder, out, prefetch, queue, "-o", f"io.on_bad_input={policy}", process=process)
            messages = [line for line in result.output.splitlines()
                        if "u05" in line or line.startswith("Error:") or "skipped" in line]
            seen[prefetch, queue, process] = (result.exit_code, messages, outputs(out))
        code, messages, files = seen[0, 0, False]
        if policy == "stop":
            assert code == 1 and messages[-1].startswith("Error:") and "u05" in messages[-1]
            # the longest first, two a batch: u11..u06 were decoded before u05's batch was read
            assert len(files["text"].splitlines()) == 6
        else:
            assert code == 0 and any("skipped (bad input)     1" in m for m in messages)
            assert len(files["text"].splitlines()) == NUM_UTTS - 1 and b"u05" not in files["text"]
        for setting, got in seen.items():
            assert got == seen[0, 0, False], (policy, setting)


class Stop(KeyboardInterrupt):
    """Ctrl-C at a chosen moment (raised by the progress callback)."""


@pytest.mark.parametrize("prefetch, queue, process", [(2, 256, False), (0, 0, False), (2, 256, True)])
def test_an_interrupt_keeps_everything_handed_over_and_resume_loses_and_duplicates_nothing(
        tmp_path, prefetch, queue, process):
    folder = corpus(tmp_path)
    overrides = [f"io.features.path={folder}", "search.batch_size=2", f"runtime.prefetch_batches={prefetch}",
                 f"runtime.writer_queue={queue}", f"runtime.writer_process={str(process).lower()}"]
    full = tmp_path / "full"
    run_decode(load_config(EXAMPLE, [*overrides, f"io.output={full}"]))
    cut = tmp_path / "cut"
    seen = []

    def interrupt_after_four(done, total, *_):
        seen.append(done)
        if done >= 4:
            raise Stop

    with pytest.raises(Stop):
        run_decode(load_config(EXAMPLE, [*overrides, f"io.output={cut}"]), progress=interrupt_after_four)
    assert seen[-1] == 4 and len(lines(cut / "nbest.jsonl")) == 4  # exactly those handed over, whole
    assert len(lines(cut / "text")) == 4
    assert not [t for t in threading.enumerate() if t.name in ("gpudecode-reader", "gpudecode-writer")]
    summary = run_decode(load_config(EXAMPLE, [*overrides, f"io.output={cut}"]), resume=True)
    assert (summary.resumed, summary.decoded) == (4, NUM_UTTS - 4)
    assert (cut / "nbest.jsonl").read_bytes() == (full / "nbest.jsonl").read_bytes()
    assert (cut / "text").read_bytes() == (full / "text").read_bytes()


@pytest.mark.parametrize("queue", [0, 1, 256])
def test_disk_full_in_the_writer_thread_is_todays_error_line(tmp_path, monkeypatch, queue):
    folder = corpus(tmp_path)
    reference, out = tmp_path / "ref", tmp_path / "out"  # paths of one length: the same resolved config
    assert run_cli(folder, reference, 2, queue).exit_code == 0
    room = sum(len((reference / n).read_bytes()) for n in ("config.resolved.yaml", "run-identity.json"))
    room += sum(len(lines(reference / n)[0].encode()) for n in ("text", "nbest.jsonl")) + 1
    faulty_disk(monkeypatch, out, full_after_bytes=room)
    result = run_cli(folder, out, 2, queue)
    monkeypatch.undo()
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {out}/text: no space left on device; the 1 utterance(s) written to {out} are kept: free space, "
        "then run the same command with --resume to decode the rest")
    assert lines(out / "nbest.jsonl") == lines(reference / "nbest.jsonl")[:1]
    result = run_cli(folder, out, 2, queue, "--resume")
    assert result.exit_code == 0, result.output
    assert (out / "nbest.jsonl").read_bytes() == (reference / "nbest.jsonl").read_bytes()
    assert (out / "text").read_bytes() == (reference / "text").read_bytes()


def test_the_keys_are_counts():
    assert load_config(EXAMPLE).runtime.prefetch_batches == 2
    for key, value in [("prefetch_batches", "-1"), ("writer_queue", "1.5"), ("prefetch_batches", "true")]:
        with pytest.raises(ConfigError, match=key):
            load_config(EXAMPLE, [f"runtime.{key}={value}"])


# --- the two helpers alone ----------------------------------------------------------------------

def numbers_then(error: BaseException | None, count: int = 6, log: list | None = None):
    for i in range(count):
        if log is not None:
            log.append(i)
        yield i
    if error is not None:
        raise error


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetched_keeps_the_order_and_raises_in_place(depth):
    assert list(prefetched(numbers_then(None), depth)) == list(range(6))
    error = ValueError("bad utterance")
    got = []
    with pytest.raises(ValueError) as raised:
        for item in prefetched(numbers_then(error), depth):
            got.append(item)
    assert got == list(range(6)) and raised.value is error


def test_prefetched_reads_ahead_at_most_depth_and_stops_when_closed():
    produced = []
    items = prefetched(numbers_then(None, count=100, log=produced), 2)
    assert next(items) == 0
    time.sleep(0.2)
    assert len(produced) <= 1 + 2 + 1  # the one taken, two queued, one waiting to be queued
    items.close()
    assert not [t for t in threading.enumerate() if t.name == "gpudecode-prefetch"]
    assert len(produced) < 100


def test_writer_thread_writes_in_order_and_raises_a_failure_once():
    written = []
    with WriterThread(written.append, 2) as writer:
        for i in range(50):
            writer.put(i)
    assert written == list(range(50))  # close waited for every one

    full = OSError(28, "No space left on device")

    def write(item):
        if item == 3:
            raise full
        written.append(item)

    written.clear()
    writer = WriterThread(write, 1)
    with pytest.raises(OSError) as raised:
        for i in range(50):
            writer.put(i)
            time.sleep(0.01)
    assert raised.value is full
    writer.close()  # does not raise it again
    assert written == [0, 1, 2]  # nothing after the failure

    written.clear()
    writer = WriterThread(write, 100)
    for i in range(10):
        writer.put(i)
    with pytest.raises(OSError):
        writer.close()
    assert written == [0, 1, 2]
