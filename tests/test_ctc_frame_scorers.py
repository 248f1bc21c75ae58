"""The CTC prefix search with label scorers in ``ctc_prefix_frames_<K>`` (a launch per full frame,
the scorers' terms ranked in the kernel): the same n-best as the numpy array search, in the kernel
emulator (bit for bit there) and on CUDA; no host transfer per frame."""

from __future__ import annotations

import numpy as np
import pytest

from examples.custom_scorer import BigramScorer
from gpudecode.search import CtcPrefixOptions, ctc_prefix_search
from gpudecode.search.stats import SearchStats
from gpudecode.search.tuning import SearchTuning
from tests.test_ctc_prefix_kernel import _emulate, assert_none_in_emulation, needs_gxx
from tests.test_ctc_search import bigram_table, random_log_probs

#: (log-probs seed, U, T, V, lengths, options, scorers as (name, table seed, scale))
CASES = [
    (1, 5, 30, 9, [30, 22, 1, 30, 0], dict(beam_size=1), (("lm", 1, 0.5),)),
    (2, 5, 30, 9, [30, 22, 1, 30, 0], dict(beam_size=4), (("lm", 2, 0.5),)),
    (3, 4, 40, 12, [40, 33, 12, 40], dict(beam_size=8, sentence_end=2), (("lm", 3, 0.7),)),
    (4, 4, 40, 12, [40, 17, 40, 5], dict(beam_size=8, score_threshold=3.0), (("lm", 4, 0.5),)),
    (5, 4, 40, 12, [40, 33, 12, 40], dict(beam_size=6, blank_skip_threshold_logp=float(np.log(0.7))),
     (("lm", 5, 0.5),)),
    (6, 3, 30, 9, [30, 25, 30], dict(beam_size=8, hash_modulus=2), (("lm", 6, 0.5),)),
    (7, 3, 30, 9, [30, 25, 30], dict(beam_size=8, max_cached_score_vectors=0), (("lm", 7, 0.5),)),
    (8, 4, 30, 12, [30, 25, 30, 2], dict(beam_size=5, sentence_end=3),
     (("a", 8, 0.3), ("b", 9, 0.0), ("c", 10, 1.0))),
    (9, 3, 20, 300, [20, 13, 20], dict(beam_size=16), (("lm", 11, 0.4),)),
    (10, 2, 12, 12_000, [12, 7], dict(beam_size=4, token_min_logp=-8.0), (("lm", 12, 0.4),)),
    (11, 3, 25, 9, [25, 25, 25], dict(beam_size=20, blank=4), (("lm", 13, 0.5),)),
]


def _search(xp, case, tuning=None, stats=None):
    seed, num_utts, num_frames, vocab, lengths, options, scorers = case
    log_probs = random_log_probs(seed, num_utts, num_frames, vocab, sharpness=2.5, blank_bias=1.0)
    entries = [(name, BigramScorer(log_probs=bigram_table(table_seed, vocab)), scale)
               for name, table_seed, scale in scorers]
    kwargs = {} if tuning is None else {"tuning": tuning}
    return ctc_prefix_search(xp.asarray(log_probs), np.array(lengths), CtcPrefixOptions(**options), entries,
                             xp=xp, stats=stats, **kwargs)


def _summary(nbest):
    return [[(tuple(h.labels), tuple(h.frames), float(h.score), tuple(sorted(h.scores.items()))) for h in hyps]
            for hyps in nbest]


def mismatches(cupy, exact: bool = True) -> list[str]:
    """Per case where the kernel search's n-best differs from numpy's: labels and frames exactly,
    scores bit for bit (``exact``) or within 1e-4; also checks one launch per full frame."""
    bad = []
    for index, case in enumerate(CASES):
        stats = SearchStats()
        want, got = _summary(_search(np, case)), _summary(_search(cupy, case, stats=stats))
        if stats.fused_launches < 1:
            bad.append(f"case {index}: the kernel did not run")
        for u, (a, b) in enumerate(zip(want, got, strict=True)):
            same = len(a) == len(b) and all(
                x[:2] == y[:2] and (x[2:] == y[2:] if exact else (
                    abs(x[2] - y[2]) <= 1e-4 and [k for k, _ in x[3]] == [k for k, _ in y[3]]
                    and all(abs(p - q) <= 1e-4 for (_, p), (_, q) in zip(x[3], y[3]))))
                for x, y in zip(a, b))
            if not same:
                bad.append(f"case {index} utterance {u}: numpy {a} != kernel {b}")
    return bad


@needs_gxx
def test_scorer_frames_in_the_kernel_equal_numpy_bit_for_bit_in_emulation():
    assert_none_in_emulation("tests.test_ctc_frame_scorers", "mismatches")


@needs_gxx
def test_no_host_transfer_per_frame_with_scorers_in_emulation():
    code = """
import cupy, numpy as np
from gpudecode.search.stats import SearchStats
from tests.test_ctc_frame_scorers import CASES, _search
counts = []
stats = SearchStats(on_transfer=lambda arrays: counts.append(len(arrays)))
seen = []
for frames in (10, 40):
    counts.clear()
    case = (3, 2, frames, 9, [frames, 3], dict(beam_size=4), (("lm", 3, 0.5),))
    _search(cupy, case, stats=stats)
    seen.append(len(counts))
print(seen)
raise SystemExit(0 if seen[0] == seen[1] else 1)
"""
    run = _emulate(code)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.gpu
def test_scorer_frames_in_the_kernel_equal_numpy_on_cuda():
    cupy = pytest.importorskip("cupy")
    assert mismatches(cupy, exact=False) == []


@pytest.mark.gpu
def test_the_kernel_and_the_array_version_agree_on_cuda():
    cupy = pytest.importorskip("cupy")
    for case in CASES[:4]:
        kernel = _summary(_search(cupy, case))
        arrays = _summary(_search(cupy, case, tuning=SearchTuning(fused_ctc_frames=False)))
        assert [[h[:2] for h in hyps] for hyps in kernel] == [[h[:2] for h in hyps] for hyps in arrays]


def test_compiled_cpu_frames_with_scorers_equal_the_array_version_bit_for_bit():
    """On numpy with numba (the ``cpu-jit`` extra) a search with scorers runs a compiled call per
    full frame (``ctc_cpu.ScoredFrameLoop``), on one thread or several; the n-best lists are the
    array version's, bit for bit."""
    from gpudecode.search import ctc_cpu

    if not ctc_cpu.available():
        pytest.skip("numba is not installed (the cpu-jit extra)")
    for case in CASES:
        arrays = _summary(_search(np, case, tuning=SearchTuning(compiled_cpu_loops=False)))
        assert _summary(_search(np, case)) == arrays
        assert _summary(_search(np, case, tuning=SearchTuning(cpu_threads=2))) == arrays
