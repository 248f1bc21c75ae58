"""Host-side n-best construction helpers (gpudecode/search/results.py)."""

import dataclasses
import gc

import numpy as np
import pytest

from gpudecode.search import results
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


@pytest.mark.parametrize("max_shared", [1 << 20, 100])
def test_label_lists_of_large_labels_are_plain_ints(max_shared):
    """Labels up to 70,000 (through the shared int objects, or one by one above MAX_SHARED_INTS):
    the same values as Python ints, each row its own list."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 70_000, (5, 9))
    tokens[1, 4:] = -1
    tokens[2, 6:] = 7
    tokens[3, :] = -1
    got = label_lists(tokens, 7, max_shared_ints=max_shared)
    assert got == _filtered(tokens, 7)
    assert all(type(x) is int for row in got for x in row)
    got[0].append(1)
    assert got[0] == _filtered(tokens, 7)[0] + [1] and got[1:] == _filtered(tokens, 7)[1:]
    assert results.python_ints(70_000)[69_999] == 69_999 and len(results.python_ints(70_000)) == 1 << 17


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


def test_hypothesis_made_without_frames_equals_the_constructed_one():
    fast = Hypothesis.made([3, 1, 4], -2.5, {"decoder": -2.0, "lm": -1.0}, 4, None)
    made = Hypothesis([3, 1, 4], -2.5, {"decoder": -2.0, "lm": -1.0}, 4)
    assert fast == made and repr(fast) == repr(made) and fast.frames is None
    assert dataclasses.astuple(fast) == dataclasses.astuple(made)
    assert fast != Hypothesis([3, 1, 4], -2.5, {"decoder": -2.0, "lm": -1.0}, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.score = 0.0
