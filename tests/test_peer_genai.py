"""Parity with ONNX Runtime GenAI on its own model builder's export (a Llama with GroupQueryAttention).

The fixture ``tests/fixtures/peers/genai/`` (made by ``tools/peer-fixtures/genai.py``: a random-
initialised Llama exported by ``python -m onnxruntime_genai.models.builder``, and GenAI's own
``Generator`` outputs for its ``PROMPTS``) is the oracle in CI; under ``-m peers`` the same cases
run against ``onnxruntime_genai`` live (and the fixture must still equal it). The toolkit loads the
export as it is (``genai_config.json``, the symbolic head size, left-aligned histories chosen and
proven at load), runs the step model as its own prefill and decodes all prompts in one batch
(different prompt lengths), statically and with continuous batching: tokens must be equal and the
greedy scores within 1e-4 of the sum of GenAI's token log-probabilities (its step logits). Beam
search (4 beams, GenAI's defaults early_stopping and length_penalty 1: ``finished="separate-genai"``,
``length_counts="prompt-and-labels"``), with max_length the whole context (64) and 20 (where lists
fill up at the limit, and GenAI's rules there differ from Hugging Face's), must return GenAI's 4
sequences in GenAI's order, each scored as a teacher-forced run of the whole sequence through the
model says (1e-4).

GenAI's oracle is one generator per prompt: its own batch of these prompts, left-padded, gives
different tokens on the padded rows (recorded in the fixture as ``genai_batch_left_padded``), while
its single-prompt runs equal transformers' greedy decodes of the same weights (``transformers_greedy``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "peers" / "genai"
DOCUMENT = json.loads((FIXTURE / "expected.json").read_text())
PROMPTS: list[list[int]] = DOCUMENT["prompts"]
EOS, MAX_LENGTH = DOCUMENT["eos"], DOCUMENT["max_length"]
TOL = 1e-4
SOURCES = ["fixture", pytest.param("live", marks=pytest.mark.peers)]


def fixture_script():
    """``tools/peer-fixtures/genai.py``: its ``generate`` runs GenAI as the fixture was made."""
    spec = importlib.util.spec_from_file_location("genai_fixture", ROOT / "tools" / "peer-fixtures" / "genai.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def live_greedy() -> dict:
    """GenAI's greedy decodes of ``PROMPTS``, run now by the fixture script's own code."""
    script = fixture_script()
    runs = [script.generate(FIXTURE, [p], 1, with_scores=True) for p in PROMPTS]
    return {"sequences": [r[0][0] for r in runs], "token_log_probs": [r[1][0] for r in runs]}


def expected_greedy(source: str) -> dict:
    if source == "fixture":
        return DOCUMENT["greedy"]
    live = live_greedy()
    assert live["sequences"] == DOCUMENT["greedy"]["sequences"], "the fixture no longer equals GenAI's output"
    return live


def expected_beams(source: str, case: str) -> list[list[list[int]]]:
    beam = DOCUMENT[case]
    if source == "fixture":
        return beam["sequences"]
    script = fixture_script()
    live = [script.generate(FIXTURE, [p], beam["num_beams"], with_scores=False, max_length=beam["max_length"])[0]
            for p in PROMPTS]
    assert live == beam["sequences"], "the fixture no longer equals GenAI's output"
    return live


def prompt_batch(max_length: int = MAX_LENGTH) -> UtteranceBatch:
    """``PROMPTS`` in one batch; each may grow to GenAI's max_length (prompt + generated labels)."""
    sizes = np.array([len(p) for p in PROMPTS])
    table = np.zeros((len(PROMPTS), sizes.max()), np.int64)
    for u, prompt in enumerate(PROMPTS):
        table[u, :len(prompt)] = prompt
    return UtteranceBatch(ids=[f"p{u}" for u in range(len(PROMPTS))], input_lengths=max_length - sizes,
                          inputs={"prompt": table}, sizes={"prompt": sizes})


@pytest.fixture(scope="module")
def scorer() -> PrefixLmScorer:
    """The GenAI model folder as it is: the step model is its own prefill."""
    lm = PrefixLmScorer(model=str(FIXTURE), vocab_size=128, scores_kind="logits")
    assert lm.self_prefill and lm.spec.history_alignment == "left"
    return lm


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("continuous", [None, 2], ids=["one-batch", "continuous"])
def test_greedy_equals_genai(scorer, source, continuous):
    expected = expected_greedy(source)
    options = LabelSyncOptions(beam_size=1, sentence_end=EOS, max_labels_per_input=1.0)
    nbest = label_sync_search([("genai", scorer, 1.0)], prompt_batch(), options, xp=np,
                              max_active_utterances=continuous)
    for prompt, hyps, sequence, log_probs in zip(PROMPTS, nbest, expected["sequences"], expected["token_log_probs"]):
        hyp = hyps[0]
        assert [*prompt, *hyp.labels] == sequence  # GenAI's sequences leave out the final EOS
        ended = hyp.length == len(hyp.labels) + 1
        assert ended == (len(log_probs) > len(hyp.labels))  # GenAI scored an EOS step
        assert hyp.score == pytest.approx(sum(log_probs), abs=TOL)
    assert any(len(s) < MAX_LENGTH for s in expected["sequences"])  # EOS occurs...
    assert any(len(s) == MAX_LENGTH for s in expected["sequences"])  # ...and the length limit too


def teacher_forced_score(sequence: list[int], prompt_length: int) -> float:
    """The log-probability of ``sequence[prompt_length:]`` from one run of the whole sequence
    through the export (empty pasts: the prompt-processing path, not the step the search runs)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(FIXTURE / "model.onnx"))
    feeds = {"input_ids": np.array([sequence]), "attention_mask": np.ones((1, len(sequence)), np.int64)}
    for info in session.get_inputs():
        if info.name.startswith("past_key_values"):
            feeds[info.name] = np.zeros((1, 2, 0, 16), np.float32)
    logits = session.run(["logits"], feeds)[0][0].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(sum(log_probs[p - 1, sequence[p]] for p in range(prompt_length, len(sequence))))


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("case", ["beam", "beam_at_max_length_20"])
@pytest.mark.parametrize("continuous", [None, 2], ids=["one-batch", "continuous"])
def test_beam_search_equals_genai(scorer, source, case, continuous):
    beam = DOCUMENT[case]
    expected = expected_beams(source, case)
    options = LabelSyncOptions(  # GenAI's search options: genai_config.json's early_stopping, length_penalty
        beam_size=beam["num_beams"], sentence_end=EOS, max_labels_per_input=1.0, max_labels=beam["max_length"],
        finished="separate-genai", early_stopping=True, length_norm_scale=1.0,
        length_counts="prompt-and-labels", nbest=beam["num_beams"])
    nbest = label_sync_search([("genai", scorer, 1.0)], prompt_batch(beam["max_length"]), options, xp=np,
                              max_active_utterances=continuous)
    ended = 0
    for prompt, hyps, sequences in zip(PROMPTS, nbest, expected):
        assert [[*prompt, *h.labels] for h in hyps] == sequences
        for hyp in hyps:
            terminated = hyp.length == len(hyp.labels) + 1
            ended += terminated
            scored = [*prompt, *hyp.labels, *([EOS] if terminated else [])]
            assert hyp.score == pytest.approx(teacher_forced_score(scored, len(prompt)), abs=TOL)
    assert 0 < ended < sum(map(len, expected))  # lists of sentence-end and length-limit hypotheses


def test_bundled_config_decodes_the_export_greedily_as_genai(tmp_path):
    """``configs/genai-generate.yaml`` (the model folder as it is, a prompt file) with one beam: each
    continuation is GenAI's greedy one, up to the config's ``search.max_labels``."""
    from click.testing import CliRunner

    from gpudecode.cli import main
    from gpudecode.config import load_config

    config = ROOT / "configs" / "genai-generate.yaml"
    result = CliRunner().invoke(main, ["decode", str(config), "--output", str(tmp_path), "-o", "search.beam_size=1"])
    assert result.exit_code == 0, result.output
    records = {r["id"]: r["nbest"][0] for r in map(json.loads, (tmp_path / "nbest.jsonl").read_text().splitlines())}
    limit = load_config(config).search.max_labels
    assert sorted(records) == [f"p{u}" for u in range(len(PROMPTS))]
    for u, (prompt, sequence) in enumerate(zip(PROMPTS, DOCUMENT["greedy"]["sequences"])):
        assert records[f"p{u}"]["labels"] == sequence[len(prompt):][:limit]
