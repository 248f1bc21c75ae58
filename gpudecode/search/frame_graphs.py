"""A search's frame step captured as two CUDA graphs that alternate, replayed frame after frame.

A step whose Python code only queues device work on the current stream (kernels, CuPy array
operations, ONNX Runtime runs without its own graphs) can be recorded once by stream capture and
replayed with one launch. A search step is functional — it reads the lanes' arrays and makes new
ones — and stateful scorers keep their states in two sets of buffers used in turn (ping-pong), so
one step reads state ``S0`` and writes ``S1``, the next reads ``S1`` and writes ``S2``. Two graphs
are captured: ``A`` (``S0`` → ``S1``) and ``B`` (``S1`` → ``S2``, then ``S2`` copied into
``S0``'s arrays), and replayed A, B, A, B, …; afterwards the search's Python state is the one the
last replayed graph left (:meth:`AlternatingGraphs.finish`).

Every array a capture makes comes from a memory pool of its own, never used outside the captures,
so that a replay never writes memory that something else holds by then (a temporary freed during
a capture goes back to that pool only). The step's frame index and whatever else changes from step
to step must be read from device arrays the step itself advances.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any


class FrameCaptureFailed(RuntimeError):
    """The step could not be captured (a host read or synchronisation in it, or state that does
    not come back in the same shapes); the caller runs the search again without capture."""


def device_arrays(tree: Any, cupy) -> list:
    """The CuPy arrays of ``tree`` (lists, tuples, dicts by sorted key, dataclass fields), in order."""
    found: list = []

    def walk(node) -> None:
        if isinstance(node, cupy.ndarray):
            found.append(node)
        elif isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for key in sorted(node, key=str):
                walk(node[key])
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                walk(getattr(node, field.name))

    walk(tree)
    return found


def snapshot(tree: Any) -> Any:
    """``tree`` with its lists, tuples, dicts and dataclass objects copied (arrays and other values
    shared): what a step replaces stays as it was when a later step changes a context in place."""
    if isinstance(tree, list):
        return [snapshot(item) for item in tree]
    if isinstance(tree, tuple):
        return tuple(snapshot(item) for item in tree)
    if isinstance(tree, dict):
        return {key: snapshot(value) for key, value in tree.items()}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        copied = copy.copy(tree)
        for field in dataclasses.fields(tree):
            setattr(copied, field.name, snapshot(getattr(tree, field.name)))
        return copied
    return tree


class AlternatingGraphs:
    """Graphs A and B of one step (see the module docstring).

    ``get_state()`` returns the step's state (a tree of arrays and host values, which the step
    replaces rather than writes in place); ``set_state(state)`` puts one back. :meth:`step` runs
    the step once: the first two calls capture A and B (and launch them), later ones launch them in
    turn. All on CuPy's current stream."""

    def __init__(self, cupy, get_state: Callable[[], Any], set_state: Callable[[Any], None]):
        self.cupy, self.get_state, self.set_state = cupy, get_state, set_state
        self.pool = cupy.cuda.MemoryPool()  # every array a capture makes, and only those
        self.graphs: list = [None, None]
        self.after: list = [None, None]  # the state each graph leaves, as its capture made it
        self.before: list = []  # the arrays of the state A reads (held: the graphs read and write them)
        self.last: int | None = None
        self.launches = 0

    def step(self, body: Callable[[], None]) -> None:
        """One step: ``body()`` captured (first two calls) and the graph launched."""
        which = 0 if self.last is None else 1 - self.last
        if self.graphs[which] is None:
            if which == 0:
                self.before = device_arrays(self.get_state(), self.cupy)
            self.graphs[which] = self._capture(body, copy_back=which == 1)
            self.after[which] = snapshot(self.get_state())
        self.graphs[which].launch(self.cupy.cuda.get_current_stream())
        self.last, self.launches = which, self.launches + 1

    def finish(self) -> None:
        """The search's state as the last launched graph left it. Its arrays live in :attr:`pool`
        (in some CuPy versions an array does not keep its pool's memory alive): keep this object as
        long as the state is read."""
        if self.last is not None:
            self.set_state(self.after[self.last])

    def _capture(self, body: Callable[[], None], *, copy_back: bool):
        cupy = self.cupy
        stream = cupy.cuda.get_current_stream()
        with cupy.cuda.using_allocator(self.pool.malloc):
            stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
            try:
                body()
                if copy_back:
                    self._copy_back()
            except BaseException as exc:
                try:
                    stream.end_capture()
                except Exception:  # noqa: BLE001 (the capture's own error is the one to report)
                    pass
                raise FrameCaptureFailed(f"the frame step could not be captured: {type(exc).__name__}: {exc}") from exc
            return stream.end_capture()

    def _copy_back(self) -> None:
        """Inside B's capture: the state B made copied into the arrays A reads."""
        targets, sources = self.before, device_arrays(self.get_state(), self.cupy)
        if len(targets) != len(sources):
            raise FrameCaptureFailed(f"the step's state has {len(sources)} arrays after two steps, {len(targets)} before")
        for target, source in zip(targets, sources):
            if target.shape != source.shape or target.dtype != source.dtype:
                raise FrameCaptureFailed(f"a state array changed from {target.shape} {target.dtype} to "
                                         f"{source.shape} {source.dtype} in two steps")
            if target.data.ptr != source.data.ptr:
                target[...] = source
