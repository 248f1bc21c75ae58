"""What every engine shares for one decoding job: the run's summary, and decoding a batch that
may not fit in GPU memory (split in halves until it does).

``gpudecode.run`` (the local engine) and ``gpudecode.engines`` (Ray) both import this module;
it imports neither.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gpudecode import backend
from gpudecode.config import Config, ConfigError
from gpudecode.decoder import Decoder
from gpudecode.io import PromptedSource, PromptSource, open_features, read_prompts
from gpudecode.io.features import PaddedBatch
from gpudecode.search.nonfinite import NonFiniteScores

_NAMED = 10  # utterance ids a warning names before "and N more"


@dataclass
class RunTimings:
    """Where a run's time goes: host wall seconds of each part of the decoding loop, and wall-clock
    instants (``time.time()``, comparable between processes) of its milestones.

    ``reading_s``: reading the features (without the front end); ``front_end_s``: the front end of
    audio input; ``encoder_s``: the encoder and the batch's inputs; ``search_s``: the search;
    ``writing_s``: writing and flushing the results. On CUDA these are host times: GPU work that
    one part queues and the next waits for is counted where it is waited for. Reading and the front
    end run in a background thread with ``runtime.prefetch_batches``, writing with
    ``runtime.writer_queue``: the decoding loop then waits only ``input_wait_s`` for its batches and
    ``output_wait_s`` for the writer (a full queue, and the last results at the end); without those
    threads the waits are the parts themselves. A run on several decoding processes
    (``processes`` > 1, ``gpudecode.engines.processes``) holds each part's mean over them, and its
    writing is this process's."""

    started_at: float = 0.0  # the run began (imports done)
    decoding_at: float = 0.0  # the decoding loop began (sessions created, the source open)
    first_result_at: float | None = None  # the first result was written and flushed
    finished_at: float = 0.0  # the decoding loop ended
    reading_s: float = 0.0
    front_end_s: float = 0.0
    encoder_s: float = 0.0
    search_s: float = 0.0
    writing_s: float = 0.0
    input_wait_s: float = 0.0  # the decoding loop waited for its next batch
    output_wait_s: float = 0.0  # the decoding loop waited for results to be written (or queued)
    processes: int = 1  # decoding processes (the parts above: their mean)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class TimedFrontEnd:
    """A front end that adds its seconds to ``timings.front_end_s`` (its other attributes are the
    front end's own)."""

    def __init__(self, front_end, timings: RunTimings):
        self._front_end, self._timings = front_end, timings

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._front_end(*args, **kwargs)
        finally:
            self._timings.front_end_s += time.perf_counter() - start

    def __getattr__(self, name: str):
        return getattr(self._front_end, name)


def timed_front_end(source, timings: RunTimings) -> None:
    """Times the front end of ``source`` (audio input) in ``timings``; other sources have none."""
    front_end = getattr(source, "front_end", None)
    if front_end is not None and not isinstance(front_end, TimedFrontEnd):
        source.front_end = TimedFrontEnd(front_end, timings)


def timed_batches(batches: Iterable, timings: RunTimings) -> Iterator:
    """``batches``, the time spent producing each (less the front end's) added to ``timings.reading_s``."""
    iterator = iter(batches)
    while True:
        start, front_end = time.perf_counter(), timings.front_end_s
        batch = next(iterator, None)
        timings.reading_s += time.perf_counter() - start - (timings.front_end_s - front_end)
        if batch is None:
            return
        yield batch


@dataclass
class RunSummary:
    """What a run did: counts, time, throughput and (with references) WER/CER."""

    decoded: int = 0
    resumed: int = 0
    skipped: list[str] = field(default_factory=list)
    frames: int = 0
    seconds: float = 0.0
    frame_shift_s: float = 0.0
    wer: dict | None = None
    output: Path | None = None
    gpu_memory_bytes: int | None = None  # CuPy pool bytes at the end (GPU runs)
    retried_batches: int = 0  # batches split after running out of GPU memory
    #: ids of utterances whose best hypothesis the search cut short (``Hypothesis.truncated``)
    truncated: list[str] = field(default_factory=list)
    timings: RunTimings = field(default_factory=RunTimings)

    def count_truncated(self, utterance_id: str, nbest) -> None:
        """Notes ``utterance_id`` when its best hypothesis (``nbest[0]``) is truncated."""
        if nbest and nbest[0].truncated:
            self.truncated.append(utterance_id)

    def warnings(self) -> list[str]:
        """Lines to show at the end of a run: the truncated utterances (up to ten named)."""
        if not self.truncated:
            return []
        named = ", ".join(self.truncated[:_NAMED])
        more = len(self.truncated) - _NAMED
        return [f"warning: {len(self.truncated)} utterance(s) cut short by the search's length limits "
                f"(search.max_labels, max_labels_per_input or max_symbols_per_frame): {named}"
                + (f" and {more} more" if more > 0 else "")
                + "; their hypotheses are marked \"truncated\": true in nbest.jsonl — raise the limit "
                  "(within the models' positions) to decode them whole"]

    @property
    def utterances_per_second(self) -> float:
        return self.decoded / self.seconds if self.seconds else 0.0

    @property
    def real_time_factor(self) -> float | None:
        """Decoding time ÷ audio duration (input frames × frame shift)."""
        audio = self.frames * self.frame_shift_s
        return self.seconds / audio if audio else None

    def rows(self) -> list[tuple[str, str]]:
        rows = [("utterances decoded", str(self.decoded)), ("resumed (already done)", str(self.resumed)),
                ("skipped (bad input)", str(len(self.skipped))), ("time", f"{self.seconds:.2f} s"),
                ("utterances/s", f"{self.utterances_per_second:.1f}")]
        if self.real_time_factor is not None:
            rows.append(("real-time factor", f"{self.real_time_factor:.4f}"))
        if self.wer is not None:
            w = self.wer
            errors = w["substitutions"] + w["deletions"] + w["insertions"]
            rows.append(("WER", f"{100 * w['wer']:.2f} % ({errors} errors / {w['num_ref_words']} words: "
                                f"{w['substitutions']} sub, {w['deletions']} del, {w['insertions']} ins)"))
            rows.append(("CER", f"{100 * self.wer['cer']:.2f} %"))
            if w.get("num_hypotheses_without_reference"):
                rows.append(("hypotheses without reference", f"{w['num_hypotheses_without_reference']} (left out of "
                                                             "the WER)"))
            if w.get("num_missing_hypotheses"):
                rows.append(("references without hypothesis", f"{w['num_missing_hypotheses']} (counted as all "
                                                              "deletions)"))
        if self.gpu_memory_bytes is not None:
            rows.append(("GPU memory (CuPy pool)", f"{self.gpu_memory_bytes / 2**20:.1f} MiB"))
        if self.retried_batches:
            rows.append(("batches split (out of GPU memory)", str(self.retried_batches)))
        if self.truncated:
            rows.append(("truncated (length limit)", str(len(self.truncated))))
        rows.append(("output", str(self.output)))
        return rows


def open_utterances(config: Config, vocabulary, *, encoder: bool, num_features: int | None = None):
    """The utterances of ``config.io`` as a source (``ids``, ``lengths``, ``read``, ``batches``,
    ``skipped``; a context manager): the features, the features with their prompts (every
    utterance needs one), or, without an encoder and without features, the prompts alone.
    ``vocabulary`` resolves prompts written as text; ``num_features``: F the encoder expects."""
    io = config.io
    prompts = None
    if io.prompts is not None:
        prompts = read_prompts(io.prompts, vocabulary=vocabulary, format=io.prompts_format)
    if io.features is None:
        if encoder:
            raise ConfigError("io.features: models.encoder needs features to decode (set io.features.path or "
                              "pass --features)")
        if prompts is None:
            raise ConfigError("io.features: no features to decode (set io.features.path or pass --features; "
                              "for a model without an encoder, io.prompts or --prompts)")
        return PromptSource(prompts, path=io.prompts)
    source = open_features(io.features.path, io.features.format, config.models.front_end,
                           num_features=io.features.num_features or num_features, on_error=io.on_bad_input)
    if prompts is None:
        return source
    try:
        return PromptedSource(source, prompts, path=io.prompts)
    except BaseException:
        source.close()
        raise


class OutOfMemory(RuntimeError):
    """One utterance alone does not fit in GPU memory."""


def whole_batch_padding(batch):
    """The features of ``batch`` as padded where it was read (a :class:`PaddedBatch` decoded
    whole), or None: pad them again. The halves of a batch split after running out of memory and
    the rest after a drop are plain lists: None."""
    if isinstance(batch, PaddedBatch) and batch.padded is not None and len(batch.padded) == len(batch):
        return batch.padded
    return None


def decode_fitting(decoder: Decoder, batch, summary: RunSummary, on_bad_input: str):
    """(utterance, n-best) pairs of ``batch``; on GPU out-of-memory the cached free memory is
    released (never live states) and the batch is decoded in halves; an utterance that fails
    alone is reported (``stop``) or skipped (``skip``). Utterances with non-finite scores
    (:class:`NonFiniteScores`) are reported, or skipped and the others decoded again. Utterances
    whose best hypothesis is truncated are noted in ``summary.truncated``.

    A batch decoded whole takes the features as padded where it was read
    (:func:`whole_batch_padding`); its halves and its rest are padded again."""
    try:
        features = None if batch[0].features is None else [u.features for u in batch]
        padded = whole_batch_padding(batch)
        extra = {} if padded is None else {"padded": padded}
        if batch[0].prompt is None:
            nbests = decoder.decode_batch([u.id for u in batch], features, **extra)
        else:
            nbests = decoder.decode_batch([u.id for u in batch], features, [u.prompt for u in batch], **extra)
    except NonFiniteScores as error:
        bad = set(error.utterance_ids)
        rest = [u for u in batch if u.id not in bad]  # a plain list: padded again
        if on_bad_input != "skip" or len(rest) == len(batch):
            raise
        summary.skipped += [f"utterance {u.id!r}: {error.what}" for u in batch if u.id in bad]
        if rest:
            yield from decode_fitting(decoder, rest, summary, on_bad_input)
        return
    except Exception as error:
        if not backend.is_out_of_memory(error):
            raise
        backend.release_cached_memory()
        if len(batch) == 1:
            message = (f"utterance {batch[0].id!r} ({batch[0].num_frames} frames) does not fit in GPU memory "
                       f"even alone: {error}")
            if on_bad_input == "skip":
                summary.skipped.append(message)
                return
            raise OutOfMemory(message) from error
        summary.retried_batches += 1
        half = len(batch) // 2  # the halves: plain lists (list slices), padded again
        yield from decode_fitting(decoder, list(batch[:half]), summary, on_bad_input)
        yield from decode_fitting(decoder, list(batch[half:]), summary, on_bad_input)
        return
    for utterance, nbest in zip(batch, nbests):
        summary.count_truncated(utterance.id, nbest)
        yield utterance, nbest
