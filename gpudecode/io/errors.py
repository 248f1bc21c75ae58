"""Errors for bad input data: features and audio, vocabularies, result and reference files."""

from __future__ import annotations

from pathlib import Path


class InputError(ValueError):
    """Bad input data: the message names the file and, where there is one, the utterance.

    ``path`` and ``utterance_id`` are kept as attributes so a caller that skips bad utterances
    can report them.
    """

    def __init__(self, problem: str, *, path: str | Path | None = None,
                 utterance_id: str | None = None):
        self.problem = problem
        self.path = None if path is None else str(path)
        self.utterance_id = utterance_id
        where = []
        if self.path is not None:
            where.append(self.path)
        if utterance_id is not None:
            where.append(f"utterance {utterance_id!r}")
        super().__init__(": ".join([*where, problem]))


class FeatureError(InputError):
    """Bad features or audio: wrong dimension, NaN/Inf, empty, missing or unreadable file."""


class VocabularyError(InputError):
    """A bad vocabulary file or special label (unknown label, index out of range)."""


class ResultFileError(InputError):
    """An unreadable hypothesis or reference file (WER scoring, resume)."""
