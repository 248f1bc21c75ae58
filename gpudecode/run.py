"""One decoding job: features from the config's source, results written incrementally.

Each utterance's results are written and flushed as soon as its batch finishes, so an
interrupted run loses nothing; with ``resume`` the utterances already in the output are skipped.
The run's identity (``gpudecode.io.identity``) is stored with the results, and ``resume`` refuses
an output folder whose results another config or other models produced, unless ``force``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from gpudecode import __version__, backend, defaults
from gpudecode.config import Config, ConfigError, dump_resolved
from gpudecode.decoder import Decoder
from gpudecode.io import ResultWriter, UtteranceResult, read_done_ids, score_wer
from gpudecode.io.prefetch import prefetched
from gpudecode.io.writer_process import ChildResultWriter
from gpudecode.io.writer_thread import WriterThread
from gpudecode.io.identity import archive_number, identity_differences, read_identity, run_identity, write_identity
from gpudecode.io.wer import validate_references
from gpudecode.job import (OutOfMemory, RunSummary, RunTimings, decode_fitting, open_utterances, timed_batches,
                           timed_front_end)

__all__ = ["OutOfMemory", "ResumeRefused", "RunSummary", "RunTimings", "SummaryNotSaved", "run_decode"]

log = logging.getLogger(__name__)


class ResumeRefused(ConfigError):
    """``resume`` into an output folder whose results a different run (config, model files, toolkit
    version) produced; ``differences``: one line each."""

    def __init__(self, message: str, differences: list[str]):
        super().__init__(message)
        self.differences = differences


class SummaryNotSaved(Exception):
    """Decoding finished and every result is written, but a summary file (``wer.json``) could not be;
    ``summary`` holds what it would have held, ``error`` the ``OSError``."""

    def __init__(self, summary: RunSummary, error: OSError):
        super().__init__(str(error))
        self.summary, self.error = summary, error


def _check_identity(output: Path, identity: dict, force: bool) -> bool:
    """Compare ``identity`` with the one stored in ``output`` (which holds results); True where they
    differ (and ``force`` accepts it)."""
    stored = read_identity(output)
    if stored is None:
        log.warning("Warning: %s holds results but no %s (written by an older gpudecode): resuming without "
                    "checking that the config and models are those that produced them", output, defaults.IDENTITY_FILE)
        return False
    differences = identity_differences(stored, identity)
    if differences and not force:
        listed = "\n".join(f"  {line}" for line in differences)
        raise ResumeRefused(
            f"io.output: {output} holds results of a different run ({defaults.IDENTITY_FILE} differs):\n{listed}\n"
            "resuming would mix their results; choose another --output, or pass --resume --force to continue "
            f"anyway (the earlier {defaults.RESOLVED_CONFIG_FILE} and {defaults.IDENTITY_FILE} are kept, numbered)",
            differences)
    return bool(differences)


def _record_run(config: Config, output: Path, identity: dict, *, resuming: bool, replaced: bool) -> None:
    """Write the resolved config and the identity; when resuming, an earlier resolved config that
    differs (and a replaced identity) is kept as ``config.resolved.<n>.yaml`` (``run-identity.<n>.json``)."""
    resolved = output / defaults.RESOLVED_CONFIG_FILE
    new = resolved.with_name("." + resolved.name + ".tmp")
    try:
        dump_resolved(config, new)
        old_text = resolved.read_text(encoding="utf-8") if resuming and resolved.exists() else None
        if (old_text is not None and old_text != new.read_text(encoding="utf-8")) or replaced:
            number = archive_number(output)
            if old_text is not None:
                stem, _, suffix = defaults.RESOLVED_CONFIG_FILE.rpartition(".")
                (output / f"{stem}.{number}.{suffix}").write_text(old_text, encoding="utf-8")
            stored = output / defaults.IDENTITY_FILE
            if replaced and stored.exists():
                stem, _, suffix = defaults.IDENTITY_FILE.rpartition(".")
                os.replace(stored, output / f"{stem}.{number}.{suffix}")
        os.replace(new, resolved)
    except OSError as exc:
        if exc.filename is None or exc.filename == str(new):
            exc.filename = str(resolved)  # the file the user knows, not the temporary one
        raise
    write_identity(output, identity)


def _decode_all(decoder: Decoder, source, writer: ResultWriter | ChildResultWriter, config: Config, summary: RunSummary, *,
                exclude: set[str], progress, total: int, start: float) -> None:
    """Decode the batches of ``source`` (less ``exclude``) and write their results in order.

    Batches are read ``runtime.prefetch_batches`` ahead by a thread and results written by another
    (``runtime.writer_queue``), a batch's results handed over together; an utterance counts in
    ``summary`` once its lines are flushed (``progress`` counts those handed to the writer). On an
    error or an interrupt every result decoded before it (in its batch too) is written, then the
    error goes on (an error of the writer itself, such as a full disk, first: the run would have
    stopped there).
    """
    timings, on_bad_input = summary.timings, config.io.on_bad_input

    def write(items: list) -> None:
        """Write (utterance, n-best) ``items`` and count those flushed (the run's first alone: its
        time is measured)."""
        if timings.first_result_at is None and len(items) > 1:
            write(items[:1])
            items = items[1:]
        written, before = time.perf_counter(), writer.num_written
        try:
            for start in range(0, len(items), writer.call_size):
                writer.write_many([UtteranceResult(id=utterance.id, nbest=nbest)
                                   for utterance, nbest in items[start:start + writer.call_size]])
        finally:  # those written before a failure are done
            timings.writing_s += time.perf_counter() - written
            done = items[:writer.num_written - before]
            if done and timings.first_result_at is None:
                timings.first_result_at = time.time()
            summary.frames += sum(utterance.num_frames for utterance, _ in done)
            summary.decoded += len(done)

    batches = prefetched(timed_batches(source.batches(config.batch_sizing, exclude=exclude), timings),
                         config.runtime.prefetch_batches, name="gpudecode-reader")
    queue_depth = config.runtime.writer_queue
    output = WriterThread(write, queue_depth) if queue_depth else None

    def hand_over(items: list) -> None:
        """Write ``items`` or queue them for the writer thread."""
        waited = time.perf_counter()
        if output is None:
            write(items)
        else:
            output.put(items, len(items))
        timings.output_wait_s += time.perf_counter() - waited

    handed, handed_frames = 0, 0  # results handed to the writer (what progress counts)
    try:
        while True:
            waited = time.perf_counter()
            batch = next(batches, None)
            timings.input_wait_s += time.perf_counter() - waited
            if batch is None:
                break
            items = []
            try:
                for item in decode_fitting(decoder, batch, summary, on_bad_input):
                    items.append(item)
            finally:  # what was decoded before an error too
                if items:
                    hand_over(items)
            handed += len(items)
            handed_frames += sum(utterance.num_frames for utterance, _ in items)
            if progress:
                summary.seconds = time.perf_counter() - start
                audio = handed_frames * summary.frame_shift_s
                progress(handed, total, summary.seconds / audio if audio else None)
    finally:
        batches.close()  # stops the reader thread before the source closes
        if output is not None:
            waited = time.perf_counter()
            output.close()  # every queued result written (or the writer's error raised)
            timings.output_wait_s += time.perf_counter() - waited


def run_decode(config: Config, *, resume: bool = False, force: bool = False,
               progress: Callable[[int, int], None] | None = None,
               on_status: Callable[[Mapping], None] | None = None) -> RunSummary:
    """Decode every utterance of ``config.io.features`` into ``config.io.output``.

    ``progress(done, total, real_time_factor)`` is called once decoding starts and after each batch.
    Without ``resume``, an output folder that already holds results is an error (results already
    written are never overwritten). With ``resume``, results of another config, other model files or
    another toolkit version are an error (``ResumeRefused``) unless ``force``.
    With ``runtime.engine.type: ray`` the work runs on a Ray cluster (``gpudecode.engines``) and
    ``on_status(workers)`` gets each worker's status (worker name -> ``WorkerStatus``).
    The local engine fills ``RunSummary.timings`` (:class:`RunTimings`).
    """
    timings = RunTimings(started_at=time.time())
    io = config.io
    if io.features is None and io.prompts is None:
        raise ConfigError("io.features: no features to decode (set io.features.path or pass --features; "
                          "for a model without an encoder, io.prompts or --prompts)")
    output = Path(io.output)
    done = read_done_ids(output) if output.exists() else set()
    if done and not resume:
        raise ConfigError(
            f"io.output: {output} already holds results for {len(done)} utterance(s); "
            "pass --resume to continue that run, or choose another --output"
        )
    identity = run_identity(config.model_dump(), __version__)
    replaced = _check_identity(output, identity, force) if done else False
    if config.runtime.engine.type != "local":
        from gpudecode.engines import run_on_engine

        output.mkdir(parents=True, exist_ok=True)
        _record_run(config, output, identity, resuming=bool(done), replaced=replaced)
        return run_on_engine(config, done=done, resume=resume, progress=progress, on_status=on_status)
    processes = config.runtime.processes
    if io.prompts is not None and processes > 1:
        raise ConfigError("runtime.processes: several decoding processes decode features without "
                          "prompts; set runtime.processes to 1 for a run with io.prompts")
    if processes > 1:
        return _decode_on_processes(config, output, identity, done=done, resume=resume, replaced=replaced,
                                    progress=progress, timings=timings, processes=processes)
    decoder = Decoder(config, timings=timings)
    front_end = config.models.front_end
    summary = RunSummary(resumed=len(done), frame_shift_s=front_end.frame_shift_s, output=output,
                         timings=timings)
    try:
        source = open_utterances(config, decoder.vocabulary, encoder=decoder.encoder is not None,
                                 num_features=decoder.encoder_num_features)
        timed_front_end(source, timings)
        if io.references is not None and "text" in io.formats:  # before decoding: bad references stop here
            validate_references(io.references, source.ids())
        output.mkdir(parents=True, exist_ok=True)
        _record_run(config, output, identity, resuming=bool(done), replaced=replaced)
    except BaseException:
        decoder.close()
        raise
    timings.decoding_at, start = time.time(), time.perf_counter()
    try:
        writer_type = ChildResultWriter if config.runtime.writes_in_child else ResultWriter
        with source, writer_type(output, decoder.vocabulary, formats=io.formats, word_merging=io.word_merging,
                                 frame_shift_s=front_end.frame_shift_s * decoder.subsampling,
                                 resume=resume) as writer:
            total = len([u for u in source.ids() if u not in done])
            if progress:
                progress(0, total)
            _decode_all(decoder, source, writer, config, summary, exclude=done, progress=progress,
                        total=total, start=start)
            summary.skipped = [str(error) for error in source.skipped] + summary.skipped
    finally:
        summary.seconds = time.perf_counter() - start
        timings.finished_at = time.time()
        if config.runtime.device == "cuda":
            summary.gpu_memory_bytes = backend.device_memory_in_use()
        decoder.close()
    _score(summary, config)
    return summary


def _score(summary: RunSummary, config: Config) -> None:
    """The run's WER (with references and the text format), written beside its results."""
    io, output = config.io, Path(config.io.output)
    if io.references is not None and "text" in io.formats:
        text, wer_file = output / defaults.TEXT_FILE, output / defaults.WER_FILE
        try:
            summary.wer = score_wer(text, io.references, wer_file)
        except OSError as exc:
            if exc.filename not in (None, str(wer_file)):
                raise
            exc.filename = str(wer_file)
            summary.wer = score_wer(text, io.references)  # every result is written: the WER is not lost
            raise SummaryNotSaved(summary, exc) from exc


def _decode_on_processes(config: Config, output: Path, identity: dict, *, done: set[str], resume: bool,
                         replaced: bool, progress, timings: RunTimings, processes: int) -> RunSummary:
    """``run_decode`` on several decoding processes (``gpudecode.engines.processes``)."""
    from gpudecode.engines.processes import run_decode_processes

    summary = RunSummary(resumed=len(done), frame_shift_s=config.models.front_end.frame_shift_s, output=output,
                         timings=timings)
    start = time.perf_counter()
    try:
        run_decode_processes(config, done=done, resume=resume, summary=summary, num_processes=processes,
                             progress=progress, on_planned=lambda: _record_run(
                                 config, output, identity, resuming=bool(done), replaced=replaced))
    finally:
        summary.seconds = time.perf_counter() - start
        timings.finished_at = time.time()
        timings.decoding_at = timings.decoding_at or timings.finished_at
    _score(summary, config)
    return summary
