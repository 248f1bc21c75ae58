"""Result writers: plain text, JSON lines (n-best), CTM — incremental and resumable.

Each finished utterance is written to every requested file and flushed at once (``write_many``:
a batch's utterances together, one write and one flush per file), so a killed run loses nothing
already decoded. Files are written in the order CTM, text, JSON lines: the last one written
(``nbest.jsonl`` if requested, else ``text``) marks an utterance as done, and ``read_done_ids``
reads it back for ``--resume``. On resume, every file is first cut back to the done utterances
(dropping a truncated last line), then appended to. A write that fails (a full disk) counts none
of its batch done; resume keeps those of them whose lines all made it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from pathlib import Path
from typing import IO, Any, NamedTuple

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
    """Strings the writer needs, made once per vocabulary, word merging and frame shift: per label
    the token, its JSON string and its piece for word merging, raw and JSON-escaped (``sentinel``,
    a character in none of them, marks a word boundary); per label or frame index its text, and
    per frame count its seconds as the CTM writes them."""

    def __init__(self, vocabulary: Vocabulary, word_merging: str, frame_shift_s: float | None):
        self.key = (vocabulary, word_merging, frame_shift_s)
        self.merging = word_merging
        self.tokens = vocabulary.labels
        self.non_word = vocabulary.non_word_indices
        self.json_tokens = tuple(map(encode_basestring, self.tokens))
        self.sentinel = None if word_merging == "none" else _unused_char(self.tokens + self.json_tokens)
        self.pieces = tuple(_piece(t, word_merging, self.sentinel) for t in self.tokens)
        # JSON escapes character by character: the escaped pieces merge into the escaped words
        self.json_pieces = tuple(_piece(t[1:-1], word_merging, self.sentinel) for t in self.json_tokens)
        # each token a word, and no quote in any: the JSON words are the JSON tokens without quotes
        self.words_are_tokens = self.sentinel is None and not any('"' in t for t in self.tokens)
        self.ints = _Texts(lambda n: str(int(n)))  # a label or frame (numpy integers too): its text
        self.seconds = _Texts(lambda n: f"{n * frame_shift_s:.3f}")

    def kept(self, labels: list[int]) -> list[int]:
        """The labels that are tokens of words."""
        non_word = self.non_word
        return labels if non_word.isdisjoint(labels) else [x for x in labels if x not in non_word]

    def best(self, nbest: Sequence[Hypothesis]) -> _Best | None:
        """The best hypothesis's labels that are tokens of words, and their frames."""
        if not nbest:
            return None
        labels, frames = _labels(nbest[0].labels), nbest[0].frames
        if frames is None or self.non_word.isdisjoint(labels):
            return _Best(self.kept(labels), None if frames is None else _ints(frames))
        frames = _ints(frames)
        keep = [i for i, label in enumerate(labels) if label not in self.non_word]
        return _Best([labels[i] for i in keep], [frames[i] for i in keep])

    def words(self, kept: list[int], pieces: tuple[str, ...]) -> Iterable[str]:
        """The words of labels ``kept``, as ``merge_words`` makes them, from ``pieces``
        (``self.pieces``, or ``self.json_pieces`` for the words JSON-escaped)."""
        if self.sentinel is None:  # no merging: each token is a word
            return map(pieces.__getitem__, kept)
        return filter(None, "".join(map(pieces.__getitem__, kept)).split(self.sentinel))

    def json_words(self, kept: list[int], tokens: str) -> str:
        """The words of labels ``kept`` JSON-escaped; ``tokens``: their JSON strings joined by ", "."""
        if self.words_are_tokens:
            return tokens[1:-1].replace('", "', " ")
        return " ".join(self.words(kept, self.json_pieces))

    def ctm_lines(self, utt_id: str, best: _Best) -> list[str]:
        """The CTM lines of ``best`` (which has frames): per word its start and its duration."""
        tokens, frames, seconds = self.tokens, best.frames, self.seconds
        if self.sentinel is None:  # each token a word of one frame
            one = seconds[1]
            return [f"{utt_id} 1 {seconds[frame]} {one} {tokens[label]}\n"
                    for label, frame in zip(best.kept, frames)]
        spans = ((w.text, frames[w.first], frames[w.last])
                 for w in merge_words([tokens[i] for i in best.kept], self.merging))
        return [f"{utt_id} 1 {seconds[start]} {seconds[end - start + 1]} {text}\n"
                for text, start, end in spans]


class _Texts(dict):
    """``self[key]``: ``text(key)``, made once per key on first use."""

    def __init__(self, text: Callable[[Any], str]):
        super().__init__()
        self._text = text

    def __missing__(self, key) -> str:
        text = self[key] = self._text(key)
        return text


class _Best(NamedTuple):
    """The best hypothesis's labels that are tokens of words, and their frames."""

    kept: list[int]
    frames: list[int] | None


def _write(file: IO[str], text: str) -> None:
    """Write ``text`` (if any) to ``file`` and flush; a full disk's ``OSError`` names the file."""
    if not text:
        return
    try:
        file.write(text)
        file.flush()
    except OSError as exc:  # a full disk says no file name: name it
        exc.filename = exc.filename or file.name
        raise


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


def _labels(values) -> list:
    """Labels as a list (of ints, or numpy integers: they index as ints)."""
    return values if type(values) is list else _ints(values)


def _ints(values) -> list[int]:
    """``values`` (a list or a numpy array) as a list of Python ints: itself where it is one."""
    if type(values) is list and {int}.issuperset(map(type, values)):
        return values
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        return values.tolist()
    return list(map(int, values))


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


class ResultFormatter:
    """Formats each ``UtteranceResult`` as the lines of the requested formats (CTM, text, JSON
    lines, in that order), without writing them: :class:`ResultWriter` writes what it makes, and a
    decoding process of a pool (``gpudecode.engines.processes``) sends it to the one that writes.
    ``formats``, ``word_merging`` and ``frame_shift_s``: as :class:`ResultWriter` takes them."""

    def __init__(self, vocabulary: Vocabulary, *, formats: Sequence[str] = defaults.OUTPUT_FORMATS,
                 word_merging: str = defaults.WORD_MERGING, frame_shift_s: float | None = None):
        unknown = [f for f in formats if f not in defaults.OUTPUT_FORMAT_CHOICES]
        if unknown or not formats:
            raise ValueError(f"output formats {list(formats)}: choose from "
                             f"{', '.join(defaults.OUTPUT_FORMAT_CHOICES)}")
        if "ctm" in formats and not (frame_shift_s and frame_shift_s > 0):
            raise ValueError("the ctm format needs a positive frame shift (frame_shift_s)")
        if word_merging not in defaults.WORD_MERGINGS:
            raise ValueError(f"unknown word merging {word_merging!r}; valid: "
                             f"{', '.join(defaults.WORD_MERGINGS)}")
        self.vocabulary = vocabulary
        self.word_merging = word_merging
        self.frame_shift_s = frame_shift_s
        #: the formats in the order their files are written (the marker of a done utterance last)
        self.formats = tuple(f for f in ("ctm", "text", "jsonl") if f in formats)
        self._labels: _Lookup | None = None
        self._templates: dict[tuple[tuple, bool], str] = {}  # see _hyp_template
        self._formatters = [getattr(self, f"_format_{fmt}") for fmt in self.formats]

    def format_into(self, results: Iterable[UtteranceResult], ids: list[str], lines: list[list[str]]) -> None:
        """Append each result's id to ``ids`` and its lines (one string per format, in
        :attr:`formats` order) to ``lines``; one that cannot be formatted (a label outside the
        vocabulary, whitespace in its id) raises with those before it appended."""
        lookup = self._lookup()
        for result in results:
            _utterance_id_ok(result.id)
            best = lookup.best(result.nbest)
            lines.append([format(result, lookup, best) for format in self._formatters])
            ids.append(result.id)

    def _lookup(self) -> _Lookup:
        """The per-label strings of the current vocabulary, word merging and frame shift (made once)."""
        key = (self.vocabulary, self.word_merging, self.frame_shift_s)
        if self._labels is None or self._labels.key != key:
            self._labels = _Lookup(*key)
        return self._labels

    def _format_text(self, result: UtteranceResult, lookup: _Lookup, best: _Best | None) -> str:
        words = () if best is None else lookup.words(best.kept, lookup.pieces)
        return " ".join([result.id, *words]) + "\n"

    def _format_jsonl(self, result: UtteranceResult, lookup: _Lookup, best: _Best | None) -> str:
        """As ``json.dumps`` (``ensure_ascii=False``) writes the record: one ``%`` of the entries'
        templates (per scorer set, made once) with per-label and per-index strings."""
        ints, json_tokens = lookup.ints.__getitem__, lookup.json_tokens.__getitem__
        values = [encode_basestring(result.id), ""]  # the id, the best's words, then each entry's
        entries = []
        for rank, hyp in enumerate(result.nbest, start=1):
            labels, scores = _labels(hyp.labels), hyp.scores
            kept = lookup.kept(labels)
            numbers = [float(hyp.score), *map(float, scores.values())]
            if not math.isfinite(sum(numbers)):  # a NaN or an infinity: null
                numbers = [v if math.isfinite(v) else "null" for v in numbers]
            names = tuple(scores)
            entries.append(self._templates.get((names, hyp.truncated))
                           or self._hyp_template(names, bool(hyp.truncated)))
            tokens = ", ".join(map(json_tokens, kept))
            words = lookup.json_words(kept, tokens)
            if rank == 1:
                values[1] = words
            values += (rank, words, tokens, ", ".join(map(ints, labels)), *numbers,
                       "null" if hyp.frames is None else f"[{', '.join(map(ints, hyp.frames))}]")
        return ('{"id": %s, "text": "%s", "nbest": [' + ", ".join(entries) + "]}\n") % tuple(values)

    def _hyp_template(self, names: tuple, truncated: bool) -> str:
        """A ``%`` template of one n-best entry for scorers ``names`` (cached for string names):
        rank, words (JSON-escaped), tokens, labels, score, each scorer's score, frames."""
        template = self._templates.get((names, truncated))
        if template is None:
            scores = ", ".join(_json_key(k).replace("%", "%%") + "%s" for k in names)
            template = ('{"rank": %s, "words": "%s", "tokens": [%s], "labels": [%s], "score": %s, '
                        f'"scores": {{{scores}}}, "frames": %s'
                        + (', "truncated": true}' if truncated else "}"))
            if all(type(k) is str for k in names):
                self._templates[(names, truncated)] = template
        return template

    def _format_ctm(self, result: UtteranceResult, lookup: _Lookup, best: _Best | None) -> str:
        if best is None or best.frames is None:
            return ""
        return "".join(lookup.ctm_lines(result.id, best))


class ResultWriter:
    """Writes each ``UtteranceResult`` to the requested formats in ``output_folder``.

    ``formats``: a subset of ``text``, ``jsonl``, ``ctm``. ``frame_shift_s``: seconds per
    frame index of ``Hypothesis.frames`` (needed for ``ctm``). ``resume``: keep what a previous
    run wrote (see the module docstring) instead of starting the files afresh.
    """

    #: results a decoding run hands to one ``write_many`` call: each call flushes (and gives up the
    #: GIL) once, so a decoding loop waits for the GIL at most one call's formatting
    call_size = defaults.WRITE_CHUNK

    def __init__(self, output_folder: str | Path, vocabulary: Vocabulary, *,
                 formats: Sequence[str] = defaults.OUTPUT_FORMATS,
                 word_merging: str = defaults.WORD_MERGING,
                 frame_shift_s: float | None = None, resume: bool = False):
        self.formatter = ResultFormatter(vocabulary, formats=formats, word_merging=word_merging,
                                         frame_shift_s=frame_shift_s)
        self.folder = Path(output_folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.done_ids: set[str] = set()
        files = {"ctm": (defaults.CTM_FILE, _text_id), "text": (defaults.TEXT_FILE, _text_id),
                 "jsonl": (defaults.JSONL_FILE, _jsonl_id)}
        order = self.formatter.formats  # marker last
        if resume:
            self.done_ids = read_done_ids(self.folder)
            for fmt in order:
                _cut_back(self.folder / files[fmt][0], files[fmt][1], self.done_ids)
        self._files: dict[str, IO[str]] = {
            fmt: open(self.folder / files[fmt][0], "a" if resume else "w", encoding="utf-8")
            for fmt in order}
        self.num_written = 0

    @property
    def paths(self) -> dict[str, Path]:
        return {fmt: Path(f.name) for fmt, f in self._files.items()}

    @property
    def vocabulary(self) -> Vocabulary:
        """The vocabulary the lines are made with (settable: the next write uses the new one)."""
        return self.formatter.vocabulary

    @vocabulary.setter
    def vocabulary(self, vocabulary: Vocabulary) -> None:
        self.formatter.vocabulary = vocabulary

    def write(self, result: UtteranceResult) -> None:
        """Write one utterance to every file and flush."""
        self.write_many((result,))

    def write_many(self, results: Iterable[UtteranceResult]) -> None:
        """Write utterances in order: each file's lines of them with one write and one flush, the
        files in the order CTM, text, JSON lines. One that cannot be formatted (a label outside the
        vocabulary) raises once those before it are written; a failed write (a full disk) raises and
        counts none of them done (``done_ids``, ``num_written``)."""
        ids, lines = [], []
        try:
            self.formatter.format_into(results, ids, lines)
        finally:  # those formatted before an error too
            if ids:
                self.write_formatted(ids, ["".join(texts) for texts in zip(*lines)])

    def write_formatted(self, ids: Sequence[str], texts: Sequence[str]) -> None:
        """Write the lines a :class:`ResultFormatter` of the same formats made for utterances
        ``ids``: ``texts`` holds each file's lines of them, joined, in the formatter's order. As
        :meth:`write_many`, a failed write counts none of them done."""
        for file, text in zip(self._files.values(), texts, strict=True):
            _write(file, text)
        self.done_ids.update(ids)
        self.num_written += len(ids)

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
