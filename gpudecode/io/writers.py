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
from pathlib import Path
from typing import IO

from gpudecode import defaults
from gpudecode.io.errors import ResultFileError
from gpudecode.io.vocabulary import Vocabulary, Word, merge_words
from gpudecode.hypothesis import Hypothesis


@dataclass(frozen=True, kw_only=True)
class UtteranceResult:
    """The n-best list of one utterance, best first (may be empty if nothing survived)."""

    id: str
    nbest: Sequence[Hypothesis]


@dataclass(frozen=True)
class _Rendered:
    tokens: list[str]
    words: list[Word]
    frames: list[int] | None  # per token


def _render(hyp: Hypothesis, vocabulary: Vocabulary, word_merging: str) -> _Rendered:
    keep = [i for i, label in enumerate(hyp.labels)
            if int(label) not in vocabulary.non_word_indices]
    tokens = [vocabulary[int(hyp.labels[i])] for i in keep]
    frames = None if hyp.frames is None else [int(hyp.frames[i]) for i in keep]
    return _Rendered(tokens, merge_words(tokens, word_merging), frames)


def _utterance_id_ok(utt_id: str) -> None:
    if not utt_id or any(c.isspace() for c in utt_id):
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

    @property
    def paths(self) -> dict[str, Path]:
        return {fmt: Path(f.name) for fmt, f in self._files.items()}

    def write(self, result: UtteranceResult) -> None:
        """Write one utterance to every file and flush."""
        _utterance_id_ok(result.id)
        rendered = [_render(h, self.vocabulary, self.word_merging) for h in result.nbest]
        for fmt, file in self._files.items():
            text = getattr(self, f"_format_{fmt}")(result, rendered)
            if text:
                try:
                    file.write(text)
                    file.flush()
                except OSError as exc:  # a full disk says no file name: name it
                    exc.filename = exc.filename or file.name
                    raise
        self.done_ids.add(result.id)
        self.num_written += 1

    def _format_text(self, result: UtteranceResult, rendered: list[_Rendered]) -> str:
        words = [w.text for w in rendered[0].words] if rendered else []
        return " ".join([result.id, *words]) + "\n"

    def _format_jsonl(self, result: UtteranceResult, rendered: list[_Rendered]) -> str:
        nbest = []
        for rank, (hyp, r) in enumerate(zip(result.nbest, rendered), start=1):
            nbest.append({
                "rank": rank,
                "words": " ".join(w.text for w in r.words),
                "tokens": r.tokens,
                "labels": [int(x) for x in hyp.labels],
                "score": _json_float(hyp.score),
                "scores": {k: _json_float(v) for k, v in hyp.scores.items()},
                "frames": None if hyp.frames is None else [int(f) for f in hyp.frames],
            })
            if hyp.truncated:  # only when set: the search cut this hypothesis short
                nbest[-1]["truncated"] = True
        record = {"id": result.id, "text": nbest[0]["words"] if nbest else "", "nbest": nbest}
        return json.dumps(record, ensure_ascii=False) + "\n"

    def _format_ctm(self, result: UtteranceResult, rendered: list[_Rendered]) -> str:
        if not rendered or rendered[0].frames is None:
            return ""
        r, shift = rendered[0], self.frame_shift_s
        lines = []
        for word in r.words:
            start, end = r.frames[word.first], r.frames[word.last]
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


def _json_float(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None
