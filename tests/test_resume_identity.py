"""--resume checks the run's identity (resolved config, model files' SHA-256, toolkit version): a
different run is refused with its differences listed and nothing written; --force accepts it and
keeps the earlier resolved config; an unchanged run, or one changed only where results cannot
change, resumes."""

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.config import load_config
from gpudecode.io.identity import identity_differences, run_identity
from gpudecode.run import ResumeRefused, run_decode

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "random-aed.yaml"
LM_FUSION = ROOT / "configs" / "lm-fusion.yaml"  # decoder + LSTM LM + length reward, beam 8


def decode(*args):
    return CliRunner().invoke(main, ["decode", *map(str, args)])


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def partial_run(tmp_path, config=EXAMPLE, *extra, keep=1):
    """An output folder as a run killed after ``keep`` utterances leaves it (its last lines cut)."""
    out = tmp_path / "out"
    result = decode(config, "--output", out, *extra)
    assert result.exit_code == 0, result.output
    full = {name: (out / name).read_text() for name in ("nbest.jsonl", "text")}
    for name, text in full.items():
        (out / name).write_text("".join(text.splitlines(keepends=True)[:keep]))
    return out, full


def test_an_unchanged_run_resumes_and_finishes_the_folder(tmp_path):
    out, full = partial_run(tmp_path)
    identity = (out / "run-identity.json").read_text()
    result = decode(EXAMPLE, "--output", out, "--resume")
    assert result.exit_code == 0, result.output
    assert "resumed (already done)  1" in result.output
    assert {n: (out / n).read_text() for n in full} == full
    assert (out / "run-identity.json").read_text() == identity
    assert not list(out.glob("config.resolved.*.yaml")) and not list(out.glob("run-identity.*.json"))


def test_a_changed_beam_is_refused_listing_it_and_nothing_is_written(tmp_path):
    out, _ = partial_run(tmp_path)
    before = snapshot(out)
    result = decode(EXAMPLE, "--output", out, "--resume", "-o", "search.beam_size=2")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[0] == f"Error: io.output: {out} holds results of a different run (run-identity.json differs):"
    assert lines[1] == "  search.beam_size: 4 → 2" and len(lines) == 3
    assert "pass --resume --force to continue anyway" in lines[2]
    assert "decoding" not in result.output
    assert snapshot(out) == before


def test_the_lm_removed_and_beam_1_are_refused_naming_the_scorer(tmp_path):
    out, _ = partial_run(tmp_path, LM_FUSION)
    config = yaml.safe_load(LM_FUSION.read_text())
    config["scorers"] = [s for s in config["scorers"] if s["name"] != "lm"]
    config["search"]["beam_size"] = 1
    without_lm = tmp_path / "no-lm.yaml"  # the same model files, by absolute path
    without_lm.write_text(yaml.safe_dump(config).replace("../examples", str(ROOT / "examples")))
    before = snapshot(out)
    result = decode(without_lm, "--output", out, "--resume")
    assert result.exit_code == 1, result.output
    lm = ROOT / "examples" / "models" / "lstm-lm.onnx"
    assert result.output.strip().splitlines()[1:3] == [
        f"  scorers[1]: {{type: recurrent-lm, name: lm, model: {lm}, ...}} → (none)",
        "  search.beam_size: 8 → 1"]  # the removed scorer is one line, not one per key of the next one
    assert snapshot(out) == before


def test_scorers_match_by_name_and_their_model_files_by_content(tmp_path):
    """With a scorer removed before another, the other's model still compares by its content."""
    files = [tmp_path / name for name in ("a.onnx", "b.onnx")]
    for f in files:
        f.write_bytes(f.name.encode())
    old = {"scorers": [{"name": "a", "model": files[0]}, {"name": "b", "model": files[1]}]}
    new = {"scorers": [{"name": "b", "model": files[1]}]}
    before = run_identity(old, "1")
    lines = identity_differences(before, run_identity(new, "1"))  # b unchanged: a's removal, one line
    assert len(lines) == 1, lines  # (a long temporary path is cut to 100 characters with "...")
    assert lines[0].startswith(f"scorers[0]: {{name: a, model: {str(files[0])[:40]}") and lines[0].endswith(" → (none)")
    files[1].write_bytes(b"changed")
    lines = identity_differences(before, run_identity(new, "1"))
    assert lines[1].startswith(f"scorers[0].model: different file content ({files[1]}; SHA-256 ")


def test_another_config_is_refused(tmp_path):
    out, _ = partial_run(tmp_path)
    before = snapshot(out)
    result = decode(ROOT / "configs" / "ctc.yaml", "--output", out, "--resume", "--features",
                    ROOT / "examples" / "features")
    assert result.exit_code == 1
    assert "holds results of a different run" in result.output
    assert "models.encoder.path: different file content" in result.output and "ctc-encoder.onnx" in result.output
    assert "search.type: \"label-sync\" → \"ctc-prefix\"" in result.output
    assert snapshot(out) == before


def test_a_changed_model_file_is_refused_and_a_moved_one_is_not(tmp_path):
    decoder = tmp_path / "models" / "decoder.onnx"
    decoder.parent.mkdir()
    shutil.copyfile(ROOT / "examples" / "models" / "decoder.onnx", decoder)
    out, full = partial_run(tmp_path, EXAMPLE, "-o", f"scorers.0.model={decoder}")
    moved = tmp_path / "elsewhere" / "decoder.onnx"
    moved.parent.mkdir()
    shutil.copyfile(decoder, moved)
    decoder.write_bytes(decoder.read_bytes() + b"\0")  # other content at the same path
    before = snapshot(out)
    result = decode(EXAMPLE, "--output", out, "--resume", "-o", f"scorers.0.model={decoder}")
    assert result.exit_code == 1
    assert f"scorers[0].model: different file content ({decoder}; SHA-256 " in result.output
    assert snapshot(out) == before
    result = decode(EXAMPLE, "--output", out, "--resume", "-o", f"scorers.0.model={moved}")
    assert result.exit_code == 0, result.output  # the same model at another path: the same run
    assert {n: (out / n).read_text() for n in full} == full


def test_force_accepts_the_change_and_keeps_the_earlier_resolved_config(tmp_path):
    out, full = partial_run(tmp_path)
    written = (out / "nbest.jsonl").read_text()
    old_config = (out / "config.resolved.yaml").read_text()
    old_identity = (out / "run-identity.json").read_text()
    result = decode(EXAMPLE, "--output", out, "--resume", "--force", "-o", "search.beam_size=2")
    assert result.exit_code == 0, result.output
    assert (out / "nbest.jsonl").read_text().startswith(written)  # what was written is untouched
    ids = [json.loads(line)["id"] for line in (out / "nbest.jsonl").read_text().splitlines()]
    assert sorted(ids) == ["example-0", "example-1", "example-2"]
    assert (out / "config.resolved.1.yaml").read_text() == old_config
    assert (out / "run-identity.1.json").read_text() == old_identity
    assert yaml.safe_load((out / "config.resolved.yaml").read_text())["search"]["beam_size"] == 2
    assert json.loads((out / "run-identity.json").read_text())["config"]["search"]["beam_size"] == 2
    assert len([json.loads(line) for line in written.splitlines()][0]["nbest"]) == 4  # beam 4's n-best kept
    result = decode(EXAMPLE, "--output", out, "--resume", "-o", "search.beam_size=2")
    assert result.exit_code == 0, result.output  # the recorded identity is now beam 2's


def test_force_needs_resume():
    result = decode(EXAMPLE, "--force")
    assert result.exit_code == 2 and "--force only applies with --resume" in result.output


def test_settings_that_cannot_change_results_resume_and_the_old_resolved_config_is_kept(tmp_path):
    out, full = partial_run(tmp_path)
    old_config = (out / "config.resolved.yaml").read_text()
    result = decode(EXAMPLE, "--output", out, "--resume", "-o", "search.batch_size=1",
                    "-o", "search.tuning.lagged_stop_test=true")
    assert result.exit_code == 0, result.output
    assert {n: (out / n).read_text() for n in full} == full
    assert (out / "config.resolved.1.yaml").read_text() == old_config  # nothing that described the run is lost


def test_an_older_folder_without_identity_resumes_with_a_warning(tmp_path, caplog):
    out, full = partial_run(tmp_path)
    (out / "run-identity.json").unlink()
    with caplog.at_level(logging.WARNING):
        result = decode(EXAMPLE, "--output", out, "--resume")
    assert result.exit_code == 0, result.output
    assert "holds results but no run-identity.json (written by an older gpudecode)" in caplog.text
    assert {n: (out / n).read_text() for n in full} == full
    assert (out / "run-identity.json").exists()


def test_the_ray_engine_is_checked_before_it_starts(tmp_path):
    """The check runs in run_decode before the engine branch: a changed run is refused on Ray too (before
    any cluster starts), and the engine itself is not part of the identity."""
    out, _ = partial_run(tmp_path)
    config = load_config(EXAMPLE, [f"io.output={out}", "search.beam_size=2", "runtime.engine.type=ray"])
    with pytest.raises(ResumeRefused) as refused:
        run_decode(config, resume=True)
    assert refused.value.differences == ["search.beam_size: 4 → 2"]
    local = run_identity(load_config(EXAMPLE).model_dump(), "1")
    ray = run_identity(load_config(EXAMPLE, ["runtime.engine.type=ray", "runtime.engine.workers=4"]).model_dump(), "1")
    assert identity_differences(local, ray) == []


def test_the_version_is_part_of_the_identity(tmp_path):
    config = load_config(EXAMPLE).model_dump()
    assert identity_differences(run_identity(config, "0.1.0"), run_identity(config, "0.2.0")) == [
        "gpudecode version: 0.1.0 → 0.2.0"]
