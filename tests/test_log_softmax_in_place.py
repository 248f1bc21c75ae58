"""``log_softmax_in_place`` (a host step's logits turned into log-probabilities over themselves)
equals ``log_softmax``, the reference, bit for bit: rows with NaN, +inf and -inf, all -inf, ±0,
with and without a scratch buffer."""

import numpy as np

from gpudecode.scorers.onnx_decoder import log_softmax, log_softmax_in_place


def test_log_softmax_in_place_equals_log_softmax_bitwise():
    rng = np.random.default_rng(17)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    for trial in range(200):
        rows, vocab = int(rng.integers(0, 9)), int(rng.integers(1, 300))
        x = (rng.standard_normal((rows, vocab)) * rng.choice([0.1, 3.0, 40.0])).astype(np.float32)
        mask = rng.random((rows, vocab)) < 0.02
        x[mask] = rng.choice(special, int(mask.sum()))
        if rows and trial % 7 == 0:
            x[0] = -np.inf  # every label impossible
        want = log_softmax(np, x.copy())
        scratch = None if trial % 2 else np.full(rows * vocab + 5, 7.0, np.float32)
        got = x.copy()
        assert log_softmax_in_place(got, scratch) is got
        np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32), err_msg=f"trial {trial}")
