"""The shipped FSDD CTC model decodes bundled real test audio (log-mel front end, CTC prefix
search) to the expected transcripts."""

import json
from pathlib import Path

from click.testing import CliRunner

from gpudecode.cli import main

ROOT = Path(__file__).resolve().parent.parent

# The model's output on the bundled test utterances: the references, except one inserted "two"
# in test-00000 (1 error in 40 words). A change here means the model, the front end or the
# search changed.
EXPECTED = {
    "test-00000-nicolas": "two seven one one two two zero one nine",
    "test-00001-yweweler": "eight four",
    "test-00002-nicolas": "five three zero",
    "test-00003-nicolas": "one zero three four",
    "test-00004-yweweler": "four seven four eight six eight",
    "test-00005-theo": "nine four eight seven zero three five",
    "test-00006-theo": "six four zero",
    "test-00007-yweweler": "four nine seven two zero five one",
}


def test_shipped_model_transcribes_the_bundled_test_audio(tmp_path):
    result = CliRunner().invoke(main, ["decode", str(ROOT / "configs" / "fsdd-ctc.yaml"), "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    hyps = dict(line.split(" ", 1) for line in (tmp_path / "text").read_text().splitlines())
    assert hyps == EXPECTED
    assert "WER                     2.50 % (1 errors / 40 words: 0 sub, 0 del, 1 ins)" in result.output
    references = dict(line.split(" ", 1) for line in (ROOT / "examples/fsdd-model/test-text").read_text().splitlines())
    assert sum(hyps[u] == references[u] for u in references) == 7


def test_shipped_model_with_the_lstm_lm_transcribes_the_bundled_test_audio(tmp_path):
    """CTC prefix beam 8 + the shipped LSTM LM + length reward (configs/fsdd-ctc-lm.yaml): the LM
    removes the inserted "two" of test-00000, so all 8 transcripts equal the references."""
    result = CliRunner().invoke(main, ["decode", str(ROOT / "configs" / "fsdd-ctc-lm.yaml"), "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    hyps = dict(line.split(" ", 1) for line in (tmp_path / "text").read_text().splitlines())
    references = dict(line.split(" ", 1) for line in (ROOT / "examples/fsdd-model/test-text").read_text().splitlines())
    assert hyps == references
    assert "WER                     0.00 % (0 errors / 40 words: 0 sub, 0 del, 0 ins)" in result.output
    # both fused scorers are reported per hypothesis
    first = json.loads((tmp_path / "nbest.jsonl").read_text().splitlines()[0])
    assert {"ctc", "lm", "length"} <= set(first["nbest"][0]["scores"])
