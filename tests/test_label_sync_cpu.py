"""The compiled selections of the label-synchronous step (``gpudecode.search.label_sync_cpu``,
numba) against the array versions they replace (``beam.select_separate`` for the separate finished
lists, ``beam.select`` in the beam), which stay the oracle: every array of a step equal bit for bit
on random states with ties, NaN, ±inf and ±0 among the scores, and the same n-best lists (labels,
scores, lengths) on the peer-semantics cases of ``test_search_finished_modes.py`` and on in-beam
searches with length normalisation, thresholds and ``min_length``, statically and with continuous
batching.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import numpy as np
import pytest

from gpudecode.scorers.base import LaneLayout
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.search import label_sync_cpu
from gpudecode.search.beam import Beam, Finished, candidate_normaliser, select, select_separate
from gpudecode.search.tuning import SearchTuning
from tests.test_search_finished_modes import BEAM, EOS, LIMITS, SETTINGS, V, table_batch
from tests.test_search_label_sync import TrigramTableScorer, random_tables

pytest.importorskip("numba")

ARRAYS = SearchTuning(compiled_cpu_loops=False)
COMPILED = SearchTuning()
NEG_INF = np.float32(-np.inf)


def _values(rng, shape, *, special: bool) -> np.ndarray:
    """float32 log-prob-like values on a coarse grid (ties), with NaN, ±inf, ±0 where ``special``."""
    values = (-rng.integers(0, 6, shape) * 0.5).astype(np.float32)
    if special:
        pick = rng.random(shape)
        values[pick < 0.05] = np.nan
        values[(pick >= 0.05) & (pick < 0.12)] = -np.inf
        values[(pick >= 0.12) & (pick < 0.14)] = np.inf
        values[(pick >= 0.14) & (pick < 0.2)] = -0.0
    return values


def random_step(seed: int, options: LabelSyncOptions, num_groups: int = 5, vocab: int = 7, num_scorers: int = 2,
                special: bool = True):
    """A random beam with finished lists (some groups done or hopeless, lanes ended or dead, lists
    part full, ranks tied), [N, V] combined scores and per-scorer log-probs, deadlines, a step."""
    rng = np.random.default_rng(seed)
    beam_size = options.beam_size
    num_lanes = num_groups * beam_size
    step = int(rng.integers(1, 6))
    scores = _values(rng, num_lanes, special=False)
    scores[rng.random(num_lanes) < 0.15] = NEG_INF  # dead lanes
    ended = rng.random(num_lanes) < 0.25
    ranks = np.sort(-rng.integers(0, 5, (num_groups, beam_size)) * 0.5, axis=1)[:, ::-1].astype(np.float32)
    filled = rng.integers(0, beam_size + 1, num_groups)
    ranks[np.arange(beam_size)[None, :] >= filled[:, None]] = NEG_INF
    size = num_lanes
    finished = Finished(
        ranks=np.ascontiguousarray(ranks.reshape(-1)), scores=_values(rng, size, special=False),
        scorer_scores=_values(rng, (num_scorers, size), special=False),
        lengths=rng.integers(0, step + 1, size).astype(np.int64), steps=rng.integers(0, step, size).astype(np.int64),
        lanes=rng.integers(0, num_lanes, size).astype(np.int64), labels=rng.integers(-1, vocab, size).astype(np.int64),
        prompt_lengths=rng.integers(0, 4, num_groups).astype(np.int64), hopeful=rng.random(num_groups) < 0.8,
        done=rng.random(num_groups) < 0.2)
    beam = Beam(scores=scores, scorer_scores=_values(rng, (num_scorers, num_lanes), special=False),
                lengths=rng.integers(0, step, num_lanes).astype(np.int64), ended=ended, finished=finished)
    log_probs = [_values(rng, (num_lanes, vocab), special=special) for _ in range(num_scorers)]
    combined = _values(rng, (num_lanes, vocab), special=special)
    deadline = np.repeat(rng.integers(step, step + 3, num_groups), beam_size).astype(np.int64)
    layout = LaneLayout(num_groups=num_groups, beam_size=beam_size, xp=np)
    return beam, combined, log_probs, deadline, step, layout


def _arrays(beam: Beam) -> dict:
    fields = {f"beam.{k}": v for k, v in dataclasses.asdict(dataclasses.replace(beam, finished=None)).items()
              if v is not None}
    for field in dataclasses.fields(Finished):
        fields[f"finished.{field.name}"] = getattr(beam.finished, field.name)
    return fields


STEP_SETTINGS = SETTINGS + [
    dict(finished="separate", early_stopping="never", length_norm_scale=0.7, length_counts="prompt-and-labels"),
    dict(finished="separate-genai", early_stopping=True, length_norm_scale=0.5, length_counts="labels",
         min_length=2),
]


@pytest.mark.parametrize("settings", STEP_SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
@pytest.mark.parametrize("beam_size", [1, 3, 4])
@pytest.mark.parametrize("special", [False, True], ids=["ties", "nan-inf-zero"])
def test_compiled_step_equals_the_array_step(settings, beam_size, special):
    """Every array of the new beam and finished lists, parents and labels: equal (NaN where NaN,
    the sign of zero included) over 30 random states."""
    options = LabelSyncOptions(beam_size=beam_size, sentence_end=EOS % 7, max_labels_per_input=1.0, **settings)
    for seed in range(30):
        beam, combined, log_probs, deadline, step, layout = random_step(seed, options, special=special)
        with np.errstate(invalid="ignore"):  # -inf + inf among the candidates
            expected = select_separate(beam, combined, log_probs, deadline, step, layout, options)
        fields, finished, parents, labels = label_sync_cpu.select_separate(beam, combined, log_probs, deadline, step,
                                                                           layout, options)
        got = Beam(**fields, finished=Finished(**finished)), parents, labels
        for i, name in ((1, "parents"), (2, "labels")):
            np.testing.assert_array_equal(got[i], expected[i], err_msg=f"seed {seed}: {name}")
        want, have = _arrays(expected[0]), _arrays(got[0])
        assert want.keys() == have.keys()
        for name, value in want.items():
            value, other = np.asarray(value), np.asarray(have[name])
            assert other.dtype == value.dtype and other.shape == value.shape, f"seed {seed}: {name}"
            if value.dtype.kind == "f":  # bit for bit: NaN payloads aside, -0.0 differs from +0.0
                same = (np.isnan(value) & np.isnan(other)) | (value.view(np.int32) == other.view(np.int32))
                assert same.all(), f"seed {seed}: {name}: {other} != {value}"
            else:
                np.testing.assert_array_equal(other, value, err_msg=f"seed {seed}: {name}")


def _nbest(results):
    return [[(h.labels, h.length, h.score, h.scores, h.truncated) for h in nbest] for nbest in results]


@contextlib.contextmanager
def calls_of(function):
    """The calls of the Python ``function`` made inside the block (a profile hook; nothing rebound)."""
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is function.__code__:
            calls.append(1)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


@pytest.mark.parametrize("continuous", [None, 2], ids=["static", "continuous"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_search_equals_the_array_search(seed, settings, continuous):
    """The peer-semantics cases: identical n-best lists (labels, lengths, scores, per-scorer
    scores, truncation), the compiled selection having run every step."""
    tables = random_tables(seed, len(LIMITS), V, EOS, eos_bias=1.0)
    options = LabelSyncOptions(beam_size=BEAM, sentence_end=EOS, max_labels_per_input=1.0, nbest=BEAM, **settings)
    _compiled_equals_arrays(tables, options, continuous, select_separate)


def _compiled_equals_arrays(tables, options, continuous, array_selection):
    """The search with the array selection (``array_selection`` runs) and compiled (it does not)
    gives identical n-best lists."""
    def search(tuning):
        return label_sync_search([("lm", TrigramTableScorer(V), 1.0), ("twice", TrigramTableScorer(V), 0.5)],
                                 table_batch(tables), options, max_active_utterances=continuous, tuning=tuning)

    with calls_of(array_selection) as calls:
        expected = search(ARRAYS)
    assert calls, "the array version did not run"
    with calls_of(array_selection) as calls:
        got = search(COMPILED)
    assert not calls, "the compiled selection did not run"
    assert _nbest(got) == _nbest(expected)


def test_the_array_version_runs_where_the_compiled_one_may_not():
    """``compiled_cpu_loops`` off, or a top-k observer: the array version runs."""
    from gpudecode.search.stats import SearchStats

    assert not label_sync_cpu.use_compiled(np, ARRAYS, None)
    assert not label_sync_cpu.use_compiled(np, COMPILED, SearchStats(on_top_k=lambda keys, k: None))
    assert label_sync_cpu.use_compiled(np, COMPILED, SearchStats())
    tables = random_tables(0, len(LIMITS), V, EOS, eos_bias=1.0)
    options = LabelSyncOptions(beam_size=BEAM, sentence_end=EOS, max_labels_per_input=1.0, **SETTINGS[0])
    with calls_of(select_separate) as calls:
        label_sync_search([("lm", TrigramTableScorer(V), 1.0)], table_batch(tables), options, tuning=ARRAYS)
    assert calls


IN_BEAM = [
    dict(length_norm_scale=0.0),
    dict(length_norm_scale=1.0),
    dict(length_norm_scale=0.7, score_threshold=2.0),
    dict(length_norm_scale=1.0, min_length=2, score_threshold=0.5),
]


def _bits_equal(got, want, where: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, where
    if want.dtype.kind == "f":
        assert ((np.isnan(want) & np.isnan(got)) | (want.view(np.int32) == got.view(np.int32))).all(), \
            f"{where}: {got} != {want}"
    else:
        np.testing.assert_array_equal(got, want, err_msg=where)


@pytest.mark.parametrize("settings", IN_BEAM, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("beam_size", [1, 3, 4])
@pytest.mark.parametrize("special", [False, True], ids=["ties", "nan-inf-zero"])
def test_compiled_in_beam_step_equals_the_array_step(settings, beam_size, special):
    """``finished="in-beam"``: the new beam, parents and labels bit for bit over 30 random states."""
    options = LabelSyncOptions(beam_size=beam_size, sentence_end=EOS % 7, max_labels_per_input=1.0, **settings)
    for seed in range(30):
        beam, combined, log_probs, deadline, step, layout = random_step(seed, options, special=special)
        beam = dataclasses.replace(beam, finished=None)
        with np.errstate(invalid="ignore"):  # -inf + inf among the candidates
            expected = select(beam, combined, log_probs, candidate_normaliser(beam, options, np), deadline <= step,
                              layout, options)
        fields, parents, labels = label_sync_cpu.select_in_beam(beam, combined, log_probs, deadline, step, layout,
                                                                options)
        _bits_equal(parents, expected[1], f"seed {seed}: parents")
        _bits_equal(labels, expected[2], f"seed {seed}: labels")
        for name, value in fields.items():
            _bits_equal(value, getattr(expected[0], name), f"seed {seed}: {name}")


@pytest.mark.parametrize("continuous", [None, 2], ids=["static", "continuous"])
@pytest.mark.parametrize("settings", IN_BEAM, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("beam_size", [1, 3])
def test_compiled_in_beam_search_equals_the_array_search(beam_size, settings, continuous):
    tables = random_tables(3, len(LIMITS), V, EOS, eos_bias=0.5)
    options = LabelSyncOptions(beam_size=beam_size, sentence_end=EOS, max_labels_per_input=1.0, **settings)
    _compiled_equals_arrays(tables, options, continuous, select)
