"""``WriterThread``: results written and flushed by a background thread, in the order given.

``put`` queues an item of ``size`` results, a batch's (waiting while ``depth`` results are
queued, unless none is); the thread hands each to ``write`` (which writes its results through a
:class:`gpudecode.io.ResultWriter`, flushing them, and counts them: an utterance is done only once
flushed). ``close`` writes everything queued before it returns. An error of ``write`` (a full
disk: the ``OSError`` names the file) stops the writing; the next ``put`` or ``close`` raises it,
as the same object, and the items queued after it are not written (they are not done:
``--resume`` decodes them again).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

_END = object()


class WriterThread:
    """Calls ``write(item)`` in a thread for each item ``put``, in order, up to ``depth`` results
    queued (``depth`` >= 1). A context manager: leaving it closes it (see ``close``)."""

    def __init__(self, write: Callable[[Any], None], depth: int, *, name: str = "gpudecode-writer"):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.error: BaseException | None = None
        self._reported = False  # ``put`` raised the error already (``close`` does not raise it again)
        self._write = write
        self._depth = depth
        self._items: deque[tuple[Any, int]] = deque()
        self._queued = 0  # results in ``_items``
        self._changed = threading.Condition()  # an item queued or taken, or the error set
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._items:
                    self._changed.wait()
                item, size = self._items.popleft()
                self._queued -= size
                self._changed.notify_all()
            if item is _END:
                return
            if self.error is not None:
                continue  # after a failure nothing more is written; the queue is only drained
            try:
                self._write(item)
            except BaseException as error:  # raised by the next put or close
                with self._changed:
                    self.error = error
                    self._changed.notify_all()

    def _raise_error(self) -> None:
        if self.error is not None and not self._reported:
            self._reported = True
            raise self.error

    def put(self, item: Any, size: int = 1) -> None:
        """Queue ``item`` of ``size`` results; raises the error of an earlier write, if one failed."""
        with self._changed:
            while self.error is None and self._queued and self._queued + size > self._depth:
                self._changed.wait()
            self._raise_error()
            self._items.append((item, size))
            self._queued += size
            self._changed.notify_all()

    def close(self) -> None:
        """Write everything queued and stop the thread; raises the error of a failed write (unless
        ``put`` raised it already)."""
        if not self._closed:
            self._closed = True
            with self._changed:
                self._items.append((_END, 0))
                self._changed.notify_all()
            self._thread.join()
        self._raise_error()

    def __enter__(self) -> WriterThread:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
