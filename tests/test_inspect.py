"""`gpudecode inspect` on the reference models."""

import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.testing import build_encoder, build_lstm_lm, build_transformer_decoder, build_transformer_lm


@pytest.mark.parametrize("kv_layout, time_axis", [("bhtd", 2), ("btd", 1)])
def test_inspect_lists_every_kv_pair_with_its_time_axis(tmp_path, kv_layout, time_axis):
    path = build_transformer_decoder(seed=1, num_layers=3, kv_layout=kv_layout).save(tmp_path / "decoder.onnx")
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 0, result.output
    assert "convention: rasr" in result.output
    for layer in range(3):
        for kind in ("key", "value"):
            line = re.search(rf"^\s*past-{kind}-{layer} -> present-{kind}-{layer}\s.*$", result.output, re.M)
            assert line, result.output
            assert f"time axis {time_axis}" in line.group(0)
    assert "state variables (6)" in result.output
    assert re.search(r"^\s*cross-key-2 .* from 'cross-key-2'", result.output, re.M)


def test_inspect_huggingface_lstm_and_encoder(tmp_path):
    hf = build_transformer_lm(seed=1, convention="huggingface").save(tmp_path / "hf.onnx")
    out = CliRunner().invoke(main, ["inspect", str(hf)]).output
    assert "convention: huggingface" in out
    assert re.search(r"past_key_values\.0\.key -> present\.0\.key .*time axis 2", out)
    lstm = build_lstm_lm(seed=1).save(tmp_path / "lstm.onnx")
    out = CliRunner().invoke(main, ["inspect", str(lstm)]).output
    assert re.search(r"lstm-h-0 -> new-lstm-h-0 .*time axis none", out), out
    encoder = build_encoder(seed=1).save(tmp_path / "enc.onnx")
    out = CliRunner().invoke(main, ["inspect", str(encoder)]).output
    assert "convention: encoder" in out and "cross-key-0" in out


def test_inspect_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "missing.onnx")])
    assert result.exit_code == 1 and "missing.onnx does not exist" in result.output
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00garbage")
    result = CliRunner().invoke(main, ["inspect", str(bad)])
    assert result.exit_code == 1 and "bad.onnx: not a readable ONNX file" in result.output


def test_python_dash_m_runs_the_cli(tmp_path):
    path = build_transformer_decoder(seed=1).save(tmp_path / "decoder.onnx")
    result = subprocess.run([sys.executable, "-m", "gpudecode", "inspect", str(path)], capture_output=True, text=True)
    assert result.returncode == 0 and "past-key-1 -> present-key-1" in result.stdout


def test_inspect_recognises_a_ctc_encoder(tmp_path):
    from gpudecode.testing import build_ctc_encoder

    path = build_ctc_encoder(seed=1, vocab_size=7).save(tmp_path / "ctc.onnx")
    out = CliRunner().invoke(main, ["inspect", str(path)]).output
    assert "convention: CTC encoder" in out and "log-probs" in out


def test_inspect_recognises_transducer_prediction_and_joint_networks(tmp_path):
    from gpudecode.testing.transducer import build_joint_network, build_prediction_network

    prediction = build_prediction_network(seed=1).save(tmp_path / "prediction.onnx")
    out = CliRunner().invoke(main, ["inspect", str(prediction)]).output
    assert "convention: rasr (RASR stateful step model, as a transducer prediction network)" in out
    assert "scores output: 'prediction'" in out and "pred-h-0 -> new-pred-h-0" in out
    joint = build_joint_network(seed=1).save(tmp_path / "joint.onnx")
    out = CliRunner().invoke(main, ["inspect", str(joint)]).output
    assert "convention: transducer joint network ('encoder-frame' + 'prediction' -> 'log-probs')" in out


@pytest.mark.parametrize("utterance_rows, said", [("lane", "one row per hypothesis"),
                                                  ("utterance", "one row per utterance")])
def test_inspect_says_how_the_per_utterance_inputs_are_laid_out(tmp_path, utterance_rows, said):
    path = build_transformer_decoder(seed=1, utterance_rows=utterance_rows).save(tmp_path / "decoder.onnx")
    out = CliRunner().invoke(main, ["inspect", str(path)]).output
    assert f"per-utterance inputs (5, {said}):" in out, out


@pytest.mark.parametrize("attention, said", [("dense", "history alignment: right"), ("ragged", "history alignment: left")])
def test_inspect_says_how_histories_are_aligned(tmp_path, attention, said):
    path = build_transformer_decoder(seed=1, state_outputs="new", attention=attention).save(tmp_path / "decoder.onnx")
    out = CliRunner().invoke(main, ["inspect", str(path)]).output
    assert said in out, out


def test_inspect_lists_outputs_written_in_place(tmp_path):
    path = build_transformer_decoder(seed=1, state_outputs="new", attention="gqa").save(tmp_path / "decoder.onnx")
    out = CliRunner().invoke(main, ["inspect", str(path)]).output
    assert "written in place" in out and "kv-cache-key-0" in out and "history alignment: left" in out, out
    dense = build_transformer_decoder(seed=1).save(tmp_path / "dense.onnx")
    assert "written in place" not in CliRunner().invoke(main, ["inspect", str(dense)]).output


def test_inspect_says_where_cuda_graphs_append_the_cache_in_place():
    """GenAI's export: every present is GroupQueryAttention's over its own past; a plain-attention
    export (the GPT-2 fixture) copies its cache and gets no such line."""
    from pathlib import Path

    peers = Path(__file__).resolve().parent / "fixtures" / "peers"
    out = CliRunner().invoke(main, ["inspect", str(peers / "genai")]).output
    assert "cache with CUDA graphs: appended in place" in out, out
    plain = CliRunner().invoke(main, ["inspect", str(peers / "gpt2" / "decoder_with_past_model.onnx")]).output
    assert "state variables" in plain and "appended in place" not in plain, plain
