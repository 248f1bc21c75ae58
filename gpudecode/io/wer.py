"""Word and character error rates with jiwer, from Kaldi-style ``<id> <words...>`` files."""

from __future__ import annotations

import json
from pathlib import Path

from gpudecode.io.errors import ResultFileError


def read_transcripts(path: str | Path) -> dict[str, str]:
    """``{id: words}`` from a text file with one ``<id> <words...>`` per line (a line with an
    id only is an empty transcript; a truncated last line without newline is kept)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ResultFileError("file does not exist", path=path) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultFileError(f"cannot read: {exc}", path=path) from exc
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
