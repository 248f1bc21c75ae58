"""Array backend: numpy on the host, CuPy on the GPU, and the CUDA stream shared with ONNX Runtime.

CuPy is imported lazily so that ``import gpudecode`` works on machines without CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from types import ModuleType

import numpy as np

from gpudecode import defaults


class GpuUnavailableError(RuntimeError):
    """The GPU path was asked for where CuPy or a CUDA device is missing."""


@functools.cache
def _import_cupy() -> tuple[ModuleType | None, str]:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return None, f"CuPy cannot be imported ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})"
    if count == 0:
        return None, "CuPy sees no CUDA device"
    return cupy, ""


@functools.cache
def numba_available() -> bool:
    """Whether numba is installed (found, not imported: what never runs a compiled loop never
    imports it), for the compiled host loops of the ``cpu-jit`` extra."""
    import importlib.util

    return importlib.util.find_spec("numba") is not None


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return _import_cupy()[0] is not None


def require_cupy() -> ModuleType:
    """The cupy module, or one clear error saying why the GPU cannot be used."""
    cupy, reason = _import_cupy()
    if cupy is None:
        raise GpuUnavailableError(
            f"the GPU was requested but cannot be used: {reason}. "
            "Install the 'cuda12' or 'cuda13' extra on a machine with an NVIDIA GPU, "
            "or set the device to 'cpu'."
        )
    return cupy


def is_device_array(array) -> bool:
    """True for CuPy arrays (checked without importing CuPy)."""
    return type(array).__module__.startswith("cupy")


def array_module(device: str) -> ModuleType:
    """numpy for ``"cpu"``, cupy for ``"cuda"``."""
    if device == "cpu":
        return np
    if device == "cuda":
        return require_cupy()
    raise ValueError(f"unknown device {device!r}; valid: 'cpu', 'cuda'")


def get_array_module(*arrays) -> ModuleType:
    """cupy if any argument is a CuPy array, else numpy."""
    if any(is_device_array(a) for a in arrays):
        return require_cupy()
    return np


def to_host(array) -> np.ndarray:
    """A numpy copy of a CuPy array, read on the shared stream after the work queued so far on
    the caller's current stream; numpy arrays pass through."""
    return to_host_all(array)[0]


def to_host_all(*arrays, wait: HostWait | None = None, clock: HostClock | None = None) -> tuple[np.ndarray, ...]:
    """:func:`to_host` of every argument with one synchronisation: the copies into pinned memory
    are queued together on the shared stream, then the stream is waited for once
    (:func:`wait_for` with ``wait`` and ``clock``; a copy into pageable memory would wait inside
    the driver)."""
    device = [a for a in arrays if is_device_array(a)]
    if not device:
        return tuple(np.asarray(a) for a in arrays)
    cupy = require_cupy()
    outs, sources = [], []
    with on_shared_stream(device[0].device.id) as stream:
        for array in arrays:
            if not is_device_array(array):
                outs.append(np.asarray(array))
                continue
            shape = array.shape
            array = cupy.ascontiguousarray(array)  # 0-d arrays come back 1-d
            pinned = cupy.cuda.alloc_pinned_memory(max(array.nbytes, 1))
            out = np.frombuffer(pinned, array.dtype, array.size).reshape(shape)
            if array.nbytes:
                cupy.cuda.runtime.memcpyAsync(out.ctypes.data, array.data.ptr, array.nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            sources.append(array)  # alive until the copies have run
            outs.append(out)
        wait_for(stream, DEFAULT_HOST_WAIT if wait is None else wait, clock)
    return tuple(outs)


@dataclasses.dataclass
class HostClock:
    """Thread CPU and wall seconds of some host work, summed since the last :meth:`reset`, with
    ``count`` the units it was spent on (a benchmark's accounting)."""

    cpu_s: float = 0.0
    wall_s: float = 0.0
    count: int = 0

    def add(self, cpu_s: float, wall_s: float, count: int = 1) -> None:
        self.cpu_s += cpu_s
        self.wall_s += wall_s
        self.count += count

    def reset(self) -> None:
        self.cpu_s = self.wall_s = 0.0
        self.count = 0


#: Seconds of a napping wait's first sleep, and the longest sleep it doubles up to (:class:`HostWait`).
NAP_S = defaults.HOST_WAIT_NAP_S
MAX_NAP_S = defaults.HOST_WAIT_MAX_NAP_S
HOST_WAIT_MODES = defaults.HOST_WAIT_MODES


@dataclasses.dataclass(frozen=True)
class HostWait:
    """How the host waits for the GPU (:func:`wait_for`).

    ``nap`` (the default): poll the event or stream and sleep in between, first ``nap_s``
    seconds, each further sleep twice as long up to ``max_nap_s`` (``max_nap_s`` = ``nap_s``:
    every sleep ``nap_s``), so a long wait (a GPU-bound step of a large batch) wakes the host a
    few times rather than every ``nap_s``. A search reads its stop test a few steps late, so a
    late wake-up leaves the GPU with queued work. ``block``: sleep in the driver until the work is
    done; it cost the host more (on an H200 a beam-8 × 512 search step took 2.07 ms of thread CPU
    time blocking against 1.01 ms napping with 100 µs naps, at the same step time). ``spin``:
    poll without sleeping (keeps a core busy)."""

    mode: str = defaults.HOST_WAIT
    nap_s: float = NAP_S
    max_nap_s: float = MAX_NAP_S

    def __post_init__(self) -> None:
        if self.mode not in HOST_WAIT_MODES:
            raise ValueError(f"host_wait: expected one of {', '.join(HOST_WAIT_MODES)}, got {self.mode!r}")
        if self.mode == "nap" and not 0 < self.nap_s <= self.max_nap_s:
            raise ValueError(f"host_wait nap: expected 0 < nap_s <= max_nap_s, got {self.nap_s} and {self.max_nap_s}")


#: Napping waits of :data:`NAP_S` doubling up to :data:`MAX_NAP_S`.
DEFAULT_HOST_WAIT = HostWait()


def wait_for(work, wait: HostWait = DEFAULT_HOST_WAIT, clock: HostClock | None = None) -> None:
    """Waits until a CuPy event or stream has run its queued work, as ``wait`` says; the wait's
    thread CPU and wall seconds are added to ``clock`` (None: not measured)."""
    if clock is not None:
        cpu, wall = time.thread_time(), time.perf_counter()
    if wait.mode == "spin":
        while not work.done:
            pass
    elif wait.mode == "nap":
        nap = wait.nap_s
        while not work.done:
            time.sleep(nap)
            nap = min(2 * nap, wait.max_nap_s)
    else:
        work.synchronize()
    if clock is not None:
        clock.add(time.thread_time() - cpu, time.perf_counter() - wall)


def to_device(array, device_id: int = 0):
    """A CuPy array on ``device_id`` (uploaded on the shared stream); CuPy arrays pass through."""
    cupy = require_cupy()
    if is_device_array(array):
        return array
    with on_shared_stream(device_id):
        return cupy.asarray(array)


def on_shared_stream(device_id: int = 0):
    """Runs the block on the shared stream of ``device_id``, after the work queued so far on the
    caller's current stream; afterwards the caller's stream waits for the block's work. Inside
    the search (whose current stream is the shared one, on its device) this costs nothing: the
    block just runs (a step enters this a dozen times)."""
    cupy = require_cupy()
    stream = shared_stream(device_id)
    if cupy.cuda.get_device_id() == device_id and cupy.cuda.get_current_stream().ptr == stream.ptr:
        return contextlib.nullcontext(stream)
    return _switched_to(cupy, stream, device_id)


@contextlib.contextmanager
def _switched_to(cupy, stream, device_id: int):
    """:func:`on_shared_stream` from another stream or device."""
    with cupy.cuda.Device(device_id):
        outer = cupy.cuda.get_current_stream()
        if outer.ptr == stream.ptr:
            yield stream
            return
        stream.wait_event(outer.record())
        try:
            with stream:
                yield stream
        finally:
            outer.wait_event(stream.record())


@functools.cache
def shared_stream(device_id: int = 0):
    """The one non-blocking CUDA stream per device on which CuPy and ONNX Runtime both run."""
    cupy = require_cupy()
    with cupy.cuda.Device(device_id):
        return cupy.cuda.Stream(non_blocking=True)


def is_out_of_memory(error: BaseException) -> bool:
    """True for CuPy's and ONNX Runtime's GPU out-of-memory errors."""
    if type(error).__name__ == "OutOfMemoryError":
        return True
    message = str(error).lower()
    return "out of memory" in message or "failed to allocate memory" in message


def release_cached_memory() -> None:
    """Returns CuPy's cached free blocks to the device (live arrays are untouched)."""
    cupy, _ = _import_cupy()
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


def device_memory_in_use() -> int | None:
    """Bytes CuPy's pool holds on the current device (None without a GPU)."""
    cupy, _ = _import_cupy()
    return None if cupy is None else int(cupy.get_default_memory_pool().total_bytes())
