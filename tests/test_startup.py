"""Start-up: a plain CPU decode imports only what its run uses (read from ``python -X importtime``)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "fsdd-ctc.yaml"

# Never needed by a CPU decode of an ONNX CTC model from audio without references.
NEVER = (
    "onnx",            # protobuf + ml_dtypes: only where a model proto is read (CUDA checks, inspect, prepare)
    "ml_dtypes", "ray", "matplotlib", "torch", "transformers", "onnxruntime_genai", "cupy",
    "jiwer",           # only with references
    "h5py", "kaldiio",  # only for those feature formats
    "gpudecode.bench", "gpudecode.prepare.api", "gpudecode.testing", "gpudecode.engines.ray",
)


def imported_modules(tmp_path, *overrides):
    """Decode the bundled FSDD test audio in a fresh interpreter; the set of modules it imported."""
    output = tmp_path / "out"
    command = [sys.executable, "-X", "importtime", "-m", "gpudecode", "decode", str(CONFIG),
               "--output", str(output), "-o", "io.references=null", *overrides]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len((output / "text").read_text().splitlines()) == 8  # it really decoded
    modules = set()
    for line in run.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                modules.add(name)
    assert "gpudecode.cli" in modules and "onnxruntime" in modules  # the trace was read
    return modules


def heavy(modules):
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in NEVER))


def test_prefix_search_decode_imports_no_heavy_optional_module(tmp_path):
    modules = imported_modules(tmp_path)
    assert heavy(modules) == []
    try:
        import numba  # noqa: F401
    except ImportError:
        return
    assert "numba" in modules  # the compiled prefix loop is used, so numba is imported for it


def test_greedy_decode_imports_no_numba(tmp_path):
    pytest.importorskip("numba")  # a test of laziness only where numba is installed
    modules = imported_modules(tmp_path, "-o", "search.type=ctc-greedy")
    assert heavy(modules) == []
    assert not any(m == "numba" or m.startswith("numba.") for m in modules)
