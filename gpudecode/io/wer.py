"""Word and character error rates with jiwer, from Kaldi-style ``<id> <words...>`` files."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpudecode.io.errors import ResultFileError

log = logging.getLogger(__name__)


def read_transcripts(path: str | Path) -> dict[str, str]:
    """``{id: words}`` from a text file with one ``<id> <words...>`` per line (a line with an
    id only is an empty transcript; a truncated last line without newline is kept)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise ResultFileError("file does not exist", path=path) from exc
    except OSError as exc:
        raise ResultFileError(f"cannot read: {exc}", path=path) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ResultFileError(f"line {line}: not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                              f"{exc.start}); save the file as UTF-8", path=path) from exc
    transcripts: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        parts = line.split(maxsplit=1)
        if not parts:
            continue
        if parts[0] in transcripts:
            raise ResultFileError(f"line {number}: duplicate id", path=path,
                                  utterance_id=parts[0])
        transcripts[parts[0]] = " ".join(parts[1].split()) if len(parts) > 1 else ""
    return transcripts


@dataclass(frozen=True)
class ReferenceCheck:
    """What :func:`validate_references` found: ``num_references`` transcripts; the utterance ids
    without a reference (their hypotheses are left out of the WER) and the references without an
    utterance (counted as all deletions), each sorted."""

    num_references: int
    without_reference: tuple[str, ...]
    without_utterance: tuple[str, ...]

    def warning(self, path: str | Path) -> str | None:
        """One line naming the counts and a few ids, or None when every id matches."""
        parts = []
        if self.without_reference:
            parts.append(f"{len(self.without_reference)} utterance(s) have no reference (left out of the "
                         f"WER): {_some(self.without_reference)}")
        if self.without_utterance:
            parts.append(f"{len(self.without_utterance)} reference(s) have no utterance to decode (counted as "
                         f"all deletions): {_some(self.without_utterance)}")
        return f"references {path}: " + "; ".join(parts) if parts else None


def validate_references(path: str | Path, ids: Iterable[str]) -> ReferenceCheck:
    """Check a reference file against the utterance ids of a run before it decodes: a missing or
    unreadable file, non-UTF-8 text, a duplicate id, no transcripts or no words are a
    :class:`ResultFileError`; ids missing on either side are counted (and logged as one warning)."""
    refs = read_transcripts(path)
    if not refs:
        raise ResultFileError("no reference transcripts", path=path)
    if not any(words for words in refs.values()):
        raise ResultFileError("the references hold no words", path=path)
    ids = list(ids)
    known = set(ids)
    check = ReferenceCheck(num_references=len(refs),
                           without_reference=tuple(sorted(i for i in known if i not in refs)),
                           without_utterance=tuple(sorted(i for i in refs if i not in known)))
    message = check.warning(path)
    if message:
        log.warning("%s", message)
    return check


def _some(ids: tuple[str, ...], limit: int = 5) -> str:
    shown = ", ".join(repr(i) for i in ids[:limit])
    return shown + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def score_wer(hyp_text_path: str | Path, ref_path: str | Path,
              output_path: str | Path | None = None) -> dict:
    """WER and CER (fractions, not percent) of the hypotheses against the references.

    Every reference utterance counts; one without a hypothesis counts as an empty hypothesis
    (all deletions) and is reported in ``num_missing_hypotheses``. Hypotheses without a
    reference are left out and counted. CER counts spaces between words as characters
    (jiwer's convention). The result is also written as JSON to ``output_path`` if given.
    """
    import jiwer

    hyps = read_transcripts(hyp_text_path)
    refs = read_transcripts(ref_path)
    if not refs:
        raise ResultFileError("no reference transcripts", path=ref_path)
    ids = list(refs)
    missing = [i for i in ids if i not in hyps]
    ref_list = [refs[i] for i in ids]
    hyp_list = [hyps.get(i, "") for i in ids]
    words = jiwer.process_words(ref_list, hyp_list)
    chars = jiwer.process_characters(ref_list, hyp_list)
    num_ref_words = words.hits + words.substitutions + words.deletions
    num_ref_chars = chars.hits + chars.substitutions + chars.deletions
    if num_ref_words == 0:
        raise ResultFileError("the references hold no words", path=ref_path)
    result = {
        "wer": (words.substitutions + words.deletions + words.insertions) / num_ref_words,
        "cer": (chars.substitutions + chars.deletions + chars.insertions) / num_ref_chars,
        "num_utterances": len(ids),
        "num_ref_words": num_ref_words,
        "substitutions": words.substitutions,
        "deletions": words.deletions,
        "insertions": words.insertions,
        "num_ref_chars": num_ref_chars,
        "char_substitutions": chars.substitutions,
        "char_deletions": chars.deletions,
        "char_insertions": chars.insertions,
        "num_missing_hypotheses": len(missing),
        "missing_hypotheses": missing[:20],
        "num_hypotheses_without_reference": sum(1 for i in hyps if i not in refs),
        "hypotheses": str(hyp_text_path),
        "references": str(ref_path),
    }
    if output_path is not None:
        Path(output_path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result
