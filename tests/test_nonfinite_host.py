"""``folded_group_maxima`` on numpy (fewer temporaries) equals the array version ``group_maxima``
folded into the maxima so far, the reference: NaN, +inf and -inf, float16 and float32 scores, lanes
given live, dead or all, one lane per group and four scorers — value for value, NaN where it has NaN."""

import numpy as np

from tests.test_score_maxima import mismatches


def test_host_maxima_equal_the_array_version():
    assert mismatches(np) == []


def test_host_maxima_on_random_steps():
    from gpudecode.search.nonfinite import folded_group_maxima, group_maxima

    rng = np.random.default_rng(9)
    for trial in range(200):
        groups, size, vocab, scorers = (int(rng.integers(1, n)) for n in (5, 5, 40, 4))
        lanes = groups * size
        arrays = [rng.choice(np.array([0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan], np.float32),
                             size=(lanes, vocab), p=[.2, .2, .2, .2, .02, .16, .02]) for _ in range(scorers)]
        previous = rng.choice(np.array([-np.inf, 0.5, np.nan, np.inf], np.float32), size=(scorers, groups))
        dead = rng.random(lanes) < 0.4
        for given in ({"dead": dead}, {"live": ~dead}, {}):
            live = None if not given else ~dead
            want = np.maximum(previous, group_maxima(arrays, live, groups, np))
            got = folded_group_maxima(previous, arrays, groups, np, **given)
            assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
            np.testing.assert_array_equal(got, want, err_msg=f"trial {trial} {sorted(given)}")
            assert np.array_equal(np.isnan(got), np.isnan(want))
