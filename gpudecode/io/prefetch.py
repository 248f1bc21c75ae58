"""``prefetched``: the items of an iterable produced by a background thread, a bounded number ahead.

The decoding loop takes batches from it, so reading and the front end of the next batches run
while the current one is decoded. Items come in the order the iterable gives them; an exception
the iterable raises reaches the consumer at the same place in that order (after the items made
before it), as the same object, so its message and type are those of the iterable itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

_POLL_S = 0.05  # how often a producer waiting on a full queue looks whether the consumer stopped
_END = object()


class _Raised:
    """An exception of the producer, queued in its place among the items."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def prefetched(items: Iterable[T], depth: int, *, name: str = "gpudecode-prefetch") -> Iterator[T]:
    """The items of ``items``, produced by a thread up to ``depth`` ahead (``depth`` 0: in the
    calling thread, as ``iter(items)`` would). Closing the iterator (or leaving the loop that
    reads it) stops the thread after the item it is producing; ``items`` is closed in that thread."""
    if depth < 1:
        yield from items
        return
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        iterator = iter(items)
        try:
            for item in iterator:
                if not put(item):
                    return
            put(_END)
        except BaseException as error:  # handed to the consumer, raised there
            put(_Raised(error))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, _Raised):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()
