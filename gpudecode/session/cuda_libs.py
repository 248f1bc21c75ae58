"""The CUDA and cuDNN libraries ONNX Runtime's CUDA provider needs: loaded from NVIDIA's pip wheels
(``onnxruntime.preload_dlls()``) before a CUDA session is made, and named in the error when the
provider does not load.

The ``cuda12`` / ``cuda13`` extras install those wheels (ONNX Runtime's ``cuda`` and ``cudnn``
extras), so a machine needs only the NVIDIA driver. ``load`` (``ctypes.CDLL``) is a parameter, so
a test can hide libraries without touching the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import io
from collections.abc import Callable, Sequence
from types import ModuleType

#: Linux sonames of CUDA 12 builds; ``{major}`` is the CUDA major version of the ONNX Runtime build.
_LIBRARIES = ("libcudart.so.{major}", "libcublasLt.so.{major}", "libcublas.so.{major}", "libcurand.so.10",
              "libcufft.so.{cufft}", "libcudnn.so.9")


def cuda_major(ort: ModuleType) -> str:
    """The CUDA major version ONNX Runtime was built with (``"12"`` when it does not say)."""
    try:
        version = getattr(importlib.import_module(f"{ort.__name__}.capi.build_and_package_info"), "cuda_version", "")
    except Exception:  # a CPU build or an unusual package: assume the CUDA 12 names
        version = ""
    major = str(version).split(".")[0]
    return major if major.isdigit() else "12"


def cuda_library_names(major: str) -> tuple[str, ...]:
    """The libraries the CUDA provider of a CUDA ``major`` build loads (cuFFT's soname lags by one)."""
    cufft = "12" if major == "13" else "11"
    return tuple(name.format(major=major, cufft=cufft) for name in _LIBRARIES)


def missing_libraries(names: Sequence[str], load: Callable[[str], object] = ctypes.CDLL) -> list[str]:
    """``name: why`` for each of ``names`` that ``load`` cannot open (the dynamic loader's search)."""
    missing = []
    for name in names:
        try:
            load(name)
        except OSError as exc:
            missing.append(str(exc) if name in str(exc) else f"{name}: {exc or 'cannot be loaded'}")
    return missing


@functools.cache
def preload_cuda_libraries(ort: ModuleType) -> str:
    """Call ``ort.preload_dlls()`` once per process where this ONNX Runtime has it (1.21 and later):
    it loads the CUDA and cuDNN libraries of NVIDIA's pip wheels. Returns what it printed (its
    reports of libraries it could not load), '' when nothing."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return ""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            preload()
        except Exception as exc:  # a failed preload leaves the provider to report what is missing
            print(f"onnxruntime.preload_dlls() failed: {type(exc).__name__}: {exc}")
    return printed.getvalue().strip()


def install_command(ort: ModuleType) -> str:
    """The command that installs the CUDA and cuDNN wheels matching the installed ONNX Runtime."""
    version = getattr(ort, "__version__", "")
    pinned = f"=={version}" if version else ""
    extra = "cuda13" if cuda_major(ort) == "13" else "cuda12"
    return (f'pip install "onnxruntime-gpu[cuda,cudnn]{pinned}" (or reinstall the toolkit with its '
            f'"{extra}" extra)')


def provider_failure(ort: ModuleType, source: str, active: Sequence[str], *, preload_report: str = "",
                     load: Callable[[str], object] = ctypes.CDLL) -> str:
    """The message for a CUDA session that ONNX Runtime made on another provider: the libraries the
    dynamic loader cannot open and the command that installs them."""
    missing = missing_libraries(cuda_library_names(cuda_major(ort)), load)
    lines = [f"{source}: CUDA was requested but ONNX Runtime runs the model on {list(active)}: the CUDA "
             "execution provider did not load"]
    if missing:
        lines.append("missing libraries: " + "; ".join(missing))
    else:
        lines.append("every CUDA and cuDNN library loads, so the provider itself failed (a driver older than "
                     "the CUDA build, or a GPU this ONNX Runtime was not built for); ONNX Runtime's log above says why")
    if preload_report:
        lines.append("onnxruntime.preload_dlls() reported: " + " ".join(preload_report.split()))
    lines.append(f"install them with: {install_command(ort)}; a machine then needs only the NVIDIA driver")
    return "\n".join(lines)
