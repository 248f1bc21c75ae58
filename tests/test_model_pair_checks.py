"""Models that do not fit each other are refused at load with an error naming both (issue item 5's
load checks): an encoder's outputs against a decoder's cross-attention inputs, the label counts of
the CTC head, the decoder and the LM against the vocabulary, and a decoder given where the LM
belongs (a state variable's kind against the state manager). Where results exist, they stay."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.config import load_config
from gpudecode.decoder import Decoder
from gpudecode.session import ModelError
from gpudecode.testing.encoder import build_encoder
from gpudecode.testing.lstm import build_lstm_lm
from gpudecode.testing.transformer import build_transformer_decoder

ROOT = Path(__file__).resolve().parent.parent
RANDOM_AED = ROOT / "configs" / "random-aed.yaml"
FSDD = ROOT / "configs" / "example.yaml"  # decoder + CTC head + LSTM LM + length reward
FSDD_MODEL = ROOT / "examples" / "fsdd-model"


def decode(*args):
    return CliRunner().invoke(main, ["decode", *map(str, args)])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    return {
        "encoder-32": build_encoder(0, model_dim=32).save(folder / "encoder-32.onnx"),
        "decoder-reads-16": build_transformer_decoder(0, cross_attention="encoder-states",
                                                      encoder_dim=16).save(folder / "decoder-reads-16.onnx"),
        "encoder-cross-64": build_encoder(0, model_dim=32, decoder_dim=64).save(folder / "encoder-cross-64.onnx"),
        "decoder-precomputed": build_transformer_decoder(0, cross_attention="precomputed").save(
            folder / "decoder-precomputed.onnx"),
        "lstm-lm": build_lstm_lm(0).save(folder / "lstm-lm.onnx"),
    }


def test_an_encoder_whose_states_do_not_fit_the_decoder_is_refused_naming_both(models, tmp_path):
    encoder, decoder = models["encoder-32"], models["decoder-reads-16"]
    with pytest.raises(ModelError) as caught:
        Decoder.from_config(RANDOM_AED, [f"models.encoder.path={encoder}", f"scorers.0.model={decoder}"])
    assert str(caught.value) == (
        f"scorers[0] 'decoder' ({decoder}) does not fit the encoder ({encoder}): its input 'encoder-states' "
        "float32[?,?,16] is fed the encoder's output 'encoder-states' float32[batch,encoder-time,32]: axis 2 is 16 "
        "in the decoder but 32 from the encoder (cross-attention width: the two models were not trained together)")
    result = decode(RANDOM_AED, "--output", tmp_path / "out", "-o", f"models.encoder.path={encoder}",
                    "-o", f"scorers.0.model={decoder}")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Error: scorers[0] 'decoder' ({decoder}) does not fit the encoder ({encoder})" in result.output
    assert not (tmp_path / "out").exists()


def test_precomputed_cross_attention_keys_of_another_width_are_refused(models):
    encoder, decoder = models["encoder-cross-64"], models["decoder-precomputed"]
    with pytest.raises(ModelError, match=(
            r"its input 'cross-key-0' float32\[\?,2,\?,16\] is fed the encoder's output 'cross-key-0' "
            r"float32\[batch,2,encoder-time,32\]: axis 3 is 16 in the decoder but 32 from the encoder")):
        Decoder.from_config(RANDOM_AED, [f"models.encoder.path={encoder}", f"scorers.0.model={decoder}"])


def test_label_counts_of_the_ctc_head_and_the_ctc_encoder_must_match_the_vocabulary(tmp_path):
    vocab = tmp_path / "vocab13.txt"
    vocab.write_text((FSDD_MODEL / "vocab.txt").read_text() + "extra\n")
    with pytest.raises(ModelError) as caught:  # a CTC search on frame log-probs over 12 labels
        Decoder.from_config(ROOT / "configs" / "fsdd-ctc.yaml", [f"models.vocabulary.path={vocab}"])
    encoder = FSDD_MODEL / "ctc-encoder.onnx"
    assert str(caught.value).startswith(
        f"models.encoder ({encoder}, output 'log-probs') scores 12 labels but the vocabulary {vocab} has 13")
    with pytest.raises(ModelError) as caught:  # joint CTC/attention: the AED encoder's CTC head
        Decoder.from_config(FSDD, [f"models.vocabulary.path={vocab}",
                                   "scorers=[{type: ctc-prefix, name: ctc}, {type: length-reward, name: len}]"])
    assert str(caught.value).startswith(
        f"scorers[0] 'ctc' (the CTC head 'log-probs' of {FSDD_MODEL / 'aed-encoder.onnx'}) scores 12 labels but the "
        f"vocabulary {vocab} has 13")


def test_an_lm_of_another_label_set_is_refused_naming_the_lm_and_the_vocabulary(tmp_path, models):
    lm = build_lstm_lm(0, vocab_size=11).save(tmp_path / "lm-11.onnx")
    with pytest.raises(ModelError, match=(
            rf"^scorers\[1\] 'lm': {lm}: score output 'scores' .*: expected vocabulary size 12 \(from the "
            r"vocabulary\), got 11")):
        Decoder.from_config(RANDOM_AED, [f"scorers.1={{type: recurrent-lm, name: lm, model: {lm}, "
                                         "state_manager: {type: lstm}}"])


def test_a_decoder_given_where_the_lm_belongs_is_named(tmp_path):
    decoder = FSDD_MODEL / "aed-decoder.onnx"
    with pytest.raises(ModelError) as caught:
        Decoder.from_config(FSDD, [f"scorers.2.model={decoder}"])
    assert str(caught.value) == (
        f"scorers[2] 'lm': {decoder}: state_manager 'lstm' keeps fixed-size states (an LSTM's), but the model's "
        "state variable 'past-value-0' float32[?,4,?,32] grows along axis 2 (the history of an attention decoder "
        "or a transformer LM): check that this scorer names the model meant for it (a decoder where the LM "
        "belongs?), or give it a transformer state manager")
    lm = FSDD_MODEL / "lstm-lm.onnx"  # and the other way round: an LSTM LM given a transformer manager
    with pytest.raises(ModelError, match=(
            rf"^scorers\[2\] 'lm': {lm}: state_manager 'transformer' keeps histories that grow by one state per "
            r"label, but the model's state variable '.*' float32\[.*\] has no time axis")):
        Decoder.from_config(FSDD, ["scorers.2.state_manager.type=transformer"])


def test_a_refused_model_pair_leaves_the_results_already_written(tmp_path):
    out = tmp_path / "out"
    first = decode(FSDD, "--output", out)
    assert first.exit_code == 0, first.output
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    again = decode(FSDD, "--output", out, "--resume", "--force", "-o",
                   f"scorers.2.model={FSDD_MODEL / 'aed-decoder.onnx'}")
    assert again.exit_code == 1
    assert "Error: scorers[2] 'lm'" in again.output and "a decoder where the LM belongs?" in again.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_the_bundled_configs_pass_the_pair_checks():
    for name in ("example.yaml", "fsdd-aed-ctc-tlm.yaml", "fsdd-ctc-lm.yaml", "fsdd-transducer-lm.yaml",
                 "random-aed.yaml", "transducer.yaml", "ctc.yaml"):
        Decoder(load_config(ROOT / "configs" / name)).close()
