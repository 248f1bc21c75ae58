"""The host step's Hugging Face per-row inputs (``HostStepFeeds``, lookups made once) against
``hf_step_feeds``, the reference: the same arrays (names, values, dtypes, shapes)."""

from types import SimpleNamespace

import numpy as np
import pytest

from gpudecode.session.step_model import HostStepFeeds, hf_step_feeds


class _Tensors:
    def __init__(self, dtypes: dict):
        self.dtypes = dtypes

    def input(self, name):
        return SimpleNamespace(name=name, dtype=np.dtype(self.dtypes[name]), rank=2)


@pytest.mark.parametrize("alignment", ["left", "right"])
@pytest.mark.parametrize("inputs", [{"attention_mask": np.int64}, {"attention_mask": np.int32, "position_ids": np.int64},
                                    {"position_ids": np.int32}])
def test_host_step_feeds_equal_hf_step_feeds(alignment, inputs):
    names = {"input_ids": "ids", **{logical: f"model_{logical}" for logical in inputs}}
    spec = SimpleNamespace(convention="huggingface", hypothesis_inputs=names, history_alignment=alignment)
    tensors = _Tensors({f"model_{logical}": dtype for logical, dtype in inputs.items()})
    assert HostStepFeeds.applies(spec)
    fast = HostStepFeeds(spec, tensors)
    rng = np.random.default_rng(5)
    for time_size in [0, 1, 3, 7, 2, 40, 5, 64, 63]:  # growing and shrinking
        rows = int(rng.integers(0, 9))
        prefix = rng.integers(0, time_size + 1, rows).astype(np.int32)
        got, want = fast(prefix, time_size), hf_step_feeds(spec, tensors, prefix, time_size)
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, T={time_size}")


def test_models_with_explicit_lengths_keep_the_reference():
    for extra in ("seqlens_k", "total_sequence_length", "use_cache_branch"):
        spec = SimpleNamespace(convention="huggingface", history_alignment="left",
                               hypothesis_inputs={"input_ids": "ids", "attention_mask": "mask", extra: extra})
        assert not HostStepFeeds.applies(spec)
    assert not HostStepFeeds.applies(SimpleNamespace(convention="rasr", hypothesis_inputs={"token": "t"}))
