"""The fused CTC frame step: the per-utterance reference (the kernel's algorithm) against the
array version of the prefix beam search, and the CUDA kernel against both (GPU)."""


import numpy as np
import pytest

from gpudecode.bench.ctc import random_log_probs
from gpudecode.search import CtcPrefixOptions, ctc_prefix_search
from gpudecode.search import ctc as ctc_module
from gpudecode.search import ctc_frame as ctc_frame_module
from gpudecode.testing.search_reference import full_frame_reference, top_labels_reference
from gpudecode.search.stats import SearchStats
from gpudecode.search.tuning import SearchTuning
from tests.test_ctc_search import assert_same_nbest

ARRAYS = SearchTuning(fused_ctc_frames=False)  # CuPy runs the array version
ARRAY_LOOPS = SearchTuning(compiled_cpu_loops=False)  # numpy runs the array version (not the compiled loop)
FULL_SCAN = SearchTuning(ctc_prefilter=False)  # the kernel scans every label of every frame

CASES = [
    dict(beam_size=1),
    dict(beam_size=4),
    dict(beam_size=8, score_threshold=3.0),
    dict(beam_size=6, hash_modulus=5),                                   # hash collisions
    dict(beam_size=6, hash_modulus=3, history_compare_steps=0),         # undecided -> exact rerun
    dict(beam_size=6, hash_modulus=7, history_compare_steps=None),
    dict(beam_size=5, blank_skip_threshold_logp=-0.05),
    dict(beam_size=4, blank=2),
]


def _inputs(seed: int, vocab_size: int = 6):
    log_probs = random_log_probs(np, 5, 14, vocab_size, seed=seed, sharpness=2.0, blank_bias=1.5)
    lengths = np.array([14, 9, 1, 12, 0])
    return log_probs, lengths


def _flat(results):
    return [[(h.labels, h.frames, round(h.score, 4)) for h in nbest] for nbest in results]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_frame_equals_the_array_frame(case, seed, monkeypatch):
    log_probs, lengths = _inputs(seed)
    options = CtcPrefixOptions(**case)
    expected = ctc_prefix_search(log_probs, lengths, options, tuning=ARRAY_LOOPS)
    calls = []

    def reference(search, t, exact):
        calls.append(t)
        full_frame_reference(search, t, exact)

    monkeypatch.setattr(ctc_module._PrefixSearch, "_full_frame", reference)
    got = ctc_prefix_search(log_probs, lengths, options, tuning=ARRAY_LOOPS)
    assert calls, "the reference frame never ran"
    assert _flat(got) == _flat(expected)
    for nbest_got, nbest_expected in zip(got, expected):
        for a, b in zip(nbest_got, nbest_expected):
            assert a.score == pytest.approx(b.score, abs=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_kernel_frame_equals_the_cpu_search(case):
    """CuPy without scorers runs the whole search as one ctc_prefix_frames_<K> launch; the n-best
    equal the numpy search's (and the CuPy array version's)."""
    import cupy

    launches = SearchStats()
    options = CtcPrefixOptions(**case)
    for seed in range(3):
        log_probs, lengths = _inputs(seed)
        expected = ctc_prefix_search(log_probs, lengths, options)
        got = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy, stats=launches)
        assert launches.fused_launches, "the kernel did not run"
        assert_same_nbest(expected, got)  # labels and frames exact, scores within CUDA's expf/log1pf
        arrays = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy, tuning=ARRAYS)
        assert_same_nbest(expected, arrays)


@pytest.mark.gpu
def test_kernel_frame_on_larger_inputs_equals_the_array_version():
    """64 utterances x 200 frames, vocabulary 1,000, beams 8, 12 and 32 (the kernel's limit; the
    8-, 16- and 32-entry kernels), with and without a threshold: the same n-best as the CuPy
    array version."""
    import cupy

    log_probs = random_log_probs(cupy, 64, 200, 1000, seed=3)
    lengths = np.random.default_rng(0).integers(1, 201, 64)
    for options in (CtcPrefixOptions(beam_size=8), CtcPrefixOptions(beam_size=12),
                    CtcPrefixOptions(beam_size=32, score_threshold=8.0)):
        got = ctc_prefix_search(log_probs, lengths, options, xp=cupy)
        expected = ctc_prefix_search(log_probs, lengths, options, xp=cupy, tuning=ARRAYS)
        assert [[h.labels for h in n] for n in got] == [[h.labels for h in n] for n in expected]
        worst = max(abs(a.score - b.score) for n, m in zip(got, expected) for a, b in zip(n, m))
        assert worst < 1e-3, worst


@pytest.mark.gpu
def test_kernel_with_a_vocabulary_too_large_for_the_shared_row():
    """V = 12,000 (the row does not fit the kernel's shared-memory stage): the kernel reads the
    frame's log-probs from global memory and still gives the CPU's n-best."""
    import cupy

    from gpudecode.search import ctc_frame

    assert 12_000 * 4 > ctc_frame._MAX_ROW_BYTES
    log_probs = random_log_probs(np, 3, 20, 12_000, seed=4, sharpness=2.0, blank_bias=1.5)
    lengths = np.array([20, 13, 7])
    options = CtcPrefixOptions(beam_size=6, score_threshold=6.0)
    expected = ctc_prefix_search(log_probs, lengths, options)
    got = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy)
    assert_same_nbest(expected, got)


def _near_ties(log_probs, blank: int, levels: int):
    """``log_probs`` with every label but blank set, per frame, to one value plus 0 .. levels - 1
    steps of 2e-7: sums that round to ties, where a lower label can beat a listed one."""
    rng = np.random.default_rng(1)
    near = np.round(log_probs.max(axis=2, keepdims=True), 0) - np.float32(1.0)
    labels = np.arange(log_probs.shape[2]) != blank
    steps = rng.integers(0, levels, log_probs.shape)[:, :, labels] * np.float32(2e-7)
    out = log_probs.copy()
    out[:, :, labels] = near + steps
    return out


PREFILTER_CASES = [
    dict(beam_size=1),
    dict(beam_size=3),
    dict(beam_size=4, score_threshold=2.0),
    dict(beam_size=4, hash_modulus=5),
    dict(beam_size=2, blank_skip_threshold_logp=-0.05),
    dict(beam_size=4, blank=3),
]


@pytest.mark.parametrize("case", PREFILTER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("levels", [None, 3])
def test_label_prefilter_gives_the_full_search(case, levels, monkeypatch):
    """The kernel's label prefilter (only the blank, each lane's last label and the frame's best
    2 * beam + 1 labels) in the reference frame: the same n-best as the array search over all
    labels, with recombination and threshold; with log-probs in clusters a few ulps apart (sums
    that round to ties, where a lower label can beat a listed one) the frames with a tie at the
    list's end are scanned in full."""
    vocab_size = 12
    options = CtcPrefixOptions(**case)
    log_probs = random_log_probs(np, 5, 14, vocab_size, seed=7, sharpness=2.0, blank_bias=1.0)
    if levels is not None:  # every label but blank within a few ulps: sums that round to a tie
        log_probs = _near_ties(log_probs, options.blank, levels)
    lengths = np.array([14, 9, 1, 12, 0])
    num_top = 2 * options.beam_size + 1
    assert vocab_size - 1 > num_top
    expected = ctc_prefix_search(log_probs, lengths, options, tuning=ARRAY_LOOPS)
    searches = []

    def reference(search, t, exact):
        searches.append(search)
        full_frame_reference(search, t, exact, num_top=num_top)

    monkeypatch.setattr(ctc_module._PrefixSearch, "_full_frame", reference)
    got = ctc_prefix_search(log_probs, lengths, options, tuning=ARRAY_LOOPS)
    assert searches, "the reference frame never ran"
    assert _flat(got) == _flat(expected)
    full_scans = max(getattr(s, "full_scans", 0) for s in searches)
    if levels is not None and options.beam_size > 1:
        assert full_scans > 0, "no frame fell back to the full scan"
    if levels is None:
        assert full_scans == 0


def test_top_labels_reference_orders_by_value_then_label():
    row = np.array([-1.0, -0.5, np.nan, -0.5, -2.0, -np.inf], dtype=np.float32)
    assert top_labels_reference(row, blank=1, count=4) == [3, 0, 4, 2]


def _top_labels_rows(kind: str, num_rows: int, vocab_size: int, blank: int, seed: int = 0) -> np.ndarray:
    """Rows [num_rows, V] float32 for ``ctc_top_labels_<P>``: random, or built to take its fallback
    (many equal values, one lane full of large values, -inf and NaN rows) or to tie."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((num_rows, vocab_size)) * 2 - 5).astype(np.float32)
    if kind == "blank-max":
        x[:, blank] = 50.0
    elif kind.startswith("levels-"):  # ties: lower label first
        x = (rng.integers(0, int(kind[7:]), x.shape) * 0.25 - 3).astype(np.float32)
    elif kind == "equal":
        x[:] = -1.5
    elif kind == "one-lane":
        x[:, 5::32] = 10 + rng.integers(0, 3, x[:, 5::32].shape)
    elif kind == "few-finite":
        x[:] = -np.inf
        x[:, rng.integers(0, vocab_size, 8)] = rng.standard_normal(8)
        x[1::2, rng.integers(0, vocab_size, 40)] = np.nan
    elif kind == "nan":
        x[rng.random(x.shape) < np.linspace(0, 1, num_rows)[:, None]] = np.nan
    elif kind == "zeros":
        x = np.where(rng.random(x.shape) < 0.5, np.float32(-0.0), np.float32(0.0))
        x[:, ::7] = -1
    elif kind == "inf":
        x[:, rng.integers(0, vocab_size, 12)] = np.inf
    return x


TOP_LABELS_ROWS = [  # (V, blank, kind); V None: P + 1 labels (P other than blank), 0: P labels (one -1)
    (1000, 0, "random"), (12_000, 5, "random"), (45, 3, "random"), (None, 1, "random"), (0, 0, "random"),
    (20, 4, "random"), (1000, 999, "blank-max"), (1000, 6, "levels-3"), (1000, 1, "levels-16"),
    (1000, 0, "levels-400"), (1000, 0, "equal"), (60, 0, "equal"), (1000, 0, "one-lane"), (5000, 7, "one-lane"),
    (1000, 3, "few-finite"), (1000, 9, "nan"), (1000, 4, "zeros"), (1000, 4, "inf"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_top", [9, 17, 33])
@pytest.mark.parametrize("vocab_size,blank,kind", TOP_LABELS_ROWS, ids=lambda v: str(v))
def test_kernel_top_labels_equal_the_reference(num_top, vocab_size, blank, kind):
    """``ctc_top_labels_<P>`` on its fast path (candidates above a threshold ranked in shared
    memory) and on its fallback (per-thread lists: ties, -inf and NaN rows, V <= P): the labels of
    top_labels_reference, -1 past the row's labels, and their log-probs bit for bit."""
    import cupy

    vocab_size = {None: num_top + 1, 0: num_top}.get(vocab_size, vocab_size)
    blank = min(blank, vocab_size - 1)
    x = _top_labels_rows(kind, 203, vocab_size, blank, seed=num_top)
    labels, values = (cupy.asnumpy(a) for a in ctc_frame_module.top_labels_kernel(cupy.asarray(x), blank, num_top))
    for r, row in enumerate(x):
        want = top_labels_reference(row, blank, num_top)
        want = np.array(want + [-1] * (num_top - len(want)), dtype=np.int32)
        assert labels[r].tolist() == want.tolist(), r
        want_values = np.where(want >= 0, row[np.maximum(want, 0)], np.float32(-np.inf)).astype(np.float32)
        assert values[r].view(np.uint32).tolist() == want_values.view(np.uint32).tolist(), r


def _exact(results):
    return [[(h.labels, h.frames, h.score) for h in nbest] for nbest in results]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PREFILTER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("levels", [None, 3])
def test_kernel_prefilter_equals_the_full_scan_kernel(case, levels):
    """The kernel with the label prefilter gives bit for bit the n-best of the kernel scanning
    every label (the same device arithmetic), also where rounding ties force full-scan frames; and
    the CPU search's n-best on the untied inputs."""
    import cupy

    from gpudecode.search import ctc_frame

    vocab_size, options = 12, CtcPrefixOptions(**case)
    assert ctc_frame.top_label_count(options.beam_size, vocab_size) > 0
    log_probs = random_log_probs(np, 5, 14, vocab_size, seed=7, sharpness=2.0, blank_bias=1.0)
    if levels is not None:
        log_probs = _near_ties(log_probs, options.blank, levels)
    lengths = np.array([14, 9, 1, 12, 0])
    run = lambda **tuning: ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy, **tuning)  # noqa: E731
    got = run()
    assert _exact(got) == _exact(run(tuning=FULL_SCAN))
    if levels is None:
        assert_same_nbest(ctc_prefix_search(log_probs, lengths, options), got)


@pytest.mark.gpu
def test_kernel_prefilter_on_larger_inputs():
    """64 utterances x 200 frames, vocabularies 1,000 and 5,000, beams 4, 8, 13 and 16 (the three
    list lengths), with and without a threshold and blank skipping: bit for bit the full-scan
    kernel's n-best."""
    import cupy

    lengths = np.random.default_rng(0).integers(1, 201, 64)
    for vocab_size in (1000, 5000):
        log_probs = random_log_probs(cupy, 64, 200, vocab_size, seed=5)
        for options in (CtcPrefixOptions(beam_size=4), CtcPrefixOptions(beam_size=8),
                        CtcPrefixOptions(beam_size=13, score_threshold=6.0),
                        CtcPrefixOptions(beam_size=16, blank_skip_threshold_logp=-0.01)):
            got = ctc_prefix_search(log_probs, lengths, options, xp=cupy)
            expected = ctc_prefix_search(log_probs, lengths, options, xp=cupy, tuning=FULL_SCAN)
            assert _exact(got) == _exact(expected), (vocab_size, options)
