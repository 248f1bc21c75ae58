"""CTC prefix beam search and greedy CTC against brute force (every alignment enumerated).

"Exact": the same label sequences and scores within 1e-4. Comparisons between
two runs of the search assert that every beam cutoff and n-best order of the reference run had a
gap above 1e-3 (recorded by wrapping the search's top-k), so a near-tie cannot flip a result.
"""

from __future__ import annotations

import numpy as np
import pytest

from examples.custom_scorer import BigramScorer
from gpudecode.backend import to_host
from gpudecode.scorers.onnx_decoder import RecurrentLmScorer
from gpudecode.search import CtcPrefixOptions, ctc_greedy_search, ctc_prefix_search
from gpudecode.search import ctc as ctc_module
from gpudecode.search.stats import SearchStats
from gpudecode.search.tuning import SearchTuning
from gpudecode.session import OnnxSession, SessionOptions
from gpudecode.states.options import StateManagerOptions
from gpudecode.testing import build_ctc_encoder, build_lstm_lm
from gpudecode.testing._graph import log_softmax
from gpudecode.testing.ctc import best_path, ctc_sequence_log_probs

TOL = 1e-4
MIN_GAP = 1e-3
BLANK = 0


def random_log_probs(seed, num_utts, num_frames, vocab_size, *, sharpness=1.5, blank_bias=0.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_utts, num_frames, vocab_size)) * sharpness
    logits[:, :, BLANK] += blank_bias
    return log_softmax(logits).astype(np.float32)


def bigram_table(seed, vocab_size, sharpness=1.0):
    """[V + 1, V] log p(label | previous label); row V = sentence-begin."""
    rng = np.random.default_rng(seed + 1000)
    return log_softmax(rng.normal(size=(vocab_size + 1, vocab_size)) * sharpness).astype(np.float32)


def bigram_score(table, labels, sentence_end=None):
    vocab_size = table.shape[1]
    previous, total = vocab_size, 0.0
    for label in labels:
        total += float(table[previous, label])
        previous = label
    if sentence_end is not None:
        total += float(table[previous, sentence_end])
    return total


class CountingBigram(BigramScorer):
    """The example bigram scorer, counting its score() calls."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.score_calls = 0

    def score(self, prev):
        self.score_calls += 1
        return super().score(prev)


def as_dict(hyps):
    return {tuple(h.labels): h for h in hyps}


class TopKGaps(list):
    """Records, for every top-k of the searches given ``stats``, the smallest gap between the k-th
    and the (k+1)-th key among rows whose k-th key is finite."""

    def __init__(self):
        super().__init__()
        self.stats = SearchStats(on_top_k=self.record)

    def record(self, keys, k):
        host = np.sort(np.asarray(to_host(keys), dtype=np.float64), axis=1)[:, ::-1]
        if host.shape[1] > k:
            kth, next_ = host[:, k - 1], host[:, k]
            cut = np.isfinite(kth)
            if cut.any():
                self.append(float(np.min(kth[cut] - next_[cut])))


@pytest.fixture
def gaps():
    """The top-k gaps of the reference searches (:class:`TopKGaps`; pass ``stats=gaps.stats``)."""
    return TopKGaps()


def assert_same_nbest(expected, got, *, frames=True):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert [h.labels for h in a] == [h.labels for h in b]
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=TOL)
        for x, y in zip(a, b):
            assert x.scores.keys() == y.scores.keys()
            for name in x.scores:
                assert x.scores[name] == pytest.approx(y.scores[name], abs=TOL)
            if frames:
                assert x.frames == y.frames


# --- the reference encoder ------------------------------------------------------------------------
def test_ctc_encoder_matches_its_oracle_and_outputs_log_probs():
    reference = build_ctc_encoder(3, vocab_size=7, subsampling=3, num_layers=2)
    rng = np.random.default_rng(3)
    features = rng.standard_normal((3, 14, 16)).astype(np.float32)
    sizes = np.array([14, 9, 1], np.int32)
    got = OnnxSession(reference.serialized()).run({"features": features, "features-size": sizes})
    want = reference.oracle({"features": features, "features-size": sizes})
    assert got["log-probs"].shape == (3, 5, 7)
    np.testing.assert_array_equal(got["log-probs-size"], [5, 3, 1])
    np.testing.assert_allclose(got["log-probs"], want["log-probs"], atol=1e-5)
    np.testing.assert_allclose(np.exp(got["log-probs"]).sum(-1), 1.0, atol=1e-5)
    # padded input frames do not leak into valid output frames
    changed = features.copy()
    changed[1, 9:] = 100.0
    again = OnnxSession(reference.serialized()).run({"features": changed, "features-size": sizes})
    np.testing.assert_allclose(again["log-probs"][1, :3], got["log-probs"][1, :3], atol=1e-6)


# --- exactness against brute force ----------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 2, 3])
def test_unlimited_beam_scores_every_sequence_exactly_and_finds_the_optimum(seed):
    vocab_size, lengths = 4, np.array([5, 4, 3])
    log_probs = random_log_probs(seed, 3, 5, vocab_size)
    nbest = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=400, nbest=400))
    for u, hyps in enumerate(nbest):
        oracle = ctc_sequence_log_probs(log_probs[u, : lengths[u]], BLANK)
        found = as_dict(hyps)
        assert found.keys() == oracle.keys()
        for labels, logp in oracle.items():
            assert found[labels].score == pytest.approx(logp, abs=TOL)
            assert found[labels].scores == {"ctc": pytest.approx(logp, abs=TOL)}
            assert found[labels].length == len(labels)
        ranked = sorted(oracle.values(), reverse=True)
        assert ranked[0] - ranked[1] > MIN_GAP
        assert tuple(hyps[0].labels) == max(oracle, key=oracle.get)
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


def test_a_moderate_beam_finds_the_exhaustive_optimum():
    vocab_size, lengths = 4, np.array([6, 6, 5, 6])
    log_probs = random_log_probs(7, 4, 6, vocab_size, sharpness=2.5)
    nbest = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=8))
    for u, hyps in enumerate(nbest):
        oracle = ctc_sequence_log_probs(log_probs[u, : lengths[u]], BLANK)
        ranked = sorted(oracle.values(), reverse=True)
        assert ranked[0] - ranked[1] > MIN_GAP
        assert tuple(hyps[0].labels) == max(oracle, key=oracle.get)
        for h in hyps:  # pruned paths can only lower a prefix's score
            assert h.score <= oracle[tuple(h.labels)] + TOL


def test_greedy_equals_the_best_path():
    log_probs = random_log_probs(4, 4, 30, 6, sharpness=2.0, blank_bias=1.0)
    lengths = np.array([30, 17, 1, 0])
    top2 = np.sort(log_probs, axis=2)[:, :, -2:]
    assert (top2[:, :, 1] - top2[:, :, 0]).min() > MIN_GAP
    nbest = ctc_greedy_search(log_probs, lengths)
    for u, (hyp,) in enumerate(zip(*[iter(h for hyps in nbest for h in hyps)])):
        labels, score, frames = best_path(log_probs[u, : lengths[u]], BLANK)
        assert hyp.labels == labels and hyp.frames == frames
        assert hyp.score == pytest.approx(score, abs=TOL)
        assert hyp.scores["ctc"] == pytest.approx(score, abs=TOL)
    assert nbest[3][0].labels == [] and nbest[3][0].score == 0.0
    assert any(len(hyps[0].labels) >= 5 for hyps in nbest)


def test_frames_of_a_peaky_input_are_the_spike_frames():
    vocab_size, num_frames = 5, 20
    logits = np.full((2, num_frames, vocab_size), -6.0)
    logits[:, :, BLANK] = 4.0
    spikes = [{2: 3, 3: 3, 7: 1, 12: 1, 13: 4}, {0: 2, 5: 2, 6: 4, 19: 3}]
    for u, table in enumerate(spikes):
        for t, label in table.items():
            logits[u, t, label] = 6.0
    log_probs = log_softmax(logits).astype(np.float32)
    lengths = np.array([20, 20])
    nbest = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=4))
    assert nbest[0][0].labels == [3, 1, 1, 4] and nbest[0][0].frames == [2, 7, 12, 13]
    assert nbest[1][0].labels == [2, 2, 4, 3] and nbest[1][0].frames == [0, 5, 6, 19]
    for hyps, (greedy,) in zip(nbest, ctc_greedy_search(log_probs, lengths)):
        assert hyps[0].labels == greedy.labels and hyps[0].frames == greedy.frames


# --- LM fusion ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sentence_end", [None, 2])
def test_bigram_fusion_equals_brute_force_with_scaled_scores_at_emissions(sentence_end):
    vocab_size, scale, lengths = 4, 0.6, np.array([5, 3])
    log_probs = random_log_probs(11, 2, 5, vocab_size)
    table = bigram_table(11, vocab_size)
    nbest = ctc_prefix_search(log_probs, lengths,
                              CtcPrefixOptions(beam_size=400, nbest=400, sentence_end=sentence_end),
                              [("lm", BigramScorer(log_probs=table), scale)])
    for u, hyps in enumerate(nbest):
        oracle = ctc_sequence_log_probs(log_probs[u, : lengths[u]], BLANK)
        found = as_dict(hyps)
        assert found.keys() == oracle.keys()
        totals = {}
        for labels, ctc in oracle.items():
            lm = bigram_score(table, labels, sentence_end)
            totals[labels] = ctc + scale * lm
            assert found[labels].scores["ctc"] == pytest.approx(ctc, abs=TOL)
            assert found[labels].scores["lm"] == pytest.approx(lm, abs=TOL)
            assert found[labels].score == pytest.approx(ctc + scale * lm, abs=TOL)
        ranked = sorted(totals.values(), reverse=True)
        assert ranked[0] - ranked[1] > MIN_GAP
        assert tuple(hyps[0].labels) == max(totals, key=totals.get)


def lstm_scorer(reference, bos=0):
    return RecurrentLmScorer(model=reference.serialized(), vocab_size=reference.vocab_size,
                             start_labels=[bos], state_manager=StateManagerOptions(type="lstm-cpu"),
                             session_options=SessionOptions(device="cpu"))


def lstm_score(reference, labels, bos=0, sentence_end=None):
    rows = reference.sequence_log_probs([bos, *labels])
    targets = [*labels, sentence_end] if sentence_end is not None else list(labels)
    return float(sum(rows[p, t] for p, t in enumerate(targets)))


@pytest.mark.parametrize("cache", [10_000, 0])
def test_lstm_lm_fusion_equals_brute_force(cache):
    vocab_size, scale, lengths = 4, 0.5, np.array([5, 4])
    log_probs = random_log_probs(5, 2, 5, vocab_size)
    reference = build_lstm_lm(5, vocab_size=vocab_size)
    scorer = lstm_scorer(reference)
    nbest = ctc_prefix_search(
        log_probs, lengths,
        CtcPrefixOptions(beam_size=200, nbest=200, sentence_end=3, max_cached_score_vectors=cache),
        [("lstm", scorer, scale)])
    for u, hyps in enumerate(nbest):
        oracle = ctc_sequence_log_probs(log_probs[u, : lengths[u]], BLANK)
        found = as_dict(hyps)
        assert found.keys() == oracle.keys()
        totals = {}
        for labels, ctc in oracle.items():
            lm = lstm_score(reference, labels, sentence_end=3)
            totals[labels] = ctc + scale * lm
            assert found[labels].scores["lstm"] == pytest.approx(lm, abs=TOL)
            assert found[labels].score == pytest.approx(totals[labels], abs=TOL)
        ranked = sorted(totals.values(), reverse=True)
        assert ranked[0] - ranked[1] > MIN_GAP
        assert tuple(hyps[0].labels) == max(totals, key=totals.get)
    assert scorer.states.statistics().live_slots == 0  # released after the run


def test_two_scorers_and_a_zero_scale():
    vocab_size, lengths = 4, np.array([4])
    log_probs = random_log_probs(12, 1, 4, vocab_size)
    table_a, table_b = bigram_table(1, vocab_size), bigram_table(2, vocab_size)
    table_b[:, 2] = -np.inf  # a scorer with scale 0 that forbids a label changes nothing
    (hyps,) = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=100, nbest=100),
                                [("a", BigramScorer(log_probs=table_a), 0.3),
                                 ("b", BigramScorer(log_probs=table_b), 0.0)])
    oracle = ctc_sequence_log_probs(log_probs[0], BLANK)
    found = as_dict(hyps)
    assert found.keys() == oracle.keys()
    for labels, ctc in oracle.items():
        assert found[labels].score == pytest.approx(ctc + 0.3 * bigram_score(table_a, labels), abs=TOL)
        assert found[labels].scores["b"] == pytest.approx(bigram_score(table_b, labels), abs=TOL)


# --- batching, cache, collisions -------------------------------------------------------------------
def test_decoding_together_equals_decoding_each_alone(gaps):
    vocab_size = 7
    log_probs = random_log_probs(21, 4, 16, vocab_size, sharpness=2.0, blank_bias=0.5)
    lengths = np.array([16, 9, 13, 2])
    table = bigram_table(21, vocab_size)
    options = CtcPrefixOptions(beam_size=4, sentence_end=1)
    together = ctc_prefix_search(log_probs, lengths, options, [("lm", BigramScorer(log_probs=table), 0.4)],
                                 stats=gaps.stats)
    assert min(gaps) > MIN_GAP
    for u in range(4):
        alone = ctc_prefix_search(log_probs[u:u + 1, : lengths[u]], lengths[u:u + 1], options,
                                  [("lm", BigramScorer(log_probs=table), 0.4)])
        assert_same_nbest([together[u]], alone)
    assert all(len(h) == 4 for h in together)


@pytest.mark.parametrize("threshold", [None, 4.0])
def test_the_score_cache_changes_nothing_and_saves_scorer_calls(gaps, threshold):
    vocab_size = 6
    log_probs = random_log_probs(31, 3, 24, vocab_size, sharpness=3.0, blank_bias=3.0)
    lengths = np.array([24, 20, 15])
    table = bigram_table(31, vocab_size)
    runs = {}
    for cache in (10_000, 0):
        scorer = CountingBigram(log_probs=table)
        options = CtcPrefixOptions(beam_size=3, max_cached_score_vectors=cache, sentence_end=2,
                                   score_threshold=threshold)
        runs[cache] = (ctc_prefix_search(log_probs, lengths, options, [("lm", scorer, 0.7)], stats=gaps.stats),
                       scorer.score_calls)
    assert min(gaps) > MIN_GAP
    assert_same_nbest(runs[0][0], runs[10_000][0])
    assert runs[0][1] == 24 + 1  # every frame, and the sentence end
    assert runs[10_000][1] < runs[0][1]


def test_lstm_score_cache_changes_nothing(gaps):
    vocab_size = 5
    log_probs = random_log_probs(41, 2, 14, vocab_size, sharpness=3.0, blank_bias=2.0)
    lengths = np.array([14, 11])
    reference = build_lstm_lm(41, vocab_size=vocab_size)
    runs = [ctc_prefix_search(log_probs, lengths,
                              CtcPrefixOptions(beam_size=4, max_cached_score_vectors=cache, sentence_end=4),
                              [("lstm", lstm_scorer(reference), 0.5)], stats=gaps.stats)
            for cache in (10_000, 0)]
    assert min(gaps) > MIN_GAP
    assert_same_nbest(*runs)
    for u, hyps in enumerate(runs[0]):
        for h in hyps:
            assert h.scores["lstm"] == pytest.approx(lstm_score(reference, h.labels, sentence_end=4), abs=TOL)


@pytest.mark.parametrize("modulus", [1, 2, 5])
@pytest.mark.parametrize("steps", [0, 1, None])
def test_forced_hash_collisions_change_nothing(gaps, monkeypatch, modulus, steps):
    vocab_size = 4
    log_probs = random_log_probs(51, 3, 12, vocab_size, sharpness=1.0)
    lengths = np.array([12, 10, 7])
    table = bigram_table(51, vocab_size)
    scorers = lambda: [("lm", BigramScorer(log_probs=table), 0.3)]  # noqa: E731
    expected = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=6), scorers(), stats=gaps.stats)
    assert min(gaps) > MIN_GAP
    runs = []
    original = ctc_module._PrefixSearch.run

    def counting_run(self, utterances, *, exact):
        runs.append(exact)
        return original(self, utterances, exact=exact)

    monkeypatch.setattr(ctc_module._PrefixSearch, "run", counting_run)
    got = ctc_prefix_search(log_probs, lengths,
                            CtcPrefixOptions(beam_size=6, hash_modulus=modulus, history_compare_steps=steps),
                            scorers(), tuning=SearchTuning(compiled_cpu_loops=False))  # the array version's reruns
    assert_same_nbest(expected, got)
    if steps is None:
        assert runs == [True]
    elif steps == 0:  # every hash pair on distinct emission nodes stays undecided: run again, exactly
        assert runs == [False, True]


def test_hash_collisions_would_merge_distinct_sequences_without_the_check(monkeypatch):
    """The collision check matters: taking hash-equal pairs as equal (modulus 1) breaks results."""
    log_probs = random_log_probs(51, 3, 12, 4, sharpness=1.0)
    lengths = np.array([12, 10, 7])
    expected = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=6))

    def trusting(self, alive, exact):
        num_utts, beam = self.layout.num_groups, self.layout.beam_size
        equal = ((self.hash.reshape(num_utts, 1, beam) == self.prev_hash.reshape(num_utts, beam, 1))
                 & (self.length.reshape(num_utts, 1, beam) + 1 == self.length.reshape(num_utts, beam, 1))
                 & alive.reshape(num_utts, 1, beam) & alive.reshape(num_utts, beam, 1))
        return (self.group_base + equal.argmax(axis=2)).reshape(-1), equal.any(axis=2).reshape(-1)

    monkeypatch.setattr(ctc_module._PrefixSearch, "_recombination", trusting)
    broken = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=6, hash_modulus=1),
                               tuning=SearchTuning(compiled_cpu_loops=False))  # the array version's check
    assert [[h.labels for h in u] for u in broken] != [[h.labels for h in u] for u in expected]


# --- pruning and skipping --------------------------------------------------------------------------
def test_blank_skip_equals_decoding_blank_only_frames():
    vocab_size, lengths = 4, np.array([6, 5])
    log_probs = random_log_probs(61, 2, 6, vocab_size, blank_bias=1.5)
    threshold = float(np.log(0.6))
    skipped = log_probs[:, :, BLANK] > threshold
    skipped &= np.arange(6)[None, :] < lengths[:, None]
    assert skipped.any() and not skipped.all()
    # the oracle input: skipped frames keep only their blank
    masked = log_probs.copy()
    masked[skipped] = -np.inf
    masked[skipped, BLANK] = log_probs[skipped, BLANK]
    nbest = ctc_prefix_search(log_probs, lengths,
                              CtcPrefixOptions(beam_size=300, nbest=300, blank_skip_threshold_logp=threshold))
    for u, hyps in enumerate(nbest):
        with np.errstate(divide="ignore"):
            oracle = ctc_sequence_log_probs(masked[u, : lengths[u]], BLANK)
        found = as_dict(hyps)
        assert found.keys() == oracle.keys()
        for labels, logp in oracle.items():
            assert found[labels].score == pytest.approx(logp, abs=TOL)
            assert all(not skipped[u, f] for f in found[labels].frames)


def test_a_frame_every_utterance_skips_takes_the_blank_only_path(monkeypatch):
    log_probs = random_log_probs(62, 2, 8, 4, sharpness=1.0)
    log_probs[:, 3] = np.log(np.array([0.97, 0.01, 0.01, 0.01], np.float32))
    calls = []
    original = ctc_module._PrefixSearch._blank_frame
    monkeypatch.setattr(ctc_module._PrefixSearch, "_blank_frame",
                        lambda self, t: (calls.append(t), original(self, t)))
    options = CtcPrefixOptions(beam_size=50, nbest=50, blank_skip_threshold_logp=float(np.log(0.9)))
    nbest = ctc_prefix_search(log_probs, np.array([8, 6]), options,
                              tuning=SearchTuning(compiled_cpu_loops=False))  # the array version's frame
    assert calls == [3]
    reference = ctc_prefix_search(log_probs, np.array([8, 6]), CtcPrefixOptions(beam_size=50, nbest=50))
    masked = log_probs.copy()
    masked[:, 3, 1:] = -np.inf
    with np.errstate(divide="ignore"):
        blank_only = ctc_prefix_search(masked, np.array([8, 6]), CtcPrefixOptions(beam_size=50, nbest=50))
    for a, b, c in zip(nbest, blank_only, reference):
        da, db = as_dict(a), as_dict(b)
        assert da.keys() == db.keys() and len(c) == 50
        for k in da:
            assert da[k].score == pytest.approx(db[k].score, abs=TOL)


def test_score_threshold_keeps_only_candidates_near_the_best():
    log_probs = random_log_probs(71, 3, 10, 5, sharpness=1.0)
    lengths = np.array([10, 10, 8])
    wide = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=8))
    huge = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=8, score_threshold=1e6))
    assert_same_nbest(wide, huge)
    narrow = ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=8, score_threshold=0.5))
    for hyps in narrow:
        assert all(h.score >= hyps[0].score - 0.5 - TOL for h in hyps)
    assert all(1 <= len(hyps) < 8 for hyps in narrow)


def test_no_host_transfer_per_frame_without_scorers():
    counts = []
    stats = SearchStats(on_transfer=lambda arrays: counts.append(len(arrays)))
    for num_frames in (6, 30):
        counts.clear()
        log_probs = random_log_probs(81, 2, num_frames, 5)
        ctc_prefix_search(log_probs, np.array([num_frames, 3]), CtcPrefixOptions(beam_size=4), stats=stats)
        assert len(counts) == 2  # the lengths, and the n-best at the end


def test_empty_utterances_and_beam_larger_than_the_candidates():
    log_probs = random_log_probs(91, 2, 3, 3)
    nbest = ctc_prefix_search(log_probs, np.array([0, 1]), CtcPrefixOptions(beam_size=5))
    assert [h.labels for h in nbest[0]] == [[]] and nbest[0][0].score == 0.0
    assert sorted(tuple(h.labels) for h in nbest[1]) == [(), (1,), (2,)]
    assert ctc_prefix_search(np.zeros((0, 3, 3), np.float32), np.zeros(0, np.int64),
                             CtcPrefixOptions(beam_size=2)) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_size=0), "beam_size"),
    (dict(beam_size=2, score_threshold=0), "score_threshold"),
    (dict(beam_size=2, blank_skip_threshold_logp=0.5), "blank_skip_threshold_logp"),
    (dict(beam_size=2, nbest=3), "nbest"),
    (dict(beam_size=2, hash_modulus=0), "hash_modulus"),
    (dict(beam_size=2, history_compare_steps=-1), "history_compare_steps"),
    (dict(beam_size=2, max_cached_score_vectors=-1), "max_cached_score_vectors"),
])
def test_bad_options_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CtcPrefixOptions(**kwargs)


def test_bad_inputs_are_errors():
    log_probs = random_log_probs(1, 2, 4, 3)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 5"):
        ctc_prefix_search(log_probs, np.array([4, 5]), CtcPrefixOptions(beam_size=2))
    with pytest.raises(ValueError, match="expected shape"):
        ctc_prefix_search(log_probs, np.array([4]), CtcPrefixOptions(beam_size=2))
    with pytest.raises(ValueError, match="blank 3"):
        ctc_prefix_search(log_probs, np.array([4, 4]), CtcPrefixOptions(beam_size=2, blank=3))
    with pytest.raises(ValueError, match="'ctc' is taken"):
        ctc_prefix_search(log_probs, np.array([4, 4]), CtcPrefixOptions(beam_size=2),
                          [("ctc", BigramScorer(log_probs=bigram_table(0, 3)), 1.0)])
    with pytest.raises(ValueError, match="vocab_size 4"):
        ctc_prefix_search(log_probs, np.array([4, 4]), CtcPrefixOptions(beam_size=2),
                          [("lm", BigramScorer(log_probs=bigram_table(0, 4)), 1.0)])


def test_encoder_output_decodes_like_its_oracle():
    reference = build_ctc_encoder(8, vocab_size=6, blank_bias=1.0)
    rng = np.random.default_rng(8)
    features = rng.standard_normal((3, 20, 16)).astype(np.float32)
    sizes = np.array([20, 13, 8], np.int32)
    out = OnnxSession(reference.serialized()).run({"features": features, "features-size": sizes})
    oracle = reference.oracle({"features": features, "features-size": sizes})
    options = CtcPrefixOptions(beam_size=4)
    got = ctc_prefix_search(out["log-probs"], out["log-probs-size"], options)
    want = ctc_prefix_search(oracle["log-probs"], oracle["log-probs-size"], options)
    assert_same_nbest(want, got)
    assert any(h[0].labels for h in got)


# --- GPU: the same n-best as the numpy path --------------------------------------------------------
def _cupy():
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    dict(beam_size=1), dict(beam_size=8), dict(beam_size=16, sentence_end=2),
    dict(beam_size=8, score_threshold=3.0), dict(beam_size=8, blank_skip_threshold_logp=float(np.log(0.8))),
    dict(beam_size=8, hash_modulus=2, history_compare_steps=0), dict(beam_size=8, max_cached_score_vectors=0),
])
def test_gpu_search_equals_cpu(gaps, options):
    cupy = _cupy()
    vocab_size = 9
    log_probs = random_log_probs(104, 5, 40, vocab_size, sharpness=2.5, blank_bias=1.5)  # no near-ties
    lengths = np.array([40, 33, 12, 40, 1])
    table = bigram_table(104, vocab_size)
    options = CtcPrefixOptions(**options)
    cpu = ctc_prefix_search(log_probs, lengths, options, [("lm", BigramScorer(log_probs=table), 0.5)],
                            stats=gaps.stats)
    assert min(gaps) > MIN_GAP
    gpu = ctc_prefix_search(cupy.asarray(log_probs), cupy.asarray(lengths), options,
                            [("lm", BigramScorer(log_probs=table), 0.5)], xp=cupy)
    assert_same_nbest(cpu, gpu)
    cpu_plain = ctc_prefix_search(log_probs, lengths, options)
    gpu_plain = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy)
    assert_same_nbest(cpu_plain, gpu_plain)


@pytest.mark.gpu
def test_gpu_unlimited_beam_equals_brute_force():
    cupy = _cupy()
    log_probs = random_log_probs(0, 3, 5, 4)
    lengths = np.array([5, 4, 3])
    nbest = ctc_prefix_search(cupy.asarray(log_probs), lengths, CtcPrefixOptions(beam_size=400, nbest=400),
                              xp=cupy)
    for u, hyps in enumerate(nbest):
        oracle = ctc_sequence_log_probs(log_probs[u, : lengths[u]], BLANK)
        found = as_dict(hyps)
        assert found.keys() == oracle.keys()
        for labels, logp in oracle.items():
            assert found[labels].score == pytest.approx(logp, abs=TOL)


@pytest.mark.gpu
def test_gpu_greedy_equals_cpu():
    cupy = _cupy()
    log_probs = random_log_probs(4, 6, 300, 50, sharpness=2.0, blank_bias=1.0)
    lengths = np.array([300, 170, 1, 0, 299, 64])
    cpu = ctc_greedy_search(log_probs, lengths)
    gpu = ctc_greedy_search(cupy.asarray(log_probs), lengths, xp=cupy)
    assert_same_nbest(cpu, gpu)


@pytest.mark.gpu
def test_gpu_lstm_fusion_equals_cpu(gaps):
    cupy = _cupy()
    vocab_size = 12
    log_probs = random_log_probs(113, 4, 30, vocab_size, sharpness=2.5, blank_bias=1.5)  # no near-ties
    lengths = np.array([30, 21, 30, 9])
    reference = build_lstm_lm(113, vocab_size=vocab_size)
    options = CtcPrefixOptions(beam_size=8, sentence_end=1)
    cpu = ctc_prefix_search(log_probs, lengths, options, [("lstm", lstm_scorer(reference), 0.5)], stats=gaps.stats)
    assert min(gaps) > MIN_GAP
    gpu_scorer = RecurrentLmScorer(model=reference.serialized(), vocab_size=vocab_size, start_labels=[0],
                                   state_manager=StateManagerOptions(type="lstm-cuda"),
                                   session_options=SessionOptions(device="cuda", use_tf32=False))
    gpu = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, [("lstm", gpu_scorer, 0.5)], xp=cupy)
    assert_same_nbest(cpu, gpu)
    assert gpu_scorer.states.statistics().live_slots == 0


@pytest.mark.gpu
def test_gpu_search_has_no_per_frame_transfer_without_scorers():
    cupy = _cupy()
    counts = []
    stats = SearchStats(on_transfer=lambda arrays: counts.append(len(arrays)))
    log_probs = cupy.asarray(random_log_probs(81, 2, 50, 5))
    ctc_prefix_search(log_probs, np.array([50, 3]), CtcPrefixOptions(beam_size=4), xp=cupy, stats=stats)
    assert len(counts) == 2
