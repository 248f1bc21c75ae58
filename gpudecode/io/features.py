"""Utterances, the feature-source interface shared by every reader, and length bucketing."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpudecode import defaults
from gpudecode.io.errors import FeatureError

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Utterance:
    """One input: ``features`` is ``(T, F)`` float32 with ``T >= 1`` (None for a model without an
    encoder); ``prompt`` its token prompt, [P] int64 label indices (None: none)."""

    id: str
    features: np.ndarray | None
    prompt: np.ndarray | None = None

    @property
    def num_frames(self) -> int:
        """Feature frames (0 without features)."""
        return 0 if self.features is None else int(self.features.shape[0])


def check_features(features: np.ndarray, *, path: str | Path, utterance_id: str,
                   num_features: int | None, expected_from: str = "num_features") -> np.ndarray:
    """Return ``features`` as C-contiguous float32 ``(T, F)`` or raise ``FeatureError``.

    Checks: a numeric 2-D array, at least one frame, ``F == num_features`` (when given), every
    value finite (the message names the first bad frame).
    """
    def fail(problem: str) -> FeatureError:
        return FeatureError(problem, path=path, utterance_id=utterance_id)

    arr = np.asarray(features)
    if arr.dtype.kind not in "fiu":
        raise fail(f"features have dtype {arr.dtype}; expected a float array")
    if arr.ndim != 2:
        raise fail(f"features have shape {arr.shape}; expected (frames, features)")
    if arr.shape[0] == 0:
        raise fail("empty utterance: zero frames")
    if arr.shape[1] == 0:
        raise fail("features have zero dimensions per frame")
    if num_features is not None and arr.shape[1] != num_features:
        raise fail(f"features have dimension {arr.shape[1]}; expected {num_features} "
                   f"({expected_from})")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    finite = np.isfinite(arr)
    if not finite.all():
        bad_frames = np.flatnonzero(~finite.all(axis=1))
        kind = "NaN" if np.isnan(arr[bad_frames[0]]).any() else "Inf"
        raise fail(f"{kind} in frame {int(bad_frames[0])} of {arr.shape[0]} "
                   f"({bad_frames.size} frame(s) with NaN/Inf)")
    return arr


#: Appended to the error that stops a run at a bad utterance (``io.on_bad_input: stop``).
SKIP_HINT = "; to leave bad utterances out and go on, set io.on_bad_input: skip (-o io.on_bad_input=skip)"


def stopping_error(exc: FeatureError) -> FeatureError:
    """``exc`` with :data:`SKIP_HINT` appended (same type, path and utterance)."""
    if exc.problem.endswith(SKIP_HINT):
        return exc
    return type(exc)(exc.problem + SKIP_HINT, path=exc.path, utterance_id=exc.utterance_id)


@dataclass(frozen=True)
class BatchSizing:
    """How utterances are cut into search calls: at most ``utterances`` per batch, at most
    ``frames`` padded input frames (the batch's size times its longest utterance; None: no limit;
    an utterance longer than that goes alone), and the first batch at most ``first`` utterances
    (None: as the others)."""

    utterances: int
    frames: int | None = None
    first: int | None = None

    def __post_init__(self) -> None:
        for name in ("utterances", "frames", "first"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"batch sizing: {name} must be >= 1, got {value}")


def bucket_by_length(utterance_lengths: Mapping[str, int] | Iterable[tuple[str, int]],
                     batch_size: int | BatchSizing, *, longest_first: bool = True) -> list[list[str]]:
    """Group utterance ids into batches of similar length.

    Ids are sorted by length (longest first by default, so an out-of-memory error shows up in
    the first batch; ties keep the input order) and cut into consecutive batches of at most
    ``batch_size`` ids (an int, or a :class:`BatchSizing` that also bounds padded frames and the
    first batch).
    """
    sizing = batch_size if isinstance(batch_size, BatchSizing) else None
    if sizing is None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        sizing = BatchSizing(int(batch_size))
    items = list(utterance_lengths.items() if isinstance(utterance_lengths, Mapping)
                 else utterance_lengths)
    order = sorted(range(len(items)),
                   key=lambda i: (-items[i][1] if longest_first else items[i][1], i))
    batches: list[list[str]] = []
    batch: list[str] = []
    longest = 0
    for i in order:
        utt_id, length = items[i][0], max(int(items[i][1]), 1)
        cap = sizing.first if sizing.first is not None and not batches else sizing.utterances
        cap = min(cap, sizing.utterances)
        padded = (len(batch) + 1) * max(longest, length)
        if batch and (len(batch) >= cap or (sizing.frames is not None and padded > sizing.frames)):
            batches.append(batch)
            batch, longest = [], 0
        batch.append(utt_id)
        longest = max(longest, length)
    if batch:
        batches.append(batch)
    return batches


def pad_features(features: Sequence[np.ndarray]) -> np.ndarray:
    """[U, T_max, F] float32, zero-padded at the end of time (C-contiguous): a batch's encoder input.

    The one home of the padding rule: a source's batches are padded by it where they are read
    (:class:`PaddedBatch`), the decoder pads with it what comes without."""
    num_features = features[0].shape[1]
    batch = np.zeros((len(features), max(f.shape[0] for f in features), num_features), np.float32)
    for i, f in enumerate(features):  # once per utterance at admission, not per search step
        batch[i, : f.shape[0]] = f
    return batch


class PaddedBatch(list):
    """A batch of utterances (a ``list[Utterance]``) that also carries ``padded``: their features
    padded by :func:`pad_features` ([U, T_max, F] float32), or None when an utterance has none.

    Built by :meth:`of` where the batch is read (the reader thread of ``gpudecode decode``), so the
    decoding loop need not pad it. Each utterance's ``features`` then is a view of its row of
    ``padded`` (its own frames, C-contiguous float32 as read): the batch holds its features once.
    ``padded`` is the batch as built; a slice or a filtered copy of it is a plain list."""

    def __init__(self, utterances: Iterable[Utterance] = (), padded: np.ndarray | None = None):
        super().__init__(utterances)
        self.padded = padded

    @classmethod
    def of(cls, utterances: Iterable[Utterance]) -> PaddedBatch:
        """``utterances`` with their features padded (none when one of them has no features)."""
        utterances = list(utterances)
        if not utterances or any(u.features is None for u in utterances):
            return cls(utterances)
        padded = pad_features([u.features for u in utterances])
        return cls([dataclasses.replace(u, features=padded[i, : u.features.shape[0]])
                    for i, u in enumerate(utterances)], padded)


class FeatureSource:
    """Utterances of one feature file or folder, read lazily and checked as they are read.

    Subclasses implement ``_keys()`` (ids in file order), ``_load(id)`` (raw array) and, where
    cheaper than loading, ``_num_frames(id)``. Iterating yields validated ``Utterance``s in
    file order; ``read(id)`` gives random access; ``batches(batch_size)`` yields length-bucketed
    batches. With ``on_error="skip"`` a bad utterance is logged, kept in ``skipped`` and left
    out instead of raising.
    """

    format = "?"

    def __init__(self, path: str | Path, *, num_features: int | None = None,
                 on_error: str = defaults.ON_BAD_INPUT):
        if on_error not in defaults.ON_BAD_INPUT_CHOICES:
            raise ValueError(f"on_error must be one of {defaults.ON_BAD_INPUT_CHOICES}, "
                             f"got {on_error!r}")
        self.path = Path(path)
        self.num_features = num_features
        self._features_from = "num_features"
        self.on_error = on_error
        self.skipped: list[FeatureError] = []
        self._ids: list[str] | None = None
        self._id_set: frozenset[str] = frozenset()

    # --- to implement ---------------------------------------------------------------------
    def _keys(self) -> list[str]:
        raise NotImplementedError

    def _load(self, utt_id: str) -> np.ndarray:
        raise NotImplementedError

    def _num_frames(self, utt_id: str) -> int:
        return int(np.shape(self._load(utt_id))[0])

    def _source_of(self, utt_id: str) -> Path:
        """The file an utterance comes from (for error messages)."""
        return self.path

    # --- public ---------------------------------------------------------------------------
    def ids(self) -> list[str]:
        """Utterance ids in file order."""
        if self._ids is None:
            ids = list(self._keys())
            seen: set[str] = set()
            for utt_id in ids:
                if utt_id in seen:
                    raise FeatureError("duplicate utterance id", path=self.path,
                                       utterance_id=utt_id)
                seen.add(utt_id)
            if not ids:
                raise FeatureError(f"no utterances found (format {self.format})", path=self.path)
            self._ids = ids
            self._id_set = frozenset(ids)
        return self._ids

    def __len__(self) -> int:
        return len(self.ids())

    def lengths(self) -> dict[str, int]:
        """Frames per utterance id (read from headers where the format allows). With
        ``on_error="skip"``, utterances whose length cannot be read are left out."""
        lengths = {}
        for utt_id in self.ids():
            try:
                try:
                    lengths[utt_id] = self._num_frames(utt_id)
                except FeatureError:
                    raise
                except Exception as exc:
                    raise FeatureError(f"cannot read: {type(exc).__name__}: {exc}",
                                       path=self._source_of(utt_id),
                                       utterance_id=utt_id) from exc
            except FeatureError as exc:
                if self.on_error == "stop":
                    raise stopping_error(exc) from exc
                log.warning("skipping: %s", exc)
                self.skipped.append(exc)
        return lengths

    def read(self, utt_id: str) -> Utterance:
        """One validated utterance; raises ``FeatureError`` whatever ``on_error`` says."""
        self.ids()
        if utt_id not in self._id_set:
            raise FeatureError("no such utterance", path=self.path, utterance_id=utt_id)
        source = self._source_of(utt_id)
        try:
            raw = self._load(utt_id)
        except FeatureError:
            raise
        except Exception as exc:  # unreadable file: name it, keep the cause
            raise FeatureError(f"cannot read: {type(exc).__name__}: {exc}", path=source,
                               utterance_id=utt_id) from exc
        features = check_features(raw, path=source, utterance_id=utt_id,
                                  num_features=self.num_features,
                                  expected_from=self._features_from)
        if self.num_features is None:
            self.num_features = features.shape[1]
            self._features_from = f"as in utterance {utt_id!r}"
        return Utterance(utt_id, features)

    def _read_or_skip(self, utt_id: str) -> Utterance | None:
        try:
            return self.read(utt_id)
        except FeatureError as exc:
            if self.on_error == "stop":
                raise stopping_error(exc) from exc
            log.warning("skipping: %s", exc)
            self.skipped.append(exc)
            return None

    def __iter__(self) -> Iterator[Utterance]:
        for utt_id in self.ids():
            utt = self._read_or_skip(utt_id)
            if utt is not None:
                yield utt

    def batches(self, batch_size: int | BatchSizing, *, exclude: Iterable[str] = (),
                longest_first: bool = True) -> Iterator[PaddedBatch]:
        """Length-bucketed batches of validated utterances (``batch_size``: see
        :func:`bucket_by_length`), leaving out ``exclude`` (e.g. the ids already decoded when
        resuming). Features are read one batch at a time, and padded for the encoder as the
        batch is read (:class:`PaddedBatch`; in ``gpudecode decode``'s reader thread)."""
        excluded = set(exclude)
        lengths = [(u, n) for u, n in self.lengths().items() if u not in excluded]
        for batch_ids in bucket_by_length(lengths, batch_size, longest_first=longest_first):
            batch = self._read_batch(batch_ids)
            if batch:
                yield batch

    def read_batch(self, utt_ids: Sequence[str]) -> PaddedBatch:
        """The batch of ``utt_ids`` as :meth:`batches` reads it (bad utterances skipped, in
        ``skipped``, or raised as ``on_error`` says), padded: a decoding process of a pool
        (``gpudecode.engines.processes``) reads the batches it is handed by their ids."""
        return self._read_batch(utt_ids)

    def _read_batch(self, utt_ids: Sequence[str]) -> PaddedBatch:
        """The batch of ``utt_ids`` (bad utterances skipped or raised as ``on_error`` says), padded.
        A format that can read a batch straight into its padded array overrides it (same result)."""
        return PaddedBatch.of(u for u in map(self._read_or_skip, utt_ids) if u is not None)

    def close(self) -> None:
        """Release open files (a no-op for formats that keep none open)."""

    def __enter__(self) -> FeatureSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sorted_files(folder: Path, suffixes: Sequence[str]) -> list[Path]:
    """Files directly in ``folder`` whose suffix (lower-cased) is in ``suffixes``, by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
