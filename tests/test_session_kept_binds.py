"""A bound CPU run leaves a name bound when it is the very same numpy array as before (a float
input, whose memory the runtime reads in place, or an output buffer): the runs still read the
array's current values and write the buffer; another array, another shape or other names rebind."""

import numpy as np
import pytest

from gpudecode.session import OnnxSession
from tests.test_session_bound_cpu import double_model


@pytest.mark.parametrize("raw", [True, False], ids=["raw-binds", "wrapper-binds"])
def test_the_same_arrays_stay_bound_and_are_read_afresh(tmp_path, raw):
    path = tmp_path / "double.onnx"
    path.write_bytes(double_model().SerializeToString())
    session = OnnxSession(path)
    session.host_raw_binds = raw
    x, y = np.ones((3, 5), np.float32), np.full((3, 5), np.nan, np.float32)
    session.run({"x": x}, ["y"], outputs={"y": y})
    np.testing.assert_array_equal(y, 2 * x)
    binds = []
    if not raw:  # count the wrapper's binds from here on
        binding = session._host.binding
        for method in ("bind_cpu_input", "bind_output"):
            inner = getattr(binding, method)
            setattr(binding, method, lambda *a, inner=inner, **k: (binds.append(a[0]), inner(*a, **k))[1])
    for value in (3.0, -1.5, 7.0):  # the same input and output arrays, new values written in place
        x[...] = value
        assert session.run({"x": x}, ["y"], outputs={"y": y})["y"] is y
        np.testing.assert_array_equal(y, np.full((3, 5), 2 * value, np.float32))
    assert binds == []  # nothing rebound
    other = np.arange(15, dtype=np.float32).reshape(3, 5)  # another input array: rebound
    session.run({"x": other}, ["y"], outputs={"y": y})
    np.testing.assert_array_equal(y, 2 * other)
    assert binds == ([] if raw else ["x"])
    x[...] = 4.0
    x.shape = (5, 3)  # the same object, another shape: rebound (input and output)
    y.shape = (5, 3)
    session.run({"x": x}, ["y"], outputs={"y": y})
    np.testing.assert_array_equal(y, 2 * x)
    assert binds == ([] if raw else ["x", "x", "y"])
    x.shape, y.shape = (3, 5), (3, 5)
    fresh = np.empty((3, 5), np.float32)
    session.run({"x": x}, ["y"], outputs={"y": fresh})  # another output buffer: written, the old one not
    np.testing.assert_array_equal(fresh, 8 * np.ones((3, 5), np.float32))
    x[...] = 6.0
    both = session.run({"x": x}, ["y", "shape"], outputs={"y": y})  # other names: all rebound
    np.testing.assert_array_equal(both["y"], 2 * x)
    np.testing.assert_array_equal(both["shape"], [3, 5])
    x[...] = 0.5
    session.run({"x": x}, ["y"], outputs={"y": fresh})
    np.testing.assert_array_equal(fresh, np.ones((3, 5), np.float32))
    np.testing.assert_array_equal(y, np.full((3, 5), 12.0, np.float32))  # bound to y no more
