"""Parity with transformers' ``generate`` on a ``torch.onnx`` GPT-2 export (Hugging Face decoder-with-
past convention), and today's search against a brute-force oracle on the same model.

The fixture ``tests/fixtures/peers/gpt2/`` (made by ``tools/peer-fixtures/gpt2.py``: a random-
initialised GPT-2, its step and prefill exports, and ``generate``'s outputs for ``PROMPTS`` in each
case) is the oracle in CI; under ``-m peers`` the same cases run against ``generate`` live (and the
fixture must still equal it). The toolkit decodes all prompts of a case in one batch (different
prompt lengths), statically and with continuous batching, in the ``finished="separate"`` mode:
token sequences must be equal and scores within 1e-4 (``sequences_scores``: the score divided by
``length ** length_penalty``; greedy: the sum of the tokens' log-probabilities).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import yaml
from click.testing import CliRunner

from gpudecode.cli import main as cli_main
from gpudecode.decoder import Decoder
from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session import SessionOptions
from gpudecode.session.graphs import GraphOptions
from gpudecode.states.options import StateManagerOptions
from tests.hf_generate import (
    TOL,
    LiveGenerate,
    assert_same,
    decode_like_generate,
    generate_options,
    prompt_batch,
)

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "peers" / "gpt2"
DOCUMENT = json.loads((FIXTURE / "expected.json").read_text())
PROMPTS: list[list[int]] = DOCUMENT["prompts"]
EOS, VOCAB, MAX_NEW = DOCUMENT["eos"], DOCUMENT["vocab_size"], DOCUMENT["max_new_tokens"]
CASES: dict[str, dict] = DOCUMENT["cases"]


def scorer(device: str = "cpu", graphs: bool = False) -> PrefixLmScorer:
    return PrefixLmScorer(model=str(FIXTURE / "decoder_with_past_model.onnx"),
                          prefill_model=str(FIXTURE / "decoder_model.onnx"), vocab_size=VOCAB, scores_kind="logits",
                          state_manager=StateManagerOptions(type=f"transformer-{device}"),
                          session_options=SessionOptions(device=device), graphs=GraphOptions(enabled=graphs))


def batch(prompts: list[list[int]], max_new: int = MAX_NEW) -> UtteranceBatch:
    return prompt_batch(prompts, max_new)


def options(generate: dict, prompt_length: int = 0) -> LabelSyncOptions:
    return generate_options(generate, eos=EOS, max_new=MAX_NEW, prompt_length=prompt_length)


def decode(generate: dict, device: str = "cpu", graphs: bool = False, **search) -> list[list[dict]]:
    """The toolkit's n-best lists of ``PROMPTS`` as ``generate`` reports them."""
    return decode_like_generate(scorer(device, graphs), PROMPTS, generate, eos=EOS, max_new=MAX_NEW, device=device,
                                **search)


LIVE = LiveGenerate("gpt2")


def test_fixture_covers_the_cases_of_the_issue():
    """greedy, beam 4 and 8, early_stopping True/False/"never", length_penalty 0 and 1, several
    returned sequences; EOS ending some outputs early, and others that run to the length limit."""
    assert {c["num_beams"] for c in CASES.values()} == {1, 4, 8}
    assert {c.get("early_stopping") for c in CASES.values()} >= {True, False, "never"}
    assert {c.get("length_penalty") for c in CASES.values()} >= {0.0, 1.0}
    assert any(c.get("num_return_sequences", 1) > 1 for c in CASES.values())
    ends = [h["tokens"][-1] == EOS for rows in DOCUMENT["expected"].values() for row in rows for h in row]
    lengths = [len(h["tokens"]) for rows in DOCUMENT["expected"].values() for row in rows for h in row]
    assert any(ends) and not all(ends)
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW
    assert not any(h["tokens"][-1] == EOS for row in DOCUMENT["expected"]["beam4-no-eos"] for h in row)


@pytest.mark.parametrize("case", list(CASES))
def test_separate_mode_equals_generate(case):
    assert_same(decode(CASES[case]), DOCUMENT["expected"][case])


@pytest.mark.parametrize("case", ["greedy", "beam4-late", "beam8-late", "beam4-min-new-tokens"])
def test_separate_mode_with_continuous_batching_equals_generate(case):
    assert_same(decode(CASES[case], max_active_utterances=2, admission_order="input"), DOCUMENT["expected"][case])


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "graphs"])
@pytest.mark.parametrize("continuous", [None, 2], ids=["one-batch", "continuous"])
@pytest.mark.parametrize("case", list(CASES))
def test_separate_mode_on_the_gpu_equals_generate(case, continuous, graphs):
    assert_same(decode(CASES[case], device="cuda", graphs=graphs, max_active_utterances=continuous),
                DOCUMENT["expected"][case])


@pytest.mark.peers
@pytest.mark.parametrize("case", list(CASES))
def test_separate_mode_equals_live_generate(case):
    expected = LIVE.expected(case)
    assert_same(expected, DOCUMENT["expected"][case])  # the fixture is what the peer gives now
    assert_same(decode(CASES[case]), expected)


def test_min_length_keeps_sentence_end_away_until_then():
    """Without min_length some outputs end before 4 labels; with it, no hypothesis of either
    mode ends before 4 (n-best lists too). (Equality with generate's min_new_tokens and
    min_length: the "min" cases above.)"""
    base = {"num_beams": 4, "early_stopping": False, "length_penalty": 0.0}
    short = [h for row in decode({**base, "num_return_sequences": 4}) for h in row]
    assert any(h["tokens"][-1] == EOS and len(h["tokens"]) <= 4 for h in short)
    for finished in ("in-beam", "separate"):
        opts = LabelSyncOptions(beam_size=4, sentence_end=EOS, max_labels_per_input=1.0, max_labels=MAX_NEW,
                                finished=finished, min_length=4)
        for hyps in label_sync_search([("gpt2", scorer(), 1.0)], batch(PROMPTS), opts):
            assert len(hyps) == 4
            for h in hyps:
                assert len(h.labels) >= 4 and EOS not in h.labels


@pytest.mark.peers
def test_min_length_equals_live_generate():
    gpt2, model = LIVE.load()
    generate = {"num_beams": 4, "early_stopping": False, "length_penalty": 0.0, "min_new_tokens": 4}
    expected = [gpt2.generate(model, prompt, generate) for prompt in PROMPTS]
    assert_same(decode(generate), expected)


# --- today's mode against brute force ---------------------------------------------------------
def exhaustive_nbest(prompt: list[int], scale: float, min_length: int) -> list[tuple[list[int], float, float]]:
    """Every hypothesis of at most 2 labels, scored by the prefill model over the whole sequence
    (no cache, no search; float64 log-softmax): (labels, score, rank) sorted by rank."""
    session = ort.InferenceSession(str(FIXTURE / "decoder_model.onnx"))

    def log_probs(rows: list[list[int]]) -> np.ndarray:
        ids = np.asarray(rows, np.int64)
        positions = np.tile(np.arange(ids.shape[1]), (len(rows), 1))
        logits = session.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                          "position_ids": positions})[0]
        last = logits[:, -1].astype(np.float64)
        return last - np.log(np.exp(last - last.max(-1, keepdims=True)).sum(-1, keepdims=True)) - last.max(
            -1, keepdims=True)

    first = log_probs([prompt])[0]
    seconds = log_probs([prompt + [label] for label in range(VOCAB)])
    hyps = []
    if min_length < 1:
        hyps.append(([], first[EOS], 1))
    for a in range(VOCAB):
        if a == EOS:
            continue
        for b in range(VOCAB):
            if b == EOS and min_length > 1:
                continue
            labels = [a] if b == EOS else [a, b]
            hyps.append((labels, first[a] + seconds[a, b], 2))
    ranked = [(labels, score, score / length ** scale) for labels, score, length in hyps]
    return sorted(ranked, key=lambda h: -h[2])


@pytest.mark.parametrize("scale,min_length", [(1.0, 0), (0.0, 0), (1.0, 2)])
def test_in_beam_mode_equals_brute_force(scale, min_length):
    """Two labels at most and beam 100 = |V|: the first step keeps every label, so today's
    in-beam search must return the exhaustive best 100 by ``score / length ** scale`` (each with
    the oracle's score, best first; near-ties at the cut-off may go either way)."""
    opts = LabelSyncOptions(beam_size=VOCAB, sentence_end=EOS, max_labels_per_input=1.0, max_labels=2,
                            length_norm_scale=scale, min_length=min_length)
    prompts = PROMPTS[:3]
    nbest = label_sync_search([("gpt2", scorer(), 1.0)], batch(prompts, max_new=2), opts)
    for prompt, hyps in zip(prompts, nbest):
        oracle = exhaustive_nbest(prompt, scale, min_length)
        by_labels = {tuple(labels): (score, rank) for labels, score, rank in oracle}
        assert len(hyps) == VOCAB
        got = [by_labels[tuple(h.labels)] for h in hyps]  # KeyError: not a hypothesis of the oracle
        np.testing.assert_allclose([h.score for h in hyps], [score for score, _ in got], atol=TOL)
        ranks = np.array([rank for _, rank in got])
        assert (np.diff(ranks) <= TOL).all()  # best first
        cut, next_best = oracle[VOCAB - 1][2], oracle[VOCAB][2]
        assert ranks.min() >= next_best - TOL
        returned = {tuple(h.labels) for h in hyps}
        assert all(tuple(labels) in returned for labels, _, rank in oracle if rank > cut + TOL)
        if min_length:
            assert all(len(h.labels) == 2 for h in hyps) and all(EOS not in h.labels for h in hyps)


# --- from a config ------------------------------------------------------------------------------
def config_file(tmp_path: Path, case: str) -> Path:
    """A config of the user guide's "Bring your own model" with the case's search keys."""
    generate = CASES[case]
    search = {"type": "label-sync", "beam_size": generate["num_beams"], "max_labels": MAX_NEW,
              "nbest": generate.get("num_return_sequences", 1), "finished": "separate",
              "early_stopping": generate.get("early_stopping", False),
              "length_norm_scale": 0.0 if generate["num_beams"] == 1 else generate.get("length_penalty", 1.0),
              "min_length": generate.get("min_new_tokens", 0)}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"p{u} {' '.join(map(str, p))}\n" for u, p in enumerate(PROMPTS)))
    data = {
        "models": {"vocabulary": {"path": str(FIXTURE / "vocab.txt"), "sentence_end": f"t{EOS}"}},
        "scorers": [{"type": "prefix-lm", "name": "gpt2", "scores_kind": "logits",
                     "model": {"prefill": str(FIXTURE / "decoder_model.onnx"),
                               "step": str(FIXTURE / "decoder_with_past_model.onnx")},
                     "state_manager": {"type": "transformer"}}],
        "search": search,
        "io": {"prompts": str(prompts), "prompts_format": "ids", "output": str(tmp_path / "out"),
               "formats": ["jsonl"]},
    }
    path = tmp_path / "gpt2.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("case", ["beam8-late", "beam4-early", "beam4-min-new-tokens"])
def test_config_with_finished_separate_equals_generate(tmp_path, case):
    """``gpudecode decode`` with ``search.finished: separate`` and a prompt file, and the same
    config through ``Decoder.decode(prompts=...)``."""
    scale = CASES[case].get("length_penalty", 1.0)
    result = CliRunner().invoke(cli_main, ["decode", str(config_file(tmp_path, case))])
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "nbest.jsonl").read_text().splitlines())}


    def generated(labels):  # (no length in the records: one shorter than the limit ended with EOS)
        return labels + [EOS] * (len(labels) < MAX_NEW)

    got = [[{"tokens": generated(h["labels"]), "score": h["score"] / len(generated(h["labels"])) ** scale}
            for h in records[f"p{u}"]["nbest"]] for u in range(len(PROMPTS))]
    assert_same(got, DOCUMENT["expected"][case])
    decoder = Decoder.from_config(config_file(tmp_path, case))
    try:
        nbest = decoder.decode(prompts=PROMPTS)
    finally:
        decoder.close()
    got = [[{"tokens": h.labels + [EOS] * (h.length - len(h.labels)), "score": h.score / h.length ** scale}
            for h in nbest[str(u)]] for u in range(len(PROMPTS))]
    assert_same(got, DOCUMENT["expected"][case])
