"""Per-frame label pruning of the CTC prefix search (``CtcPrefixOptions.token_min_logp``,
pyctcdecode's rule) against independent oracles: the rule written as pyctcdecode writes it (a set
of kept labels per frame), brute force over the kept labels' alignments, the search of inputs
pruned by that rule, the compiled loop against the array version, and pyctcdecode's own best
transcripts (committed fixture, no pyctcdecode needed).
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from gpudecode.bench.cpu import ctc_log_likelihood, peaky_log_probs
from gpudecode.bench.ctc import random_log_probs
from gpudecode.search import CtcPrefixOptions, ctc_prefix_search
from gpudecode.search.ctc import prune_labels
from gpudecode.search.tuning import SearchTuning

ARRAYS = SearchTuning(compiled_cpu_loops=False)
TOL = 1e-4
FIXTURE = Path(__file__).parent / "fixtures" / "peers" / "pyctcdecode"


def kept_labels(row: np.ndarray, token_min_logp: float) -> set[int]:
    """pyctcdecode 0.5's ``_decode_logits``: ``set(np.where(logit_col >= token_min_logp)[0]) | {max_idx}``."""
    return set(np.where(row >= token_min_logp)[0].tolist()) | {int(row.argmax())}


def pruned_by_rule(log_probs: np.ndarray, token_min_logp: float) -> np.ndarray:
    out = np.full_like(log_probs, -np.inf)
    for index in np.ndindex(log_probs.shape[:-1]):
        for v in kept_labels(log_probs[index], token_min_logp):
            out[index + (v,)] = log_probs[index + (v,)]
    return out


def brute_force_kept_paths(log_probs: np.ndarray, token_min_logp: float, blank: int = 0) -> dict:
    """Label sequence -> log Σ over the alignments whose every frame's label is kept (float64)."""
    scores: dict[tuple, float] = defaultdict(lambda: -np.inf)
    choices = [sorted(kept_labels(row, token_min_logp)) for row in log_probs]
    for path in itertools.product(*choices):
        labels = tuple(c for i, c in enumerate(path) if c != blank and (i == 0 or path[i - 1] != c))
        scores[labels] = np.logaddexp(scores[labels], sum(float(log_probs[t, c]) for t, c in enumerate(path)))
    return dict(scores)


def _nbest(results):
    return [[(h.labels, h.frames, h.score, h.scores) for h in nbest] for nbest in results]


# --- the rule ----------------------------------------------------------------------------------------
def test_prune_labels_is_pyctcdecodes_rule():
    """Rows with entries exactly at the threshold, ties at the maximum (above and below the
    threshold: only the first maximum is kept when below), all-below rows, -inf."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(40, 9)).astype(np.float32) * 3 - 4
    rows[0, [2, 5]] = -5.0  # at the threshold: kept
    rows[1] = -7.0  # all equal, below: only label 0
    rows[2, [3, 6]] = 1.0  # tied maxima above: both kept
    rows[3] = -9.0
    rows[3, [4, 7]] = -6.0  # tied maxima below: the first only
    rows[4, :5] = -np.inf
    got = prune_labels(rows, -5.0)
    np.testing.assert_array_equal(got, pruned_by_rule(rows, -5.0))
    assert np.isfinite(got[1]).sum() == 1 and np.isfinite(got[1, 0])
    assert np.flatnonzero(np.isfinite(got[3])).tolist() == [4]
    assert np.isfinite(got[0, [2, 5]]).all()


# --- the search --------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, token_min_logp", [(0, -1.5), (1, -1.0), (2, -2.5), (3, -0.5)])
@pytest.mark.parametrize("tuning", [ARRAYS, SearchTuning()], ids=["arrays", "compiled"])
def test_unlimited_beam_scores_exactly_the_kept_paths(seed, token_min_logp, tuning):
    """With every prefix kept, each label sequence's score is the log-sum of its alignments over
    the kept labels only (blank and repeats pruned too); nothing else is found."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(3, 6, 4)) * 1.5
    log_probs = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    lengths = np.array([6, 5, 3])
    pruned = pruned_by_rule(log_probs, token_min_logp)
    assert (~np.isfinite(pruned[..., 0])).any(), "some blank should be pruned"
    options = CtcPrefixOptions(beam_size=500, nbest=500, token_min_logp=token_min_logp)
    nbest = ctc_prefix_search(log_probs, lengths, options, tuning=tuning)
    for u, hyps in enumerate(nbest):
        oracle = {k: v for k, v in brute_force_kept_paths(log_probs[u, :lengths[u]], token_min_logp).items()
                  if v > -np.inf}
        found = {tuple(h.labels): h.score for h in hyps if h.score > -np.inf}
        assert found.keys() == oracle.keys()
        for labels, logp in oracle.items():
            assert found[labels] == pytest.approx(logp, abs=TOL)


@pytest.mark.parametrize("case", [
    dict(beam_size=1), dict(beam_size=4), dict(beam_size=8, score_threshold=3.0),
    dict(beam_size=6, hash_modulus=5), dict(beam_size=6, hash_modulus=3, history_compare_steps=0),
    dict(beam_size=5, blank_skip_threshold_logp=-0.05), dict(beam_size=5, blank_skip_threshold_logp=-2.0),
    dict(beam_size=4, blank=2),
], ids=str)
@pytest.mark.parametrize("token_min_logp", [-0.7, -2.0, -5.0])
def test_pruning_is_the_search_of_the_pruned_log_probs(case, token_min_logp):
    """The option equals searching the log-probs pruned by pyctcdecode's rule without it — the
    array version and the compiled loop, bit for bit; the blank skip sees the pruned blank."""
    log_probs = random_log_probs(np, 5, 14, 6, seed=11, sharpness=2.0, blank_bias=1.0)
    lengths = np.array([14, 9, 1, 12, 0])
    options = CtcPrefixOptions(**case, token_min_logp=token_min_logp)
    plain = CtcPrefixOptions(**case)
    expected = ctc_prefix_search(pruned_by_rule(log_probs, token_min_logp), lengths, plain, tuning=ARRAYS)
    assert _nbest(ctc_prefix_search(log_probs, lengths, options, tuning=ARRAYS)) == _nbest(expected)
    assert _nbest(ctc_prefix_search(log_probs, lengths, options)) == _nbest(expected)


@pytest.mark.parametrize("inputs", ["peaky", "flat"])
@pytest.mark.parametrize("beam, threshold", [(1, None), (8, None), (25, 10.0), (12, 6.0)])
def test_compiled_loop_equals_the_array_search(inputs, beam, threshold):
    """The CPU bench's inputs (smaller), pyctcdecode's default pruning: the compiled loop — one
    call, two threads, one utterance per call — gives the array version's n-best lists."""
    log_probs = peaky_log_probs(12, 120, 80, seed=4) if inputs == "peaky" else \
        random_log_probs(np, 12, 120, 80, seed=4)
    lengths = np.array([120, 117, 64, 1, 0, 90, 120, 33, 100, 12, 119, 75])
    options = CtcPrefixOptions(beam_size=beam, score_threshold=threshold, token_min_logp=-5.0)
    expected = _nbest(ctc_prefix_search(log_probs, lengths, options, tuning=ARRAYS))
    assert _nbest(ctc_prefix_search(log_probs, lengths, options)) == expected
    assert _nbest(ctc_prefix_search(log_probs, lengths, options, tuning=SearchTuning(cpu_threads=2))) == expected
    for u in (0, 3, 9):
        assert _nbest(ctc_prefix_search(log_probs[u:u + 1], lengths[u:u + 1], options)) == expected[u:u + 1]
    # the pruning changes something here (else the tests above would prove little)
    unpruned = _nbest(ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=beam,
                                                                              score_threshold=threshold)))
    assert unpruned != expected


def test_nan_and_infinite_log_probs_with_pruning():
    """A NaN frame is still reported (the argmax keeps the first NaN); +inf labels are kept."""
    from gpudecode.search.nonfinite import NonFiniteScores

    log_probs = random_log_probs(np, 5, 14, 6, seed=5, sharpness=2.0, blank_bias=1.5)
    lengths = np.array([14, 9, 1, 12, 0])
    log_probs[:, :, 3] = -np.inf
    options = CtcPrefixOptions(beam_size=4, token_min_logp=-1.0)
    assert _nbest(ctc_prefix_search(log_probs, lengths, options)) == \
        _nbest(ctc_prefix_search(log_probs, lengths, options, tuning=ARRAYS))
    nan = log_probs.copy()
    nan[1, 2, 2] = np.nan
    for tuning in (ARRAYS, SearchTuning()):
        with pytest.raises(NonFiniteScores, match="1"):
            ctc_prefix_search(nan, lengths, options, tuning=tuning)
    assert np.isnan(prune_labels(nan, -1.0)[1, 2, 2])


@pytest.mark.parametrize("value", [0.5, float("nan"), float("-inf"), float("inf"), True, "-5"])
def test_bad_token_min_logp_names_the_option(value):
    with pytest.raises(ValueError, match="token_min_logp"):
        CtcPrefixOptions(beam_size=2, token_min_logp=value)


def test_token_min_logp_defaults_to_off_and_takes_numpy_floats():
    assert CtcPrefixOptions(beam_size=2).token_min_logp is None
    options = CtcPrefixOptions(beam_size=2, token_min_logp=np.float32(-5))
    assert options.token_min_logp == -5.0 and type(options.token_min_logp) is float
    assert CtcPrefixOptions(beam_size=2, token_min_logp=0).token_min_logp == 0.0


# --- pyctcdecode's transcripts (committed fixture: tools/peer-fixtures/ctc-pyctcdecode.py) ------------------
def _fixture():
    document = json.loads((FIXTURE / "expected.json").read_text())
    return document, np.load(FIXTURE / "log_probs.npy")


def test_fixture_holds_the_bench_input():
    """The fixture's log-probs are ``peaky_log_probs`` of its recorded arguments."""
    document, log_probs = _fixture()
    np.testing.assert_allclose(log_probs, peaky_log_probs(**document["input"])[:document["utterances"]], atol=1e-5)
    assert document["labels"][0] == "" and len(document["labels"]) == log_probs.shape[2]


def test_pyctcdecodes_default_pruning_gives_its_best_transcripts():
    """With pyctcdecode's default pruning as options (``token_min_logp`` -5; ``beam_prune_logp``
    -10 as ``score_threshold`` 10) the best transcripts equal pyctcdecode 0.5's but on at most the
    few the fixture records; where they differ the toolkit's has the higher exact CTC likelihood."""
    document, log_probs = _fixture()
    lengths = np.full(log_probs.shape[0], log_probs.shape[1])
    for cell in document["cells"]:
        options = CtcPrefixOptions(beam_size=cell["beam"], nbest=1, token_min_logp=document["token_min_logp"],
                                   score_threshold=-document["beam_prune_logp"])
        ours = [h[0].labels for h in ctc_prefix_search(log_probs, lengths, options)]
        differ = [u for u, (a, b) in enumerate(zip(ours, cell["best"])) if a != b]
        assert len(differ) <= cell["max_differing"], (cell["beam"], differ)
        for u in differ:
            assert ctc_log_likelihood(log_probs[u], ours[u]) > ctc_log_likelihood(log_probs[u], cell["best"][u])
        # unpruned, the toolkit differs where it did when the fixture was made (so the pruning is what matches)
        unpruned = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=cell["beam"], nbest=1))
        assert [u for u, (h, b) in enumerate(zip(unpruned, cell["best"])) if h[0].labels != b] == \
            cell["differing_when_made"]["unpruned"]
    assert any(cell["differing_when_made"]["unpruned"] for cell in document["cells"])


def test_cpu_bench_has_rows_with_pyctcdecodes_pruning(tmp_path):
    """``bench cpu``'s CTC part: per cell the unpruned toolkit and, under "pruned", the toolkit with
    pyctcdecode's default pruning as options, each compared to the same pyctcdecode run (where it imports)."""
    from gpudecode.bench.cpu import CTC_PRUNING, format_table, run_cpu_bench

    results = run_cpu_bench(num_utts=2, num_frames=10, vocab_size=6, beams=(2,), ctc_inputs=("peaky",),
                            parts=("ctc",), cores=1, output_dir=tmp_path)
    assert CTC_PRUNING["pyctcdecode"] == {"token_min_logp": -5.0, "score_threshold": 10.0}
    (cell,) = results["ctc"]["cells"]
    pruned = cell["pruned"]
    assert pruned["gpudecode_pruning"] == "pyctcdecode" and pruned["gpudecode_batched_frames_per_s"] > 0
    if results["ctc"]["pyctcdecode"] is not None:
        assert pruned["pyctcdecode_s"] == cell["pyctcdecode_s"] and 0 <= pruned["best_equal"] <= 2
    assert "| peaky | 2 | none |" in format_table(results) and "| peaky | 2 | pyctcdecode |" in format_table(results)


# --- GPU: the CuPy paths (the fused kernel and the array version) search the pruned log-probs -------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(beam_size=1), dict(beam_size=8, score_threshold=10.0), dict(beam_size=16), dict(beam_size=25),
    dict(beam_size=6, blank_skip_threshold_logp=-2.0), dict(beam_size=4, blank=2),
], ids=str)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "arrays"])
def test_gpu_pruning_equals_cpu(case, fused):
    import cupy

    log_probs = peaky_log_probs(6, 60, 80, seed=2)
    lengths = np.array([60, 41, 1, 0, 60, 17])
    options = CtcPrefixOptions(**case, token_min_logp=-5.0)
    expected = ctc_prefix_search(log_probs, lengths, options)
    got = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy,
                            tuning=SearchTuning(fused_ctc_frames=fused))
    assert [[h.labels for h in n] for n in got] == [[h.labels for h in n] for n in expected]
    assert [[h.frames for h in n] for n in got] == [[h.frames for h in n] for n in expected]
    np.testing.assert_allclose([h.score for n in got for h in n], [h.score for n in expected for h in n], atol=TOL)
