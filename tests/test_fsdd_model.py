"""The shipped FSDD models decode bundled real test audio (log-mel front end; CTC prefix search,
with and without the shipped LSTM or transformer LM; the transducer and the attention
encoder-decoder greedy, beam and beam + LM; joint CTC/attention) to the expected transcripts."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpudecode.cli import main

ROOT = Path(__file__).resolve().parent.parent

def test_shipped_model_transcribes_the_bundled_test_audio(tmp_path):
    result = CliRunner().invoke(main, ["decode", str(ROOT / "configs" / "fsdd-ctc.yaml"), "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    hyps = dict(line.split(" ", 1) for line in (tmp_path / "text").read_text().splitlines())
    assert hyps == _with({})  # the references: a change means the model, front end or search changed
    assert "WER                     0.00 % (0 errors / 40 words: 0 sub, 0 del, 0 ins)" in result.output


def test_shipped_model_with_the_lstm_lm_transcribes_the_bundled_test_audio(tmp_path):
    """CTC prefix beam 8 + the shipped LSTM LM + length reward (configs/fsdd-ctc-lm.yaml): all 8
    transcripts equal the references, as without the LM, and each hypothesis reports both fused
    scorers."""
    result = CliRunner().invoke(main, ["decode", str(ROOT / "configs" / "fsdd-ctc-lm.yaml"), "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    hyps = dict(line.split(" ", 1) for line in (tmp_path / "text").read_text().splitlines())
    assert hyps == _with({})
    assert "WER                     0.00 % (0 errors / 40 words: 0 sub, 0 del, 0 ins)" in result.output
    # both fused scorers are reported per hypothesis
    first = json.loads((tmp_path / "nbest.jsonl").read_text().splitlines()[0])
    assert {"ctc", "lm", "length"} <= set(first["nbest"][0]["scores"])


def test_shipped_model_with_the_transformer_lm_transcribes_the_bundled_test_audio(tmp_path):
    """CTC prefix beam 8 + the shipped transformer LM (KV caches through the transformer state
    manager) + length reward (configs/fsdd-ctc-tlm.yaml): all 8 transcripts equal the references,
    as with the LSTM LM; each best hypothesis's LM score is the step model's own sentence
    log-probability (``</s> w1 ... wn </s>``, run here step by step from an empty history), and the
    total is the scaled sum of the scorers."""
    np = pytest.importorskip("numpy")
    ort = pytest.importorskip("onnxruntime")
    result = CliRunner().invoke(main, ["decode", str(ROOT / "configs" / "fsdd-ctc-tlm.yaml"), "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    hyps = dict(line.split(" ", 1) for line in (tmp_path / "text").read_text().splitlines())
    assert hyps == _with({})
    assert "WER                     0.00 % (0 errors / 40 words: 0 sub, 0 del, 0 ins)" in result.output

    session = ort.InferenceSession(str(ROOT / "examples/fsdd-model/transformer-lm.onnx"),
                                   providers=["CPUExecutionProvider"])
    past = [f"past-{kind}-{i}" for i in range(2) for kind in ("key", "value")]
    end = 1  # "</s>": sentence begin and end
    records = [json.loads(line) for line in (tmp_path / "nbest.jsonl").read_text().splitlines()]
    assert len(records) == 8
    for record in records:
        best = record["nbest"][0]
        assert set(best["scores"]) == {"ctc", "lm", "length"}
        sequence = [end, *best["labels"], end]
        feeds = {p: np.zeros((1, 4, 0, 32), np.float32) for p in past}
        log_prob = 0.0
        for t in range(len(sequence) - 1):
            outputs = session.run(None, {"token": np.array([[sequence[t]]], np.int32),
                                         "prefix-length": np.array([t], np.int32), **feeds})
            log_prob += float(outputs[0][0, 0, sequence[t + 1]])
            feeds = dict(zip(past, outputs[1:]))
        assert best["scores"]["lm"] == pytest.approx(log_prob, abs=1e-4)
        scores = best["scores"]  # scales of configs/fsdd-ctc-tlm.yaml: ctc 1, lm 1.2, length 1
        assert best["score"] == pytest.approx(scores["ctc"] + 1.2 * scores["lm"] + scores["length"], abs=1e-4)


def _decode(tmp_path, config: str, *overrides: str) -> tuple[dict[str, str], str]:
    args = ["decode", str(ROOT / "configs" / config), "--output", str(tmp_path)]
    for override in overrides:
        args += ["-o", override]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return dict(line.split(" ", 1) for line in (tmp_path / "text").read_text().splitlines()), result.output


def _with(changes: dict[str, str]) -> dict[str, str]:
    references = dict(line.split(" ", 1) for line in
                      (ROOT / "examples/fsdd-model/test-text").read_text().splitlines())
    return {**references, **changes}


# The shipped transducer on the bundled test audio: greedy, beam 8 and beam 8 with the LSTM LM
# (weights tuned for it on dev) give the references.
TRANSDUCER_CASES = {
    "greedy": ("fsdd-transducer.yaml", ["search.type=transducer-greedy"], _with({}),
               "0 errors / 40 words: 0 sub, 0 del, 0 ins"),
    "beam": ("fsdd-transducer.yaml", [], _with({}), "0 errors / 40 words: 0 sub, 0 del, 0 ins"),
    "beam+lm": ("fsdd-transducer-lm.yaml", [], _with({}), "0 errors / 40 words: 0 sub, 0 del, 0 ins"),
}


@pytest.mark.parametrize("case", list(TRANSDUCER_CASES))
def test_shipped_transducer_transcribes_the_bundled_test_audio(tmp_path, case):
    config, overrides, expected, errors = TRANSDUCER_CASES[case]
    hyps, output = _decode(tmp_path, config, *overrides)
    assert hyps == expected
    assert errors in output


# The shipped attention encoder-decoder on the bundled test audio: alone (greedy = beam 1, beam 8,
# beam 8 + LM) it repeats the last digit of test-00004 (1 insertion in 40 words); joint
# CTC/attention decoding with the encoder's CTC head gives the references, with or without the LM.
_AED_ALONE = {"test-00004-yweweler": "four seven four eight six eight six"}
AED_CASES = {
    "greedy": ("fsdd-aed.yaml", ["search.beam_size=1"], _with(_AED_ALONE), "1 errors / 40 words: 0 sub, 0 del, 1 ins"),
    "beam": ("fsdd-aed.yaml", [], _with(_AED_ALONE), "1 errors / 40 words: 0 sub, 0 del, 1 ins"),
    "beam+lm": ("fsdd-aed-lm.yaml", [], _with(_AED_ALONE), "1 errors / 40 words: 0 sub, 0 del, 1 ins"),
    "joint-ctc": ("fsdd-aed-ctc.yaml", [], _with({}), "0 errors / 40 words: 0 sub, 0 del, 0 ins"),
    "joint-ctc+lm": ("example.yaml", [], _with({}), "0 errors / 40 words: 0 sub, 0 del, 0 ins"),
}


@pytest.mark.parametrize("case", list(AED_CASES))
def test_shipped_aed_transcribes_the_bundled_test_audio(tmp_path, case):
    config, overrides, expected, errors = AED_CASES[case]
    hyps, output = _decode(tmp_path, config, *overrides)
    assert hyps == expected
    assert errors in output


@pytest.mark.parametrize("encoder, output", [("ctc-encoder.onnx", "log-probs"),
                                             ("aed-encoder.onnx", "log-probs"),
                                             ("transducer-encoder.onnx", "encoder-states")])
def test_shipped_encoders_ignore_the_recording_level(encoder, output):
    """The shipped encoders subtract each utterance's mean log-mel vector over its real frames, so
    a level change (a constant added to the log-mel features of one utterance) leaves their
    outputs unchanged, also for an utterance padded in a batch with a longer one."""
    np = pytest.importorskip("numpy")
    ort = pytest.importorskip("onnxruntime")
    soundfile = pytest.importorskip("soundfile")
    from gpudecode.io.frontend import LogMelFrontEnd, LogMelOptions

    front_end = LogMelFrontEnd(LogMelOptions(sample_rate_hz=8000, window_ms=25, hop_ms=10, fft_size=256,
                                             num_mel_bins=40, low_freq_hz=20, window_type="hann"))
    audio = ROOT / "examples/fsdd-model/test-audio"
    short, long = (front_end(soundfile.read(audio / f"{name}.wav", dtype="float64")[0])
                   for name in ("test-00001-yweweler", "test-00000-nicolas"))
    assert short.shape[0] < long.shape[0]
    session = ort.InferenceSession(str(ROOT / "examples/fsdd-model" / encoder), providers=["CPUExecutionProvider"])

    def run(first):
        batch = np.zeros((2, long.shape[0], 40), np.float32)
        batch[0, : first.shape[0]], batch[1] = first, long
        sizes = np.array([first.shape[0], long.shape[0]], np.int32)
        out = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {"features": batch, "features-size": sizes})))
        return out[output][0], out[output][1]

    plain, quieter = run(short), run(short - np.float32(2.5))
    frames = (((short.shape[0] - 1) // 2 - 1) // 2)  # after the 4x subsampling
    np.testing.assert_allclose(quieter[0][:frames], plain[0][:frames], atol=1e-4)
    np.testing.assert_allclose(quieter[1], plain[1], atol=1e-6)  # the other utterance untouched
