"""``prefix-lm``: a prefill model + step model against the no-cache oracles of the whole prompted
sequence (exactness). Expected values come from the reference models' numpy oracles."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from gpudecode.scorers import UtteranceBatch, create_scorer
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session import OnnxSession, SessionOptions
from gpudecode.states.options import StateManagerOptions
from gpudecode.testing import build_optimum_pair, build_prefix_lm

BOS, EOS, V = 0, 1, 12
TOL = 1e-4


def xp_of(device):
    if device == "cuda":
        import cupy

        return cupy
    return np


def utterances(seed: int, sizes, *, encoder_dim=32, xp=np, prompts=None):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    states = rng.normal(size=(len(sizes), int(sizes.max()), encoder_dim)).astype(np.float32)
    states[np.arange(states.shape[1])[None, :] >= sizes[:, None]] = 7.0  # padding: garbage
    inputs, extra_sizes = {"encoder-states": xp.asarray(states)}, {}
    if prompts is not None:
        width = max(len(p) for p in prompts)
        table = np.full((len(prompts), width), 5, np.int32)
        for u, p in enumerate(prompts):
            table[u, :len(p)] = p
        inputs["prompt"] = table
        extra_sizes["prompt"] = np.array([len(p) for p in prompts], np.int64)
    batch = UtteranceBatch(ids=[f"utt{u}" for u in range(len(sizes))], input_lengths=sizes,
                           inputs=inputs, sizes=extra_sizes)
    return batch, states


def prefix_scorer(pair, device="cpu", prefill_device=None, **options):
    sm = "transformer-cuda" if device == "cuda" else "transformer-cpu"
    options.setdefault("state_manager", StateManagerOptions(type=sm))
    prefill = pair.prefill.serialized()
    if prefill_device is not None:
        prefill = OnnxSession(prefill, SessionOptions(device=prefill_device))
    return PrefixLmScorer(model=pair.step.serialized(), prefill_model=prefill, vocab_size=V,
                          session_options=SessionOptions(device=device), **options)


def search(scorers, batch, xp=np, **options):
    options = {"beam_size": 4, "sentence_end": EOS, "max_labels_per_input": 1.5, **options}
    continuous = options.pop("max_active_utterances", None)
    return label_sync_search(scorers, batch, LabelSyncOptions(**options), xp=xp,
                             max_active_utterances=continuous)


def terminated(hyp):
    return hyp.length == len(hyp.labels) + 1


def oracle_score(pair, hyp, **prompt):
    rows = pair.sequence_log_probs(hyp.labels, **prompt)
    targets = [*hyp.labels, EOS] if terminated(hyp) else hyp.labels
    return float(sum(rows[p, t] for p, t in enumerate(targets)))


def check_against_oracle(pair, nbest, states, sizes, *, prompt=(), suffix=(), prompts=None, name="lm"):
    checked = 0
    for u, hyps in enumerate(nbest):
        assert hyps, f"utterance {u}: no hypothesis"
        for hyp in hyps:
            expected = oracle_score(pair, hyp, prompt=prompt if prompts is None else prompts[u],
                                    encoder_states=states[u, :sizes[u]], suffix=suffix)
            assert hyp.score == pytest.approx(expected, abs=TOL)
            assert hyp.scores[name] == pytest.approx(expected, abs=TOL)
            checked += 1
    return checked


# --- the reference models ---------------------------------------------------------------------
@pytest.mark.parametrize("num_prompt, num_suffix", [(2, 1), (0, 0), (3, 0), (0, 2)])
def test_prefill_model_equals_its_oracle_with_ragged_prompts(num_prompt, num_suffix):
    pair = build_prefix_lm(3)
    rng = np.random.default_rng(num_prompt * 10 + num_suffix)
    feeds = {
        "prompt": rng.integers(0, V, (3, num_prompt)).astype(np.int32),
        "prompt-size": np.array([num_prompt, max(num_prompt - 1, 0), 0], np.int32),
        "encoder-states": rng.normal(size=(3, 6, 32)).astype(np.float32),
        "encoder-states-size": np.array([6, 3, 1], np.int32),
        "suffix": rng.integers(0, V, (3, num_suffix)).astype(np.int32),
        "suffix-size": np.array([num_suffix, num_suffix, 0], np.int32),
    }
    session = ort.InferenceSession(pair.prefill.serialized())
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    expected = pair.prefill.oracle(feeds)
    counts = expected["prefix-length"]
    np.testing.assert_array_equal(got["prefix-length"], counts)
    np.testing.assert_allclose(got["scores"], expected["scores"], atol=TOL)
    for name in pair.step.states.values():
        for n in range(3):
            np.testing.assert_allclose(got[name][n, :, :counts[n]], expected[name][n, :, :counts[n]], atol=TOL)
    for n in range(3):  # the prefill's scores are the first row of the whole-sequence oracle
        rows = pair.sequence_log_probs([], prompt=feeds["prompt"][n, :feeds["prompt-size"][n]],
                                       encoder_states=feeds["encoder-states"][n, :feeds["encoder-states-size"][n]],
                                       suffix=feeds["suffix"][n, :feeds["suffix-size"][n]])
        np.testing.assert_allclose(rows[0], got["scores"][n, 0], atol=TOL)


def test_optimum_pair_models_equal_their_oracles():
    pair = build_optimum_pair(4)
    rng = np.random.default_rng(1)
    feeds = {"input_ids": np.array([[0, 3], [0, 5]], np.int64),
             "encoder_hidden_states": rng.normal(size=(2, 6, 32)).astype(np.float32),
             "encoder_attention_mask": np.array([[1] * 6, [1] * 4 + [0] * 2], np.int64)}
    first = ort.InferenceSession(pair.prefill.serialized())
    got = dict(zip([o.name for o in first.get_outputs()], first.run(None, feeds)))
    for name, value in pair.prefill.oracle(feeds).items():
        np.testing.assert_allclose(got[name], value, atol=TOL)
    step_feeds = {"input_ids": np.array([[4], [7]], np.int64),
                  "attention_mask": np.array([[0, 1, 1, 1], [0, 1, 1, 1]], np.int64),
                  "encoder_attention_mask": feeds["encoder_attention_mask"]}
    for past, present in pair.step.states.items():  # one left-padded (garbage) position
        value = got[present]
        step_feeds[past] = np.concatenate([np.full_like(value[:, :, :1], 3.0), value], 2)
    for i in range(2):
        for kind in ("key", "value"):
            step_feeds[f"past_key_values.{i}.encoder.{kind}"] = got[f"present.{i}.encoder.{kind}"]
    step = ort.InferenceSession(pair.step.serialized())
    out = dict(zip([o.name for o in step.get_outputs()], step.run(None, step_feeds)))
    for name, value in pair.step.oracle(step_feeds).items():
        np.testing.assert_allclose(out[name], value, atol=TOL)
    rows = pair.sequence_log_probs([7], prompt=[0, 5], encoder_states=feeds["encoder_hidden_states"][1, :4])
    logits = out["logits"][1, 0]
    np.testing.assert_allclose(logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max(), rows[1],
                               atol=TOL)


# --- the scorer in a search ---------------------------------------------------------------------
@pytest.mark.parametrize("prompt, suffix, beam", [([2, 3], [BOS], 4), ([], [], 3), ([BOS], [], 1), ([], [4, BOS], 2)])
def test_prefix_lm_nbest_equals_the_whole_sequence_oracle(prompt, suffix, beam):
    pair = build_prefix_lm(3)
    sizes = [5, 2, 4]
    batch, states = utterances(0, sizes)
    scorer = prefix_scorer(pair, initial_prompt_labels=prompt, suffix_prompt_labels=suffix)
    nbest = search([("lm", scorer, 1.0)], batch, beam_size=beam)
    assert check_against_oracle(pair, nbest, states, sizes, prompt=prompt, suffix=suffix) == 3 * beam
    stats = scorer.states.statistics()
    assert stats.live_slots == 0
    # the prompt counts into the history: the peak holds every lane's prompt positions
    assert stats.peak_live_slots >= sum(len(prompt) + s + len(suffix) for s in sizes)


def test_per_utterance_prompts_of_different_lengths():
    pair = build_prefix_lm(5)
    sizes = [3, 4, 2]
    prompts = [[2], [3, 4, 5], []]
    batch, states = utterances(2, sizes, prompts=prompts)
    scorer = prefix_scorer(pair, suffix_prompt_labels=[BOS])
    nbest = search([("lm", scorer, 1.0)], batch, beam_size=3)
    assert check_against_oracle(pair, nbest, states, sizes, prompts=prompts, suffix=[BOS]) == 9


def test_prefill_in_its_own_host_session_gives_the_same_result():
    pair = build_prefix_lm(7)
    sizes = [6, 3]
    batch, states = utterances(3, sizes)
    a = search([("lm", prefix_scorer(pair, initial_prompt_labels=[2]), 1.0)], batch)
    b = search([("lm", prefix_scorer(pair, prefill_device="cpu", initial_prompt_labels=[2]), 1.0)], batch)
    for x, y in zip(a, b):
        assert [h.labels for h in x] == [h.labels for h in y]
        np.testing.assert_allclose([h.score for h in x], [h.score for h in y], atol=TOL)
    check_against_oracle(pair, b, states, sizes, prompt=[2])


@pytest.mark.parametrize("continuous", [None, 2])
def test_optimum_pair_nbest_equals_its_oracle(continuous):
    pair = build_optimum_pair(4)
    sizes = [5, 3, 4]
    batch, states = utterances(1, sizes)
    scorer = PrefixLmScorer(model=pair.step.serialized(), prefill_model=pair.prefill.serialized(),
                            vocab_size=V, initial_prompt_labels=[BOS], scores_kind="logits",
                            state_manager=StateManagerOptions(type="transformer-cpu"))
    nbest = search([("decoder", scorer, 1.0)], batch, beam_size=3, max_active_utterances=continuous)
    assert check_against_oracle(pair, nbest, states, sizes, prompt=[BOS], name="decoder") == 9
    assert scorer.states.statistics().live_slots == 0


def test_prefix_lm_is_registered_and_checks_its_prefill():
    pair = build_prefix_lm(1)
    scorer = create_scorer("prefix-lm", model=pair.step.serialized(), prefill_model=pair.prefill.serialized(),
                           vocab_size=V, initial_prompt_labels=[2])
    assert isinstance(scorer, PrefixLmScorer)
    with pytest.raises(ValueError, match="lacks the step model's state outputs"):
        PrefixLmScorer(model=pair.step.serialized(), prefill_model=build_optimum_pair(1).prefill.serialized(),
                       vocab_size=V, initial_prompt_labels=[BOS])
    with pytest.raises(ValueError, match="no 'suffix' input"):
        optimum = build_optimum_pair(1)
        PrefixLmScorer(model=optimum.step.serialized(), prefill_model=optimum.prefill.serialized(),
                       vocab_size=V, initial_prompt_labels=[BOS], suffix_prompt_labels=[3])
    with pytest.raises(ValueError, match="needs the utterances' 'encoder-states'"):
        search([("lm", prefix_scorer(pair), 1.0)], UtteranceBatch(ids=["a"], input_lengths=[3]))


# --- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("prefill_device", ["cuda", "cpu"])
def test_cuda_prefix_lm_equals_the_oracle_and_the_cpu_run(prefill_device):
    import cupy

    pair = build_prefix_lm(3)
    sizes = [5, 2, 4, 6]
    cpu_batch, states = utterances(0, sizes)
    gpu_batch, _ = utterances(0, sizes, xp=cupy)
    expected = search([("lm", prefix_scorer(pair, initial_prompt_labels=[2], suffix_prompt_labels=[BOS]), 1.0)],
                      cpu_batch)
    scorer = prefix_scorer(pair, device="cuda", prefill_device=prefill_device, initial_prompt_labels=[2],
                           suffix_prompt_labels=[BOS],
                           state_manager=StateManagerOptions(type="transformer-cuda", slots_per_chunk=64))
    for continuous in (None, 2):
        got = search([("lm", scorer, 1.0)], gpu_batch, xp=cupy, max_active_utterances=continuous)
        for a, b in zip(expected, got):
            assert [h.labels for h in a] == [h.labels for h in b]
            np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=TOL)
        check_against_oracle(pair, got, states, sizes, prompt=[2], suffix=[BOS])
    assert scorer.states.statistics().live_slots == 0


@pytest.mark.gpu
def test_cuda_optimum_pair_equals_its_oracle():
    import cupy

    pair = build_optimum_pair(4)
    sizes = [5, 3, 4]
    batch, states = utterances(1, sizes, xp=cupy)
    scorer = PrefixLmScorer(model=pair.step.serialized(), prefill_model=pair.prefill.serialized(),
                            vocab_size=V, initial_prompt_labels=[BOS], scores_kind="logits",
                            state_manager=StateManagerOptions(type="transformer-cuda"),
                            session_options=SessionOptions(device="cuda"))
    for continuous in (None, 2):
        nbest = search([("decoder", scorer, 1.0)], batch, xp=cupy, beam_size=3, max_active_utterances=continuous)
        assert check_against_oracle(pair, nbest, cupy.asnumpy(batch.inputs["encoder-states"]), sizes,
                                    prompt=[BOS], name="decoder") == 9
    assert scorer.states.statistics().live_slots == 0
