"""``ChildResultWriter``: a :class:`~gpudecode.io.writers.ResultWriter` that formats and writes in a
child process.

Formatting results is pure Python (JSON lines above all: tens of microseconds an utterance of 8
hypotheses). In the decoding process it holds the interpreter lock that the decoding loop needs
each time it comes back from a GPU wait or an ONNX Runtime run. Here the decoding process only
pickles each call's results and sends them down a pipe; the child formats, writes and flushes
them and answers how many it flushed. ``write_many`` keeps :class:`ResultWriter`'s contract: when
it returns, the results are flushed (``num_written``, ``done_ids``); a failure (a full disk, a
label outside the vocabulary) raises there as the child's exception, with its errno and file name.

The child opens the files (and, with ``resume``, cuts them back) while the parent decodes its first
batch: an error there raises at the first ``write_many`` or at ``close``. The child ignores SIGINT
(a terminal sends it to the whole process group; the parent decides what is written) and ends when
its input ends, so a killed parent leaves whole lines only, as ``--resume`` expects.

Protocol (pickles on the child's stdin and a duplicate of its stdout): the parent sends
``("open", kwargs)``, then ``("write", results)`` and ``("close",)``; the child answers
``("written", n)`` or ``("failed", n, exception)`` to each write (``("failed", 0, the same
exception)`` after a failed one: nothing more is written) and ``("closed",)`` or
``("failed", 0, exception)`` to close; a failed open is answered at once and again to each write.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

from gpudecode import defaults
from gpudecode.io.vocabulary import Vocabulary
from gpudecode.io.writers import ResultWriter, UtteranceResult

#: seconds ``close`` waits for the child to exit after its last answer, before it kills it
CLOSE_TIMEOUT_S = 60.0


class WriterProcessError(RuntimeError):
    """The writer process ended without answering (it crashed or was killed)."""


class ChildResultWriter:
    """:class:`ResultWriter`'s interface (``write_many``, ``write``, ``num_written``, ``done_ids``,
    ``close``, a context manager), the formatting and writing done by a child process."""

    #: results a decoding run hands to one ``write_many`` call (its messages are pipelined)
    call_size = 256

    def __init__(self, output_folder: str | Path, vocabulary: Vocabulary, *,
                 formats: Sequence[str] = defaults.OUTPUT_FORMATS,
                 word_merging: str = defaults.WORD_MERGING,
                 frame_shift_s: float | None = None, resume: bool = False):
        self.folder = Path(output_folder)
        self.done_ids: set[str] = set()
        self.num_written = 0
        self._child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=child_environment())
        self._unanswered: list[list[UtteranceResult]] = []  # messages sent, their answers not read
        self._opened = False  # the child's answer to "open" read (a failed open raised)
        self._closed = False
        self._send(("open", {"output_folder": str(output_folder), "vocabulary": vocabulary,
                             "formats": tuple(formats), "word_merging": word_merging,
                             "frame_shift_s": frame_shift_s, "resume": resume}))

    def write(self, result: UtteranceResult) -> None:
        """Write one utterance to every file and flush."""
        self.write_many((result,))

    def write_many(self, results: Iterable[UtteranceResult]) -> None:
        """As :meth:`ResultWriter.write_many`: returns once the child flushed them; raises the
        child's exception (those before the failing one are written and counted). The results go
        ``defaults.WRITE_CHUNK`` to a message, each pickled while the child writes the one before
        (the lock the decoding loop needs is held one message's pickling at a time)."""
        results = list(results)
        self._check_open()
        self._collect()  # answers an interrupted call left unread
        for start in range(0, len(results), defaults.WRITE_CHUNK):
            chunk = results[start:start + defaults.WRITE_CHUNK]
            self._send(("write", chunk))
            self._unanswered.append(chunk)
        self._collect()

    def _collect(self) -> None:
        """Read the answers to the messages sent and not yet answered, in order, and count what
        they flushed; raise the first failure among them."""
        failure = None
        while self._unanswered:
            answer = self._receive()
            chunk = self._unanswered.pop(0)
            self.done_ids.update(result.id for result in chunk[:answer[1]])
            self.num_written += answer[1]
            if answer[0] == "failed" and failure is None:
                failure = answer[2]
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Close the child's files and wait for it to exit; raises a failure to open or close them."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._child.poll() is None:
                self._check_open()
                self._collect()
                self._send(("close",))
                answer = self._receive()
                if answer[0] == "failed":
                    raise answer[2]
        finally:
            try:
                self._child.stdin.close()
            except OSError:  # the child is gone, with a message not yet sent
                pass
            try:
                self._child.wait(timeout=CLOSE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
            self._child.stdout.close()

    def __enter__(self) -> ChildResultWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if not self._opened:
            answer = self._receive()
            self._opened = True
            if answer[0] == "failed":
                raise answer[2]

    def _send(self, message: tuple) -> None:
        try:
            pickle.dump(message, self._child.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._child.stdin.flush()
        except BrokenPipeError:
            raise self._ended() from None

    def _receive(self) -> tuple:
        try:
            return pickle.load(self._child.stdout)
        except EOFError:
            raise self._ended() from None

    def _ended(self) -> WriterProcessError:
        code = self._child.wait()
        return WriterProcessError(f"the result writer process ended unexpectedly (exit status {code}); "
                                  f"the results written to {self.folder} are kept: run the same command "
                                  "with --resume to decode the rest")


def child_environment() -> dict[str, str]:
    """This process's environment, with the folder this ``gpudecode`` was imported from first on
    ``PYTHONPATH`` (the child imports the same package even where a script put it on ``sys.path``)."""
    package_root = str(Path(__file__).resolve().parents[2])
    paths = [package_root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def picklable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception that does not pickle
        return RuntimeError(f"{type(error).__name__}: {error}")


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    """The child's loop: read requests from ``requests`` and answer on ``answers`` until "close"
    or the end of the input (a parent that is gone: what was written stays)."""

    def answer(message: tuple) -> None:
        pickle.dump(message, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()

    writer = None
    failure = None  # a failed open or write (picklable): the answer to every later write
    try:
        while True:
            try:
                request = pickle.load(requests)
            except (EOFError, pickle.UnpicklingError):  # the parent is gone (maybe mid-message)
                return
            if request[0] == "open":
                try:
                    writer = ResultWriter(**request[1])
                except Exception as error:  # noqa: BLE001 - reported to the parent
                    failure = picklable(error)
                answer(("failed", 0, failure) if failure else ("opened",))
            elif request[0] == "close":
                closing, writer = writer, None
                try:
                    if closing is not None:
                        closing.close()
                except Exception as error:  # noqa: BLE001 - reported to the parent
                    answer(("failed", 0, picklable(error)))
                else:
                    answer(("closed",))
                return
            elif failure is not None:  # nothing to write to, or nothing more after a failure
                answer(("failed", 0, failure))
            elif request[0] == "write":
                before = writer.num_written
                try:
                    writer.write_many(request[1])
                except Exception as error:  # noqa: BLE001 - reported to the parent
                    failure = picklable(error)
                    answer(("failed", writer.num_written - before, failure))
                else:
                    answer(("written", writer.num_written - before))
    finally:
        if writer is not None:  # the parent is gone: nobody to report a failure to
            try:
                writer.close()
            except Exception:  # noqa: BLE001, S110 - every line it flushed is whole
                pass


def serve_stdin(serve_requests: Callable[[BinaryIO, BinaryIO], None]) -> None:
    """A child process's main: SIGINT ignored (the parent decides), ``serve_requests`` reading
    requests from stdin and answering on a duplicate of stdout (anything else that prints goes to
    stderr) until the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        serve_requests(sys.stdin.buffer, answers)
    except BrokenPipeError:  # the parent is gone
        pass


def main() -> None:
    """The writer process (:func:`serve` on stdin and stdout)."""
    serve_stdin(serve)


if __name__ == "__main__":
    main()
