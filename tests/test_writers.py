"""Vocabulary, word merging, result writers (text, JSON lines, CTM), resume, WER."""

from __future__ import annotations

import json

import pytest

from gpudecode.io import (
    Hypothesis,
    ResultFileError,
    ResultWriter,
    UtteranceResult,
    Vocabulary,
    VocabularyError,
    merge_words,
    read_done_ids,
    score_wer,
)

LABELS = ["<blank>", "<s>", "</s>", "<unk>", "▁he", "llo", "▁world", "▁a", "b@@", "c", "d"]


@pytest.fixture
def vocab_path(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(LABELS) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def vocab(vocab_path):
    return Vocabulary.load(vocab_path, blank="<blank>", sentence_begin=1, sentence_end="</s>",
                           unknown="<unk>")


def _result(utt_id, labels, *, score=-1.5, frames=None, more=()):
    best = Hypothesis(labels=labels, score=score, scores={"decoder": score - 0.5, "lm": 0.5},
                      frames=frames)
    return UtteranceResult(id=utt_id, nbest=[best, *more])


# --- vocabulary and word merging ---------------------------------------------------------

def test_vocabulary_resolves_special_labels_by_label_or_index(vocab):
    assert len(vocab) == len(LABELS)
    assert (vocab.blank_index, vocab.sentence_begin_index, vocab.sentence_end_index,
            vocab.unknown_index) == (0, 1, 2, 3)
    assert vocab.index("▁world") == 6 and vocab[6] == "▁world"
    assert vocab.tokens([1, 4, 0, 5, 3, 2]) == ["▁he", "llo", "<unk>"]


def test_vocabulary_errors(tmp_path, vocab_path):
    with pytest.raises(VocabularyError, match=r"vocab\.txt: sentence_end label '<eos>' is not in "
                                              r"the vocabulary \(11 labels\)"):
        Vocabulary.load(vocab_path, sentence_end="<eos>")
    with pytest.raises(VocabularyError, match=r"blank index 11 is out of range: the vocabulary "
                                              r"has 11 labels \(0\.\.10\)"):
        Vocabulary.load(vocab_path, blank=11)
    with pytest.raises(VocabularyError, match=r"label 'zzz' is not in the vocabulary"):
        Vocabulary.load(vocab_path).index("zzz")
    dup = tmp_path / "dup.txt"
    dup.write_text("a\nb\na\n")
    with pytest.raises(VocabularyError, match=r"dup\.txt: label 'a' on lines 1 and 3"):
        Vocabulary.load(dup)
    blank_line = tmp_path / "blank.txt"
    blank_line.write_text("a\n\nb\n")
    with pytest.raises(VocabularyError, match=r"blank\.txt: line 2 is blank"):
        Vocabulary.load(blank_line)
    with pytest.raises(VocabularyError, match=r"nope\.txt: vocabulary file does not exist"):
        Vocabulary.load(tmp_path / "nope.txt")


@pytest.mark.parametrize("mode,tokens,words", [
    ("none", ["a", "b"], ["a", "b"]),
    ("sentencepiece", ["▁he", "llo", "▁world", "▁", "x"], ["hello", "world", "x"]),
    ("sentencepiece", ["lead", "▁in"], ["lead", "in"]),
    ("bpe", ["b@@", "c", "d", "e@@", "f@@"], ["bc", "d", "ef"]),
])
def test_merge_words(mode, tokens, words):
    assert [w.text for w in merge_words(tokens, mode)] == words


def test_merge_words_keeps_token_spans():
    merged = merge_words(["▁he", "llo", "▁world"], "sentencepiece")
    assert [(w.first, w.last) for w in merged] == [(0, 1), (2, 2)]
    with pytest.raises(ValueError, match="unknown word merging 'wordpiece'"):
        merge_words(["a"], "wordpiece")


# --- writers -----------------------------------------------------------------------------

def test_text_and_jsonl(tmp_path, vocab):
    second = Hypothesis(labels=[1, 7, 2], score=-3.0, scores={"decoder": -3.0, "lm": 0.0})
    with ResultWriter(tmp_path / "out", vocab, formats=["text", "jsonl"],
                      word_merging="sentencepiece") as writer:
        writer.write(_result("u1", [1, 4, 5, 6, 2], more=[second]))
        # Flushed at once: readable before the writer closes.
        assert (tmp_path / "out" / "text").read_text() == "u1 hello world\n"
        writer.write(UtteranceResult(id="u2", nbest=[]))
    assert (tmp_path / "out" / "text").read_text() == "u1 hello world\nu2\n"
    records = [json.loads(line) for line in (tmp_path / "out" / "nbest.jsonl").open()]
    assert records[0] == {
        "id": "u1", "text": "hello world",
        "nbest": [
            {"rank": 1, "words": "hello world", "tokens": ["▁he", "llo", "▁world"],
             "labels": [1, 4, 5, 6, 2], "score": -1.5, "scores": {"decoder": -2.0, "lm": 0.5},
             "frames": None},
            {"rank": 2, "words": "a", "tokens": ["▁a"], "labels": [1, 7, 2], "score": -3.0,
             "scores": {"decoder": -3.0, "lm": 0.0}, "frames": None},
        ]}
    assert records[1] == {"id": "u2", "text": "", "nbest": []}


def test_ctm_from_frame_indices(tmp_path, vocab):
    with ResultWriter(tmp_path, vocab, formats=["ctm", "jsonl"], word_merging="bpe",
                      frame_shift_s=0.04) as writer:
        # blank (0) frames are dropped with their label; "b@@ c" is one word over frames 3..5.
        writer.write(_result("utt", [8, 0, 9, 10], frames=[3, 4, 5, 9]))
        writer.write(_result("no-frames", [10]))
    assert (tmp_path / "hyp.ctm").read_text() == ("utt 1 0.120 0.120 bc\n"
                                                 "utt 1 0.360 0.040 d\n")
    record = json.loads((tmp_path / "nbest.jsonl").read_text().splitlines()[0])
    assert record["nbest"][0]["frames"] == [3, 4, 5, 9]


def test_writer_argument_errors(tmp_path, vocab):
    with pytest.raises(ValueError, match="ctm format needs a positive frame shift"):
        ResultWriter(tmp_path, vocab, formats=["ctm"])
    with pytest.raises(ValueError, match=r"output formats \['xml'\]"):
        ResultWriter(tmp_path, vocab, formats=["xml"])
    with ResultWriter(tmp_path, vocab, formats=["text"]) as writer:
        with pytest.raises(ValueError, match="contains whitespace"):
            writer.write(_result("a b", [4]))
    with pytest.raises(ValueError, match="3 frame indices for 2 labels"):
        Hypothesis(labels=[1, 2], score=0.0, frames=[0, 1, 2])


# --- resume ------------------------------------------------------------------------------

def test_read_done_ids_tolerates_a_truncated_last_line(tmp_path, vocab):
    with ResultWriter(tmp_path, vocab, formats=["text", "jsonl"]) as writer:
        for i in range(3):
            writer.write(_result(f"u{i}", [4, 5]))
    assert read_done_ids(tmp_path) == {"u0", "u1", "u2"}
    jsonl = tmp_path / "nbest.jsonl"
    with jsonl.open("a") as f:
        f.write('{"id": "u3", "text": "hel')  # killed mid-line
    assert read_done_ids(tmp_path) == {"u0", "u1", "u2"}
    # text alone decides when there is no JSON lines file; its last line lacks the newline.
    jsonl.unlink()
    with (tmp_path / "text").open("a") as f:
        f.write("u3 hel")
    assert read_done_ids(tmp_path) == {"u0", "u1", "u2"}
    assert read_done_ids(tmp_path / "missing") == set()


def test_resume_cuts_files_back_and_appends(tmp_path, vocab):
    with ResultWriter(tmp_path, vocab, formats=["ctm", "text", "jsonl"],
                      frame_shift_s=0.01) as writer:
        writer.write(_result("u0", [4], frames=[1]))
        writer.write(_result("u1", [6], frames=[2]))
    # A crash between the text and the JSON line of u2, with u2's text line half written:
    with (tmp_path / "hyp.ctm").open("a") as f:
        f.write("u2 1 0.010 0.010 ▁a\n")
    with (tmp_path / "text").open("a") as f:
        f.write("u2 ▁")
    with ResultWriter(tmp_path, vocab, formats=["ctm", "text", "jsonl"], frame_shift_s=0.01,
                      resume=True) as writer:
        assert writer.done_ids == {"u0", "u1"}
        writer.write(_result("u2", [7], frames=[1]))
    assert (tmp_path / "text").read_text() == "u0 ▁he\nu1 ▁world\nu2 ▁a\n"
    assert [line.split()[0] for line in (tmp_path / "hyp.ctm").open()] == ["u0", "u1", "u2"]
    assert [json.loads(x)["id"] for x in (tmp_path / "nbest.jsonl").open()] == ["u0", "u1", "u2"]


def test_fresh_run_truncates_old_outputs(tmp_path, vocab):
    (tmp_path / "text").write_text("old 1 2 3\n")
    with ResultWriter(tmp_path, vocab, formats=["text"]) as writer:
        writer.write(_result("new", [10]))
    assert (tmp_path / "text").read_text() == "new d\n"


# --- WER -----------------------------------------------------------------------------------

def test_score_wer(tmp_path):
    ref = tmp_path / "ref.txt"
    hyp = tmp_path / "text"
    ref.write_text("a one two three\nb four five\nc six\n")
    hyp.write_text("a one too three\nb four five extra\nz seven\n")
    result = score_wer(hyp, ref, tmp_path / "wer.json")
    # a: 1 substitution; b: 1 insertion; c: missing hypothesis -> 1 deletion. 6 ref words.
    assert (result["substitutions"], result["insertions"], result["deletions"]) == (1, 1, 1)
    assert result["num_ref_words"] == 6
    assert result["wer"] == pytest.approx(3 / 6)
    assert 0 < result["cer"] < result["wer"]
    assert result["num_missing_hypotheses"] == 1 and result["missing_hypotheses"] == ["c"]
    assert result["num_hypotheses_without_reference"] == 1
    assert json.loads((tmp_path / "wer.json").read_text())["wer"] == pytest.approx(0.5)


def test_score_wer_errors(tmp_path):
    (tmp_path / "hyp").write_text("a x\n")
    with pytest.raises(ResultFileError, match=r"ref\.txt: file does not exist"):
        score_wer(tmp_path / "hyp", tmp_path / "ref.txt")
    (tmp_path / "dup.txt").write_text("a x\na y\n")
    with pytest.raises(ResultFileError, match=r"dup\.txt: utterance 'a': line 2: duplicate id"):
        score_wer(tmp_path / "hyp", tmp_path / "dup.txt")
