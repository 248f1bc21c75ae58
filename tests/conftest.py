import sys
import types

import pytest

from gpudecode import backend
from gpudecode.backend import gpu_available


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_MISSING = object()


def _cupy_as(module):
    """Puts ``module`` (None: "cannot be imported") in place of CuPy, and the backend probes it again
    (its answer is cached); the real one comes back afterwards."""
    saved = sys.modules.get("cupy", _MISSING)
    sys.modules["cupy"] = module
    backend._import_cupy.cache_clear()
    try:
        yield
    finally:
        if saved is _MISSING:
            del sys.modules["cupy"]
        else:
            sys.modules["cupy"] = saved
        backend._import_cupy.cache_clear()


@pytest.fixture
def no_gpu():
    """CuPy cannot be imported during the test, as on a machine without it."""
    yield from _cupy_as(None)


@pytest.fixture
def fake_gpu():
    """A stand-in CuPy that sees one device, for code that only asks whether there is a GPU."""
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=lambda: 1))
    yield from _cupy_as(fake)


@pytest.fixture
def loads(monkeypatch):
    """The entries ``kaldiio.load_mat`` loads during the test (kaldiio's own function, wrapped to count)."""
    import kaldiio

    calls = []
    load_mat = kaldiio.load_mat

    def counted(*args, **kwargs):
        calls.append(args[0])
        return load_mat(*args, **kwargs)

    monkeypatch.setattr(kaldiio, "load_mat", counted)
    return calls
