"""A GPT-2 exported with ``torch.onnx`` as Optimum's decoder-only pair (``decoder_model`` as the
prefill, ``decoder_with_past_model`` as the step model) decoded from a prompt file with
``gpudecode decode`` and from ``Decoder.decode(prompts=...)``: the same tokens and scores as
transformers' greedy ``generate`` on the same weights.

The fixture ``tests/fixtures/peers/gpt2-prompts/`` (made by ``tools/peer-fixtures/gpt2-prompts.py``)
is the oracle in CI; under ``-m peers`` the same prompts run against ``generate`` live.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.decoder import Decoder

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "peers" / "gpt2-prompts"
DOCUMENT = json.loads((FIXTURE / "expected.json").read_text())
EOS = DOCUMENT["eos"]


def config(tmp_path, **search) -> Path:
    """The config of the user guide's "Bring your own model" (torch.onnx / Optimum decoder-only)."""
    data = {
        "models": {"vocabulary": {"path": str(FIXTURE / "vocab.txt"), "sentence_begin": "<s>", "sentence_end": "</s>"}},
        "scorers": [{"type": "prefix-lm", "name": "gpt2", "scores_kind": "logits",
                     "model": {"prefill": str(FIXTURE / "decoder_model.onnx"),
                               "step": str(FIXTURE / "decoder_with_past_model.onnx")},
                     "state_manager": {"type": "transformer"}}],
        "search": {"type": "label-sync", "beam_size": 1, "max_labels": DOCUMENT["max_new_tokens"], **search},
        "io": {"prompts": str(FIXTURE / "prompts.txt"), "prompts_format": "ids", "output": str(tmp_path / "out"),
               "formats": ["text", "jsonl"]},
    }
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "gpt2.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def generated(labels, terminated: bool) -> list[int]:
    return [*labels, EOS] if terminated else list(labels)


def assert_same(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for utt, want in expected.items():
        tokens, score = got[utt]
        assert tokens == want["tokens"], utt
        assert score == pytest.approx(want["score"], abs=1e-4), utt


def cli_results(tmp_path, **search) -> dict:
    result = CliRunner().invoke(main, ["decode", str(config(tmp_path, **search))])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "out" / "nbest.jsonl").read_text().splitlines()]
    out = {}
    for record in records:
        best = record["nbest"][0]
        # labels exclude sentence-end: a hypothesis shorter than the limit ended with it
        ended = len(best["labels"]) < DOCUMENT["max_new_tokens"]
        out[record["id"]] = (generated(best["labels"], ended), best["score"])
    return out


def api_results(tmp_path, **search) -> dict:
    decoder = Decoder.from_config(config(tmp_path, **search))
    nbest = decoder.decode(prompts=DOCUMENT["prompts"])
    decoder.close()
    return {u: (generated(h[0].labels, h[0].length == len(h[0].labels) + 1), h[0].score) for u, h in nbest.items()}


def test_fixture_has_outputs_that_end_with_eos_and_one_that_runs_to_the_limit():
    ends = [g["tokens"][-1] == EOS for g in DOCUMENT["greedy"].values()]
    assert any(ends) and not all(ends)
    assert len({len(p) for p in DOCUMENT["prompts"].values()}) == len(DOCUMENT["prompts"])  # ragged prompts


@pytest.mark.parametrize("search", [{}, {"max_active_utterances": 2}, {"batch_size": 2}],
                         ids=["static", "continuous", "batches-of-2"])
def test_cli_prompt_file_equals_generate(tmp_path, search):
    assert_same(cli_results(tmp_path, **search), DOCUMENT["greedy"])


def test_python_api_prompts_equal_generate(tmp_path):
    assert_same(api_results(tmp_path), DOCUMENT["greedy"])


def peer_module():
    spec = importlib.util.spec_from_file_location("gpt2_prompts_fixture",
                                                  ROOT / "tools" / "peer-fixtures" / "gpt2-prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.peers
def test_prompt_file_equals_live_generate(tmp_path):
    peer = peer_module()
    lm = peer.model()
    expected = {u: peer.generate(lm, p) for u, p in peer.PROMPTS.items()}
    assert_same({u: (e["tokens"], e["score"]) for u, e in expected.items()}, DOCUMENT["greedy"])  # fixture = peer now
    assert_same(cli_results(tmp_path), expected)
    assert_same(api_results(tmp_path / "api"), expected)
