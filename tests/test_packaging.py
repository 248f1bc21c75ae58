"""The package imports without CUDA and finds its kernels from a checkout and from a wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import gpudecode
from gpudecode.kernels import kernel_dir, kernel_source

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_found_in_checkout():
    assert kernel_dir() == ROOT / "kernels"
    cu_files = sorted(p.stem for p in kernel_dir().glob("*.cu"))
    assert cu_files, "no kernels/*.cu"
    assert "__global__" in kernel_source(cu_files[0])
    with pytest.raises(FileNotFoundError, match="no kernel family 'nope'"):
        kernel_source("nope")


def test_kernel_source_inlines_the_shared_headers():
    """``#include "x.cuh"`` lines are replaced by the header (CuPy compiles the text alone)."""
    headers = sorted(p.name for p in kernel_dir().glob("*.cuh"))
    assert headers
    for family in sorted(p.stem for p in kernel_dir().glob("*.cu")):
        raw, source = (kernel_dir() / f"{family}.cu").read_text(), kernel_source(family)
        assert '#include "' not in source, family
        for header in headers:
            if f'#include "{header}"' in raw:
                assert (kernel_dir() / header).read_text() in source


def test_import_does_not_import_cupy():
    code = "import sys, gpudecode, gpudecode.session, gpudecode.cli; print('cupy' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_wheel_ships_kernels_as_package_data(tmp_path):
    pytest.importorskip("hatchling")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("gpudecode-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernels = [n for n in names if n.startswith("gpudecode/kernels/") and n.endswith(".cu")]
    assert len(kernels) == len(list((ROOT / "kernels").glob("*.cu")))
    headers = [n for n in names if n.startswith("gpudecode/kernels/") and n.endswith(".cuh")]
    assert len(headers) == len(list((ROOT / "kernels").glob("*.cuh")))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "from gpudecode.kernels import kernel_dir; print(kernel_dir())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == site / "gpudecode" / "kernels"
    assert gpudecode.__version__ in wheel.name
