"""Per-utterance token prompts: a prompt file, one utterance per line.

Each line is an utterance id followed by its prompt, whitespace-separated::

    utt1 12 7 99          # format "ids": label indices into the vocabulary
    utt2 the cat sat      # format "text": labels of the vocabulary, each looked up by its string

Blank lines and lines starting with ``#`` are skipped; an id alone is an empty prompt. Errors
(:class:`PromptError`) name the file, the line and the utterance: a label that is not an integer
(``ids``) or not in the vocabulary (``text``), an index out of range, an id given twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from gpudecode import defaults
from gpudecode.io.errors import InputError, VocabularyError
from gpudecode.io.features import BatchSizing, Utterance, bucket_by_length

#: How a prompt file writes its labels.
PROMPT_FORMATS = defaults.PROMPT_FORMATS


class PromptError(InputError):
    """A bad prompt file or prompt: unreadable, an unknown label, an id given twice or missing."""


def parse_prompts(lines: Sequence[str] | str, *, vocabulary=None, vocab_size: int | None = None,
                  format: str = defaults.PROMPT_FORMAT, path: str | Path = "<prompts>") -> dict[str, np.ndarray]:
    """Utterance id -> [P] int64 label indices, in file order.

    ``format`` ``ids``: integers, checked against ``vocab_size`` (or ``len(vocabulary)``) when
    given; ``text``: labels looked up in ``vocabulary`` (a :class:`gpudecode.io.Vocabulary`).
    """
    if format not in PROMPT_FORMATS:
        raise ValueError(f"prompt format: expected one of {', '.join(PROMPT_FORMATS)}, got {format!r}")
    if format == "text" and vocabulary is None:
        raise ValueError("prompt format 'text' needs the vocabulary to look the labels up in")
    if vocab_size is None and vocabulary is not None:
        vocab_size = len(vocabulary)
    if isinstance(lines, str):
        lines = lines.split("\n")
    prompts: dict[str, np.ndarray] = {}
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        utt, words = fields[0], fields[1:]

        def fail(problem: str) -> PromptError:
            return PromptError(f"line {number}: {problem}", path=path, utterance_id=utt)

        if utt in prompts:
            raise fail(f"the id is given twice (first on line {first_line[utt]})")
        labels = []
        for word in words:
            if format == "text":
                try:
                    index = vocabulary.index(word)
                except VocabularyError:
                    raise fail(f"label {word!r} is not in the vocabulary ({len(vocabulary)} labels)") from None
            else:
                try:
                    index = int(word)
                except ValueError:
                    raise fail(f"{word!r} is not a label index (the prompt format is 'ids'; "
                               "use format 'text' for labels written out)") from None
                if index < 0 or (vocab_size is not None and index >= vocab_size):
                    bound = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
                    raise fail(f"label index {index} is out of range ({bound})")
            labels.append(index)
        prompts[utt] = np.asarray(labels, dtype=np.int64)
        first_line[utt] = number
    return prompts


def read_prompts(path: str | Path, *, vocabulary=None, vocab_size: int | None = None,
                 format: str = defaults.PROMPT_FORMAT) -> dict[str, np.ndarray]:
    """:func:`parse_prompts` of the file at ``path``; an empty file is an error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise PromptError("prompt file does not exist", path=path) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(f"cannot read prompt file: {exc}", path=path) from exc
    prompts = parse_prompts(text, vocabulary=vocabulary, vocab_size=vocab_size, format=format, path=path)
    if not prompts:
        raise PromptError("no prompts in the file", path=path)
    return prompts


def check_prompts_cover(prompts: Mapping[str, np.ndarray], ids: Sequence[str], *,
                        path: str | Path = "<prompts>") -> None:
    """Every id of ``ids`` has a prompt and every prompt an utterance; else a :class:`PromptError`
    naming the first few ids."""
    missing = [i for i in ids if i not in prompts]
    if missing:
        raise PromptError(f"no prompt for {len(missing)} utterance(s): {', '.join(map(repr, missing[:5]))}"
                          f"{' ...' if len(missing) > 5 else ''}", path=path)
    known = set(ids)
    extra = [i for i in prompts if i not in known]
    if extra:
        raise PromptError(f"prompts for {len(extra)} id(s) that are not among the utterances: "
                          f"{', '.join(map(repr, extra[:5]))}{' ...' if len(extra) > 5 else ''}", path=path)


class PromptSource:
    """The utterances of a prompt file for a model without an encoder: ``Utterance(id,
    features=None, prompt=...)``, in length-bucketed batches (longest prompt first) like a
    :class:`gpudecode.io.FeatureSource`."""

    format = "prompts"

    def __init__(self, prompts: Mapping[str, np.ndarray], *, path: str | Path = "<prompts>"):
        self.prompts = dict(prompts)
        self.path = Path(path)
        self.skipped: list[InputError] = []

    def ids(self) -> list[str]:
        return list(self.prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def lengths(self) -> dict[str, int]:
        return {u: int(p.size) for u, p in self.prompts.items()}

    def read(self, utt_id: str) -> Utterance:
        if utt_id not in self.prompts:
            raise PromptError("no such utterance", path=self.path, utterance_id=utt_id)
        return Utterance(utt_id, None, prompt=self.prompts[utt_id])

    def __iter__(self) -> Iterator[Utterance]:
        return (self.read(u) for u in self.prompts)

    def batches(self, batch_size: int | BatchSizing, *, exclude=(), longest_first: bool = True) -> Iterator[list[Utterance]]:
        excluded = set(exclude)
        lengths = [(u, n) for u, n in self.lengths().items() if u not in excluded]
        for batch_ids in bucket_by_length(lengths, batch_size, longest_first=longest_first):
            yield [self.read(u) for u in batch_ids]

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> PromptSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PromptedSource:
    """A feature source whose utterances also carry their prompt (every utterance must have one)."""

    def __init__(self, source, prompts: Mapping[str, np.ndarray], *, path: str | Path = "<prompts>"):
        self.source = source
        self.prompts = dict(prompts)
        self.path = path
        check_prompts_cover(self.prompts, source.ids(), path=path)

    @property
    def skipped(self):
        return self.source.skipped

    def ids(self) -> list[str]:
        return self.source.ids()

    def __len__(self) -> int:
        return len(self.source)

    def lengths(self) -> dict[str, int]:
        """Feature frames per utterance id (as the feature source gives them)."""
        return self.source.lengths()

    def read(self, utt_id: str) -> Utterance:
        u = self.source.read(utt_id)
        return Utterance(u.id, u.features, prompt=self.prompts[u.id])

    def batches(self, batch_size: int | BatchSizing, *, exclude=(), longest_first: bool = True) -> Iterator[list[Utterance]]:
        for batch in self.source.batches(batch_size, exclude=exclude, longest_first=longest_first):
            yield [Utterance(u.id, u.features, prompt=self.prompts[u.id]) for u in batch]

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> PromptedSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
