"""The result writer's files are byte for byte what a straightforward formatting writes: per
hypothesis a plain dict through ``json.dumps``, words by ``merge_words`` (the reference below)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from gpudecode.io import Hypothesis, ResultWriter, UtteranceResult, Vocabulary, merge_words

LABELS = ["<blank>", "<s>", "</s>", "<unk>", "▁he", "llo", "▁world", "▁a", "b@@", "c", "d",
          "▁", "@@", "x@@y", "e▁f", "▁▁g", 'q"uote', "back\\slash", "é", "日本", "tab\there",
          "p%s", "\x00nul", "h@@@@"]
SHIFT = 0.04


def _vocab(labels=LABELS) -> Vocabulary:
    return Vocabulary(labels, blank=0, sentence_begin=1, sentence_end=2, unknown=3)


#: no label with a quote (the JSON words of each token as a word are then cut from the JSON tokens)
QUOTELESS = [label.replace('"', "'") for label in LABELS]


def _json_float(value):
    value = float(value)
    return value if math.isfinite(value) else None


def _reference(results, vocab, mode) -> dict[str, bytes]:
    """The files as the straightforward writer formats them."""
    text, jsonl, ctm = [], [], []
    for res in results:
        rendered = []
        for hyp in res.nbest:
            keep = [i for i, label in enumerate(hyp.labels)
                    if int(label) not in vocab.non_word_indices]
            tokens = [vocab.labels[int(hyp.labels[i])] for i in keep]
            frames = None if hyp.frames is None else [int(hyp.frames[i]) for i in keep]
            rendered.append((tokens, merge_words(tokens, mode), frames))
        words = [w.text for w in rendered[0][1]] if rendered else []
        text.append(" ".join([res.id, *words]) + "\n")
        nbest = []
        for rank, (hyp, (tokens, hyp_words, _)) in enumerate(zip(res.nbest, rendered), start=1):
            entry = {"rank": rank, "words": " ".join(w.text for w in hyp_words),
                     "tokens": tokens, "labels": [int(x) for x in hyp.labels],
                     "score": _json_float(hyp.score),
                     "scores": {k: _json_float(v) for k, v in hyp.scores.items()},
                     "frames": None if hyp.frames is None else [int(f) for f in hyp.frames]}
            if hyp.truncated:
                entry["truncated"] = True
            nbest.append(entry)
        record = {"id": res.id, "text": nbest[0]["words"] if nbest else "", "nbest": nbest}
        jsonl.append(json.dumps(record, ensure_ascii=False) + "\n")
        if rendered and rendered[0][2] is not None:
            _, best_words, frames = rendered[0]
            for w in best_words:
                start, end = frames[w.first], frames[w.last]
                ctm.append(f"{res.id} 1 {start * SHIFT:.3f} {(end - start + 1) * SHIFT:.3f} "
                           f"{w.text}\n")
    return {"text": "".join(text).encode(), "nbest.jsonl": "".join(jsonl).encode(),
            "hyp.ctm": "".join(ctm).encode()}


def _written(tmp_path, results, vocab, mode, chunk=None) -> dict[str, bytes]:
    """The files written one result at a time (``write``), or ``chunk`` at a time (``write_many``)."""
    with ResultWriter(tmp_path, vocab, formats=("text", "jsonl", "ctm"), word_merging=mode,
                      frame_shift_s=SHIFT) as writer:
        if chunk is None:
            for res in results:
                writer.write(res)
        else:
            for start in range(0, len(results), chunk):
                writer.write_many(results[start:start + chunk])
        assert writer.num_written == len(results)
        paths = writer.paths
    return {path.name: path.read_bytes() for path in paths.values()}


def _hyp(labels, *, frames=None, score=-1.25, scores=None, truncated=False):
    return Hypothesis(labels=labels, score=score, frames=frames, truncated=truncated,
                      scores={"ctc": -0.5, "lm": -2.0} if scores is None else scores)


def _cases() -> list[UtteranceResult]:
    nan, inf = float("nan"), float("inf")
    return [
        UtteranceResult(id="numpy", nbest=[
            _hyp(np.array([4, 5, 6], dtype=np.int64), frames=np.array([1, 3, 7])),
            _hyp(np.array([1, 7, 0, 8, 9, 2], dtype=np.int32),
                 frames=np.array([0, 2, 2, 4, 5, 9], dtype=np.int64), score=np.float32(-3.5))]),
        UtteranceResult(id="lists", nbest=[
            _hyp([4, 5, 3, 6], frames=[0, 1, 5, 8]),
            _hyp([np.int64(7), 10], frames=[np.int32(2), 4], scores={"ctc": np.float64(-0.1)})]),
        UtteranceResult(id="no-frames", nbest=[_hyp([8, 9, 10, 12, 13]), _hyp([])]),
        UtteranceResult(id="non-finite", nbest=[
            _hyp([4, 5], frames=[0, 1], score=-inf, scores={"ctc": nan, "lm": inf}),
            _hyp([6], score=nan, scores={"ctc": -0.0, "lm": 1e300}),
            _hyp([7], score=1e308, scores={"ctc": 1e308, "lm": 1e308})]),  # the sum overflows
        UtteranceResult(id="truncated", nbest=[
            _hyp([4, 5], truncated=True), _hyp([6], truncated=np.bool_(True)),
            _hyp([7], truncated=np.bool_(False)), _hyp([7, 8], truncated=1)]),
        UtteranceResult(id="empty", nbest=[]),
        UtteranceResult(id="odd-tokens", nbest=[
            _hyp(list(range(len(LABELS))), frames=list(range(len(LABELS)))),
            _hyp([11, 12, 13, 14, 15, 23, 11], frames=[3, 3, 4, 6, 6, 7, 9]),
            _hyp([-1, 20, 21], frames=[0, 1, 2])]),
        UtteranceResult(id="odd-scorers", nbest=[
            _hyp([4], scores={}), _hyp([5], scores={'50%"x': -1.0, "é": -2.0, "%s": 3.0}),
            _hyp([6], scores={1: -1.0, None: 0.5, 2.5: 1.0})]),
        UtteranceResult(id="only-specials", nbest=[_hyp([0, 1, 2], frames=[0, 1, 2])]),
    ]


def _random_cases(seed: int, count: int) -> list[UtteranceResult]:
    rng = random.Random(seed)
    results = []
    for u in range(count):
        nbest = []
        for _ in range(rng.randint(0, 4)):
            labels = [rng.randrange(len(LABELS)) for _ in range(rng.randint(0, 7))]
            frames = sorted(rng.randrange(100) for _ in labels) if rng.random() < 0.7 else None
            if rng.random() < 0.5:
                labels = np.array(labels, dtype=np.int64)
                frames = None if frames is None else np.array(frames, dtype=np.int64)
            nbest.append(_hyp(labels, frames=frames, score=-rng.random() * 50,
                              scores={"ctc": -rng.random(), "lm": rng.choice([-1.5, -math.inf])},
                              truncated=rng.random() < 0.2))
        results.append(UtteranceResult(id=f"r{u}", nbest=nbest))
    return results


@pytest.mark.parametrize("labels", [LABELS, QUOTELESS], ids=["quote", "quoteless"])
@pytest.mark.parametrize("chunk", [None, 1, 7])
@pytest.mark.parametrize("mode", ["none", "sentencepiece", "bpe"])
def test_files_equal_the_reference_byte_for_byte(tmp_path, mode, chunk, labels):
    vocab = _vocab(labels)
    results = _cases() + _random_cases(seed=len(mode), count=200)
    written = _written(tmp_path, results, vocab, mode, chunk)
    expected = _reference(results, vocab, mode)
    for name in ("text", "nbest.jsonl", "hyp.ctm"):
        assert written[name] == expected[name], name
    assert b'"nbest": []' in written["nbest.jsonl"] and b"NaN" not in written["nbest.jsonl"]
    assert b'"truncated": true' in written["nbest.jsonl"]


def test_write_many_stops_at_a_failing_utterance_and_counts_those_before(tmp_path):
    good = [UtteranceResult(id=f"u{i}", nbest=[_hyp([4, 5], frames=[0, 1])]) for i in range(3)]
    bad = UtteranceResult(id="bad", nbest=[_hyp([4, len(LABELS)], frames=[0, 1])])  # outside the vocabulary
    with ResultWriter(tmp_path, _vocab(), formats=("ctm", "text", "jsonl"), frame_shift_s=SHIFT) as writer:
        with pytest.raises(IndexError):
            writer.write_many([*good[:2], bad, good[2]])
        assert (writer.num_written, writer.done_ids) == (2, {"u0", "u1"})
    expected = _reference(good[:2], _vocab(), "none")
    for name in ("text", "nbest.jsonl", "hyp.ctm"):
        assert (tmp_path / name).read_bytes() == expected[name], name


def test_a_new_vocabulary_is_used_at_once(tmp_path):
    first, second = _vocab(), Vocabulary(["<b>", "x", "y"], blank=0)
    result = UtteranceResult(id="u", nbest=[_hyp([1, 2])])
    with ResultWriter(tmp_path, first, formats=("text",), word_merging="none") as writer:
        writer.write(result)
        writer.vocabulary = second
        writer.write(result)
    assert (tmp_path / "text").read_text() == "u\nu x y\n"  # <s> </s> are no words in the first


def test_a_label_outside_the_vocabulary_writes_nothing(tmp_path):
    with ResultWriter(tmp_path, _vocab(), formats=("text", "jsonl")) as writer:
        with pytest.raises(IndexError):
            writer.write(UtteranceResult(id="u", nbest=[_hyp([4, len(LABELS)])]))
    assert (tmp_path / "text").read_text() == "" and (tmp_path / "nbest.jsonl").read_text() == ""

