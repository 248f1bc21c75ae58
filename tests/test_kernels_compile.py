"""Every kernels/*.cu compiles with the machine's nvcc for Hopper, without register spills.

So CI catches a broken kernel without a GPU. Skipped only where nvcc is absent.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from gpudecode.kernels import kernel_dir

NVCC = shutil.which("nvcc")
SOURCES = sorted(kernel_dir().glob("*.cu"))
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def test_kernel_sources_exist():
    names = {path.stem for path in SOURCES}
    assert {"state_copy", "state_pool"} <= names


def parse_spills(ptxas_log: str) -> list[tuple[int, int]]:
    """(spill store bytes, spill load bytes) of every function ptxas reported."""
    return [(int(stores), int(loads)) for stores, loads in SPILLS.findall(ptxas_log)]


def test_parse_spills_reads_ptxas_lines():
    log = (
        "ptxas info    : Function properties for merge_states\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Function properties for split_states\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    )
    assert parse_spills(log) == [(4, 12), (0, 0)]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
@pytest.mark.parametrize("source", SOURCES, ids=[path.name for path in SOURCES])
def test_kernel_compiles_without_spills(source, tmp_path):
    result = subprocess.run(
        [NVCC, "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", "-c", str(source), "-o", str(tmp_path / "kernel.o")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"nvcc failed on {source.name}:\n{log}"
    assert "warning" not in log.lower(), f"nvcc warnings for {source.name}:\n{log}"
    spills = parse_spills(log)
    assert spills, f"no ptxas function report for {source.name} (is -Xptxas -v honoured?):\n{log}"
    assert all(stores == 0 and loads == 0 for stores, loads in spills), f"register spills in {source.name}:\n{log}"
