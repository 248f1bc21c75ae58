"""The compiled CPU loops (numba, ``SearchTuning.compiled_cpu_loops``) against the array versions
they replace, which stay the oracle: the same n-best lists — labels, frames and scores — on the
existing CTC prefix search and transducer cases, and on larger random and peaky inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.bench.cpu import peaky_log_probs
from gpudecode.bench.ctc import random_log_probs
from gpudecode.search import CtcPrefixOptions, TransducerOptions, ctc_prefix_search, transducer_search
from gpudecode.search import ctc as ctc_module
from gpudecode.search import ctc_cpu, transducer_cpu
from gpudecode.search import transducer as transducer_module
from gpudecode.search.stats import SearchStats
from gpudecode.search.tuning import SearchTuning
from tests.test_ctc_frame import CASES, _inputs
from tests.test_transducer_search import make_models, random_encoder_states
from tests.test_transducer_step import CASES as TRANSDUCER_CASES
from tests.test_transducer_step import _inputs as transducer_inputs

pytest.importorskip("numba")

ARRAYS = SearchTuning(compiled_cpu_loops=False)
COMPILED = SearchTuning()


def _nbest(results):
    return [[(h.labels, h.frames, h.score, h.scores) for h in nbest] for nbest in results]


@pytest.fixture
def array_frames_counted(monkeypatch):
    """Counts the array version's full frames (the compiled loop runs none)."""
    calls = []
    original = ctc_module._PrefixSearch._full_frame
    monkeypatch.setattr(ctc_module._PrefixSearch, "_full_frame",
                        lambda self, t, exact: (calls.append(t), original(self, t, exact)))
    return calls


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_ctc_loop_equals_the_array_search(case, seed, array_frames_counted):
    """The CTC frame step's cases (hash collisions, undecided pairs, blank skipping, threshold,
    another blank, empty and one-frame utterances): identical n-best lists, bit for bit."""
    log_probs, lengths = _inputs(seed)
    options = CtcPrefixOptions(**case, nbest=case["beam_size"])
    expected = ctc_prefix_search(log_probs, lengths, options, tuning=ARRAYS)
    assert array_frames_counted, "the array version did not run"
    array_frames_counted.clear()
    got = ctc_prefix_search(log_probs, lengths, options, tuning=COMPILED)
    assert not array_frames_counted, "the compiled loop did not run"
    assert _nbest(got) == _nbest(expected)


@pytest.mark.parametrize("inputs", ["peaky", "flat"])
@pytest.mark.parametrize("beam, threshold", [(1, None), (8, None), (25, None), (12, 6.0)])
def test_compiled_ctc_loop_on_larger_inputs(inputs, beam, threshold):
    """12 utterances of up to 120 frames, 80 classes (the CPU bench's inputs, smaller), utterances
    of different lengths: identical n-best lists; one utterance per call gives the same too."""
    log_probs = peaky_log_probs(12, 120, 80, seed=4) if inputs == "peaky" else \
        random_log_probs(np, 12, 120, 80, seed=4)
    lengths = np.array([120, 117, 64, 1, 0, 90, 120, 33, 100, 12, 119, 75])
    options = CtcPrefixOptions(beam_size=beam, score_threshold=threshold)
    expected = ctc_prefix_search(log_probs, lengths, options, tuning=ARRAYS)
    got = ctc_prefix_search(log_probs, lengths, options)
    assert _nbest(got) == _nbest(expected)
    for u in (0, 3, 9):
        assert _nbest(ctc_prefix_search(log_probs[u:u + 1], lengths[u:u + 1], options)) == _nbest(expected[u:u + 1])


@pytest.mark.parametrize("case", [dict(beam_size=8), dict(beam_size=6, score_threshold=3.0, hash_modulus=5),
                                  dict(beam_size=5, blank_skip_threshold_logp=-0.05)], ids=str)
def test_threaded_ctc_loop_equals_the_array_search(case):
    """Utterances spread over two threads (``cpu_threads``): the same n-best lists."""
    log_probs = random_log_probs(np, 9, 40, 12, seed=8, sharpness=2.0, blank_bias=1.0)
    lengths = np.array([40, 33, 0, 1, 40, 17, 25, 40, 8])
    options = CtcPrefixOptions(**case)
    expected = ctc_prefix_search(log_probs, lengths, options, tuning=ARRAYS)
    assert _nbest(ctc_prefix_search(log_probs, lengths, options, tuning=SearchTuning(cpu_threads=2))) == \
        _nbest(expected)
    with pytest.raises(ValueError, match="cpu_threads"):
        SearchTuning(cpu_threads=0)


def test_compiled_ctc_loop_with_nan_and_infinite_log_probs():
    """-inf labels (never emitted) and a NaN frame (the search's non-finite check names the
    utterance either way)."""
    from gpudecode.search.nonfinite import NonFiniteScores

    log_probs, lengths = _inputs(5)
    log_probs[:, :, 3] = -np.inf
    options = CtcPrefixOptions(beam_size=4)
    assert _nbest(ctc_prefix_search(log_probs, lengths, options)) == \
        _nbest(ctc_prefix_search(log_probs, lengths, options, tuning=ARRAYS))
    log_probs[1, 2, 2] = np.nan
    for tuning in (ARRAYS, COMPILED):
        with pytest.raises(NonFiniteScores, match="1"):
            ctc_prefix_search(log_probs, lengths, options, tuning=tuning)


def test_the_loops_run_only_where_they_apply():
    assert transducer_cpu.use_loop(np, 0, COMPILED)
    assert not transducer_cpu.use_loop(np, 1, COMPILED)  # scorers: the array version
    assert not transducer_cpu.use_loop(np, 0, ARRAYS)
    assert ctc_cpu.use_loop(np, COMPILED)  # with or without scorers (a call per full frame with them)
    assert not ctc_cpu.use_loop(np, ARRAYS)
    assert not ctc_cpu.use_loop(np, COMPILED, SearchStats(on_top_k=lambda keys, k: None))  # top-k observed


# --- transducer ------------------------------------------------------------------------------------
@pytest.fixture
def array_selections_counted(monkeypatch):
    """Counts the array version's selections (the compiled selection runs none)."""
    calls = []
    original = transducer_module._TransducerSearch._select
    monkeypatch.setattr(transducer_module._TransducerSearch, "_select",
                        lambda self, *args: (calls.append(args[:2]), original(self, *args))[1])
    return calls


@pytest.mark.parametrize("case", TRANSDUCER_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("seed", [0, 1])
def test_compiled_transducer_selection_equals_the_array_search(case, seed, array_selections_counted):
    """The fused selection's cases (expansions within a frame, max recombination, threshold, hash
    collisions, undecided pairs, another blank, one-frame and empty utterances): identical n-best."""
    options = TransducerOptions(**case, nbest=case["beam_size"])
    models, encoder_states, lengths = transducer_inputs(seed)
    expected = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options,
                                 tuning=ARRAYS)
    assert array_selections_counted, "the array version did not run"
    array_selections_counted.clear()
    got = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options)
    assert not array_selections_counted, "the compiled selection did not run"
    assert _nbest(got) == _nbest(expected)


@pytest.mark.parametrize("stateless", [False, True])
@pytest.mark.parametrize("beam, symbols, recombination", [(8, 1, "sum"), (6, 3, "sum"), (5, 2, "max")])
def test_compiled_transducer_selection_on_larger_inputs(stateless, beam, symbols, recombination):
    """6 utterances of up to 30 frames, 12 labels, LSTM and stateless prediction networks."""
    models = make_models(9, 12, stateless=stateless, sharpness=1.5)
    encoder_states = random_encoder_states(9, 6, 30)
    lengths = np.array([30, 21, 1, 0, 17, 30])
    options = TransducerOptions(beam_size=beam, max_symbols_per_frame=symbols, recombination=recombination)
    expected = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options,
                                 tuning=ARRAYS)
    got = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options)
    assert _nbest(got) == _nbest(expected)
