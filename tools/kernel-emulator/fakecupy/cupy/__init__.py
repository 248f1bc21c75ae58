"""numpy posing as CuPy: arrays are an ndarray subclass defined in a module named ``cupy`` (so
gpudecode.backend.is_device_array sees device arrays) and ``RawModule`` compiles the kernel source
for the CPU emulation (../emu). Only what gpudecode's CuPy paths touch is provided;
everything else falls through to numpy."""

import contextlib
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "emu"))
import emulator  # noqa: E402

__version__ = "13.0.0-emulated"


class ndarray(np.ndarray):
    @property
    def device(self):
        return types.SimpleNamespace(id=0)

    @property
    def data(self):  # CuPy's MemoryPointer: .ptr is the device address (here the host address)
        return types.SimpleNamespace(ptr=np.ndarray.__array_interface__.__get__(self)["data"][0])

    def get(self, stream=None, out=None, **_):
        host = np.asarray(self).view(np.ndarray)
        if out is None:
            return host.copy()
        out[...] = host
        return out


_rng = np.random.default_rng(5)


def _garbage(a):
    b = a.reshape(-1).view(np.uint8) if a.size else a
    if a.size:
        b[...] = _rng.integers(0, 256, b.shape, dtype=np.uint8)
    return a


def asarray(a, dtype=None, order=None):
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return np.array(a, dtype=dtype).view(ndarray)


def array(a, dtype=None, copy=True, **_):
    return np.array(a, dtype=dtype, copy=copy).view(ndarray)


def asnumpy(a, stream=None):
    return np.asarray(a).view(np.ndarray).copy()


def ascontiguousarray(a, dtype=None):
    return np.ascontiguousarray(a, dtype=dtype).view(ndarray)


def empty(shape, dtype=float, order="C"):
    return _garbage(np.empty(shape, dtype)).view(ndarray)


def empty_like(a, dtype=None):
    return _garbage(np.empty_like(a, dtype=dtype)).view(ndarray)


def zeros(shape, dtype=float, order="C"):
    return np.zeros(shape, dtype).view(ndarray)


def ones(shape, dtype=float, order="C"):
    return np.ones(shape, dtype).view(ndarray)


def full(shape, fill_value, dtype=None, order="C"):
    return np.full(shape, fill_value, dtype).view(ndarray)


def arange(*a, **k):
    return np.arange(*a, **k).view(ndarray)


def argsort(a, axis=-1, **_):
    return np.argsort(a, axis=axis, kind="stable").view(ndarray)


def get_array_module(*arrays):
    return sys.modules[__name__]


# --- cuda --------------------------------------------------------------------------------------------
class _Event:
    done = True  # launches run to completion when called

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        pass

    def record(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


class Stream:
    _count = 0
    done = True  # launches run to completion when called

    def __init__(self, non_blocking=False, null=False, ptr=None):
        Stream._count += 1
        self.ptr = 0 if null else Stream._count

    def record(self, event=None):
        return _Event()

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def __enter__(self):
        _stream_stack.append(self)
        return self

    def __exit__(self, *exc):
        _stream_stack.pop()


_stream_stack = [Stream(null=True)]


class Device:
    def __init__(self, device=0):
        self.id = int(device or 0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def synchronize(self):
        pass


class RawModule:
    def __init__(self, code=None, path=None, options=(), name_expressions=None, **_):
        if code is None:
            code = Path(path).read_text()
        self.code = code
        self._library = None

    def compile(self, log_stream=None):
        if self._library is None:
            self._library = emulator.compile_source(self.code)

    def get_function(self, name):
        self.compile()
        return self._library.kernel(name)


class RawKernel:
    def __init__(self, code, name, options=(), **_):
        self._module, self._name = RawModule(code=code), name

    def __call__(self, grid, block, args, **kw):
        return self._module.get_function(self._name)(grid, block, args, **kw)


class _Pool:
    def free_all_blocks(self):
        pass

    def total_bytes(self):
        return 0

    def used_bytes(self):
        return 0


_pool, _pinned_pool = _Pool(), _Pool()


def get_default_memory_pool():
    return _pool


def get_default_pinned_memory_pool():
    return _pinned_pool


def _memcpy(dst, src, size, kind=None, stream=None):
    import ctypes

    if size:
        ctypes.memmove(int(dst), int(src), int(size))


cuda = types.SimpleNamespace(
    runtime=types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        memcpy=_memcpy,
        memcpyAsync=_memcpy,
        memcpyHostToHost=0,
        memcpyHostToDevice=1,
        memcpyDeviceToHost=2,
        memcpyDeviceToDevice=3,
        memcpyDefault=4,
        deviceSynchronize=lambda: None,
        streamSynchronize=lambda stream: None,
    ),
    Device=Device,
    Stream=Stream,
    Event=_Event,
    get_current_stream=lambda: _stream_stack[-1],
    get_device_id=lambda: 0,
    alloc_pinned_memory=lambda n: bytearray(n),
)


def __getattr__(name):
    return getattr(np, name)
