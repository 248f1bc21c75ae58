"""CPU runs with bound output buffers (IO binding) on a session that reuses its binding: each call
sees only its own inputs and writes only its own buffers, whatever the calls before it bound."""

import numpy as np
import pytest

from gpudecode.session import OnnxSession
from tests.test_session import double_model


@pytest.mark.parametrize("raw", [True, False], ids=["runtime-binding", "python-wrapper"])
def test_bound_runs_write_only_their_own_buffers(tmp_path, raw):
    path = tmp_path / "double.onnx"
    path.write_bytes(double_model().SerializeToString())
    session = OnnxSession(path)
    session.host_raw_binds = raw
    rng = np.random.default_rng(3)
    earlier = []  # (buffer, what it must still hold)
    for rows in (2, 3, 3, 1, 4, 4):
        x = rng.standard_normal((rows, 5)).astype(np.float32)
        y = np.full((rows, 5), np.nan, np.float32)
        out = session.run({"x": x}, ["y", "shape"], outputs={"y": y})  # shape allocated by the runtime
        assert out["y"] is y
        np.testing.assert_array_equal(y, 2 * x)
        np.testing.assert_array_equal(out["shape"], [rows, 5])
        shape = np.zeros(2, np.int64)
        both = session.run({"x": x}, ["y", "shape"], outputs={"y": np.empty_like(y), "shape": shape})
        np.testing.assert_array_equal(both["shape"], [rows, 5])
        for buffer, held in earlier:  # buffers bound by earlier calls are never written again
            np.testing.assert_array_equal(buffer, held)
        earlier += [(y, y.copy()), (shape, shape.copy()), (out["shape"], out["shape"].copy())]
    # a call that binds fewer outputs than the one before does not write the other's buffer
    x = np.ones((4, 5), np.float32)
    shape = np.zeros(2, np.int64)
    session.run({"x": x}, ["y", "shape"], outputs={"y": np.empty((4, 5), np.float32), "shape": shape})
    only = session.run({"x": 3 * x[:2]}, ["y"], outputs={"y": np.empty((2, 5), np.float32)})
    np.testing.assert_array_equal(only["y"], 6 * x[:2])
    np.testing.assert_array_equal(shape, [4, 5])  # not [2, 5]
    plain = session.run({"x": x})  # and an unbound run after bound ones
    np.testing.assert_array_equal(plain["y"], 2 * x)
    strided = np.arange(40, dtype=np.float32).reshape(4, 10)[:, ::2]  # a copy made contiguous for the run
    y = np.empty((4, 5), np.float32)
    np.testing.assert_array_equal(session.run({"x": strided}, ["y"], outputs={"y": y})["y"], 2 * strided)
    if not raw:
        assert session._host.raw is None  # bound through the wrapper
