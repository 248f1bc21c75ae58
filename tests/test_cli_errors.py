"""`gpudecode decode` failures as one `Error:` line that names the file and keeps what was written:
disk full, read-only output (and an unwritable wer.json), SIGINT and SIGTERM; no "decoding" before
an early error; the "(with -o overrides)" note only with -o overrides; the exit statuses."""

import builtins
import importlib.machinery
import importlib.util
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gpudecode.cli import EXIT_SIGINT, EXIT_SIGTERM, main
from tests.test_cli_decode import slow_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "random-aed.yaml"
WORDS = ["one", "two", "three"]


def decode(*args):
    return CliRunner().invoke(main, ["decode", *map(str, args)])


def faults():
    """tools/faults (a script without the .py suffix) as a module: its ``make_open`` write hook."""
    loader = importlib.machinery.SourceFileLoader("faults", str(ROOT / "tools" / "faults"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("faults", loader))
    loader.exec_module(module)
    return module


def faulty_disk(monkeypatch, root, **faults_of_the_disk):
    """``open`` in this process as a disk at ``root`` with the given faults has it (builtins only)."""
    faulty = faults().make_open(io.open, root, **faults_of_the_disk)
    monkeypatch.setattr(builtins, "open", faulty)
    monkeypatch.setattr(io, "open", faulty)


def lines(path):
    return path.read_text().splitlines(keepends=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "out"
    assert decode(EXAMPLE, "--output", out).exit_code == 0
    return out


def test_disk_full_is_one_error_line_naming_the_file_and_resume_finishes(tmp_path, monkeypatch, reference):
    out = tmp_path / "out"
    first_text, first_json = lines(reference / "text")[0], lines(reference / "nbest.jsonl")[0]
    room = sum(len((reference / n).read_bytes()) for n in ("config.resolved.yaml", "run-identity.json"))
    room += len(first_text.encode()) + len(first_json.encode()) + 5  # the first utterance, then 5 bytes
    room += len(str(out)) - len(str(reference))  # the output path in the resolved config
    faulty_disk(monkeypatch, out, full_after_bytes=room)
    result = decode(EXAMPLE, "--output", out)
    monkeypatch.undo()
    assert result.exit_code == 1
    assert "Traceback" not in result.output and "Errno" not in result.output
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {out}/text: no space left on device; the 1 utterance(s) written to {out} are kept: free space, "
        "then run the same command with --resume to decode the rest")
    assert lines(out / "nbest.jsonl") == [first_json]  # the first utterance, whole
    result = decode(EXAMPLE, "--output", out, "--resume")
    assert result.exit_code == 0, result.output
    assert (out / "nbest.jsonl").read_text() == (reference / "nbest.jsonl").read_text()
    assert (out / "text").read_text() == (reference / "text").read_text()  # the torn line cut back


def test_disk_full_before_any_result_says_so(tmp_path, monkeypatch):
    out = tmp_path / "out"
    faulty_disk(monkeypatch, out, full_after_bytes=100)
    result = decode(EXAMPLE, "--output", out)
    monkeypatch.undo()
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {out}/config.resolved.yaml: no space left on device; no result was written yet: free space and "
        "run the command again")


def test_read_only_output_names_the_file_and_keeps_the_results(tmp_path, monkeypatch, reference):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("nbest.jsonl", "text"):  # a run stopped after one utterance
        (out / name).write_text(lines(reference / name)[0])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    faulty_disk(monkeypatch, out, read_only=True)
    result = decode(EXAMPLE, "--output", out, "--resume")
    monkeypatch.undo()
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {out}/config.resolved.yaml: Permission denied (a read-only folder or file?); the 1 utterance(s) "
        f"written to {out} are kept: make it writable (or choose another --output), then run the same command "
        "with --resume to decode the rest")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert decode(EXAMPLE, "--output", out, "--resume").exit_code == 0
    assert (out / "nbest.jsonl").read_text() == (reference / "nbest.jsonl").read_text()


def test_an_unwritable_wer_file_keeps_the_wer_on_the_console(tmp_path, monkeypatch):
    references = tmp_path / "refs"
    references.write_text("".join(f"example-{i} {WORDS[i]}\n" for i in range(3)))
    out = tmp_path / "out"
    faulty_disk(monkeypatch, out / "wer.json", read_only=True)
    result = decode(EXAMPLE, "--output", out, "--references", references)
    monkeypatch.undo()
    assert result.exit_code == 1
    assert "WER  " in result.output or "WER " in result.output
    wer_row = next(line for line in result.output.splitlines() if line.startswith("WER"))
    assert "%" in wer_row and "words" in wer_row
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {out}/wer.json: Permission denied; every result is written and the WER is shown above, but this "
        "file is not saved")
    assert len(lines(out / "nbest.jsonl")) == 3 and not (out / "wer.json").exists()


def _ctrl_c_default() -> None:
    """In the child before it starts: SIGINT's default disposition (a background job's shell may
    have set it to ignored, which Python then keeps)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, name, code", [(signal.SIGINT, "SIGINT", EXIT_SIGINT),
                                             (signal.SIGTERM, "SIGTERM", EXIT_SIGTERM)])
def test_sigint_and_sigterm_say_that_resume_continues(tmp_path, sig, name, code):
    config = slow_config(tmp_path, num_utts=12)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "gpudecode", "decode", str(config), "--output", str(out)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_ctrl_c_default)  # as from a terminal, even where the tests ignore Ctrl-C
    deadline = time.monotonic() + 60
    jsonl = out / "nbest.jsonl"
    while time.monotonic() < deadline and (not jsonl.exists() or len(jsonl.read_text().splitlines()) < 2):
        time.sleep(0.005)
    process.send_signal(sig)
    _, err = process.communicate(timeout=60)
    assert process.returncode == code, err
    written = [json.loads(line) for line in jsonl.read_text().splitlines()]  # every line whole
    assert 2 <= len(written) < 12
    assert "Aborted!" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"Error: interrupted ({name}); the {len(written)} utterance(s) written to {out} are kept: run the same "
        "command with --resume to decode the rest")
    resumed = subprocess.run([*command, "--resume"], cwd=ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    after = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert after[:len(written)] == written and len({r["id"] for r in after}) == len(after) == 12


def started(output):
    return any(line.startswith("decoding") for line in output.splitlines())


def test_no_decoding_line_before_an_early_error(tmp_path):
    result = decode(EXAMPLE, "--output", tmp_path / "a", "-o", "search.beam_size=0")
    assert result.exit_code == 1 and "search.beam_size" in result.output
    assert not started(result.output)
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"not onnx")
    result = decode(EXAMPLE, "--output", tmp_path / "b", "-o", f"scorers.0.model={corrupt}")
    assert result.exit_code == 1 and "corrupt.onnx" in result.output
    assert not started(result.output)
    result = decode(EXAMPLE, "--output", tmp_path / "c")
    assert result.exit_code == 0 and started(result.output)  # (the line the others must not print)


def test_the_overrides_note_only_with_overrides(tmp_path):
    config = yaml.safe_load(EXAMPLE.read_text())
    config["search"]["beam_size"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config).replace("../examples", str(ROOT / "examples")))
    result = decode(bad, "--output", tmp_path / "a", "--features", ROOT / "examples" / "features")
    assert result.exit_code == 1
    assert f"Error: {bad}: search.beam_size: " in result.output and "(with -o overrides)" not in result.output
    result = decode(bad, "--output", tmp_path / "a", "-o", "search.nbest=2")
    assert result.exit_code == 1
    assert f"Error: {bad} (with -o overrides): search.beam_size: " in result.output


def test_exit_statuses():
    assert decode(EXAMPLE, "--force").exit_code == 2  # usage
    assert decode(ROOT / "nowhere.yaml").exit_code == 1  # an Error: line
    assert (EXIT_SIGINT, EXIT_SIGTERM) == (128 + signal.SIGINT, 128 + signal.SIGTERM)
