"""Hypotheses the search cuts short are flagged (``Hypothesis.truncated``, ``"truncated": true`` in
nbest.jsonl, the run summary and a warning), and a model's own position limit is checked at load.

Oracles: a truncated label-synchronous hypothesis has exactly its label limit of labels and no
sentence-end; one that ends by itself is shorter than the limit and counts its sentence-end in
``length``; a transducer that prefers a label in every step emits ``max_symbols_per_frame`` labels
per frame.
"""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.decoder import Decoder
from gpudecode.hypothesis import Hypothesis
from gpudecode.io import ResultWriter, UtteranceResult, Vocabulary
from gpudecode.scorers import LabelScorer, UtteranceBatch
from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer
from gpudecode.scorers.transducer import StatelessPredictionNetwork
from gpudecode.search import (
    CtcPrefixOptions,
    LabelSyncOptions,
    TransducerOptions,
    ctc_prefix_search,
    label_sync_search,
    transducer_greedy_search,
    transducer_search,
)
from gpudecode.search.positions import check_max_labels
from gpudecode.session import ModelError, SessionOptions
from gpudecode.testing import build_stateless_prediction_network
from gpudecode.testing.transformer import build_transformer_decoder

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "example.yaml"
AUDIO = ROOT / "examples" / "fsdd-model" / "test-audio"
V, END = 6, 1


class RowScorer(LabelScorer):
    """Scores every lane of an utterance with that utterance's fixed row [V] (``rows``: id -> row)."""

    def __init__(self, rows: dict[str, np.ndarray]):
        self.rows = {k: np.asarray(r, np.float32) for k, r in rows.items()}
        self.vocab_size = len(next(iter(self.rows.values())))

    def begin(self, layout):
        super().begin(layout)
        self._table = layout.xp.zeros((layout.num_groups, self.vocab_size), np.float32)

    def admit(self, utterances, groups):
        xp = self.layout.xp
        self._table[xp.asarray(groups)] = xp.asarray(np.stack([self.rows[u] for u in utterances.ids]))

    def initial_context(self, groups, ctx=None):
        return None

    def score(self, ctx):
        return self._table[self.layout.lane_groups()]

    def extend(self, ctx, parents, labels):
        return None


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return (x - np.log(np.exp(x - x.max()).sum()) - x.max()).astype(np.float32)


# utterance "runs" prefers label 3 over sentence-end at every step; "ends" prefers sentence-end
ROWS = {"runs": log_softmax([-9, 0, -9, 3, 1, -9]), "ends": log_softmax([-9, 3, -9, 0, 1, -9])}


def batch(ids, lengths):
    return UtteranceBatch(ids=list(ids), input_lengths=np.asarray(lengths, np.int64), inputs={})


@pytest.mark.parametrize("finished", ["in-beam", "separate", "separate-genai"])
@pytest.mark.parametrize("active", [None, 1])
def test_label_sync_hypotheses_force_ended_at_the_label_limit_are_truncated(finished, active):
    options = LabelSyncOptions(beam_size=2, sentence_end=END, max_labels=5, max_labels_per_input=1.0,
                               finished=finished)
    rows = {**ROWS, "short": ROWS["runs"]}
    nbest = label_sync_search([("row", RowScorer(rows), 1.0)], batch(["runs", "ends", "short"], [9, 9, 3]),
                              options, max_active_utterances=active)
    runs, ends, short = (lists[0] for lists in nbest)
    assert runs.truncated and runs.labels == [3] * 5 and runs.length == 5  # the limit, no sentence-end
    assert short.truncated and short.labels == [3] * 3  # max_labels_per_input × 3 frames
    assert not ends.truncated and ends.labels == [] and ends.length == 1  # sentence-end counted
    assert all(h.truncated == (END not in h.labels and h.length == len(h.labels)) for lists in nbest for h in lists)


def test_truncated_is_written_to_nbest_jsonl_only_when_set(tmp_path):
    vocab_path = tmp_path / "vocab.txt"
    vocab_path.write_text("".join(f"w{i}\n" for i in range(V)))
    vocabulary = Vocabulary.load(vocab_path)
    with ResultWriter(tmp_path / "out", vocabulary, formats=["jsonl"]) as writer:
        writer.write(UtteranceResult(id="cut", nbest=[Hypothesis(labels=[2, 3], score=-1.0, truncated=True),
                                                      Hypothesis(labels=[2], score=-2.0)]))
        writer.write(UtteranceResult(id="whole", nbest=[Hypothesis(labels=[2], score=-1.0)]))
    cut, whole = (json.loads(line) for line in (tmp_path / "out" / "nbest.jsonl").read_text().splitlines())
    assert cut["nbest"][0]["truncated"] is True and "truncated" not in cut["nbest"][1]
    assert "truncated" not in whole["nbest"][0]
    assert set(whole["nbest"][0]) == {"rank", "words", "tokens", "labels", "score", "scores", "frames"}


# --- transducer ---------------------------------------------------------------------------------
def prediction_network():
    reference = build_stateless_prediction_network(0, vocab_size=V, context_size=2, output_dim=4, blank=0)
    return StatelessPredictionNetwork(model=reference.serialized(), blank=0,
                                      session_options=SessionOptions(device="cpu", use_tf32=False))


def joint(encoder_frames, prediction):
    """Prefers label 3 where the frame's first value is positive, else blank."""
    wants_label = np.asarray(encoder_frames)[:, 0:1] > 0
    return np.where(wants_label, log_softmax([0, -5, -5, 3, -5, -5]), log_softmax([3, -5, -5, 0, -5, -5]))


ENCODER = np.zeros((2, 3, 4), np.float32)
ENCODER[0, :, 0] = 1  # utterance "label": a label wins every step; "blank": blank does


@pytest.mark.parametrize("symbols", [1, 2, 3])
def test_transducer_hypotheses_cut_by_the_symbol_limit_are_truncated(symbols):
    options = TransducerOptions(beam_size=2, blank=0, max_symbols_per_frame=symbols)
    nbest = transducer_search(ENCODER, np.array([3, 3]), prediction_network(), joint, options, ids=["label", "blank"])
    greedy = transducer_greedy_search(ENCODER, np.array([3, 3]), prediction_network(), joint, blank=0,
                                      max_symbols_per_frame=symbols, ids=["label", "blank"])
    for lists in (nbest, greedy):
        label, blank = lists[0][0], lists[1][0]
        assert label.labels == [3] * (3 * symbols) and blank.labels == []
        # one symbol per frame is the topology (a label consumes its frame), not a cut
        assert label.truncated == (symbols > 1) and not blank.truncated


def test_ctc_has_no_length_cap_so_nothing_is_truncated():
    log_probs = np.log(np.full((1, 6, V), 1 / V, np.float32))
    nbest = ctc_prefix_search(log_probs, np.array([6]), CtcPrefixOptions(beam_size=3, blank=0))
    assert nbest[0] and not any(h.truncated for h in nbest[0])


# --- end to end: a long recording with the example config ---------------------------------------
def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.astype(np.int16).tobytes())


def test_a_long_recording_with_the_example_config_is_flagged_truncated(tmp_path):
    """20 s of the bundled recordings one after the other need far more than example.yaml's
    max_labels of 24 labels; one recording of two digits does not."""
    chunks = []
    for path in sorted(AUDIO.glob("*.wav")):
        with wave.open(str(path)) as wav:
            rate = wav.getframerate()
            chunks.append(np.frombuffer(wav.readframes(wav.getnframes()), np.int16))
    audio = tmp_path / "audio"
    audio.mkdir()
    write_wav(audio / "long.wav", np.tile(np.concatenate(chunks), 2)[:20 * rate], rate)
    write_wav(audio / "short.wav", chunks[1], rate)  # "eight four"
    result = CliRunner().invoke(main, ["decode", str(EXAMPLE), "--features", str(audio), "--output",
                                       str(tmp_path / "out"), "-o", "io.references=null"])
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "nbest.jsonl").read_text().splitlines())}
    long, short = records["long"]["nbest"][0], records["short"]["nbest"][0]
    assert long["truncated"] is True and len(long["labels"]) == 24  # example.yaml's max_labels
    assert "truncated" not in short and short["words"] == "eight four"
    assert "truncated (length limit)  1" in result.output
    assert "warning: 1 utterance(s) cut short by the search's length limits" in result.output
    assert "max_symbols_per_frame): long; their hypotheses" in result.output  # the short one is not named


# --- a model's own positions --------------------------------------------------------------------
def test_the_example_decoder_declares_its_positions_and_a_longer_max_labels_is_refused(tmp_path):
    with pytest.raises(ModelError, match=r"aed-decoder\.onnx: scorer 'decoder': the model has 32 label positions "
                                         r"\(ONNX metadata max_positions\), but search\.max_labels is 33"):
        Decoder.from_config(EXAMPLE, ["search.max_labels=33"])
    result = CliRunner().invoke(main, ["decode", str(EXAMPLE), "--output", str(tmp_path / "out"),
                                       "-o", "search.max_labels=40"])
    assert result.exit_code != 0 and "Error:" in result.output and "search.max_labels to at most 32" in result.output
    assert Decoder.from_config(EXAMPLE, ["search.max_labels=32"]).search_options.max_labels == 32


def tiny_decoder(tmp_path, max_positions: str | None) -> Path:
    reference = build_transformer_decoder(0, vocab_size=V, model_dim=8, num_layers=1, num_heads=1, ffn_dim=8,
                                          cross_attention=None, max_positions=16)
    model = reference.model
    if max_positions is not None:
        entry = model.metadata_props.add()
        entry.key, entry.value = "max_positions", max_positions
    path = tmp_path / "tiny-decoder.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_a_tiny_model_that_declares_its_positions(tmp_path):
    scorer = OnnxDecoderScorer(model=str(tiny_decoder(tmp_path, "8")), vocab_size=V, start_labels=[END])
    assert scorer.spec.max_time == 7
    check_max_labels([("lm", scorer, 1.0)], 8)  # 8 labels fit in 8 positions
    with pytest.raises(ModelError, match=r"tiny-decoder\.onnx: scorer 'lm': the model has 8 label positions "
                                         r"\(ONNX metadata max_positions\), but search\.max_labels is 9"):
        check_max_labels([("lm", scorer, 1.0)], 9)
    undeclared = OnnxDecoderScorer(model=str(tiny_decoder(tmp_path, None)), vocab_size=V, start_labels=[END])
    assert undeclared.spec.max_time is None
    check_max_labels([("lm", undeclared, 1.0)], 1000)
    with pytest.raises(ModelError, match=r"metadata max_positions='many': expected a number of positions >= 1"):
        OnnxDecoderScorer(model=str(tiny_decoder(tmp_path, "many")), vocab_size=V, start_labels=[END])
