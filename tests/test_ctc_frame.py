"""The fused CTC frame step: the per-utterance reference (the kernel's algorithm) against the
array version of the prefix beam search, and the CUDA kernel against both (GPU)."""

import numpy as np
import pytest

from gpudecode.bench.ctc import random_log_probs
from gpudecode.search import CtcPrefixOptions, ctc_prefix_search
from gpudecode.search import ctc as ctc_module
from gpudecode.search.ctc_frame import full_frame_reference
from tests.test_ctc_search import assert_same_nbest

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
    expected = ctc_prefix_search(log_probs, lengths, options)
    calls = []

    def reference(search, t, exact):
        calls.append(t)
        full_frame_reference(search, t, exact)

    monkeypatch.setattr(ctc_module._PrefixSearch, "_full_frame", reference)
    got = ctc_prefix_search(log_probs, lengths, options)
    assert calls, "the reference frame never ran"
    assert _flat(got) == _flat(expected)
    for nbest_got, nbest_expected in zip(got, expected):
        for a, b in zip(nbest_got, nbest_expected):
            assert a.score == pytest.approx(b.score, abs=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_kernel_frame_equals_the_cpu_search(case, monkeypatch):
    """CuPy without scorers runs the whole search as one ctc_prefix_frames_<K> launch; the n-best
    equal the numpy search's (and the CuPy array version's)."""
    import cupy

    from gpudecode.search import ctc_frame

    launches = []
    original = ctc_frame.search_kernel
    monkeypatch.setattr(ctc_frame, "search_kernel", lambda *a: launches.append(a[1]) or original(*a))
    options = CtcPrefixOptions(**case)
    for seed in range(3):
        log_probs, lengths = _inputs(seed)
        expected = ctc_prefix_search(log_probs, lengths, options)
        got = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy)
        assert launches, "the kernel did not run"
        assert_same_nbest(expected, got)  # labels and frames exact, scores within CUDA's expf/log1pf
        monkeypatch.setattr(ctc_frame, "enabled", False)
        arrays = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy)
        monkeypatch.setattr(ctc_frame, "enabled", True)
        assert_same_nbest(expected, arrays)


@pytest.mark.gpu
def test_kernel_frame_on_larger_inputs_equals_the_array_version():
    """64 utterances x 200 frames, vocabulary 1,000, beams 8, 12 and 32 (the kernel's limit; the
    8-, 16- and 32-entry kernels), with and without a threshold: the same n-best as the CuPy
    array version."""
    import cupy

    from gpudecode.search import ctc_frame

    log_probs = random_log_probs(cupy, 64, 200, 1000, seed=3)
    lengths = np.random.default_rng(0).integers(1, 201, 64)
    for options in (CtcPrefixOptions(beam_size=8), CtcPrefixOptions(beam_size=12),
                    CtcPrefixOptions(beam_size=32, score_threshold=8.0)):
        got = ctc_prefix_search(log_probs, lengths, options, xp=cupy)
        ctc_frame.enabled = False
        try:
            expected = ctc_prefix_search(log_probs, lengths, options, xp=cupy)
        finally:
            ctc_frame.enabled = True
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
