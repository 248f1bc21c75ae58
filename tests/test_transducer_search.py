"""Transducer beam search and greedy decoding against brute force (every alignment enumerated).

"Exact": the same label sequences and scores within 1e-4. Comparisons between two
runs of the search assert that every beam cutoff of the reference run had a gap above 1e-3
(recorded by wrapping the search's top-k), so a near-tie cannot flip a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from examples.custom_scorer import BigramScorer
from gpudecode.scorers.onnx_decoder import RecurrentLmScorer
from gpudecode.scorers.transducer import JointNetwork, StatefulPredictionNetwork, StatelessPredictionNetwork
from gpudecode.search import (
    TransducerOptions,
    transducer_greedy_search,
    transducer_search,
)
from gpudecode.search import transducer as transducer_module
from gpudecode.search.stats import SearchStats
from gpudecode.search.tuning import SearchTuning
from gpudecode.session import OnnxSession, SessionOptions
from gpudecode.states.options import StateManagerOptions
from gpudecode.testing import (
    build_joint_network,
    build_lstm_lm,
    build_prediction_network,
    build_stateless_prediction_network,
    build_transducer_encoder,
)
from gpudecode.testing._graph import log_softmax
from tests.test_ctc_search import TopKGaps, assert_same_nbest
from gpudecode.testing.transducer import (
    lstm_prediction_fn,
    stateless_prediction_fn,
    transducer_greedy,
    transducer_log_probs_fn,
    transducer_sequence_scores,
)

TOL = 1e-4
MIN_GAP = 1e-3
BLANK = 0
ENCODER_DIM = PREDICTION_DIM = 8


@dataclass
class Models:
    """Reference prediction + joint networks and the search's wrappers of them (CPU)."""

    prediction_ref: object
    joint_ref: object
    stateless: bool = False

    def prediction(self, device="cpu"):
        if self.stateless:
            return StatelessPredictionNetwork(model=self.prediction_ref.serialized(), blank=BLANK,
                                              session_options=SessionOptions(device=device, use_tf32=False))
        return StatefulPredictionNetwork(model=self.prediction_ref.serialized(), blank=BLANK,
                                         state_manager=StateManagerOptions(type=f"lstm-{device}"),
                                         session_options=SessionOptions(device=device, use_tf32=False))

    def joint(self, device="cpu"):
        return JointNetwork(model=self.joint_ref.serialized(),
                            session_options=SessionOptions(device=device, use_tf32=False))

    def oracle(self, encoder_states):
        """``frame_log_probs(t, labels)`` of one utterance [T, E]."""
        fn = stateless_prediction_fn(self.prediction_ref) if self.stateless else lstm_prediction_fn(self.prediction_ref, BLANK)
        return transducer_log_probs_fn(encoder_states, fn, self.joint_ref)


def make_models(seed, vocab_size, *, stateless=False, sharpness=1.5, blank_bias=0.0):
    if stateless:
        prediction_ref = build_stateless_prediction_network(seed, vocab_size=vocab_size, context_size=2,
                                                            output_dim=PREDICTION_DIM, blank=BLANK)
    else:
        prediction_ref = build_prediction_network(seed, vocab_size=vocab_size, output_dim=PREDICTION_DIM)
    joint_ref = build_joint_network(seed, encoder_dim=ENCODER_DIM, prediction_dim=PREDICTION_DIM,
                                    vocab_size=vocab_size, blank=BLANK, sharpness=sharpness, blank_bias=blank_bias)
    return Models(prediction_ref, joint_ref, stateless)


def random_encoder_states(seed, num_utts, num_frames, dim=ENCODER_DIM, scale=1.5):
    rng = np.random.default_rng(seed + 500)
    return np.tanh(scale * rng.normal(size=(num_utts, num_frames, dim))).astype(np.float32)


def bigram_table(seed, vocab_size, sharpness=1.0):
    """[V + 1, V] log p(label | previous label); row V = sentence-begin."""
    rng = np.random.default_rng(seed + 1000)
    return log_softmax(rng.normal(size=(vocab_size + 1, vocab_size)) * sharpness).astype(np.float32)


def bigram_score(table, labels, sentence_end=None):
    previous, total = table.shape[1], 0.0
    for label in labels:
        total += float(table[previous, label])
        previous = label
    if sentence_end is not None:
        total += float(table[previous, sentence_end])
    return total


def lstm_lm_score(reference, labels, bos=0, sentence_end=None):
    rows = reference.sequence_log_probs([bos, *labels])
    targets = [*labels, sentence_end] if sentence_end is not None else list(labels)
    return float(sum(rows[p, t] for p, t in enumerate(targets)))


def lstm_lm(reference, device="cpu"):
    return RecurrentLmScorer(model=reference.serialized(), vocab_size=reference.vocab_size, start_labels=[0],
                             state_manager=StateManagerOptions(type=f"lstm-{device}"),
                             session_options=SessionOptions(device=device, use_tf32=False))


def as_dict(hyps):
    return {tuple(h.labels): h for h in hyps}


def oracle_scores(models, encoder_states, lengths, u, max_symbols, recombination="sum"):
    return transducer_sequence_scores(int(lengths[u]), models.oracle(encoder_states[u]),
                                      max_symbols_per_frame=max_symbols, blank=BLANK, recombination=recombination)


@pytest.fixture
def gaps():
    """The top-k gaps of the reference searches (:class:`TopKGaps`; pass ``stats=gaps.stats``)."""
    return TopKGaps()


# --- reference models -------------------------------------------------------------------------------
def test_reference_models_match_their_oracles():
    rng = np.random.default_rng(0)
    encoder = build_transducer_encoder(0, num_features=6, model_dim=16, encoder_dim=8, subsampling=3, num_layers=2)
    features = rng.standard_normal((3, 10, 6)).astype(np.float32)
    sizes = np.array([10, 7, 1], np.int32)
    got = OnnxSession(encoder.serialized()).run({"features": features, "features-size": sizes})
    want = encoder.oracle({"features": features, "features-size": sizes})
    assert got["encoder-states"].shape == (3, 4, 8)
    np.testing.assert_array_equal(got["encoder-states-size"], [4, 3, 1])
    np.testing.assert_allclose(got["encoder-states"], want["encoder-states"], atol=1e-5)
    assert not got["encoder-states"][1, 3:].any()

    prediction = build_prediction_network(1, vocab_size=5, output_dim=7, num_layers=2)
    feeds = {"token": np.array([[0], [3]], np.int32)}
    feeds.update({name: rng.standard_normal((2, prediction.hidden_dim)).astype(np.float32) for name in prediction.states})
    got = OnnxSession(prediction.serialized()).run(feeds)
    for name, value in prediction.oracle(feeds).items():
        np.testing.assert_allclose(got[name], value, atol=1e-5)
    assert got["prediction"].shape == (2, 1, 7)

    stateless = build_stateless_prediction_network(2, vocab_size=5, context_size=3, output_dim=7)
    labels = np.array([[0, 0, 4], [1, 2, 3]], np.int32)
    got = OnnxSession(stateless.serialized()).run({"labels": labels})
    np.testing.assert_allclose(got["prediction"], stateless.oracle({"labels": labels})["prediction"], atol=1e-5)
    np.testing.assert_allclose(stateless.sequence_oracle([4], None)[0], got["prediction"][0], atol=1e-5)

    joint = build_joint_network(3, encoder_dim=8, prediction_dim=7, vocab_size=5)
    feeds = {"encoder-frame": rng.standard_normal((4, 8)).astype(np.float32),
             "prediction": rng.standard_normal((4, 7)).astype(np.float32)}
    got = OnnxSession(joint.serialized()).run(feeds)["log-probs"]
    np.testing.assert_allclose(got, joint.oracle(feeds)["log-probs"], atol=1e-5)
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, atol=1e-5)


# --- exactness against brute force -----------------------------------------------------------------
@pytest.mark.parametrize("max_symbols, vocab_size, num_frames, beam", [(1, 4, 4, 300), (2, 3, 4, 1100), (3, 3, 3, 1100)])
@pytest.mark.parametrize("recombination", ["sum", "max"])
def test_unlimited_beam_scores_every_sequence_exactly(max_symbols, vocab_size, num_frames, beam, recombination):
    models = make_models(1, vocab_size)
    encoder_states = random_encoder_states(1, 2, num_frames)
    lengths = np.array([num_frames, num_frames - 1])
    options = TransducerOptions(beam_size=beam, nbest=beam, max_symbols_per_frame=max_symbols,
                                recombination=recombination)
    prediction = models.prediction()
    nbest = transducer_search(encoder_states, lengths, prediction, models.joint(), options)
    assert prediction.states.statistics().live_slots == 0  # released after the run
    for u, hyps in enumerate(nbest):
        oracle = oracle_scores(models, encoder_states, lengths, u, max_symbols, recombination)
        found = as_dict(hyps)
        assert len(hyps) < beam  # nothing was cut at the end
        assert found.keys() == oracle.keys()
        for labels, (logp, frames) in oracle.items():
            assert found[labels].score == pytest.approx(logp, abs=TOL)
            assert found[labels].scores == {"transducer": pytest.approx(logp, abs=TOL)}
            assert found[labels].length == len(labels)
            if recombination == "max":  # the Viterbi alignment's frames
                assert found[labels].frames == list(frames)
        ranked = sorted(v for v, _ in oracle.values())[::-1]
        assert ranked[0] - ranked[1] > MIN_GAP
        assert tuple(hyps[0].labels) == max(oracle, key=lambda k: oracle[k][0])
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)


@pytest.mark.parametrize("max_symbols", [1, 2])
def test_a_moderate_beam_finds_the_exhaustive_optimum(max_symbols):
    vocab_size, num_frames = 4, 4 if max_symbols == 1 else 3
    models = make_models(7, vocab_size, sharpness=2.5)
    encoder_states = random_encoder_states(7, 3, num_frames)
    lengths = np.array([num_frames, num_frames, num_frames - 1])
    nbest = transducer_search(encoder_states, lengths, models.prediction(), models.joint(),
                              TransducerOptions(beam_size=4, max_symbols_per_frame=max_symbols))
    for u, hyps in enumerate(nbest):
        oracle = oracle_scores(models, encoder_states, lengths, u, max_symbols)
        ranked = sorted(v for v, _ in oracle.values())[::-1]
        assert ranked[0] - ranked[1] > MIN_GAP
        assert tuple(hyps[0].labels) == max(oracle, key=lambda k: oracle[k][0])
        for h in hyps:  # pruned alignments can only lower a sequence's score
            assert h.score <= oracle[tuple(h.labels)][0] + TOL


def greedy_min_gap(frame_log_probs, num_frames, max_symbols):
    """The smallest top-1 / top-2 gap along the greedy path."""
    labels, smallest = [], np.inf
    for t in range(num_frames):
        for _ in range(max_symbols):
            row = np.sort(frame_log_probs(t, tuple(labels)))
            smallest = min(smallest, row[-1] - row[-2])
            best = int(np.argmax(frame_log_probs(t, tuple(labels))))
            if best == BLANK:
                break
            labels.append(best)
    return smallest


@pytest.mark.parametrize("stateless", [False, True])
@pytest.mark.parametrize("max_symbols", [1, 2, 4])
def test_greedy_equals_the_oracles_greedy_and_beam_one(stateless, max_symbols):
    vocab_size, num_frames = 6, 14
    models = make_models(4, vocab_size, stateless=stateless, sharpness=2.5)
    encoder_states = random_encoder_states(4, 4, num_frames)
    lengths = np.array([14, 9, 1, 0])
    nbest = transducer_greedy_search(encoder_states, lengths, models.prediction(), models.joint(),
                                     max_symbols_per_frame=max_symbols)
    beam_one = transducer_search(encoder_states, lengths, models.prediction(), models.joint(),
                                 TransducerOptions(beam_size=1, max_symbols_per_frame=max_symbols))
    for u, ((hyp,), (beam_hyp,)) in enumerate(zip(nbest, beam_one)):
        oracle = models.oracle(encoder_states[u])
        assert greedy_min_gap(oracle, int(lengths[u]), max_symbols) > MIN_GAP
        labels, score, frames = transducer_greedy(int(lengths[u]), oracle, max_symbols_per_frame=max_symbols)
        assert hyp.labels == labels and hyp.frames == frames
        assert hyp.score == pytest.approx(score, abs=TOL)
        assert hyp.scores == {"transducer": pytest.approx(score, abs=TOL)}
        assert beam_hyp.labels == labels and beam_hyp.frames == frames
        assert beam_hyp.score == pytest.approx(score, abs=TOL)
    assert nbest[3][0].labels == [] and nbest[3][0].score == 0.0
    assert any(len(h[0].labels) >= 4 for h in nbest)


@pytest.mark.parametrize("max_symbols", [1, 2])
def test_stateless_prediction_network_equals_brute_force(max_symbols):
    vocab_size, num_frames = (4, 4) if max_symbols == 1 else (3, 4)
    models = make_models(3, vocab_size, stateless=True)
    encoder_states = random_encoder_states(3, 2, num_frames)
    lengths = np.array([num_frames, 2])
    beam = 1100
    nbest = transducer_search(encoder_states, lengths, models.prediction(), models.joint(),
                              TransducerOptions(beam_size=beam, nbest=beam, max_symbols_per_frame=max_symbols))
    for u, hyps in enumerate(nbest):
        oracle = oracle_scores(models, encoder_states, lengths, u, max_symbols)
        found = as_dict(hyps)
        assert found.keys() == oracle.keys()
        for labels, (logp, _) in oracle.items():
            assert found[labels].score == pytest.approx(logp, abs=TOL)


# --- LM fusion ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_symbols", [1, 2])
@pytest.mark.parametrize("sentence_end", [None, 2])
def test_bigram_fusion_equals_brute_force_with_scaled_scores_at_emissions(max_symbols, sentence_end):
    vocab_size, scale = (4, 0.6) if max_symbols == 1 else (3, 0.6)
    num_frames = 4
    models = make_models(11, vocab_size)
    encoder_states = random_encoder_states(11, 2, num_frames)
    lengths = np.array([4, 3])
    table = bigram_table(11, vocab_size)
    beam = 1100
    nbest = transducer_search(
        encoder_states, lengths, models.prediction(), models.joint(),
        TransducerOptions(beam_size=beam, nbest=beam, max_symbols_per_frame=max_symbols, sentence_end=sentence_end),
        [("lm", BigramScorer(log_probs=table), scale)])
    for u, hyps in enumerate(nbest):
        oracle = oracle_scores(models, encoder_states, lengths, u, max_symbols)
        found = as_dict(hyps)
        assert found.keys() == oracle.keys()
        totals = {}
        for labels, (transducer, _) in oracle.items():
            lm = bigram_score(table, labels, sentence_end)
            totals[labels] = transducer + scale * lm
            assert found[labels].scores["transducer"] == pytest.approx(transducer, abs=TOL)
            assert found[labels].scores["lm"] == pytest.approx(lm, abs=TOL)
            assert found[labels].score == pytest.approx(totals[labels], abs=TOL)
        ranked = sorted(totals.values(), reverse=True)
        assert ranked[0] - ranked[1] > MIN_GAP
        assert tuple(hyps[0].labels) == max(totals, key=totals.get)


@pytest.mark.parametrize("cache", [10_000, 0])
def test_lstm_lm_fusion_equals_brute_force(cache):
    vocab_size, scale, num_frames = 4, 0.5, 4
    models = make_models(5, vocab_size)
    encoder_states = random_encoder_states(5, 2, num_frames)
    lengths = np.array([4, 3])
    reference = build_lstm_lm(5, vocab_size=vocab_size)
    scorer = lstm_lm(reference)
    nbest = transducer_search(
        encoder_states, lengths, models.prediction(), models.joint(),
        TransducerOptions(beam_size=300, nbest=300, max_symbols_per_frame=1, sentence_end=3,
                          max_cached_score_vectors=cache),
        [("lstm", scorer, scale)])
    for u, hyps in enumerate(nbest):
        oracle = oracle_scores(models, encoder_states, lengths, u, 1)
        found = as_dict(hyps)
        assert found.keys() == oracle.keys()
        totals = {}
        for labels, (transducer, _) in oracle.items():
            lm = lstm_lm_score(reference, labels, sentence_end=3)
            totals[labels] = transducer + scale * lm
            assert found[labels].scores["lstm"] == pytest.approx(lm, abs=TOL)
            assert found[labels].score == pytest.approx(totals[labels], abs=TOL)
        ranked = sorted(totals.values(), reverse=True)
        assert ranked[0] - ranked[1] > MIN_GAP
        assert tuple(hyps[0].labels) == max(totals, key=totals.get)
    assert scorer.states.statistics().live_slots == 0


# --- batching, cache, collisions ------------------------------------------------------------------
@pytest.mark.parametrize("max_symbols", [1, 3])
def test_decoding_together_equals_decoding_each_alone(gaps, max_symbols):
    vocab_size = 6
    models = make_models(21, vocab_size, sharpness=2.5)
    encoder_states = random_encoder_states(21, 4, 12)
    lengths = np.array([12, 7, 10, 2])
    table = bigram_table(21, vocab_size)
    options = TransducerOptions(beam_size=4, max_symbols_per_frame=max_symbols, sentence_end=1)
    together = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options,
                                 [("lm", BigramScorer(log_probs=table), 0.4)], stats=gaps.stats)
    assert min(gaps) > MIN_GAP
    for u in range(4):
        alone = transducer_search(encoder_states[u:u + 1, : lengths[u]], lengths[u:u + 1], models.prediction(),
                                  models.joint(), options, [("lm", BigramScorer(log_probs=table), 0.4)])
        assert_same_nbest([together[u]], alone)
    assert all(len(h) == 4 for h in together)


def test_the_lm_score_cache_changes_nothing(gaps):
    vocab_size = 5
    models = make_models(41, vocab_size, sharpness=2.5)
    encoder_states = random_encoder_states(41, 2, 10)
    lengths = np.array([10, 8])
    reference = build_lstm_lm(41, vocab_size=vocab_size)
    runs = [transducer_search(encoder_states, lengths, models.prediction(), models.joint(),
                              TransducerOptions(beam_size=4, max_symbols_per_frame=2, max_cached_score_vectors=cache,
                                                sentence_end=4),
                              [("lstm", lstm_lm(reference), 0.5)], stats=gaps.stats)
            for cache in (10_000, 0)]
    assert min(gaps) > MIN_GAP
    assert_same_nbest(*runs)
    for hyps in runs[0]:
        for h in hyps:
            assert h.scores["lstm"] == pytest.approx(lstm_lm_score(reference, h.labels, sentence_end=4), abs=TOL)


@pytest.mark.parametrize("modulus", [1, 3])
@pytest.mark.parametrize("steps", [0, None])
def test_forced_hash_collisions_change_nothing(gaps, monkeypatch, modulus, steps):
    vocab_size = 4
    models = make_models(51, vocab_size, sharpness=2.0)
    encoder_states = random_encoder_states(51, 3, 8)
    lengths = np.array([8, 6, 5])
    expected = transducer_search(encoder_states, lengths, models.prediction(), models.joint(),
                                 TransducerOptions(beam_size=6, max_symbols_per_frame=2), stats=gaps.stats,
                                 tuning=SearchTuning(compiled_cpu_loops=False))  # the array version's top-k gaps
    assert min(gaps) > MIN_GAP
    runs = []
    original = transducer_module._TransducerSearch.run

    def counting_run(self, utterances, *, exact):
        runs.append(exact)
        return original(self, utterances, exact=exact)

    monkeypatch.setattr(transducer_module._TransducerSearch, "run", counting_run)
    got = transducer_search(encoder_states, lengths, models.prediction(), models.joint(),
                            TransducerOptions(beam_size=6, max_symbols_per_frame=2, hash_modulus=modulus,
                                              history_compare_steps=steps),
                            tuning=SearchTuning(compiled_cpu_loops=False))  # the array version's rerun
    assert_same_nbest(expected, got)
    assert runs == ([True] if steps is None else [False, True])


def test_score_threshold_keeps_only_candidates_near_the_best():
    models = make_models(71, 5, sharpness=1.0)
    encoder_states = random_encoder_states(71, 3, 8)
    lengths = np.array([8, 8, 6])
    wide = transducer_search(encoder_states, lengths, models.prediction(), models.joint(),
                             TransducerOptions(beam_size=8, max_symbols_per_frame=1))
    huge = transducer_search(encoder_states, lengths, models.prediction(), models.joint(),
                             TransducerOptions(beam_size=8, max_symbols_per_frame=1, score_threshold=1e6))
    assert_same_nbest(wide, huge)
    narrow = transducer_search(encoder_states, lengths, models.prediction(), models.joint(),
                               TransducerOptions(beam_size=8, max_symbols_per_frame=1, score_threshold=0.5))
    for hyps in narrow:
        assert all(h.score >= hyps[0].score - 0.5 - TOL for h in hyps)
    assert all(len(hyps) >= 1 for hyps in narrow) and any(len(hyps) < 8 for hyps in narrow)


def test_one_host_transfer_per_symbol_step():
    counts = []
    stats = SearchStats(on_transfer=lambda arrays: counts.append(len(arrays)))
    models = make_models(81, 5)
    encoder_states = random_encoder_states(81, 2, 9)
    transducer_search(encoder_states, np.array([9, 3]), models.prediction(), models.joint(),
                      TransducerOptions(beam_size=4, max_symbols_per_frame=1), stats=stats)
    assert len(counts) == 1 + 9 + 1  # the lengths, one per frame (one symbol step each), the n-best


def test_encoder_output_decodes_like_its_oracle():
    encoder = build_transducer_encoder(8, num_features=6, model_dim=16, encoder_dim=ENCODER_DIM, subsampling=2)
    models = make_models(8, 6, sharpness=2.5)
    rng = np.random.default_rng(8)
    features = rng.standard_normal((3, 20, 6)).astype(np.float32)
    sizes = np.array([20, 13, 8], np.int32)
    out = OnnxSession(encoder.serialized()).run({"features": features, "features-size": sizes})
    oracle = encoder.oracle({"features": features, "features-size": sizes})
    options = TransducerOptions(beam_size=4, max_symbols_per_frame=2)
    got = transducer_search(out["encoder-states"], out["encoder-states-size"], models.prediction(), models.joint(),
                            options)
    want = transducer_search(oracle["encoder-states"], oracle["encoder-states-size"], models.prediction(),
                             models.joint(), options)
    assert_same_nbest(want, got)
    assert any(h[0].labels for h in got)


def test_empty_utterances_and_beam_larger_than_the_candidates():
    models = make_models(91, 3)
    encoder_states = random_encoder_states(91, 2, 1)
    nbest = transducer_search(encoder_states, np.array([0, 1]), models.prediction(), models.joint(),
                              TransducerOptions(beam_size=5, max_symbols_per_frame=1))
    assert [h.labels for h in nbest[0]] == [[]] and nbest[0][0].score == 0.0
    assert sorted(tuple(h.labels) for h in nbest[1]) == [(), (1,), (2,)]
    assert transducer_search(np.zeros((0, 3, ENCODER_DIM), np.float32), np.zeros(0, np.int64), models.prediction(),
                             models.joint(), TransducerOptions(beam_size=2)) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(beam_size=0), "beam_size"),
    (dict(beam_size=2, max_symbols_per_frame=0), "max_symbols_per_frame"),
    (dict(beam_size=2, recombination="mean"), "recombination"),
    (dict(beam_size=2, score_threshold=0), "score_threshold"),
    (dict(beam_size=2, nbest=3), "nbest"),
    (dict(beam_size=2, hash_modulus=0), "hash_modulus"),
    (dict(beam_size=2, history_compare_steps=-1), "history_compare_steps"),
])
def test_bad_options_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransducerOptions(**kwargs)


def test_bad_inputs_are_errors():
    models = make_models(1, 3)
    encoder_states = random_encoder_states(1, 2, 4)
    run = lambda lengths, options, scorers=(): transducer_search(
        encoder_states, lengths, models.prediction(), models.joint(), options, scorers)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 5"):
        run(np.array([4, 5]), TransducerOptions(beam_size=2))
    with pytest.raises(ValueError, match="expected shape"):
        run(np.array([4]), TransducerOptions(beam_size=2))
    with pytest.raises(ValueError, match="blank 3"):
        run(np.array([4, 4]), TransducerOptions(beam_size=2, blank=3))
    with pytest.raises(ValueError, match="'transducer' is taken"):
        run(np.array([4, 4]), TransducerOptions(beam_size=2),
            [("transducer", BigramScorer(log_probs=bigram_table(0, 3)), 1.0)])
    with pytest.raises(ValueError, match="vocab_size 4"):
        run(np.array([4, 4]), TransducerOptions(beam_size=2), [("lm", BigramScorer(log_probs=bigram_table(0, 4)), 1.0)])
    with pytest.raises(ValueError, match="no output 'missing'"):
        StatefulPredictionNetwork(model=models.prediction_ref.serialized(), io_map={"scores": "missing"})


# --- GPU: the same n-best as the numpy path --------------------------------------------------------
def _cupy():
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("options", [
    dict(beam_size=1, max_symbols_per_frame=1), dict(beam_size=8, max_symbols_per_frame=1),
    dict(beam_size=8, max_symbols_per_frame=3), dict(beam_size=16, max_symbols_per_frame=2, sentence_end=2),
    dict(beam_size=8, max_symbols_per_frame=2, recombination="max"),
    dict(beam_size=8, max_symbols_per_frame=2, score_threshold=3.0),
    dict(beam_size=8, max_symbols_per_frame=2, hash_modulus=2, history_compare_steps=0),
])
def test_gpu_search_equals_cpu(gaps, options):
    cupy = _cupy()
    vocab_size = 6
    models = make_models(109, vocab_size, sharpness=4.0, blank_bias=1.0)  # seed: no near-ties
    encoder_states = random_encoder_states(109, 3, 10)
    lengths = np.array([10, 7, 4])
    table = bigram_table(109, vocab_size)
    options = TransducerOptions(**options)
    cpu = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options,
                            [("lm", BigramScorer(log_probs=table), 0.5)], stats=gaps.stats)
    cpu_plain = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options,
                                  stats=gaps.stats)
    assert min(gaps) > MIN_GAP
    prediction = models.prediction("cuda")
    gpu = transducer_search(cupy.asarray(encoder_states), cupy.asarray(lengths), prediction, models.joint("cuda"),
                            options, [("lm", BigramScorer(log_probs=table), 0.5)], xp=cupy)
    assert_same_nbest(cpu, gpu)
    assert prediction.states.device == "cuda" and prediction.states.statistics().live_slots == 0
    gpu_plain = transducer_search(cupy.asarray(encoder_states), lengths, models.prediction("cuda"),
                                  models.joint("cuda"), options, xp=cupy)
    assert_same_nbest(cpu_plain, gpu_plain)


@pytest.mark.gpu
@pytest.mark.parametrize("stateless", [False, True])
def test_gpu_greedy_equals_cpu(stateless):
    cupy = _cupy()
    models = make_models(4, 20, stateless=stateless, sharpness=2.5)
    encoder_states = random_encoder_states(4, 6, 60)
    lengths = np.array([60, 17, 1, 0, 59, 33])
    for max_symbols in (1, 3):
        for u in range(6):
            assert greedy_min_gap(models.oracle(encoder_states[u]), int(lengths[u]), max_symbols) > MIN_GAP
        cpu = transducer_greedy_search(encoder_states, lengths, models.prediction(), models.joint(),
                                       max_symbols_per_frame=max_symbols)
        gpu = transducer_greedy_search(cupy.asarray(encoder_states), lengths, models.prediction("cuda"),
                                       models.joint("cuda"), max_symbols_per_frame=max_symbols, xp=cupy)
        assert_same_nbest(cpu, gpu)


@pytest.mark.gpu
def test_gpu_unlimited_beam_equals_brute_force():
    cupy = _cupy()
    models = make_models(1, 3)
    encoder_states = random_encoder_states(1, 2, 4)
    lengths = np.array([4, 3])
    nbest = transducer_search(cupy.asarray(encoder_states), lengths, models.prediction("cuda"), models.joint("cuda"),
                              TransducerOptions(beam_size=1100, nbest=1100, max_symbols_per_frame=2), xp=cupy)
    for u, hyps in enumerate(nbest):
        oracle = oracle_scores(models, encoder_states, lengths, u, 2)
        found = as_dict(hyps)
        assert found.keys() == oracle.keys()
        for labels, (logp, _) in oracle.items():
            assert found[labels].score == pytest.approx(logp, abs=TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("stateless", [False, True])
def test_gpu_lstm_lm_fusion_equals_cpu(gaps, stateless):
    cupy = _cupy()
    vocab_size = 8
    models = make_models(100, vocab_size, stateless=stateless, sharpness=4.0, blank_bias=1.0)  # no near-ties
    encoder_states = random_encoder_states(100, 3, 12)
    lengths = np.array([12, 9, 5])
    reference = build_lstm_lm(100, vocab_size=vocab_size)
    options = TransducerOptions(beam_size=8, max_symbols_per_frame=2, sentence_end=1)
    cpu = transducer_search(encoder_states, lengths, models.prediction(), models.joint(), options,
                            [("lstm", lstm_lm(reference), 0.5)], stats=gaps.stats)
    assert min(gaps) > MIN_GAP
    lm = lstm_lm(reference, "cuda")
    gpu = transducer_search(cupy.asarray(encoder_states), lengths, models.prediction("cuda"), models.joint("cuda"),
                            options, [("lstm", lm, 0.5)], xp=cupy)
    assert_same_nbest(cpu, gpu)
    assert lm.states.statistics().live_slots == 0
