"""Per-utterance token prompts: the prompt file, ``Decoder.decode(prompts=...)``, prompts on the
command line, and text generation with a decoder-only model and no encoder. Expected scores come
from the reference models' no-cache oracles (the whole prompt + labels run at once)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.config import ConfigError
from gpudecode.decoder import Decoder
from gpudecode.io import PromptError, Vocabulary, parse_prompts, read_prompts
from gpudecode.io.prompts import check_prompts_cover
from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.testing import build_optimum_lm, build_prefix_lm
from gpudecode.testing.optimum_lm import EXAMPLE_FILES, write_optimum_lm_example

ROOT = Path(__file__).resolve().parent.parent
GENERATE = ROOT / "configs" / "lm-generate.yaml"
PREFIX_LM = ROOT / "configs" / "prefix-lm.yaml"
VOCAB = Vocabulary.load(ROOT / "examples" / "models" / "vocab.txt", sentence_begin="<s>", sentence_end="</s>")
EOS = 1


# --- the prompt file ------------------------------------------------------------------------------

def test_prompt_file_in_both_formats():
    ids = parse_prompts("# comment\nutt1 3 4 5\n\nutt2\n  utt3   11 0\n", vocab_size=12)
    assert list(ids) == ["utt1", "utt2", "utt3"]
    assert [p.tolist() for p in ids.values()] == [[3, 4, 5], [], [11, 0]]
    assert all(p.dtype == np.int64 for p in ids.values())
    text = parse_prompts(["a one two", "b <s> nine"], vocabulary=VOCAB, format="text")
    assert {k: v.tolist() for k, v in text.items()} == {"a": [3, 4], "b": [0, 11]}


@pytest.mark.parametrize("lines, options, message", [
    ("u1 3 x 5", {"vocab_size": 12}, r"line 1: 'x' is not a label index"),
    ("u1 3\nu2 12", {"vocab_size": 12}, r"utterance 'u2': line 2: label index 12 is out of range \(0..11\)"),
    ("u1 -1", {}, r"label index -1 is out of range"),
    ("u1 one\nu2 one zehn", {"vocabulary": VOCAB, "format": "text"},
     r"utterance 'u2': line 2: label 'zehn' is not in the vocabulary"),
    ("u1 1\n\nu1 2", {}, r"utterance 'u1': line 3: the id is given twice \(first on line 1\)"),
])
def test_prompt_file_errors_name_the_line_the_id_and_the_label(lines, options, message):
    with pytest.raises(PromptError, match=message):
        parse_prompts(lines, path="p.txt", **options)


def test_prompt_file_reading_and_coverage(tmp_path):
    with pytest.raises(PromptError, match="prompt file does not exist"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    with pytest.raises(PromptError, match="no prompts in the file"):
        read_prompts(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="'text' needs the vocabulary"):
        parse_prompts("u one", format="text")
    prompts = {"a": np.array([1]), "b": np.array([2])}
    check_prompts_cover(prompts, ["b", "a"])
    with pytest.raises(PromptError, match=r"no prompt for 1 utterance\(s\): 'c'"):
        check_prompts_cover(prompts, ["a", "b", "c"])
    with pytest.raises(PromptError, match=r"prompts for 1 id\(s\) that are not among the utterances: 'b'"):
        check_prompts_cover(prompts, ["a"])


# --- per-input sizes ------------------------------------------------------------------------------

def test_a_token_prompt_carries_its_own_sizes():
    with pytest.raises(ValueError, match="token prompts carry their own sizes"):
        UtteranceBatch(ids=["a"], input_lengths=[5], inputs={"prompt": np.zeros((1, 2), np.int64)})
    decoder = Decoder.from_config(PREFIX_LM)
    features = [np.ones((9, 16), np.float32), np.ones((4, 16), np.float32)]
    batch = decoder.encode(["x", "y"], features, [[3, 4, 5], [6]])
    assert batch.size_of("prompt").tolist() == [3, 1]  # not the encoder lengths
    assert batch.inputs["prompt"].tolist() == [[3, 4, 5], [6, 0, 0]]
    assert batch.size_of("encoder-states").tolist() == batch.input_lengths.tolist()
    assert set(batch.sizes) == set(batch.inputs)  # every input with its own sizes
    assert batch.input_lengths.tolist() != [3, 1]
    decoder.close()


# --- Decoder.decode with token prompts -----------------------------------------------------------

def oracle_score(pair, labels, prompt, *, terminated, **context):
    rows = pair.sequence_log_probs(labels, prompt=prompt, **context)
    targets = [*labels, EOS] if terminated else labels
    return float(sum(rows[p, t] for p, t in enumerate(targets)))


GENERATE_PROMPTS = {"count-up": [3, 4, 5], "phone": [7, 7, 7], "date": [11, 3], "single": [9]}


def test_text_generation_equals_the_utterance_batch_route_and_the_oracle():
    """Decoder-only, no encoder: each prompt continued up to search.max_labels labels; every
    hypothesis's score is the no-cache oracle's (logits -> log-softmax), and the same n-best as
    the search on an UtteranceBatch with a ``prompt`` input."""
    decoder = Decoder.from_config(GENERATE, ["search.max_labels=5"])
    nbest = decoder.decode(prompts=GENERATE_PROMPTS)
    pair = build_optimum_lm(0)  # the bundled models' builder
    checked = 0
    for utt, hyps in nbest.items():
        assert len(hyps) == 4
        for hyp in hyps:
            terminated = hyp.length == len(hyp.labels) + 1
            assert len(hyp.labels) <= 5 and (terminated or len(hyp.labels) == 5)
            expected = oracle_score(pair, hyp.labels, GENERATE_PROMPTS[utt], terminated=terminated)
            assert hyp.score == pytest.approx(expected, abs=1e-4)
            checked += 1
    assert checked == 16
    assert any(h.length == len(h.labels) for hs in nbest.values() for h in hs)  # some hit the limit

    ids = list(GENERATE_PROMPTS)
    table = np.zeros((4, 3), np.int64)
    for u, p in enumerate(GENERATE_PROMPTS.values()):
        table[u, :len(p)] = p
    batch = UtteranceBatch(ids=ids, input_lengths=[5] * 4, inputs={"prompt": table},
                           sizes={"prompt": np.array([3, 3, 2, 1])})
    scorer = PrefixLmScorer(model=pair.step.serialized(), prefill_model=pair.prefill.serialized(), vocab_size=12,
                            scores_kind="logits")
    options = LabelSyncOptions(beam_size=4, sentence_end=EOS, max_labels_per_input=1.0, max_labels=5,
                               length_norm_scale=decoder.config.search.length_norm_scale)
    direct = label_sync_search([("lm", scorer, 1.0)], batch, options)
    for utt, hyps in zip(ids, direct):
        assert [h.labels for h in hyps] == [h.labels for h in nbest[utt]]
        np.testing.assert_allclose([h.score for h in hyps], [h.score for h in nbest[utt]], atol=1e-5)
    decoder.close()


def test_prompts_with_features_equal_the_utterance_batch_route_and_the_oracle():
    """A prefix LM prompted with each utterance's own labels and its encoder states; list or dict
    prompts; continuous batching gives the same n-best."""
    rng = np.random.default_rng(3)
    features = {f"u{i}": rng.normal(size=(n, 16)).astype(np.float32) for i, n in enumerate([12, 7, 9])}
    prompts = {"u0": [4], "u1": [5, 6, 7], "u2": [0, 3]}
    overrides = ["scorers.0.options.initial_prompt_labels=[]"]
    decoder = Decoder.from_config(PREFIX_LM, overrides)
    nbest = decoder.decode(features, prompts=prompts)
    as_lists = decoder.decode(list(features.values()), prompts=list(prompts.values()))
    assert [[h.labels for h in hs] for hs in as_lists.values()] == [[h.labels for h in hs] for hs in nbest.values()]
    pair = build_prefix_lm(0)  # the bundled prefix LM's builder
    for utt, hyps in nbest.items():
        encoded = decoder.encode([utt], [features[utt]])
        size = int(encoded.input_lengths[0])
        states = np.asarray(encoded.inputs["encoder-states"])[0, :size]
        for hyp in hyps:
            terminated = hyp.length == len(hyp.labels) + 1
            expected = oracle_score(pair, hyp.labels, prompts[utt], terminated=terminated, encoder_states=states,
                                    suffix=[0])
            assert hyp.score == pytest.approx(expected, abs=1e-4)
    ids = list(features)
    batch = decoder.encode(ids, list(features.values()), list(prompts.values()))
    direct = decoder.search_type.decode(decoder.search_setup, batch)
    for utt, hyps in zip(ids, direct):
        assert [h.labels for h in hyps] == [h.labels for h in nbest[utt]]
    static = Decoder.from_config(PREFIX_LM, [*overrides, "search.max_active_utterances=null"])
    assert static.config.search.max_active_utterances is None and decoder.config.search.max_active_utterances == 2
    again = static.decode(features, prompts=prompts)
    for utt in ids:
        assert [h.labels for h in again[utt]] == [h.labels for h in nbest[utt]]
    with pytest.raises(ValueError, match=r"no prompt for \['u2'\]"):
        decoder.decode(features, prompts={"u0": [4], "u1": [5]})
    with pytest.raises(ValueError, match="prompt label 12 is out of range"):
        decoder.decode(features, prompts={"u0": [4], "u1": [12], "u2": [1]})
    decoder.close()
    static.close()


def test_prompts_nobody_reads_and_a_prefill_without_labels_are_errors():
    decoder = Decoder.from_config(ROOT / "configs" / "random-aed.yaml")
    with pytest.raises(ConfigError, match="the utterances bring token prompts, but no scorer reads them"):
        decoder.decode([np.ones((5, 16), np.float32)], prompts=[[3]])
    with pytest.raises(ConfigError, match="the encoder needs features"):
        decoder.decode(prompts=[[3]])
    decoder.close()
    # Optimum's decoder_model as the prefill, without initial_prompt_labels: loads; without
    # prompts the admission says what is missing
    pair = build_optimum_lm(1)
    scorer = PrefixLmScorer(model=pair.step.serialized(), prefill_model=pair.prefill.serialized(), vocab_size=12,
                            scores_kind="logits")
    assert scorer.takes_prompts
    with pytest.raises(ValueError, match="'input_ids' gets no labels: the utterances bring no 'prompt' input"):
        label_sync_search([("lm", scorer, 1.0)], UtteranceBatch(ids=["a"], input_lengths=[3]),
                          LabelSyncOptions(beam_size=2, sentence_end=EOS))
    with pytest.raises(ValueError, match="utterance 'a' has an empty prompt"):
        label_sync_search([("lm", scorer, 1.0)],
                          UtteranceBatch(ids=["a"], input_lengths=[3], inputs={"prompt": np.zeros((1, 0), np.int64)},
                                         sizes={"prompt": np.array([0])}),
                          LabelSyncOptions(beam_size=2, sentence_end=EOS))


def test_the_bundled_generation_models_are_current(tmp_path):
    for path in write_optimum_lm_example(tmp_path):
        assert path.stat().st_size < 200_000
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        shipped = ROOT / "examples" / "models" / path.name
        assert shipped.read_bytes() == path.read_bytes(), f"{shipped} is stale: rerun write_optimum_lm_example"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(EXAMPLE_FILES)


# --- the command line -----------------------------------------------------------------------------

def decode(*args):
    return CliRunner().invoke(main, ["decode", *map(str, args)])


def nbest_records(folder):
    return {r["id"]: r for r in map(json.loads, (Path(folder) / "nbest.jsonl").read_text().splitlines())}


def test_cli_generates_text_from_the_bundled_config(tmp_path):
    result = decode(GENERATE, "--output", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "utterances decoded      4" in result.output
    records = nbest_records(tmp_path / "out")
    expected = Decoder.from_config(GENERATE).decode(prompts=GENERATE_PROMPTS)
    assert set(records) == set(expected)
    for utt, hyps in expected.items():
        assert [h["labels"] for h in records[utt]["nbest"]] == [h.labels for h in hyps]
    text = dict(line.split(" ", 1) if " " in line else (line, "")
                for line in (tmp_path / "out" / "text").read_text().splitlines())
    assert text["phone"] == " ".join(VOCAB.tokens(expected["phone"][0].labels))
    # the same prompts as label indices, from --prompts
    (tmp_path / "ids.txt").write_text("".join(f"{u} {' '.join(map(str, p))}\n" for u, p in GENERATE_PROMPTS.items()))
    result = decode(GENERATE, "--prompts", tmp_path / "ids.txt", "--prompts-format", "ids", "--output", tmp_path / "ids")
    assert result.exit_code == 0, result.output
    by_ids = nbest_records(tmp_path / "ids")
    assert {u: r["nbest"] for u, r in by_ids.items()} == {u: r["nbest"] for u, r in records.items()}


def test_cli_prompt_errors(tmp_path):
    (tmp_path / "bad.txt").write_text("a one two\nb one zehn\n")
    result = decode(GENERATE, "--prompts", tmp_path / "bad.txt", "--output", tmp_path / "out")
    assert result.exit_code != 0
    assert "utterance 'b'" in result.output and "'zehn' is not in the vocabulary" in result.output
    # features and prompts: every utterance needs its prompt
    (tmp_path / "some.txt").write_text("example-0 3\n")
    result = decode(PREFIX_LM, "--prompts", tmp_path / "some.txt", "--output", tmp_path / "out2")
    assert result.exit_code != 0 and "no prompt for 2 utterance(s)" in result.output
    # no features, no prompts
    result = decode(GENERATE, "-o", "io.prompts=null", "--output", tmp_path / "out3")
    assert result.exit_code != 0 and "no features to decode" in result.output


def test_cli_prompts_with_features(tmp_path):
    ids = sorted(p.stem for p in (ROOT / "examples" / "features").glob("*.npy"))
    prompts = {u: [3 + i, 4] for i, u in enumerate(ids)}
    (tmp_path / "p.txt").write_text("".join(f"{u} {' '.join(map(str, p))}\n" for u, p in prompts.items()))
    result = decode(PREFIX_LM, "--prompts", tmp_path / "p.txt", "--output", tmp_path / "out")
    assert result.exit_code == 0, result.output
    records = nbest_records(tmp_path / "out")
    features = {u: np.load(ROOT / "examples" / "features" / f"{u}.npy") for u in ids}
    expected = Decoder.from_config(PREFIX_LM).decode(features, prompts=prompts)
    for utt, hyps in expected.items():
        assert [h["labels"] for h in records[utt]["nbest"]] == [h.labels for h in hyps]


def test_the_optimum_decoder_model_equals_its_oracle_on_padded_prompts():
    pair = build_optimum_lm(2)
    feeds = {"input_ids": np.array([[2, 3, 4], [5, 6, 0]]), "attention_mask": np.array([[1, 1, 1], [1, 1, 0]]),
             "position_ids": np.tile(np.arange(3), (2, 1))}
    session = ort.InferenceSession(pair.prefill.serialized())
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    expected = pair.prefill.oracle(feeds)
    valid = feeds["attention_mask"].astype(bool)
    np.testing.assert_allclose(got["logits"][valid], expected["logits"][valid], atol=1e-5)
    for name in expected:
        if name != "logits":
            np.testing.assert_allclose(got[name].transpose(0, 2, 1, 3)[valid],
                                       expected[name].transpose(0, 2, 1, 3)[valid], atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["plain", "cuda-graphs"])
def test_text_generation_on_cuda_equals_the_cpu(graphs):
    overrides = ["runtime.device=cuda", f"runtime.cuda_graphs.enabled={str(graphs).lower()}",
                 "runtime.cuda_graphs.time_step=4"]
    cpu = Decoder.from_config(GENERATE).decode(prompts=GENERATE_PROMPTS)
    cuda = Decoder.from_config(GENERATE, overrides).decode(prompts=GENERATE_PROMPTS)
    for utt, hyps in cpu.items():
        assert [h.labels for h in cuda[utt]] == [h.labels for h in hyps]
        np.testing.assert_allclose([h.score for h in cuda[utt]], [h.score for h in hyps], atol=1e-4)
