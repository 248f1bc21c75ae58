"""``WriterThread``: results written and flushed by a background thread, in the order given.

``put`` queues an item (waiting while ``depth`` are queued); the thread hands each to ``write``
(which writes it through a :class:`gpudecode.io.ResultWriter`, flushing it, and counts it: an
utterance is done only once flushed). ``close`` writes everything queued before it returns. An
error of ``write`` (a full disk: the ``OSError`` names the file) stops the writing; the next
``put`` or ``close`` raises it, as the same object, and the items queued after it are not written
(they are not done: ``--resume`` decodes them again).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

_POLL_S = 0.05  # how often ``put`` on a full queue looks whether the thread has failed
_END = object()


class WriterThread:
    """Calls ``write(item)`` in a thread for each item ``put``, in order, up to ``depth`` queued
    (``depth`` >= 1). A context manager: leaving it closes it (see ``close``)."""

    def __init__(self, write: Callable[[Any], None], depth: int, *, name: str = "gpudecode-writer"):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.error: BaseException | None = None
        self._reported = False  # ``put`` raised the error already (``close`` does not raise it again)
        self._write = write
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if self.error is not None:
                continue  # after a failure nothing more is written; the queue is only drained
            try:
                self._write(item)
            except BaseException as error:  # raised by the next put or close
                self.error = error

    def _raise_error(self) -> None:
        if self.error is not None and not self._reported:
            self._reported = True
            raise self.error

    def put(self, item: Any) -> None:
        """Queue ``item``; raises the error of an earlier write, if one failed."""
        self._raise_error()
        while True:
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                self._raise_error()

    def close(self) -> None:
        """Write everything queued and stop the thread; raises the error of a failed write (unless
        ``put`` raised it already)."""
        if not self._closed:
            self._closed = True
            self._queue.put(_END)
            self._thread.join()
        self._raise_error()

    def __enter__(self) -> WriterThread:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
