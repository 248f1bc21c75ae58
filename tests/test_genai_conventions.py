"""ONNX Runtime GenAI's conventions, recognised at load, and models fed wrongly refused at load.

The models: ``gpudecode.testing.build_genai_lm`` (GroupQueryAttention fed from ``attention_mask``
or from explicit ``seqlens_k`` / ``total_sequence_length`` inputs, the head size symbolic as GenAI's
builder declares it; a numpy oracle of the whole sequence) and the committed GenAI builder export
``tests/fixtures/peers/genai/`` (its parity with GenAI itself is ``test_peer_genai.py``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session import ModelError, OnnxSession, discover_step_model, from_onnx_model
from gpudecode.session.conventions import load_step_model_spec, probe_alignment
from gpudecode.session.genai import read_genai_config
from gpudecode.testing import build_genai_lm

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "peers" / "genai"
V, EOS = 16, 3
TOL = 1e-4


def saved(tmp_path, name="lm.onnx", **options) -> tuple[Path, object]:
    model = build_genai_lm(5, vocab_size=V, **options)
    return model.save(tmp_path / name), model


# --- recognised at load ------------------------------------------------------------------------
def test_the_issue_failure_without_hints_names_the_symbolic_head_size():
    """The builder export's state inputs carry a symbolic head size: plain discovery refuses them
    and says how to resolve it (the time axis is the one that grows from past to present)."""
    import onnx

    tensors = from_onnx_model(onnx.load(str(FIXTURE / "model.onnx")), "model.onnx")
    with pytest.raises(ModelError, match=r"the time axis is 2 .*'kv_cache_dim' \(axis 3\) is symbolic: resolve it "
                                         r"with a genai_config.json"):
        discover_step_model(tensors)
    spec = discover_step_model(tensors, state_dims={"kv_cache_dim": 16})
    assert spec.resolved_dims == {"kv_cache_dim": 16}
    assert all(v.shape == (None, 2, None, 16) and v.time_axis == 2 for v in spec.state_variables)


def test_genai_config_is_read():
    config = read_genai_config(FIXTURE / "genai_config.json")
    assert config.model_file == FIXTURE / "model.onnx"
    assert (config.head_size, config.num_key_value_heads, config.num_layers) == (16, 2, 2)
    assert (config.bos_token_id, config.eos_token_ids, config.pad_token_id) == (1, (79,), 0)
    assert config.io_map["attention_mask"] == "attention_mask" and config.io_map["logits"] == "logits"


def test_genai_export_loads_left_aligned_and_inspect_says_so():
    scorer = OnnxDecoderScorer(model=str(FIXTURE), vocab_size=128, start_labels=[1], scores_kind="logits")
    assert scorer.spec.history_alignment == "left" and scorer.spec.resolved_dims == {"kv_cache_dim": 16}
    assert scorer.states.options.history_alignment == "left"
    # the probe tells the conventions apart: right-aligned feeding is far off, left-aligned exact
    right = probe_alignment(scorer.session, replace(scorer.spec, history_alignment="right"))
    left = probe_alignment(scorer.session, scorer.spec)
    assert not right.passed and right.difference > 0.1
    assert left.passed and left.difference <= 1e-5
    out = CliRunner().invoke(main, ["inspect", str(FIXTURE)])  # the model folder
    assert out.exit_code == 0, out.output
    assert "convention: huggingface" in out.output
    assert "symbolic state dims resolved: kv_cache_dim=16 (genai_config.json)" in out.output
    assert "history alignment: left, expected (GroupQueryAttention" in out.output
    assert "sentence-end 79" in out.output


@pytest.mark.parametrize("lengths", ["mask", "inputs"])
def test_gqa_model_without_genai_config_resolves_dims_from_the_graph(tmp_path, lengths):
    path, _ = saved(tmp_path, lengths=lengths)
    spec = load_step_model_spec(OnnxSession(str(path)), vocab_size=V)
    assert spec.resolved_dims == {"kv_cache_dim": 8}
    assert spec.history_alignment == "left"
    if lengths == "inputs":  # the explicit lengths are logical inputs, provided by the toolkit
        assert {"seqlens_k", "total_sequence_length"} <= set(spec.hypothesis_inputs)


# --- decoding them exactly -----------------------------------------------------------------------
def prompt_batch(prompts, max_new):
    table = np.zeros((len(prompts), max(map(len, prompts))), np.int64)
    for u, p in enumerate(prompts):
        table[u, :len(p)] = p
    return UtteranceBatch(ids=[f"u{u}" for u in range(len(prompts))], input_lengths=np.full(len(prompts), max_new),
                          inputs={"prompt": table}, sizes={"prompt": np.array([len(p) for p in prompts])})


@pytest.mark.parametrize("lengths, continuous", [("mask", None), ("inputs", None), ("mask", 2)])
def test_self_prefilled_gqa_nbest_equals_the_whole_sequence_oracle(tmp_path, lengths, continuous):
    """Prompts of different lengths in one batch (and with continuous batching): the step model is
    its own prefill; every n-best score equals the numpy oracle of the whole sequence, and beam 1
    equals the oracle's greedy continuation."""
    path, model = saved(tmp_path, lengths=lengths)
    prompts = [[1, 7, 9, 4, 12], [1], [1, 5, 5], [1, 2, 14, 6, 8, 10, 11]]
    scorer = PrefixLmScorer(model=str(path), vocab_size=V, scores_kind="logits")
    assert scorer.self_prefill and scorer.takes_prompts
    options = LabelSyncOptions(beam_size=3, sentence_end=EOS, max_labels_per_input=1.0)
    nbest = label_sync_search([("lm", scorer, 1.0)], prompt_batch(prompts, 6), options, xp=np,
                              max_active_utterances=continuous)
    checked = 0
    for prompt, hyps in zip(prompts, nbest):
        assert hyps
        for hyp in hyps:
            ended = hyp.length == len(hyp.labels) + 1
            sequence = [*prompt, *hyp.labels, *([EOS] if ended else [])]
            rows = model.sequence_log_probs(sequence)
            expected = sum(rows[p - 1, sequence[p]] for p in range(len(prompt), len(sequence)))
            assert hyp.score == pytest.approx(expected, abs=TOL)
            checked += 1
    assert checked >= 3 * len(prompts) - 2
    greedy = label_sync_search([("lm", scorer, 1.0)], prompt_batch(prompts, 6),
                               replace(options, beam_size=1), xp=np, max_active_utterances=continuous)
    for prompt, hyps in zip(prompts, greedy):
        sequence = list(prompt)
        while len(sequence) < len(prompt) + 6:
            label = int(np.argmax(model.sequence_log_probs(sequence)[-1]))
            if label == EOS:
                break
            sequence.append(label)
        assert [*prompt, *hyps[0].labels] == sequence


# --- refused at load -------------------------------------------------------------------------------
def test_gqa_model_declared_right_aligned_is_refused(tmp_path):
    """GroupQueryAttention ignores where the mask's zeros are: fed right-aligned (padding first, the
    toolkit's default for the Hugging Face convention, here forced by metadata) it reads the padding
    as history. The load-time probe sees it and refuses the model, saying why."""
    path, _ = saved(tmp_path, history_alignment="right")
    with pytest.raises(ModelError, match=r"refused: the toolkit cannot prove it feeds this model's attention "
                                         r"correctly.*right-aligned histories \(padding first\): max difference "
                                         r"[0-9.e+-]+ \(tolerance 0.0001\)") as error:
        OnnxDecoderScorer(model=str(path), vocab_size=V, start_labels=[1], scores_kind="logits")
    assert "left-aligned" not in str(error.value)  # the metadata fixes the convention: nothing else tried


def test_attention_that_ignores_the_mask_is_refused_under_every_convention(tmp_path):
    path, _ = saved(tmp_path, attention="unmasked")
    with pytest.raises(ModelError, match=r"refused: .*right-aligned histories \(padding first\): max difference "
                                         r"[0-9.e+-]+ .*; left-aligned histories .*: max difference [0-9.e+-]+ .*"
                                         r"must ignore masked"):
        PrefixLmScorer(model=str(path), vocab_size=V, scores_kind="logits")


def test_a_history_beyond_the_genai_context_is_an_error():
    """genai_config.json's context_length (64) bounds the histories: a search that would feed more
    past positions stops with an error instead of truncating them."""
    scorer = PrefixLmScorer(model=str(FIXTURE), vocab_size=128, scores_kind="logits")
    assert scorer.spec.max_time == 63
    prompt = [1, 17, 33, 5, 90, 61, 7]  # its greedy continuation does not end within the context
    options = LabelSyncOptions(beam_size=1, sentence_end=79, max_labels_per_input=1.0, max_labels=100)
    with pytest.raises(ValueError, match=r"a history of 64 labels \(prompt included\) exceeds the model's "
                                         r"context of 64 positions"):
        label_sync_search([("lm", scorer, 1.0)], prompt_batch([prompt], 80), options, xp=np)
    nbest = label_sync_search([("lm", scorer, 1.0)], prompt_batch([prompt], 64 - len(prompt)), options, xp=np)
    assert len(prompt) + len(nbest[0][0].labels) == 64  # up to the whole context, as GenAI's max_length
