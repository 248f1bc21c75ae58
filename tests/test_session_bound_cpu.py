"""CPU runs with bound output buffers (IO binding) on a session that reuses its binding: each call
sees only its own inputs and writes only its own buffers, whatever the calls before it bound."""

import numpy as np

from gpudecode.session import OnnxSession
from tests.test_session import double_model


def test_bound_runs_write_only_their_own_buffers(tmp_path):
    path = tmp_path / "double.onnx"
    path.write_bytes(double_model().SerializeToString())
    session = OnnxSession(path)
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
        earlier += [(y, y.copy()), (shape, shape.copy())]
    # a call that binds fewer outputs than the one before does not write the other's buffer
    x = np.ones((4, 5), np.float32)
    shape = np.zeros(2, np.int64)
    session.run({"x": x}, ["y", "shape"], outputs={"y": np.empty((4, 5), np.float32), "shape": shape})
    only = session.run({"x": 3 * x[:2]}, ["y"], outputs={"y": np.empty((2, 5), np.float32)})
    np.testing.assert_array_equal(only["y"], 6 * x[:2])
    np.testing.assert_array_equal(shape, [4, 5])  # not [2, 5]
    plain = session.run({"x": x})  # and an unbound run after bound ones
    np.testing.assert_array_equal(plain["y"], 2 * x)
