"""Finds the CUDA sources of ``kernels/`` and compiles them lazily with ``cupy.RawModule``.

From a source checkout the sources are the top-level ``kernels/`` folder; in an installed wheel
they are package data at ``gpudecode/kernels/``.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

from gpudecode.backend import require_cupy


def kernel_dir() -> Path:
    """The folder holding the ``.cu`` files."""
    packaged = Path(str(resources.files("gpudecode"))) / "kernels"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parent.parent / "kernels"
    if checkout.is_dir():
        return checkout
    raise FileNotFoundError(f"CUDA kernel sources not found in {packaged} or {checkout}")


_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"$', re.MULTILINE)


def kernel_source(family: str) -> str:
    """The source text of ``kernels/<family>.cu``, its ``#include "x.cuh"`` lines replaced by
    those headers (so CuPy's compile cache, keyed on the source text, sees header changes)."""
    path = kernel_dir() / f"{family}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel family {family!r}: {path} does not exist")
    return _INCLUDE.sub(lambda m: (kernel_dir() / m.group(1)).read_text(), path.read_text())


@functools.cache
def load_module(family: str, name_expressions: tuple[str, ...], device_id: int = 0):
    """The compiled ``RawModule`` of one kernel family, memoised per device."""
    cupy = require_cupy()
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(
            code=kernel_source(family),
            options=("--std=c++17",),
            name_expressions=list(name_expressions),
        )
        module.compile()
    return module


@functools.cache
def kernel_function(family: str, name: str, device_id: int = 0):
    """The kernel ``name`` of a family (``load_module(family).get_function(name)``), looked up once
    per device: a lookup costs a driver call, a step launches a dozen kernels."""
    return load_module(family, (), device_id).get_function(name)
