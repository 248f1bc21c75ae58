"""A Hugging Face step's ``attention_mask`` and ``position_ids`` written in one launch
(``session.hf.write_attention_inputs``, ``kernels/hf_inputs.cu``) equal the array version
``hf_attention_inputs``: left- and right-aligned histories, int64 and int32 inputs, either output
alone, rows of every length from empty to full. In the kernel emulator here, on CUDA under ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.session.hf import hf_attention_inputs, write_attention_inputs
from tests.test_ctc_prefix_kernel import assert_none_in_emulation, needs_gxx

PAST_TIME = 7


def _prefix(rows: int = 5) -> np.ndarray:
    return np.array([0, 3, PAST_TIME, 1, 5][:rows], dtype=np.int32)


def mismatches(cupy) -> list[str]:
    """Every case written on ``cupy`` (poisoned outputs first) against the numpy arrays."""
    bad = []
    prefix = _prefix()
    for alignment in ("left", "right"):
        mask, positions = hf_attention_inputs(prefix, PAST_TIME, alignment=alignment)
        for dtype in (np.int64, np.int32):
            for which in ("both", "mask", "positions"):
                mask_out = cupy.full(mask.shape, -7, dtype=dtype) if which != "positions" else None
                positions_out = cupy.full(positions.shape, -7, dtype=dtype) if which != "mask" else None
                write_attention_inputs(cupy.asarray(prefix), PAST_TIME, alignment, mask_out, positions_out)
                for name, out, want in (("mask", mask_out, mask), ("positions", positions_out, positions)):
                    if out is not None and not np.array_equal(cupy.asnumpy(out), want.astype(dtype)):
                        bad.append(f"{alignment} {np.dtype(dtype)} {which}: {name} {cupy.asnumpy(out)} != {want}")
    return bad


def test_host_arrays_are_written_through_the_array_version():
    prefix = _prefix()
    mask, positions = np.full((5, PAST_TIME + 1), -7), np.full((5, 1), -7)
    write_attention_inputs(prefix, PAST_TIME, "left", mask, positions)
    want_mask, want_positions = hf_attention_inputs(prefix, PAST_TIME, alignment="left")
    np.testing.assert_array_equal(mask, want_mask)
    np.testing.assert_array_equal(positions, want_positions)
    assert mask[0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0] and mask[2].all()  # empty and full histories


@needs_gxx
def test_one_launch_equals_the_array_version_in_emulation():
    assert_none_in_emulation("tests.test_hf_step_inputs", "mismatches")


@pytest.mark.gpu
def test_one_launch_equals_the_array_version_on_cuda():
    cupy = pytest.importorskip("cupy")
    assert mismatches(cupy) == []
