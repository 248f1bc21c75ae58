"""The fused transducer selection: the per-utterance reference (the kernel's algorithm) against
the array version of the search's selection, and the CUDA kernel against both (GPU)."""

import numpy as np
import pytest

from gpudecode.search import TransducerOptions, transducer_search
from gpudecode.search import transducer as transducer_module
from gpudecode.search.stats import SearchStats
from gpudecode.testing.search_reference import select_reference
from gpudecode.search.tuning import SearchTuning
from tests.test_ctc_prefix_kernel import _emulate, assert_none_in_emulation, needs_gxx
from tests.test_ctc_search import assert_same_nbest
from tests.test_transducer_search import make_models, random_encoder_states

ARRAYS = SearchTuning(fused_transducer_step=False)  # CuPy runs the array version
ARRAY_LOOPS = SearchTuning(compiled_cpu_loops=False)  # numpy runs the array version (not the compiled selection)

CASES = [
    dict(beam_size=1),
    dict(beam_size=4),
    dict(beam_size=4, max_symbols_per_frame=2),
    dict(beam_size=5, max_symbols_per_frame=3, recombination="max"),
    dict(beam_size=6, max_symbols_per_frame=2, score_threshold=2.0),
    dict(beam_size=6, max_symbols_per_frame=2, hash_modulus=3),                                # collisions
    dict(beam_size=6, max_symbols_per_frame=2, hash_modulus=1, history_compare_steps=0),       # exact rerun
    dict(beam_size=4, max_symbols_per_frame=2, blank=2),
]


def _case_id(case):
    return ",".join(f"{k}={v}" for k, v in case.items())


def _inputs(seed: int, vocab_size: int = 5):
    models = make_models(seed, vocab_size, sharpness=2.0)
    encoder_states = random_encoder_states(seed, 4, 9)
    lengths = np.array([9, 5, 1, 0])
    return models, encoder_states, lengths


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_selection_equals_the_array_selection(case, seed, monkeypatch):
    options = TransducerOptions(**case)
    models, encoder_states, lengths = _inputs(seed)
    expected = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options,
                                 tuning=ARRAY_LOOPS)
    calls = []

    def reference(search, t, s, forced, logp, exact):
        calls.append((t, s))
        return select_reference(search, t, s, forced, logp, exact)

    monkeypatch.setattr(transducer_module._TransducerSearch, "_select", reference)
    got = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options,
                            tuning=ARRAY_LOOPS)
    assert calls, "the reference selection never ran"
    assert any(s > 0 for _, s in calls) == (options.max_symbols_per_frame > 1)
    assert_same_nbest(expected, got)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_selection_equals_the_cpu_search(case):
    """CuPy without scorers selects each symbol step in one transducer_select_<K> launch; the
    n-best equal the numpy search's (and the CuPy array version's)."""
    import cupy

    launches = SearchStats()
    options = TransducerOptions(**case)
    for seed in range(2):
        models, encoder_states, lengths = _inputs(seed)
        expected = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options)
        got = transducer_search(cupy.asarray(encoder_states), lengths, models.prediction("cuda"),
                                models.joint("cuda"), options, xp=cupy, stats=launches)
        assert launches.fused_launches, "the kernel did not run"
        assert_same_nbest(expected, got)
        arrays = transducer_search(cupy.asarray(encoder_states), lengths, models.prediction("cuda"),
                                   models.joint("cuda"), options, xp=cupy, tuning=ARRAYS)
        assert_same_nbest(expected, arrays)


@pytest.mark.gpu
def test_kernel_selection_on_larger_inputs_equals_the_array_version():
    """8 utterances x 30 frames, vocabulary 300, beams 8, 12 and 32 (the 8-, 16- and 32-entry
    kernels), two symbols per frame, with and without a threshold: the same n-best as the CuPy
    array version."""
    import cupy

    models = make_models(7, 300, sharpness=2.0)
    states = cupy.asarray(random_encoder_states(7, 8, 30))
    lengths = np.random.default_rng(0).integers(1, 31, 8)
    for options in (TransducerOptions(beam_size=8, max_symbols_per_frame=2),
                    TransducerOptions(beam_size=12, max_symbols_per_frame=2),
                    TransducerOptions(beam_size=32, max_symbols_per_frame=2, score_threshold=6.0)):
        got = transducer_search(states, lengths, models.prediction("cuda"), models.joint("cuda"), options, xp=cupy)
        expected = transducer_search(states, lengths, models.prediction("cuda"), models.joint("cuda"), options,
                                     xp=cupy, tuning=ARRAYS)
        assert [[h.labels for h in n] for n in got] == [[h.labels for h in n] for n in expected]
        worst = max(abs(a.score - b.score) for n, m in zip(got, expected) for a, b in zip(n, m))
        assert worst < 1e-3, worst


def scorer_mismatches(xp, exact: bool = True, prediction_device: str = "cpu") -> list[str]:
    """Per case of CASES (plus two scorers, one at scale 0) where the search with bigram LM scorers
    on ``xp`` (the kernel with the scorers' terms) differs from numpy's array search: labels and
    frames exactly, scores bit for bit (``exact``) or within 1e-4; and cases where no kernel ran."""
    from examples.custom_scorer import BigramScorer
    from tests.test_transducer_search import bigram_table

    bad = []
    scorer_sets = [((0.5,),)] * len(CASES) + [((0.3, 0.0, 1.0),)]
    for index, (case, (scales,)) in enumerate(zip(CASES + [dict(beam_size=5, max_symbols_per_frame=2,
                                                                   sentence_end=3)], scorer_sets)):
        options = TransducerOptions(**case)
        models, encoder_states, lengths = _inputs(index, vocab_size=7)

        def scorers():
            return [(f"lm{k}", BigramScorer(log_probs=bigram_table(index * 10 + k, 7)), scale)
                    for k, scale in enumerate(scales)]

        want = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options, scorers(),
                                 tuning=ARRAY_LOOPS)
        stats = SearchStats()
        got = transducer_search(xp.asarray(encoder_states), lengths, models.prediction(prediction_device),
                                models.joint(prediction_device), options, scorers(), xp=xp, stats=stats)
        if not stats.fused_launches:
            bad.append(f"case {index}: the kernel did not run")
        for u, (a, b) in enumerate(zip(want, got, strict=True)):
            same = len(a) == len(b) and all(
                x.labels == y.labels and x.frames == y.frames and x.scores.keys() == y.scores.keys() and (
                    (x.score == y.score and x.scores == y.scores) if exact else
                    abs(x.score - y.score) <= 1e-4 and all(abs(x.scores[k] - y.scores[k]) <= 1e-4 for k in x.scores))
                for x, y in zip(a, b))
            if not same:
                bad.append(f"case {index} utterance {u}: numpy {[(h.labels, h.score) for h in a]} != "
                           f"kernel {[(h.labels, h.score) for h in b]}")
    return bad


@needs_gxx
def test_kernel_selection_with_scorers_equals_numpy_bit_for_bit_in_emulation():
    assert_none_in_emulation("tests.test_transducer_step", "scorer_mismatches")


@pytest.mark.gpu
def test_kernel_selection_with_scorers_equals_numpy_on_cuda():
    import cupy

    assert scorer_mismatches(cupy, exact=False, prediction_device="cuda") == []


@needs_gxx
def test_one_symbol_per_frame_reads_nothing_back_per_frame_in_emulation():
    """On CuPy with one symbol per frame neither search reads back per frame (beam with an LM)."""
    code = """
import cupy, numpy as np
from examples.custom_scorer import BigramScorer
from gpudecode.search import TransducerOptions, transducer_greedy_search, transducer_search
from gpudecode.search.stats import SearchStats
from tests.test_transducer_search import bigram_table, make_models, random_encoder_states
counts = []
stats = SearchStats(on_transfer=lambda arrays: counts.append(len(arrays)))
models = make_models(5, 7, sharpness=2.0)
seen = []
for frames in (4, 12):
    states = cupy.asarray(random_encoder_states(5, 2, frames))
    counts.clear()
    transducer_search(states, np.array([frames, 3]), models.prediction(), models.joint(),
                      TransducerOptions(beam_size=3, max_symbols_per_frame=1), [("lm", BigramScorer(log_probs=bigram_table(5, 7)), 0.5)],
                      xp=cupy, stats=stats)
    beam = len(counts)
    counts.clear()
    transducer_greedy_search(states, np.array([frames, 3]), models.prediction(), models.joint(), xp=cupy,
                             max_symbols_per_frame=1, stats=stats)
    seen.append((beam, len(counts)))
print(seen)
raise SystemExit(0 if seen[0] == seen[1] else 1)
"""
    run = _emulate(code)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
