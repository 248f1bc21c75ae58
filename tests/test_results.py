"""Host-side n-best construction helpers (gpudecode/search/results.py)."""

import dataclasses
import gc

import numpy as np
import pytest

from gpudecode.search.results import Hypothesis, label_lists, no_cyclic_gc


def _filtered(tokens, eos):
    return [[int(x) for x in row if x >= 0 and x != eos] for row in tokens]


@pytest.mark.parametrize("eos", [1, None])
def test_label_lists_equal_a_plain_filter(eos):
    rng = np.random.default_rng(0)
    prefix = rng.integers(2, 9, (6, 7))
    for row, n in zip(prefix, [0, 3, 7, 5, 1, 6]):  # labels first, then sentence-end / -1 padding
        row[n:] = -1
        if n < 7 and eos is not None:
            row[n] = eos
    scattered = rng.integers(-1, 9, (6, 7))  # -1 and sentence-end anywhere: the general path
    for tokens in (prefix, scattered, np.zeros((3, 0), np.int64)):
        got = label_lists(tokens, eos)
        assert got == _filtered(tokens, eos)
        assert all(type(x) is int for row in got for x in row)


def test_no_cyclic_gc_restores_the_collector_state():
    assert gc.isenabled()
    with no_cyclic_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with no_cyclic_gc():
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_cyclic_gc():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_hypothesis_without_frames_equals_the_constructed_one():
    fast = Hypothesis.without_frames([3, 1, 4], -2.5, {"decoder": -2.0, "lm": -1.0}, 4)
    made = Hypothesis([3, 1, 4], -2.5, {"decoder": -2.0, "lm": -1.0}, 4)
    assert fast == made and repr(fast) == repr(made) and fast.frames is None
    assert dataclasses.astuple(fast) == dataclasses.astuple(made)
    assert fast != Hypothesis([3, 1, 4], -2.5, {"decoder": -2.0, "lm": -1.0}, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.score = 0.0
