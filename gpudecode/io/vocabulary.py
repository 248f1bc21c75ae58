"""Vocabulary (one label per line, index = line number) and merging of subword tokens into
words (SentencePiece ``▁`` and BPE ``@@`` conventions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpudecode import defaults
from gpudecode.io.errors import VocabularyError

SPECIAL_ROLES = ("blank", "sentence_begin", "sentence_end", "unknown")
SENTENCEPIECE_SPACE = "\u2581"  # ▁
BPE_CONTINUATION = "@@"


class Vocabulary:
    """Labels by index, plus the indices of the special labels.

    Special labels are given by label string or by index (``blank="<blank>"`` or
    ``blank=0``); ``None`` when the model has none. ``blank_index``, ``sentence_begin_index``,
    ``sentence_end_index`` and ``unknown_index`` hold the resolved indices.
    """

    def __init__(self, labels: Sequence[str], *, path: str | Path | None = None,
                 **special: int | str | None):
        self.labels = tuple(labels)
        self.path = None if path is None else Path(path)
        self._where = str(self.path) if self.path else "vocabulary"
        self._index: dict[str, int] = {}
        for i, label in enumerate(self.labels):
            if label in self._index:
                raise VocabularyError(f"label {label!r} on lines {self._index[label] + 1} and "
                                   f"{i + 1}; labels must be unique", path=self._where)
            self._index[label] = i
        unknown_roles = set(special) - set(SPECIAL_ROLES)
        if unknown_roles:
            raise ValueError(f"unknown special label role(s) {sorted(unknown_roles)}; valid: "
                             f"{', '.join(SPECIAL_ROLES)}")
        self.blank_index = self.resolve(special.get("blank"), "blank")
        self.sentence_begin_index = self.resolve(special.get("sentence_begin"), "sentence_begin")
        self.sentence_end_index = self.resolve(special.get("sentence_end"), "sentence_end")
        self.unknown_index = self.resolve(special.get("unknown"), "unknown")
        # Labels that never become words (the unknown label does: it stands for a word).
        self.non_word_indices = frozenset(
            i for i in (self.blank_index, self.sentence_begin_index, self.sentence_end_index)
            if i is not None)

    @classmethod
    def load(cls, path: str | Path, **special: int | str | None) -> Vocabulary:
        """Read a vocabulary file: one label per line (trailing newline and ``\\r`` dropped)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise VocabularyError("vocabulary file does not exist", path=path) from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise VocabularyError(f"cannot read vocabulary: {exc}", path=path) from exc
        labels = [line.rstrip("\r") for line in text.split("\n")]
        if labels and labels[-1] == "":
            labels.pop()  # the final newline
        if not labels:
            raise VocabularyError("vocabulary is empty", path=path)
        for number, label in enumerate(labels, start=1):
            if not label.strip():
                raise VocabularyError(f"line {number} is blank; every line must hold one label",
                                   path=path)
        return cls(labels, path=path, **special)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> str:
        return self.labels[index]

    def index(self, label: str) -> int:
        try:
            return self._index[label]
        except KeyError:
            raise VocabularyError(f"label {label!r} is not in the vocabulary ({len(self)} labels)",
                               path=self._where) from None

    def resolve(self, spec: int | str | None, role: str = "label") -> int | None:
        """A label given by index (int) or label string -> its index (``None`` stays ``None``)."""
        if spec is None:
            return None
        if isinstance(spec, bool) or not isinstance(spec, (int, str)):
            raise ValueError(f"{role}: expected a label or an index, got {spec!r}")
        if isinstance(spec, int):
            if not 0 <= spec < len(self):
                raise VocabularyError(f"{role} index {spec} is out of range: the vocabulary has "
                                   f"{len(self)} labels (0..{len(self) - 1})", path=self._where)
            return spec
        if spec not in self._index:
            raise VocabularyError(f"{role} label {spec!r} is not in the vocabulary "
                               f"({len(self)} labels)", path=self._where)
        return self._index[spec]

    def tokens(self, labels: Sequence[int]) -> list[str]:
        """Label indices -> label strings, dropping blank and sentence begin/end."""
        return [self.labels[i] for i in labels if i not in self.non_word_indices]


@dataclass(frozen=True)
class Word:
    """A word and the span of tokens it came from (``first``, ``last`` inclusive)."""

    text: str
    first: int
    last: int


def merge_words(tokens: Sequence[str], mode: str = defaults.WORD_MERGING) -> list[Word]:
    """Merge subword tokens into words.

    ``none``: every token is a word. ``sentencepiece``: a token starting with ``▁`` starts a
    new word (the ``▁`` is dropped; a lone ``▁`` only marks the boundary). ``bpe``: a token
    ending in ``@@`` continues into the next token.
    """
    if mode not in defaults.WORD_MERGINGS:
        raise ValueError(f"unknown word merging {mode!r}; valid: "
                         f"{', '.join(defaults.WORD_MERGINGS)}")
    if mode == "none":
        return [Word(t, i, i) for i, t in enumerate(tokens)]
    words: list[Word] = []
    pieces: list[str] = []
    first = last = -1

    def finish() -> None:
        nonlocal pieces
        if pieces and "".join(pieces):
            words.append(Word("".join(pieces), first, last))
        pieces = []

    for i, token in enumerate(tokens):
        if mode == "sentencepiece":
            if token.startswith(SENTENCEPIECE_SPACE):
                finish()
                token = token[len(SENTENCEPIECE_SPACE):]
            if token:
                if not pieces:
                    first = i
                pieces.append(token)
                last = i
        else:  # bpe
            continues = token.endswith(BPE_CONTINUATION)
            piece = token[:-len(BPE_CONTINUATION)] if continues else token
            if not pieces:
                first = i
            pieces.append(piece)
            last = i
            if not continues:
                finish()
    finish()
    return words
