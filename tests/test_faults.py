"""tools/faults, reduced (2 kills, 8 utterances): every fault leaves 0 utterances lost, duplicated or
altered against an uninterrupted run, each check holds, and the changed config is refused with its
differences listed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_fault_script_loses_duplicates_and_alters_nothing(tmp_path):
    out = tmp_path / "faults"
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "faults"), "--kills", "2", "--utterances", "8",
                             "--out", str(out), "--seed", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and not line.startswith("| fault")]
    faults = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert faults == ["kill -9 ×2, then resume", "SIGINT, then resume", "SIGTERM, then resume",
                      "disk full (ENOSPC), then resume", "read-only output, then resume once writable",
                      "resume with a changed config (refused), then the run's own",
                      "resume --force with a changed setting"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-3:] == ["0", "0", "0"], row  # lost, duplicated, altered
        assert "✗" not in cells[3] and "✓" in cells[3], row
    refusal = (out / "logs" / "changed-config.txt").read_text()
    assert refusal.startswith("Error: io.output: ") and "holds results of a different run" in refusal
    assert "search.beam_size: 8 → 1" in refusal and "scorers[0]: (none) → {type: recurrent-lm, name: lm" in refusal
    assert "--resume --force" in refusal
    full = (out / "logs" / "disk-full.txt").read_text().strip().splitlines()[-1]
    assert full.startswith(f"Error: {out / 'disk-full'}/") and "no space left on device" in full
    assert "run the same command with --resume" in full


def load_faults():
    """tools/faults as a module (a script without the .py suffix)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("faults", str(ROOT / "tools" / "faults"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("faults", loader))
    loader.exec_module(module)
    return module


def test_the_comparison_counts_lost_duplicated_and_altered_utterances(tmp_path):
    """The script's oracle sees each kind of damage (so its zeros mean something)."""
    import json
    import shutil

    faults = load_faults()
    ref = tmp_path / "ref"
    ref.mkdir()
    records = [{"id": f"u{i}", "text": f"w{i}", "nbest": [{"words": f"w{i}"}]} for i in range(4)]
    (ref / "nbest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (ref / "text").write_text("".join(f"u{i} w{i}\n" for i in range(4)))
    (ref / "hyp.ctm").write_text("".join(f"u{i} 1 0.000 0.100 w{i}\n" for i in range(4)))
    assert faults.compare(ref, ref) == (0, 0, 0)
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    lines = (run / "nbest.jsonl").read_text().splitlines(keepends=True)
    lines = [lines[0], lines[0], lines[1].replace("w1", "x1"), lines[2]]  # u0 twice, u1 altered, u3 lost
    (run / "nbest.jsonl").write_text("".join(lines))
    text = (run / "text").read_text().splitlines(keepends=True)
    (run / "text").write_text("".join(text[:3]))  # u3 lost from text too
    assert faults.compare(ref, run) == (1, 1, 1)
    ctm = (run / "hyp.ctm").read_text().replace("u2 1 0.000 0.100 w2", "u2 1 0.000 0.200 w2")
    (run / "hyp.ctm").write_text(ctm + "torn-li")
    (run / "nbest.jsonl").write_text((run / "nbest.jsonl").read_text() + '{"id": "u3", "nb')  # a torn last line
    assert faults.compare(ref, run) == (1, 1, 4)  # + u2's CTM, the torn CTM line, the torn n-best line
