"""Result writers: plain text, JSON lines (n-best), CTM — incremental and resumable.

Each finished utterance is written to every requested file and flushed at once, so a killed
run loses nothing already decoded. Files are written in the order CTM, text, JSON lines: the
last one written (``nbest.jsonl`` if requested, else ``text``) marks an utterance as done, and
``read_done_ids`` reads it back for ``--resume``. On resume, every file is first cut back to
the done utterances (dropping a truncated last line), then appended to.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from pathlib import Path
from typing import IO, NamedTuple

import numpy as np

from gpudecode import defaults
from gpudecode.io.errors import ResultFileError
from gpudecode.io.vocabulary import BPE_CONTINUATION, SENTENCEPIECE_SPACE, Vocabulary, merge_words
from gpudecode.hypothesis import Hypothesis


@dataclass(frozen=True, kw_only=True)
class UtteranceResult:
    """The n-best list of one utterance, best first (may be empty if nothing survived)."""

    id: str
    nbest: Sequence[Hypothesis]


class _Lookup:
    """Per-label strings the writer needs, made once per vocabulary and word merging: the token,
    its JSON string, and its piece for word merging (``sentinel`` marks a word boundary)."""

    def __init__(self, vocabulary: Vocabulary, word_merging: str):
        self.key = (vocabulary, word_merging)
        self.merging = word_merging
        self.tokens = vocabulary.labels
        self.non_word = vocabulary.non_word_indices
        self.json_tokens = tuple(map(encode_basestring, self.tokens))
        self.sentinel = None if word_merging == "none" else _unused_char(self.tokens)
        self.pieces = tuple(_piece(t, word_merging, self.sentinel) for t in self.tokens)

    def render(self, nbest: Sequence[Hypothesis]) -> list[_Rendered]:
        """Per hypothesis its labels and frames as lists of ints, the labels that are tokens of
        words (and their frames) and its words, as ``merge_words`` makes them."""
        non_word, pieces, sentinel = self.non_word, self.pieces, self.sentinel
        rendered = []
        for hyp in nbest:
            labels = _ints(hyp.labels)
            frames = None if hyp.frames is None else _ints(hyp.frames)
            kept, kept_frames = labels, frames
            if not non_word.isdisjoint(labels):
                keep = [i for i, label in enumerate(labels) if label not in non_word]
                kept = [labels[i] for i in keep]
                kept_frames = None if frames is None else [frames[i] for i in keep]
            if sentinel is None:  # no merging: each token is a word
                words = [pieces[i] for i in kept]
            else:
                words = [w for w in "".join([pieces[i] for i in kept]).split(sentinel) if w]
            rendered.append(_Rendered(labels, frames, kept, kept_frames, words))
        return rendered


def _unused_char(labels: Sequence[str]) -> str:
    """A character that occurs in no label."""
    used = set("".join(labels))
    return next(c for c in map(chr, range(0x110000)) if c not in used)


def _piece(token: str, word_merging: str, sentinel: str | None) -> str:
    """``token`` as merged text, ``sentinel`` where a word ends or starts."""
    if word_merging == "none":
        return token
    if word_merging == "sentencepiece" and token.startswith(SENTENCEPIECE_SPACE):
        return sentinel + token[len(SENTENCEPIECE_SPACE):]
    if word_merging == "bpe":
        if token.endswith(BPE_CONTINUATION):
            return token[:-len(BPE_CONTINUATION)]
        return token + sentinel
    return token


def _ints(values) -> list[int]:
    """``values`` (a list or a numpy array) as a list of Python ints."""
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        return values.tolist()
    return list(map(int, values))


class _Rendered(NamedTuple):
    labels: list[int]
    frames: list[int] | None
    kept: list[int]  # the labels that are words' tokens
    kept_frames: list[int] | None  # their frames
    words: list[str]


def _utterance_id_ok(utt_id: str) -> None:
    if utt_id.split() != [utt_id]:  # empty, or whitespace in it
        raise ValueError(f"utterance id {utt_id!r} is empty or contains whitespace; text and "
                         "CTM lines could not be parsed back")


def _complete_lines(path: Path) -> list[str]:
    """Lines of ``path`` that end in a newline (a truncated last line is dropped)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ResultFileError(f"cannot read: {exc}", path=path) from exc
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    return lines[:-1]  # the part after the last "\n" is empty or truncated


def _jsonl_id(line: str) -> str | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("id") if isinstance(record, dict) and "nbest" in record else None


def _text_id(line: str) -> str | None:
    parts = line.split(maxsplit=1)
    return parts[0] if parts else None


def read_done_ids(output_folder: str | Path) -> set[str]:
    """Ids of utterances completely written to ``output_folder`` (for ``--resume``).

    Reads ``nbest.jsonl`` if it exists, else ``text``, else the CTM (where an utterance
    without words leaves no line, so it is decoded again). A truncated last line from a killed
    process, or a JSON line that does not parse, does not count.
    """
    folder = Path(output_folder)
    for name, get_id in ((defaults.JSONL_FILE, _jsonl_id), (defaults.TEXT_FILE, _text_id),
                         (defaults.CTM_FILE, _text_id)):
        path = folder / name
        if path.exists():
            return {i for i in map(get_id, _complete_lines(path)) if i is not None}
    return set()


def _cut_back(path: Path, get_id, done: set[str]) -> None:
    """Rewrite ``path`` keeping only complete lines of done utterances (atomically)."""
    if not path.exists():
        return
    kept = [line for line in _complete_lines(path) if get_id(line) in done]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


class ResultWriter:
    """Writes each ``UtteranceResult`` to the requested formats in ``output_folder``.

    ``formats``: a subset of ``text``, ``jsonl``, ``ctm``. ``frame_shift_s``: seconds per
    frame index of ``Hypothesis.frames`` (needed for ``ctm``). ``resume``: keep what a previous
    run wrote (see the module docstring) instead of starting the files afresh.
    """

    def __init__(self, output_folder: str | Path, vocabulary: Vocabulary, *,
                 formats: Sequence[str] = defaults.OUTPUT_FORMATS,
                 word_merging: str = defaults.WORD_MERGING,
                 frame_shift_s: float | None = None, resume: bool = False):
        unknown = [f for f in formats if f not in defaults.OUTPUT_FORMAT_CHOICES]
        if unknown or not formats:
            raise ValueError(f"output formats {list(formats)}: choose from "
                             f"{', '.join(defaults.OUTPUT_FORMAT_CHOICES)}")
        if "ctm" in formats and not (frame_shift_s and frame_shift_s > 0):
            raise ValueError("the ctm format needs a positive frame shift (frame_shift_s)")
        if word_merging not in defaults.WORD_MERGINGS:
            raise ValueError(f"unknown word merging {word_merging!r}; valid: "
                             f"{', '.join(defaults.WORD_MERGINGS)}")
        self.folder = Path(output_folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.vocabulary = vocabulary
        self.word_merging = word_merging
        self.frame_shift_s = frame_shift_s
        self.done_ids: set[str] = set()
        files = {"ctm": (defaults.CTM_FILE, _text_id), "text": (defaults.TEXT_FILE, _text_id),
                 "jsonl": (defaults.JSONL_FILE, _jsonl_id)}
        order = [f for f in ("ctm", "text", "jsonl") if f in formats]  # marker last
        if resume:
            self.done_ids = read_done_ids(self.folder)
            for fmt in order:
                _cut_back(self.folder / files[fmt][0], files[fmt][1], self.done_ids)
        self._files: dict[str, IO[str]] = {
            fmt: open(self.folder / files[fmt][0], "a" if resume else "w", encoding="utf-8")
            for fmt in order}
        self.num_written = 0
        self._labels: _Lookup | None = None
        self._templates: dict[tuple[tuple, bool], str] = {}  # see _hyp_template
        self._formatters = [(file, getattr(self, f"_format_{fmt}"))
                            for fmt, file in self._files.items()]

    @property
    def paths(self) -> dict[str, Path]:
        return {fmt: Path(f.name) for fmt, f in self._files.items()}

    def write(self, result: UtteranceResult) -> None:
        """Write one utterance to every file and flush."""
        _utterance_id_ok(result.id)
        rendered = self._lookup().render(result.nbest)
        texts = [(file, format(result, rendered)) for file, format in self._formatters]
        for file, text in texts:
            if text:
                try:
                    file.write(text)
                    file.flush()
                except OSError as exc:  # a full disk says no file name: name it
                    exc.filename = exc.filename or file.name
                    raise
        self.done_ids.add(result.id)
        self.num_written += 1

    def _lookup(self) -> _Lookup:
        """The per-label strings of the current vocabulary and word merging (made once)."""
        if self._labels is None or self._labels.key != (self.vocabulary, self.word_merging):
            self._labels = _Lookup(self.vocabulary, self.word_merging)
        return self._labels

    def _format_text(self, result: UtteranceResult, rendered: list[_Rendered]) -> str:
        words = rendered[0].words if rendered else []
        return " ".join([result.id, *words]) + "\n"

    def _format_jsonl(self, result: UtteranceResult, rendered: list[_Rendered]) -> str:
        """As ``json.dumps`` (``ensure_ascii=False``) writes the record, pieced together from
        per-label JSON strings and a per-scorer-set template made once."""
        json_tokens, templates = self._lookup().json_tokens, self._templates
        nbest, best_words = [], '""'
        for rank, (hyp, r) in enumerate(zip(result.nbest, rendered), start=1):
            scores = hyp.scores
            numbers = [float(hyp.score), *map(float, scores.values())]
            if not math.isfinite(sum(numbers)):  # a NaN or an infinity: null
                numbers = [v if math.isfinite(v) else "null" for v in numbers]
            words = encode_basestring(" ".join(r.words))
            if rank == 1:
                best_words = words
            names = tuple(scores)
            template = (templates.get((names, hyp.truncated))
                        or self._hyp_template(names, bool(hyp.truncated)))
            nbest.append(template % (
                rank, words, ", ".join([json_tokens[i] for i in r.kept]), r.labels, *numbers,
                "null" if r.frames is None else r.frames))
        return (f'{{"id": {encode_basestring(result.id)}, "text": {best_words}, '
                f'"nbest": [{", ".join(nbest)}]}}\n')

    def _hyp_template(self, names: tuple, truncated: bool) -> str:
        """A ``%`` template of one n-best entry for scorers ``names`` (cached for string names):
        rank, words, tokens, labels, score, each scorer's score, frames."""
        template = self._templates.get((names, truncated))
        if template is None:
            scores = ", ".join(_json_key(k).replace("%", "%%") + "%s" for k in names)
            template = ('{"rank": %s, "words": %s, "tokens": [%s], "labels": %s, "score": %s, '
                        f'"scores": {{{scores}}}, "frames": %s'
                        + (', "truncated": true}' if truncated else "}"))
            if all(type(k) is str for k in names):
                self._templates[(names, truncated)] = template
        return template

    def _format_ctm(self, result: UtteranceResult, rendered: list[_Rendered]) -> str:
        if not rendered or rendered[0].kept_frames is None:
            return ""
        best, shift = rendered[0], self.frame_shift_s
        tokens, frames = self._lookup().tokens, best.kept_frames
        lines = []
        for word in merge_words([tokens[i] for i in best.kept], self.word_merging):
            start, end = frames[word.first], frames[word.last]
            lines.append(f"{result.id} 1 {start * shift:.3f} {(end - start + 1) * shift:.3f} "
                         f"{word.text}\n")
        return "".join(lines)

    def close(self) -> None:
        for file in self._files.values():
            file.close()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _json_key(key) -> str:
    """``'"key": '`` as ``json.dumps`` writes a dict key."""
    if isinstance(key, str):
        return encode_basestring(key) + ": "
    return json.dumps({key: None}, ensure_ascii=False)[1:-len("null}")]
