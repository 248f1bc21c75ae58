"""Decoding by several local processes sharing one device (``runtime.processes``).

    gpudecode decode CONFIG -o runtime.processes=2

Small models leave a GPU idle while one interpreter does the host's share of each batch (reading
it, the encoder's inputs, the search's n-best lists, formatting the lines). With
``runtime.processes`` N > 1 this process plans the batches as the single-process run does
(length-bucketed, less the utterances already written, cut so that each process gets several),
and N decoding processes (``python -m gpudecode.engines.processes``), each with its own
:class:`~gpudecode.decoder.Decoder` on the same device, read, decode and format the batches handed
to them, :data:`IN_FLIGHT` each (one read while the other is decoded). While they start, this
process decodes the first batch itself, so the first result comes as early as in a single-process
run; then it only hands out batches and writes their lines as they come
(:meth:`ResultWriter.write_formatted`): every utterance's lines are those of the single-process
run (on CUDA up to float32 noise in the scores: the batches differ), whole, and ``--resume`` works
as there (across settings too); across batches the order is the order the batches finished.
Processes take turns on a GPU, so whether this pays depends on the system (the default is one).

A decoding process that fails sends its error (and the lines of the utterances its batch decoded
before it); one that dies is reported. Either way the run stops, keeping what was written, and says
to ``--resume``. The processes ignore SIGINT (a terminal sends it to the whole group; this process
decides what is written) and end when their input ends, so a killed run leaves no process behind.

Protocol (pickles on each child's stdin and a duplicate of its stdout): ``("start", config)``, then
``("batch", ids)`` per batch; the child answers ``("ready", subsampling, time)`` or ``("failed",
BatchDone, error)`` to the start and ``("done", BatchDone)`` or ``("failed", BatchDone, error)`` to
each batch, in order; it ends at the end of its input.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import selectors
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from gpudecode import backend, defaults
from gpudecode.config import Config
from gpudecode.io import ResultWriter, UtteranceResult, bucket_by_length
from gpudecode.io.features import BatchSizing
from gpudecode.io.wer import validate_references
from gpudecode.io.writer_process import child_environment, picklable, serve_stdin
from gpudecode.job import RunSummary, RunTimings, open_utterances

__all__ = ["BatchDone", "DecodingProcessError", "plan_batches", "run_decode_processes"]

#: batches handed to a decoding process ahead of its answers: one read while another is decoded
IN_FLIGHT = 2
#: seconds the run waits for a decoding process to exit once its input is closed
CLOSE_TIMEOUT_S = 30.0
#: timing fields a decoding process reports (their mean over the processes goes into the run's)
_PROCESS_TIMINGS = ("reading_s", "front_end_s", "encoder_s", "search_s", "input_wait_s")
#: loggers whose warnings (about the models, sessions and searches) the decoding processes leave out
_SAID_ONCE = ("gpudecode.session", "gpudecode.states", "gpudecode.search", "gpudecode.scorers", "gpudecode.decoder")


class DecodingProcessError(RuntimeError):
    """A decoding process ended without answering (it crashed or was killed)."""


@dataclass
class BatchDone:
    """One batch decoded and formatted by a decoding process."""

    ids: list[str] = field(default_factory=list)  # the utterances formatted, in order
    frames: int = 0  # their input frames
    texts: tuple[str, ...] = ()  # each file's lines of them, in the formatter's order
    skipped: list[str] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)
    retried_batches: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # the process's totals so far
    gpu_memory_bytes: int | None = None


def plan_batches(lengths: list[tuple[str, int]], sizing: BatchSizing, num_processes: int) -> list[list[str]]:
    """The run's batches for ``num_processes`` processes: the single-process run's
    (:func:`bucket_by_length`), with at most ~1/(``defaults.BATCHES_PER_PROCESS`` × N) of the
    utterances each, so the processes finish close together."""
    share = -(-len(lengths) // (defaults.BATCHES_PER_PROCESS * num_processes))
    cap = max(min(sizing.utterances, share), sizing.first or 1, 1)
    return bucket_by_length(lengths, dataclasses.replace(sizing, utterances=cap))


class _Child:
    """One decoding process, as this process sees it."""

    def __init__(self, index: int, config: Config):
        self.index = index
        self.process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=child_environment())
        self.pending: list[list[str]] = []  # batches sent, not answered
        self.ready = False
        self.stopped = False
        self.timings: dict[str, float] = {}
        self.send(("start", config))

    def send(self, message: tuple) -> None:
        try:
            pickle.dump(message, self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self.ended() from None

    def receive(self) -> tuple:
        try:
            return pickle.load(self.process.stdout)
        except (EOFError, pickle.UnpicklingError):
            raise self.ended() from None

    def stop(self) -> None:
        """No more batches: close its input (it exits after answering what it has)."""
        if not self.stopped:
            self.stopped = True
            try:
                self.process.stdin.close()
            except OSError:
                pass

    def ended(self) -> DecodingProcessError:
        code = self.process.wait()
        return DecodingProcessError(f"decoding process {self.index + 1} ended unexpectedly (exit status {code})")

    def close(self, kill: bool) -> None:
        self.stop()
        if kill and self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


def run_decode_processes(config: Config, *, done: set[str], resume: bool, summary: RunSummary,
                         num_processes: int, progress: Callable | None = None,
                         on_planned: Callable[[], None] = lambda: None) -> None:
    """``run_decode``'s decoding loop on up to ``num_processes`` decoding processes (one per batch
    at most; see the module docstring): fills ``summary`` (and its timings) as the single-process
    loop does. ``on_planned`` is called once the utterances are listed (and the references checked
    against them), before anything is decoded.

    This process decodes the first batch itself while the others start (so the first result comes
    as soon as in a single-process run), then only hands out batches and writes."""
    from gpudecode.decoder import Decoder  # only here: the decoding processes import it themselves

    io, timings, start = config.io, summary.timings, time.perf_counter()
    vocabulary = config.models.vocabulary.load()
    with open_utterances(config, vocabulary, encoder=config.models.encoder is not None) as source:
        if io.references is not None and "text" in io.formats:  # before decoding: bad references stop here
            validate_references(io.references, source.ids())
        lengths = [(u, n) for u, n in source.lengths().items() if u not in done]
        summary.skipped += [str(error) for error in source.skipped]
        Path(io.output).mkdir(parents=True, exist_ok=True)
        on_planned()
        batches = plan_batches(lengths, config.batch_sizing, num_processes)
        children = [_Child(k, config) for k in range(min(num_processes, len(batches) - 1))]
        timings.processes = max(1, len(children))
        todo = iter(batches[1:])
        finished = False
        try:
            for most in range(1, IN_FLIGHT + 1):  # their first batches, one to each in turn, now
                for child in children:
                    _hand_out(child, todo, most)
            if progress:
                progress(0, len(lengths))
            decoder = Decoder(config, timings=timings)
            try:
                writer = ResultWriter(io.output, vocabulary, formats=io.formats, word_merging=io.word_merging,
                                      resume=resume,
                                      frame_shift_s=config.models.front_end.frame_shift_s * decoder.subsampling)
                timings.decoding_at = time.time()
                with writer:
                    if batches:
                        _decode_here(decoder, source, batches[0], writer, summary, config.io.on_bad_input)
                    decoder.close()
                    decoder = None
                    if progress:
                        progress(summary.decoded, len(lengths))
                    _decode_batches(children, todo, writer, summary, progress, len(lengths), start)
            finally:
                if decoder is not None:
                    decoder.close()
            finished = True
        except DecodingProcessError as error:
            raise DecodingProcessError(f"{error}; the results written to {config.io.output} are kept: run "
                                       "the same command with --resume to decode the rest") from None
        finally:
            for child in children:
                child.close(kill=not finished)
            if children:
                _mean_timings(children, timings)


def _decode_here(decoder, source, ids: list[str], writer: ResultWriter, summary: RunSummary,
                 on_bad_input: str) -> None:
    """Decode and write one batch in this process, as the single-process loop does (what was
    decoded before an error is written, then the error goes on)."""
    from gpudecode.job import decode_fitting

    timings = summary.timings
    skipped_before, began = len(source.skipped), time.perf_counter()
    batch = source.read_batch(ids)
    timings.reading_s += time.perf_counter() - began
    summary.skipped += [str(e) for e in source.skipped[skipped_before:]]
    if not batch:
        return
    items = []
    try:
        items.extend(decode_fitting(decoder, batch, summary, on_bad_input))
    finally:
        if items:
            written = time.perf_counter()
            writer.write_many([UtteranceResult(id=utterance.id, nbest=nbest) for utterance, nbest in items])
            timings.writing_s += time.perf_counter() - written
            timings.first_result_at = time.time()
            summary.decoded += len(items)
            summary.frames += sum(utterance.num_frames for utterance, _ in items)


def _hand_out(child: _Child, todo: Iterator[list[str]], most: int) -> None:
    """Keep up to ``most`` batches of ``todo`` at ``child``; close its input when none are left."""
    while len(child.pending) < most:
        ids = next(todo, None)
        if ids is None:
            child.stop()
            return
        child.pending.append(ids)
        child.send(("batch", ids))


def _decode_batches(children: list[_Child], todo: Iterator[list[str]], writer: ResultWriter,
                    summary: RunSummary, progress: Callable | None, total: int, start: float) -> None:
    """Write the processes' answers as they come, handing each the next batches of ``todo``
    (``start``: the run's ``perf_counter`` start, for the progress's real-time factor)."""
    selector = selectors.DefaultSelector()
    for child in children:
        selector.register(child.process.stdout, selectors.EVENT_READ, child)
    try:
        while selector.get_map():
            for key, _ in selector.select():
                child = key.data
                answer = child.receive()
                if answer[0] == "ready":
                    child.ready = True
                    continue
                if child.ready:  # else it failed to start
                    child.pending.pop(0)
                _take(answer[1], child, writer, summary)
                if answer[0] == "failed":
                    raise answer[2]
                if progress:
                    summary.seconds = time.perf_counter() - start
                    audio = summary.frames * summary.frame_shift_s
                    progress(summary.decoded, total, summary.seconds / audio if audio else None)
                _hand_out(child, todo, IN_FLIGHT)
                if not child.pending:
                    selector.unregister(child.process.stdout)
    finally:
        selector.close()


def _take(result: BatchDone, child: _Child, writer: ResultWriter | None, summary: RunSummary) -> None:
    """Write a batch's lines and count them."""
    timings = summary.timings
    child.timings = result.timings or child.timings
    if result.ids:
        written = time.perf_counter()
        try:
            writer.write_formatted(result.ids, result.texts)
        finally:
            timings.writing_s += time.perf_counter() - written
            timings.output_wait_s = timings.writing_s
        if timings.first_result_at is None:
            timings.first_result_at = time.time()
        summary.decoded += len(result.ids)
        summary.frames += result.frames
    summary.skipped += result.skipped
    summary.truncated += result.truncated
    summary.retried_batches += result.retried_batches
    if result.gpu_memory_bytes is not None:
        summary.gpu_memory_bytes = max(summary.gpu_memory_bytes or 0, result.gpu_memory_bytes)


def _mean_timings(children: list[_Child], timings: RunTimings) -> None:
    """Each part's seconds in the run's timings: the mean over the processes (they run side by side)."""
    for name in _PROCESS_TIMINGS:
        setattr(timings, name, sum(c.timings.get(name, 0.0) for c in children) / len(children))


# --- the decoding process ----------------------------------------------------------------------

def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    """A decoding process's loop: the start request, then batches until the end of its input."""
    from gpudecode.decoder import Decoder
    from gpudecode.io import ResultFormatter

    def answer(message: tuple) -> None:
        pickle.dump(message, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()

    try:
        request = pickle.load(requests)
    except (EOFError, pickle.UnpicklingError):
        return
    config: Config = request[1]
    # what the models and searches warn about, the process you started says once (its own decoder
    # runs the first batch); what is said about the input (skipped utterances) stays
    warnings.simplefilter("ignore")
    for name in _SAID_ONCE:
        logging.getLogger(name).setLevel(logging.ERROR)
    timings = RunTimings(started_at=time.time())
    decoder = source = None
    try:
        try:
            decoder = Decoder(config, timings=timings)
            io = config.io
            source = open_utterances(config, decoder.vocabulary, encoder=decoder.encoder is not None,
                                     num_features=decoder.encoder_num_features)
            formatter = ResultFormatter(decoder.vocabulary, formats=io.formats, word_merging=io.word_merging,
                                        frame_shift_s=config.models.front_end.frame_shift_s * decoder.subsampling)
        except Exception as error:  # noqa: BLE001 - reported to the parent
            answer(("failed", BatchDone(), picklable(error)))
            return
        answer(("ready", decoder.subsampling, time.time()))
        _serve_batches(requests, answer, config, decoder, source, formatter, timings)
    finally:
        if source is not None:
            source.close()
        if decoder is not None:
            decoder.close()


def _serve_batches(requests: BinaryIO, answer: Callable[[tuple], None], config: Config, decoder, source,
                   formatter, timings: RunTimings) -> None:
    """Read, decode, format and answer each batch requested until the end of ``requests``."""
    from gpudecode.io.prefetch import prefetched
    from gpudecode.job import decode_fitting

    io = config.io

    def read() -> object:
        """(ids, the batch read or the error reading it, the source's new skips) per request."""
        while True:
            try:
                request = pickle.load(requests)
            except (EOFError, pickle.UnpicklingError):  # no more batches (or the parent is gone)
                return
            ids, skipped_before, began = request[1], len(source.skipped), time.perf_counter()
            try:
                batch = source.read_batch(ids)
            except Exception as error:  # noqa: BLE001 - answered in its place
                batch = error
            timings.reading_s += time.perf_counter() - began
            yield ids, batch, [str(e) for e in source.skipped[skipped_before:]]

    batches = prefetched(read(), IN_FLIGHT - 1, name="gpudecode-reader")
    while True:
        waited = time.perf_counter()
        item = next(batches, None)
        timings.input_wait_s += time.perf_counter() - waited
        if item is None:
            return
        ids, batch, skipped = item
        done, scratch, error = BatchDone(skipped=skipped), RunSummary(), None
        lines: list[list[str]] = []
        results, frames = [], {}
        try:
            if isinstance(batch, Exception):
                raise batch
            if batch:  # what decode_fitting yields before an error is formatted too
                for utterance, nbest in decode_fitting(decoder, batch, scratch, io.on_bad_input):
                    results.append(UtteranceResult(id=utterance.id, nbest=nbest))
                    frames[utterance.id] = utterance.num_frames
        except Exception as exc:  # noqa: BLE001 - reported to the parent with what was done
            error = picklable(exc)
        try:
            formatter.format_into(results, done.ids, lines)
        except Exception as exc:  # noqa: BLE001 - a label outside the vocabulary
            error = error or picklable(exc)
        done.texts = tuple("".join(texts) for texts in zip(*lines)) if lines else ()
        done.frames = sum(frames[u] for u in done.ids)
        done.skipped += scratch.skipped
        formatted = set(done.ids)
        done.truncated = [u for u in scratch.truncated if u in formatted]  # decode_fitting counted them
        done.retried_batches = scratch.retried_batches
        done.timings = {name: getattr(timings, name) for name in _PROCESS_TIMINGS}
        if config.runtime.device == "cuda":
            done.gpu_memory_bytes = backend.device_memory_in_use()
        if error is not None:
            answer(("failed", done, error))
            return
        answer(("done", done))


def main() -> None:
    """The decoding process (:func:`serve` on stdin and stdout)."""
    serve_stdin(serve)


if __name__ == "__main__":  # run as the package's module, so what it pickles unpickles by that name
    from gpudecode.engines.processes import main as serve_requests

    serve_requests()
