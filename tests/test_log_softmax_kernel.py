"""A step's logits through the one-launch log-softmax on CuPy (``scorers.onnx_decoder.log_softmax``,
``kernels/log_softmax.cu``) against the array version on numpy: equal to within float32 rounding,
NaN, ±inf and all -inf rows giving what numpy gives, float16 logits read as float32. In the kernel
emulator here, on CUDA under ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.scorers.onnx_decoder import log_softmax
from tests.test_ctc_prefix_kernel import assert_none_in_emulation, needs_gxx


def _logits(vocab: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((6, vocab)) * 4).astype(dtype)
    x[1, vocab // 2] = np.nan  # a NaN row
    x[2, :] = -np.inf  # every label impossible
    x[3, 0] = -np.inf  # one impossible label
    x[4, -1] = np.inf
    return x


def mismatches(cupy) -> list[str]:
    """Every case on ``cupy`` against numpy's log-softmax of the float32 logits."""
    bad = []
    for vocab in (1, 7, 256, 1000, 10_001):
        for dtype in (np.float32, np.float16):
            x = _logits(vocab, dtype)
            with np.errstate(invalid="ignore"):
                want = log_softmax(np, x.astype(np.float32))
            got = cupy.asnumpy(log_softmax(cupy, cupy.asarray(x)))
            if got.dtype != np.float32 or got.shape != want.shape:
                bad.append(f"V {vocab} {np.dtype(dtype)}: {got.dtype}{got.shape}")
            elif not np.allclose(got, want, rtol=1e-6, atol=2e-6, equal_nan=True):
                worst = np.nanmax(np.abs(np.where(np.isfinite(want), got - want, 0)))
                bad.append(f"V {vocab} {np.dtype(dtype)}: max |diff| {worst}, non-finite "
                           f"{np.argwhere(np.isfinite(got) != np.isfinite(want))[:3].tolist()}")
    return bad


def test_numpy_keeps_the_array_version():
    x = _logits(7, np.float32)[[0, 3]]
    got = log_softmax(np, x)
    np.testing.assert_allclose(np.exp(got).sum(axis=1), 1.0, rtol=1e-6)
    assert got[1, 0] == -np.inf


@needs_gxx
def test_one_launch_equals_the_array_version_in_emulation():
    assert_none_in_emulation("tests.test_log_softmax_kernel", "mismatches")


@pytest.mark.gpu
def test_one_launch_equals_the_array_version_on_cuda():
    cupy = pytest.importorskip("cupy")
    assert mismatches(cupy) == []
