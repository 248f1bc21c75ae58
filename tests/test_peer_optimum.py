"""Parity with transformers' ``generate`` on real Optimum exports of one decoder-only model, in each
form Optimum writes.

The fixture ``tests/fixtures/peers/optimum/`` (made by ``tools/peer-fixtures/optimum.py``: a random-
initialised Llama exported by optimum-onnx, and ``generate``'s outputs for ``PROMPTS`` in each case)
is the oracle in CI; under ``-m peers`` the same cases run against ``generate`` live (and the
fixture must still equal it). Forms:

- ``pair``: ``decoder_model.onnx`` as the prefill, ``decoder_with_past_model.onnx`` as the step model;
- ``merged``: ``decoder_model_merged.onnx`` alone, its own prefill: ``use_cache_branch`` False on the
  prompt run (empty pasts), True on every step;
- ``default``: ``model.onnx`` (``optimum-cli export onnx --task text-generation-with-past``) alone,
  its own prefill with empty pasts.

The toolkit decodes all prompts of a case in one batch (different prompt lengths) in the
``finished="separate"`` mode (transformers' beam rules): token sequences must be equal and scores
within 1e-4 (``sequences_scores``: the score divided by ``length ** length_penalty``; greedy: the sum
of the tokens' log-probabilities). Today's (in-beam) mode is checked against a brute-force oracle
on the same export. The live tests build the model from the seed again and run
``generate``: with the transformers the fixture was made with (4.57, which optimum-onnx 0.1.0 needs:
``PYTHONPATH=/path/to/transformers-4.57``) and with transformers 5.24 alike, which initialise the same
weights and give the same outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from click.testing import CliRunner

from gpudecode.cli import main as cli_main
from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session import ModelError, OnnxSession, SessionOptions
from gpudecode.session.conventions import load_step_model_spec
from gpudecode.session.graphs import GraphOptions
from gpudecode.session.step_model import hf_prompt_feeds, hf_step_feeds
from gpudecode.states.options import StateManagerOptions
from tests.hf_generate import TOL, LiveGenerate, assert_same, decode_like_generate, generate_options, prompt_batch

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "peers" / "optimum"
DOCUMENT = json.loads((FIXTURE / "expected.json").read_text())
PROMPTS: list[list[int]] = DOCUMENT["prompts"]
EOS, VOCAB, MAX_NEW = DOCUMENT["eos"], DOCUMENT["vocab_size"], DOCUMENT["max_new_tokens"]
CASES: dict[str, dict] = DOCUMENT["cases"]
FILES: dict[str, str] = DOCUMENT["files"]
#: form -> (prefill model or None: the step model is its own prefill, step model)
FORMS = {"pair": (FILES["prefill"], FILES["step"]), "merged": (None, FILES["merged"]),
         "default": (None, FILES["default"])}


def scorer(form: str, device: str = "cpu", graphs: bool = False) -> PrefixLmScorer:
    prefill, step = FORMS[form]
    return PrefixLmScorer(model=str(FIXTURE / step), prefill_model=prefill and str(FIXTURE / prefill),
                          vocab_size=VOCAB, scores_kind="logits",
                          state_manager=StateManagerOptions(type=f"transformer-{device}"),
                          session_options=SessionOptions(device=device), graphs=GraphOptions(enabled=graphs))


def batch(prompts: list[list[int]]) -> UtteranceBatch:
    return prompt_batch(prompts, MAX_NEW)


def options(generate: dict, prompt_length: int = 0) -> LabelSyncOptions:
    return generate_options(generate, eos=EOS, max_new=MAX_NEW, prompt_length=prompt_length)


def decode(form: str, generate: dict, device: str = "cpu", graphs: bool = False, **search) -> list[list[dict]]:
    """The toolkit's n-best lists of ``PROMPTS`` with the export ``form``, as ``generate`` reports them."""
    return decode_like_generate(scorer(form, device, graphs), PROMPTS, generate, eos=EOS, max_new=MAX_NEW,
                                device=device, **search)


LIVE = LiveGenerate("optimum")


# --- the fixture ---------------------------------------------------------------------------------
def test_fixture_covers_the_cases_of_the_issue():
    """Real Optimum exports (versions recorded); greedy, beam 4 and 8, early_stopping True/False/
    "never", length_penalty 0 and 1, several returned sequences; EOS ending some outputs early, and
    others that run to the length limit."""
    assert DOCUMENT["versions"]["optimum-onnx"] and DOCUMENT["versions"]["transformers"]
    assert {c["num_beams"] for c in CASES.values()} == {1, 4, 8}
    assert {c.get("early_stopping") for c in CASES.values()} >= {True, False, "never"}
    assert {c.get("length_penalty") for c in CASES.values()} >= {0.0, 1.0}
    assert any(c.get("num_return_sequences", 1) > 1 for c in CASES.values())
    hyps = [h for rows in DOCUMENT["expected"].values() for row in rows for h in row]
    assert any(h["tokens"][-1] == EOS and len(h["tokens"]) < MAX_NEW for h in hyps)
    assert any(h["tokens"][-1] != EOS for h in hyps)
    assert max(len(h["tokens"]) for h in hyps) == MAX_NEW
    assert not any(h["tokens"][-1] == EOS for row in DOCUMENT["expected"]["beam4-no-eos"] for h in row)


def test_the_forms_are_what_optimum_writes():
    """The pair: a prefill without pasts and a step model with them; the merged model: both graphs
    behind an ``If`` on ``use_cache_branch`` [1] bool; the default export: a decoder with pasts."""
    def inputs(name):
        return {i.name: i for i in onnx.load(FIXTURE / name, load_external_data=False).graph.input}

    assert not any(n.startswith("past_key_values") for n in inputs(FILES["prefill"]))
    for name in (FILES["step"], FILES["default"], FILES["merged"]):
        assert {"input_ids", "attention_mask", "position_ids", "past_key_values.0.key"} <= set(inputs(name))
    branch = inputs(FILES["merged"])["use_cache_branch"].type.tensor_type
    assert branch.elem_type == onnx.TensorProto.BOOL and len(branch.shape.dim) == 1
    merged = onnx.load(FIXTURE / FILES["merged"])
    assert any(node.op_type == "If" and node.input[0] == "use_cache_branch" for node in merged.graph.node)
    assert "use_cache_branch" not in inputs(FILES["default"])


def test_merged_branch_is_false_on_the_prompt_and_true_on_steps():
    """The logical input ``use_cache_branch``: False with the prompt's feeds (empty pasts), True with
    a step's, on the host, shaped as declared ([1])."""
    session = OnnxSession(str(FIXTURE / FILES["merged"]))
    spec = load_step_model_spec(session, vocab_size=VOCAB)
    assert spec.hypothesis_inputs["use_cache_branch"] == "use_cache_branch"
    prompt = hf_prompt_feeds(spec, session.tensors, np.array([3, 1]), 3)["use_cache_branch"]
    step = hf_step_feeds(spec, session.tensors, np.array([3, 1]), 4)["use_cache_branch"]
    assert isinstance(prompt, np.ndarray) and prompt.dtype == np.bool_ and prompt.shape == (1,) and not prompt[0]
    assert isinstance(step, np.ndarray) and step.dtype == np.bool_ and step.shape == (1,) and step[0]


# --- each form equals generate -------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("form", list(FORMS))
def test_form_equals_generate(form, case):
    assert_same(decode(form, CASES[case]), DOCUMENT["expected"][case])


@pytest.mark.parametrize("case", ["greedy", "beam4-late", "beam8-late"])
@pytest.mark.parametrize("form", list(FORMS))
def test_form_with_continuous_batching_equals_generate(form, case):
    assert_same(decode(form, CASES[case], max_active_utterances=2, admission_order="input"),
                DOCUMENT["expected"][case])


@pytest.mark.parametrize("case", ["greedy", "beam8-late"])
@pytest.mark.parametrize("form", list(FORMS))
def test_form_with_bucketed_runs_equals_generate(form, case):
    """``cuda_graphs`` on the CPU: every step padded to its (rows, history) bucket and fed from the
    graph buffers (the merged model's ``use_cache_branch`` among the static inputs)."""
    assert_same(decode(form, CASES[case], graphs=True, max_active_utterances=3), DOCUMENT["expected"][case])


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["no-graphs", "graphs"])
@pytest.mark.parametrize("case", ["greedy", "beam4-early", "beam8-late", "beam4-min-length"])
@pytest.mark.parametrize("form", list(FORMS))
def test_form_on_the_gpu_equals_generate(form, case, graphs):
    """(The merged model's ``If`` cannot be captured in a CUDA graph: with graphs on it runs without.)"""
    assert_same(decode(form, CASES[case], device="cuda", graphs=graphs, max_active_utterances=2),
                DOCUMENT["expected"][case])


@pytest.mark.peers
@pytest.mark.parametrize("case", list(CASES))
def test_forms_equal_live_generate(case):
    expected = LIVE.expected(case)
    assert_same(expected, DOCUMENT["expected"][case])  # the fixture is what the peer gives now
    for form in FORMS:
        assert_same(decode(form, CASES[case]), expected)


@pytest.mark.peers
def test_exports_are_of_the_live_model():
    """The committed exports reproduce the live model's logits (prefill + steps, each form)."""
    import torch

    fixture, lm = LIVE.load()
    with torch.no_grad():
        reference = lm(torch.tensor([fixture.CHECK_SEQUENCE])).logits[0].numpy()
    fixture.check_exports(reference, FIXTURE)


@pytest.mark.parametrize("case", ["greedy", "beam4-late"])
@pytest.mark.parametrize("form", ["default", "merged"])
def test_as_a_recurrent_lm_from_a_start_label_equals_generate(form, case):
    """A ``recurrent-lm`` (an LM as fused into another decoder's search) started from one label:
    ``generate`` of that one-label prompt (``PROMPTS[1]``)."""
    from gpudecode.scorers.onnx_decoder import RecurrentLmScorer

    (start,) = PROMPTS[1]
    lm = RecurrentLmScorer(model=str(FIXTURE / FORMS[form][1]), vocab_size=VOCAB, start_labels=[start],
                           scores_kind="logits", state_manager=StateManagerOptions(type="transformer-cpu"))
    opts = options(CASES[case])
    utterances = UtteranceBatch(ids=["p1"], input_lengths=np.array([MAX_NEW]), inputs={}, sizes={})
    (hyps,) = label_sync_search([("lm", lm, 1.0)], utterances, opts)
    got = [{"tokens": h.labels + [EOS] * (h.length - len(h.labels)),
            "score": h.score / h.length ** opts.length_norm_scale} for h in hyps]
    assert_same([got], DOCUMENT["expected"][case][1:2])


# --- today's mode against brute force ---------------------------------------------------------
def exhaustive_nbest(prompt: list[int], scale: float) -> list[tuple[list[int], float, float]]:
    """Every hypothesis of at most 2 labels, scored by ``decoder_model.onnx`` over the whole
    sequence (no pasts, no search; float64 log-softmax): (labels, score, rank) sorted by rank."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(FIXTURE / FILES["prefill"]))

    def log_probs(rows: list[list[int]]) -> np.ndarray:
        ids = np.asarray(rows, np.int64)
        positions = np.tile(np.arange(ids.shape[1]), (len(rows), 1))
        last = session.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                        "position_ids": positions})[0][:, -1].astype(np.float64)
        top = last.max(-1, keepdims=True)
        return last - top - np.log(np.exp(last - top).sum(-1, keepdims=True))

    first = log_probs([prompt])[0]
    seconds = log_probs([prompt + [label] for label in range(VOCAB)])
    hyps = [([], first[EOS], 1)]
    hyps += [([a] if b == EOS else [a, b], first[a] + seconds[a, b], 2)
             for a in range(VOCAB) if a != EOS for b in range(VOCAB)]
    return sorted(((labels, score, score / length ** scale) for labels, score, length in hyps), key=lambda h: -h[2])


@pytest.mark.parametrize("scale", [1.0, 0.0])
@pytest.mark.parametrize("form", ["pair", "merged"])
def test_in_beam_mode_equals_brute_force(form, scale):
    """Two labels at most and beam 100 = |V|: today's in-beam search returns the exhaustive best 100
    by ``score / length ** scale`` (each with the oracle's score, best first; near-ties at the
    cut-off may go either way)."""
    opts = LabelSyncOptions(beam_size=VOCAB, sentence_end=EOS, max_labels_per_input=1.0, max_labels=2,
                            length_norm_scale=scale)
    prompts = PROMPTS[:3]
    nbest = label_sync_search([("lm", scorer(form), 1.0)], batch(prompts), opts)
    for prompt, hyps in zip(prompts, nbest):
        oracle = exhaustive_nbest(prompt, scale)
        by_labels = {tuple(labels): (score, rank) for labels, score, rank in oracle}
        assert len(hyps) == VOCAB
        got = [by_labels[tuple(h.labels)] for h in hyps]  # KeyError: not a hypothesis of the oracle
        np.testing.assert_allclose([h.score for h in hyps], [score for score, _ in got], atol=TOL)
        ranks = np.array([rank for _, rank in got])
        assert (np.diff(ranks) <= TOL).all()
        cut, next_best = oracle[VOCAB - 1][2], oracle[VOCAB][2]
        assert ranks.min() >= next_best - TOL
        returned = {tuple(h.labels) for h in hyps}
        assert all(tuple(labels) in returned for labels, _, rank in oracle if rank > cut + TOL)


# --- refused at load -----------------------------------------------------------------------------
def _edited_merged(tmp_path: Path, edit) -> Path:
    model = onnx.load(FIXTURE / FILES["merged"])
    edit(model.graph)
    path = tmp_path / "edited.onnx"
    onnx.save(model, path)
    return path


def test_a_branch_input_of_another_type_is_refused(tmp_path):
    """``use_cache_branch`` taken as int64 (cast inside): the toolkit feeds a bool, so it refuses."""
    def edit(graph):
        branch = next(i for i in graph.input if i.name == "use_cache_branch")
        branch.type.tensor_type.elem_type = onnx.TensorProto.INT64
        for node in graph.node:
            if node.op_type == "If" and node.input[0] == "use_cache_branch":
                node.input[0] = "branch_bool"
        graph.node.insert(0, onnx.helper.make_node("Cast", ["use_cache_branch"], ["branch_bool"],
                                                   to=onnx.TensorProto.BOOL))

    path = _edited_merged(tmp_path, edit)
    with pytest.raises(ModelError, match=r"use_cache_branch'.*expected dtype bool, got int64"):
        PrefixLmScorer(model=str(path), vocab_size=VOCAB, scores_kind="logits",
                       state_manager=StateManagerOptions(type="transformer-cpu"))


def test_an_input_the_toolkit_cannot_provide_is_refused(tmp_path):
    """A merged export with a further input (here ``cache_position`` [N, S]): nothing provides it."""
    def edit(graph):
        graph.input.append(onnx.helper.make_tensor_value_info("cache_position", onnx.TensorProto.INT64,
                                                              ["batch_size", "sequence_length"]))

    path = _edited_merged(tmp_path, edit)
    with pytest.raises(ModelError, match=r"input 'cache_position' .* is provided by nothing"):
        PrefixLmScorer(model=str(path), vocab_size=VOCAB, scores_kind="logits",
                       state_manager=StateManagerOptions(type="transformer-cpu"))


# --- from a config ------------------------------------------------------------------------------
BUNDLED = ROOT / "configs" / "optimum-generate.yaml"
#: the generate case the bundled config's search reproduces
BUNDLED_CASE = "beam4-late"


def records(out: Path, scale: float) -> list[list[dict]]:
    """nbest.jsonl as ``generate`` reports it (no length in the records: one shorter than the limit
    ended with EOS)."""
    by_id = {r["id"]: r for r in map(json.loads, (out / "nbest.jsonl").read_text().splitlines())}

    def generated(labels):
        return labels + [EOS] * (len(labels) < MAX_NEW)

    return [[{"tokens": generated(h["labels"]), "score": h["score"] / len(generated(h["labels"])) ** scale}
             for h in by_id[f"p{u}"]["nbest"]] for u in range(len(PROMPTS))]


def test_bundled_config_equals_generate(tmp_path):
    """``gpudecode decode configs/optimum-generate.yaml``: the merged export from a prompt file (the
    fixture's prompts) gives ``generate``'s 4-beam n-best (early_stopping False, length_penalty 1)."""
    config = yaml.safe_load(BUNDLED.read_text())
    search = config["search"]
    case = CASES[BUNDLED_CASE]
    assert (search["beam_size"], search["finished"], search["early_stopping"], search["length_norm_scale"],
            search["max_labels"]) == (case["num_beams"], "separate", case["early_stopping"], case["length_penalty"],
                                      MAX_NEW)
    assert config["scorers"][0]["model"].endswith(FILES["merged"])
    prompts = (BUNDLED.parent / config["io"]["prompts"]).read_text().splitlines()
    assert [[int(x) for x in line.split()[1:]] for line in prompts if line and line[0] != "#"] == PROMPTS
    result = CliRunner().invoke(cli_main, ["decode", str(BUNDLED), "--output", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert_same(records(tmp_path / "out", case["length_penalty"]), DOCUMENT["expected"][BUNDLED_CASE])


@pytest.mark.parametrize("form", ["pair", "default"])
def test_config_of_each_form_equals_generate(tmp_path, form):
    """The bundled config with the pair (``model: {prefill, step}``) or the default export instead."""
    config = yaml.safe_load(BUNDLED.read_text())
    prefill, step = FORMS[form]
    config["scorers"][0]["model"] = ({"prefill": str(FIXTURE / prefill), "step": str(FIXTURE / step)} if prefill
                                     else str(FIXTURE / step))
    config["models"]["vocabulary"]["path"] = str(FIXTURE / "vocab.txt")
    config["io"]["prompts"] = str(BUNDLED.parent / config["io"]["prompts"])
    config["io"]["output"] = str(tmp_path / "out")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli_main, ["decode", str(path)])
    assert result.exit_code == 0, result.output
    assert_same(records(tmp_path / "out", CASES[BUNDLED_CASE]["length_penalty"]),
                DOCUMENT["expected"][BUNDLED_CASE])
