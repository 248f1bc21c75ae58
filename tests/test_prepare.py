"""``gpudecode prepare``: standard decoder exports rewritten into the fast form, proven against the
original and against the peers' committed outputs.

- the ``torch.onnx`` GPT-2 (``tests/fixtures/peers/gpt2``) and Optimum's Llama (``model.onnx``, and
  ``decoder_with_past_model.onnx`` with its prefill) -> ``GroupQueryAttention`` over a left-aligned
  cache: the check's figures, the n-best of ``transformers`` ``generate`` (``expected.json``), the
  in-place CPU path taken;
- Optimum's merged decoder (an ``If`` the rewrite does not recognise) -> written unfused, reported so, works;
- ``torch.onnx``'s Llama (``tests/fixtures/peers/llama-torch``: grouped key-value heads as a query
  reshape, not a key repeat) -> ``GroupQueryAttention`` with the model's query heads;
- ONNX Runtime GenAI's builder output, float32 CPU and float16 CUDA, and any model a
  ``genai_config.json`` names -> "already fast", the config next to the output;
- the command line, ``inspect``'s suggestion and the load-time warning.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from gpudecode.cli import main as cli_main
from gpudecode.prepare.api import FORM_ALREADY_FAST, FORM_GQA, FORM_UNFUSED, prepare_model
from gpudecode.prepare.check import compare_steps
from gpudecode.prepare.detect import PREPARED_KEY
from gpudecode.prepare.rewrite import find_attention, to_group_query_attention
from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session.discovery import HISTORY_ALIGNMENT_KEY
from gpudecode.states.options import StateManagerOptions
from tests.hf_generate import assert_same, decode_like_generate

PEERS = Path(__file__).resolve().parent / "fixtures" / "peers"
GPT2, OPTIMUM, GENAI, GENAI_CUDA = PEERS / "gpt2", PEERS / "optimum", PEERS / "genai", PEERS / "genai-cuda"
LLAMA_TORCH = PEERS / "llama-torch"
GPT2_STEP = GPT2 / "decoder_with_past_model.onnx"
CASES = ("greedy", "beam4-late", "beam8-late")


def document(folder: Path) -> dict:
    return json.loads((folder / "expected.json").read_text())


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    output = tmp_path_factory.mktemp("gpt2") / "fast.onnx"
    return prepare_model(GPT2_STEP, output, check=True)


@pytest.fixture(scope="module")
def optimum(tmp_path_factory):
    output = tmp_path_factory.mktemp("optimum") / "fast.onnx"
    return prepare_model(OPTIMUM / "model.onnx", output, check=True)


def lm(model, prefill=None, vocab: int = 100) -> PrefixLmScorer:
    return PrefixLmScorer(model=str(model), prefill_model=prefill and str(prefill), vocab_size=vocab,
                          scores_kind="logits", state_manager=StateManagerOptions(type="transformer-cpu"))


def ops(path) -> Counter:
    return Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def metadata(path) -> dict:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def test_gpt2_attention_becomes_group_query_attention(gpt2):
    assert gpt2.form == FORM_GQA and gpt2.layers == 2 and gpt2.reason is None
    counts = ops(gpt2.output)
    assert counts["GroupQueryAttention"] == 2
    assert counts["Softmax"] == 0 and ops(GPT2_STEP)["Softmax"] == 2  # the plain attention is gone
    assert gpt2.fused_ops.get("SkipLayerNormalization", 0) > 0  # ONNX Runtime's fusions ran
    assert metadata(gpt2.output)[HISTORY_ALIGNMENT_KEY] == "left"
    assert metadata(gpt2.output)[PREPARED_KEY] == FORM_GQA


def test_gpt2_check_passes_within_float32_tolerance(gpt2):
    check = gpt2.check
    assert check.passed and check.skipped is None
    assert check.max_logit_difference <= 1e-4 and check.max_state_difference <= 1e-4
    assert check.decode_prompts >= 4 and check.same_nbest == check.decode_prompts
    assert "max |Δ| logits" in gpt2.table() and "passed" in gpt2.table()


@pytest.mark.parametrize("case", CASES)
def test_prepared_gpt2_decodes_like_generate_and_the_original(gpt2, case):
    """The prepared model's n-best = transformers' ``generate`` on the same weights (the committed
    fixture) = the original export's, and it runs the in-place CPU path (left-aligned, resident)."""
    doc = document(GPT2)
    settings, prompts = doc["cases"][case], doc["prompts"]
    prepared = lm(gpt2.output, GPT2 / "decoder_model.onnx")
    got = decode_like_generate(prepared, prompts, settings, eos=doc["eos"], max_new=doc["max_new_tokens"])
    assert_same(got, doc["expected"][case])
    assert prepared.spec.history_alignment == "left" and prepared.runner._resident
    original = lm(GPT2_STEP, GPT2 / "decoder_model.onnx")
    assert original.spec.history_alignment == "right" and not original.runner._resident
    assert_same(decode_like_generate(original, prompts, settings, eos=doc["eos"], max_new=doc["max_new_tokens"]), got)


def test_optimum_llama_is_rewritten_and_decodes_like_generate(optimum):
    """Optimum's ``model.onnx`` (grouped key-value heads, rotary positions, its own prefill)."""
    assert optimum.form == FORM_GQA and optimum.layers == 2
    assert optimum.check.passed and optimum.check.max_logit_difference <= 1e-4
    graph = onnx.load(str(optimum.output)).graph
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    attrs = {a.name: a.i for a in gqa[0].attribute if a.name in ("num_heads", "kv_num_heads")}
    assert attrs == {"num_heads": 4, "kv_num_heads": 2}
    doc = document(OPTIMUM)
    for case in ("greedy", "beam4-late"):
        prepared = lm(optimum.output, vocab=doc["vocab_size"])
        got = decode_like_generate(prepared, doc["prompts"], doc["cases"][case], eos=doc["eos"],
                                   max_new=doc["max_new_tokens"])
        assert_same(got, doc["expected"][case])
        assert prepared.spec.history_alignment == "left" and prepared.runner._resident


def test_optimum_decoder_with_past_and_its_prefill(tmp_path):
    report = prepare_model(OPTIMUM / "decoder_with_past_model.onnx", tmp_path / "fast.onnx", check=True,
                           prefill_model=OPTIMUM / "decoder_model.onnx")
    assert report.form == FORM_GQA and report.check.passed
    doc = document(OPTIMUM)
    prepared = lm(report.output, OPTIMUM / "decoder_model.onnx", vocab=doc["vocab_size"])
    got = decode_like_generate(prepared, doc["prompts"], doc["cases"]["beam4-late"], eos=doc["eos"],
                               max_new=doc["max_new_tokens"])
    assert_same(got, doc["expected"]["beam4-late"])


def test_a_pattern_prepare_cannot_fuse_still_works_and_is_reported_unfused(tmp_path):
    """Optimum's merged decoder (the attention inside an ``If``): written unfused, with the reason,
    and it decodes as the original does."""
    report = prepare_model(OPTIMUM / "decoder_model_merged.onnx", tmp_path / "merged.onnx", check=True)
    assert report.form == FORM_UNFUSED and not report.fused
    assert "not recognised" in report.reason and "unfused" in report.table()
    assert report.check.passed and report.check.same_nbest == report.check.decode_prompts
    assert ops(report.output)["GroupQueryAttention"] == 0
    assert metadata(report.output)[PREPARED_KEY] == FORM_UNFUSED
    assert HISTORY_ALIGNMENT_KEY not in metadata(report.output)
    with warnings.catch_warnings(record=True) as caught:  # no suggestion to prepare it again
        warnings.simplefilter("always")
        lm(report.output, vocab=document(OPTIMUM)["vocab_size"])
    assert not any("gpudecode prepare" in str(w.message) for w in caught)
    doc = document(OPTIMUM)
    got = decode_like_generate(lm(report.output, vocab=doc["vocab_size"]), doc["prompts"], doc["cases"]["greedy"],
                               eos=doc["eos"], max_new=doc["max_new_tokens"])
    assert_same(got, doc["expected"]["greedy"])


def test_attention_none_leaves_the_attention(tmp_path):
    report = prepare_model(GPT2_STEP, tmp_path / "plain.onnx", attention="none")
    assert report.form == FORM_UNFUSED and report.reason == "--attention none"
    assert ops(report.output)["GroupQueryAttention"] == 0 and ops(report.output)["Softmax"] == 2


def test_genai_export_is_already_fast(tmp_path):
    report = prepare_model(GENAI / "model.onnx", tmp_path / "fast.onnx", check=True)
    assert report.form == FORM_ALREADY_FAST and report.family == "fast" and "already fast" in report.table()
    assert report.check.passed
    config = json.loads((tmp_path / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "fast.onnx"
    assert metadata(report.output)[PREPARED_KEY] == FORM_ALREADY_FAST


def test_torch_onnx_llama_grouped_query_fold_becomes_group_query_attention(tmp_path):
    """torch.onnx exports sdpa's grouped heads as the query reshaped to [N, kv heads, groups·S, Dh]:
    read as it stands that is 2 heads over 2 positions; the rewrite finds the model's 4 heads over
    one position, and the rewritten model equals the export (steps and decodes)."""
    source = LLAMA_TORCH / "decoder_with_past_model.onnx"
    folded = [n for n in onnx.load(str(source)).graph.node if n.op_type == "Reshape"]
    assert ops(source)["Expand"] <= 1 and len(folded) >= 4  # no key repeat; the query fold's reshapes
    report = prepare_model(source, tmp_path / "fast.onnx", check=True)
    assert report.form == FORM_GQA and report.layers == 1 and report.reason is None, report.table()
    [node] = [n for n in onnx.load(str(report.output)).graph.node if n.op_type == "GroupQueryAttention"]
    assert {a.name: a.i for a in node.attribute if a.name in ("num_heads", "kv_num_heads")} == \
        {"num_heads": 4, "kv_num_heads": 2}
    assert ops(report.output)["Softmax"] == 0
    check = report.check
    assert check.passed and check.max_logit_difference <= 1e-4 and check.same_nbest == check.decode_prompts


def test_genai_float16_export_is_already_fast_and_loads(tmp_path):
    """GenAI's float16 CUDA export: copied, its genai_config.json next to the output naming it; the
    folder loads, and where the CPU provider runs float16 GroupQueryAttention its greedy decodes equal
    GenAI's own (on CUDA, expected.json)."""
    report = prepare_model(GENAI_CUDA / "model.onnx", tmp_path / "fast.onnx")
    assert report.form == FORM_ALREADY_FAST and report.family == "fast"
    config = json.loads((tmp_path / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "fast.onnx"
    assert metadata(report.output)[PREPARED_KEY] == FORM_ALREADY_FAST
    assert metadata(report.output)[HISTORY_ALIGNMENT_KEY] == "left"
    assert f"written: {tmp_path / 'genai_config.json'}" in report.table()
    try:
        scorer = PrefixLmScorer(model=str(tmp_path), vocab_size=128, scores_kind="logits")
    except Exception as exc:  # noqa: BLE001 - a CPU provider without float16 GroupQueryAttention
        pytest.skip(f"the CPU provider cannot run the float16 export: {str(exc).splitlines()[0][:200]}")
    assert scorer.self_prefill and scorer.spec.history_alignment == "left"
    assert scorer.spec.tensors.source == str(tmp_path / "fast.onnx")
    expected = document(GENAI_CUDA)
    options = LabelSyncOptions(beam_size=1, sentence_end=expected["eos"], max_labels_per_input=1.0)
    prompts = expected["prompts"]
    sizes = np.array([len(p) for p in prompts])
    table = np.zeros((len(prompts), sizes.max()), np.int64)
    for u, prompt in enumerate(prompts):
        table[u, :len(prompt)] = prompt
    batch = UtteranceBatch(ids=[f"p{u}" for u in range(len(prompts))], input_lengths=expected["max_length"] - sizes,
                           inputs={"prompt": table}, sizes={"prompt": sizes})
    nbest = label_sync_search([("genai", scorer, 1.0)], batch, options, xp=np)
    decoded = [[*prompt, *hyps[0].labels] for prompt, hyps in zip(prompts, nbest)]
    assert decoded == expected["greedy"]["sequences"]


def test_a_model_named_by_a_genai_config_is_left_as_it_is(tmp_path):
    """The family comes from the genai_config.json that names the file, whatever its attention ops:
    the GPT-2 export (plain attention) named by one is copied, its alignment left to the load-time
    probe; named by none it is rewritten."""
    folder = tmp_path / "genai"
    folder.mkdir()
    (folder / "step.onnx").write_bytes(GPT2_STEP.read_bytes())
    config = json.loads((GENAI / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "step.onnx"
    (folder / "genai_config.json").write_text(json.dumps(config))
    report = prepare_model(folder / "step.onnx", tmp_path / "out" / "fast.onnx")
    assert report.form == FORM_ALREADY_FAST and ops(report.output)["Softmax"] == 2
    written = json.loads((tmp_path / "out" / "genai_config.json").read_text())
    assert written["model"]["decoder"]["filename"] == "fast.onnx"
    assert HISTORY_ALIGNMENT_KEY not in metadata(report.output)
    config["model"]["decoder"]["filename"] = "model.onnx"  # a config naming another file: not this model's
    (folder / "genai_config.json").write_text(json.dumps(config))
    other = prepare_model(folder / "step.onnx", tmp_path / "other" / "fast.onnx")
    assert other.form == FORM_GQA and not (tmp_path / "other" / "genai_config.json").exists()
    assert other.genai_config is None and "genai_config.json" not in other.table()


def test_a_genai_export_prepared_into_its_own_folder_says_its_config_names_the_export(tmp_path):
    for name in ("model.onnx", "genai_config.json"):
        (tmp_path / name).write_bytes((GENAI / name).read_bytes())
    report = prepare_model(tmp_path / "model.onnx", tmp_path / "fast.onnx")
    assert report.form == FORM_ALREADY_FAST
    assert json.loads((tmp_path / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "model.onnx"
    assert report.genai_config.startswith(f"left naming {tmp_path / 'model.onnx'}")


def test_the_check_finds_a_wrong_rewrite():
    """A rewrite with the wrong attention scale differs from the original by far more than the
    tolerance: the check can fail."""
    model = onnx.load(str(GPT2_STEP))
    matches = find_attention(model)
    assert [m.scale for m in matches] == [pytest.approx(0.25)] * 2  # 1/sqrt(16), as GPT-2 scales
    wrong = [type(m)(**{**m.__dict__, "scale": m.scale * 3}) for m in matches]
    right_logits, _ = compare_steps(model, to_group_query_attention(model, matches, {0: 4, 1: 4}))
    wrong_logits, _ = compare_steps(model, to_group_query_attention(model, wrong, {0: 4, 1: 4}))
    assert right_logits <= 1e-4 < 1e-2 < wrong_logits


def test_float16_keeps_float32_logits(tmp_path):
    report = prepare_model(GPT2_STEP, tmp_path / "half.onnx", float16=True, check=True)
    graph = onnx.load(str(report.output)).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
    assert types["logits"] == onnx.TensorProto.FLOAT
    assert types["past_key_values.0.key"] == types["present.0.key"] == onnx.TensorProto.FLOAT16
    check = report.check
    if check.skipped is not None:  # a CPU provider without the float16 kernels says so
        assert "float16" in check.skipped and "skipped" in report.table() and report.passed
        assert check.max_logit_difference is None
    else:
        assert check.passed and 1e-5 < check.max_logit_difference <= 2e-2  # float16 rounding, within bounds


def test_cli_prepare_check_prints_the_table(tmp_path):
    result = CliRunner().invoke(cli_main, ["prepare", str(GPT2_STEP), "-o", str(tmp_path / "fast.onnx"), "--check"])
    assert result.exit_code == 0, result.output
    for line in ("export family", "GroupQueryAttention over a left-aligned cache", "max |Δ| logits", "passed"):
        assert line in result.output
    assert (tmp_path / "fast.onnx").is_file()


def test_cli_attention_gqa_fails_where_it_cannot_fuse(tmp_path):
    result = CliRunner().invoke(cli_main, ["prepare", str(OPTIMUM / "decoder_model_merged.onnx"), "-o",
                                           str(tmp_path / "m.onnx"), "--attention", "gqa"])
    assert result.exit_code != 0 and "stayed unfused" in result.output


def test_inspect_suggests_prepare_only_where_it_helps(gpt2):
    def inspect(path):
        result = CliRunner().invoke(cli_main, ["inspect", str(path)])
        assert result.exit_code == 0, result.output
        return result.output
    assert "gpudecode prepare" in inspect(GPT2_STEP)
    assert "gpudecode prepare" not in inspect(gpt2.output)
    assert "gpudecode prepare" not in inspect(GENAI / "model.onnx")


def test_loading_a_model_not_in_the_fast_form_warns(gpt2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm(GPT2_STEP, GPT2 / "decoder_model.onnx")
    assert any("gpudecode prepare" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm(gpt2.output, GPT2 / "decoder_model.onnx")
    assert not any("gpudecode prepare" in str(w.message) for w in caught)


WHISPER = PEERS / "whisper"


@pytest.fixture(scope="module")
def whisper_prepared(tmp_path_factory):
    """Optimum's Whisper export (encoder, prefill, step) through ``prepare`` with ``--check``."""
    folder = tmp_path_factory.mktemp("whisper")
    return {name: prepare_model(WHISPER / name, folder / name, check=True)
            for name in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")}


def test_whisper_models_are_fused_checked_and_their_attention_reported_kept(whisper_prepared):
    """The encoder and the cross-attention decoders: ONNX Runtime's fusions kept where the outputs on
    random inputs agree, the attention left as it is (and said so), the check by the outputs."""
    families = {name: report.family for name, report in whisper_prepared.items()}
    assert families == {"encoder_model.onnx": "encoder", "decoder_model.onnx": "seq2seq-decoder",
                        "decoder_with_past_model.onnx": "seq2seq-decoder"}
    for name, report in whisper_prepared.items():
        assert report.form == FORM_UNFUSED and ("cross-attention" in report.reason or "encoder" in report.reason)
        assert report.fused_ops.get("SkipLayerNormalization", 0) > 0, name  # the fusions ran and were kept
        assert report.check.passed and report.check.max_output_difference <= 1e-4, name
        assert "max |Δ| outputs" in report.table() and metadata(report.output)[PREPARED_KEY] == FORM_UNFUSED


def test_prepared_whisper_decodes_like_generate(whisper_prepared):
    """The bundled Whisper config on the prepared models: transformers' generate's best sequences
    (the committed fixture), as on the originals."""
    from tests.test_peer_whisper import check, decoder, expected, hf_features

    paths = {name: report.output for name, report in whisper_prepared.items()}
    overrides = [f"models.encoder.path={paths['encoder_model.onnx']}",
                 f"scorers[0].model.prefill={paths['decoder_model.onnx']}",
                 f"scorers[0].model.step={paths['decoder_with_past_model.onnx']}"]
    features = {name: f.T for name, f in hf_features(None).items()}
    for case, beam in (("greedy", 1), ("beam4", 4)):
        check(decoder(beam, *overrides).decode(features), expected(None, case), beam)


def test_a_float16_conversion_onnx_rejects_is_refused_not_written(tmp_path):
    """Optimum's merged Whisper decoder (an If's subgraphs): the converter's float16 graph fails the
    checker, so prepare says so and writes nothing; float32 works (its fusions reported dropped)."""
    with pytest.raises(ValueError, match="float16 converter wrote an invalid model"):
        prepare_model(WHISPER / "decoder_model_merged.onnx", tmp_path / "half.onnx", float16=True)
    assert not (tmp_path / "half.onnx").exists()
    report = prepare_model(WHISPER / "decoder_model_merged.onnx", tmp_path / "merged.onnx", check=True)
    assert report.family == "seq2seq-decoder" and report.check.passed and report.fusion_note.startswith("dropped")


def test_the_outputs_check_finds_a_changed_encoder(tmp_path):
    """An encoder whose output was scaled by 1.01 is not the original: the outputs check fails."""
    from gpudecode.prepare.check import check_outputs

    model = onnx.load(str(WHISPER / "encoder_model.onnx"))
    graph = model.graph
    out = graph.output[0].name
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.01, np.float32), "gpudecode_test/scale"))
    for node in graph.node:
        node.output[:] = [f"{o}/unscaled" if o == out else o for o in node.output]
    graph.node.append(onnx.helper.make_node("Mul", [f"{out}/unscaled", "gpudecode_test/scale"], [out]))
    onnx.save(model, tmp_path / "changed.onnx")
    report = check_outputs(str(WHISPER / "encoder_model.onnx"), str(tmp_path / "changed.onnx"), float16=False)
    assert not report.passed and report.max_output_difference > 1e-3
