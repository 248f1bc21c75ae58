"""CUDA graphs of a model step: one ONNX Runtime graph per shape bucket.

Shapes are padded up to buckets (rows to powers of two, history time to powers of two up to
``time_step`` and multiples of it beyond), so a handful of graphs cover a whole decode;
:class:`GraphBuckets` holds that rule (which shapes are valid), the runs behind it and the
warm-up that captures every bucket. Every
graph reads and writes views of **one device buffer per tensor name**, sized for the largest
bucket seen (SGLang's shared output buffer, applied to inputs as well): graph memory is
max(bucket) instead of the sum over buckets. When a buffer has to grow, every graph bound to
the old buffers is dropped and captured again on next use.

ONNX Runtime captures a graph on the second run of a graph id (the first is a plain run that
sizes its arena) and replays it from then on; runs outside any graph use id -1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gpudecode import backend, defaults
from gpudecode.sizes import next_power_of_two

if TYPE_CHECKING:  # onnx (protobuf) is imported only where a model proto is read
    import onnx

CONTROL_FLOW_OPS = ("If", "Loop", "Scan")
SKIP_GRAPH = "-1"


@dataclass(frozen=True, kw_only=True)
class GraphOptions:
    """How a scorer's model step is captured.

    ``time_step``: history lengths are padded to powers of two up to it, then to multiples of it.
    ``min_rows``: the smallest row bucket. ``shared_buffers``: one buffer per tensor name across
    buckets (False: one per bucket and tensor, only to measure what sharing saves).
    ``warm_up_time``: capture every bucket up to this history length when a batch begins
    (0: capture lazily on first use). ``auto``: ``enabled`` came from ``"auto"``; a recurrent
    model whose states can stay dense then runs without graphs (``gpudecode.states.dense``: its
    plain steps cost less host time than the captured pool steps). ``resident_greedy``: with one
    hypothesis per utterance, a left-aligned Hugging Face model's states stay in the step's own
    inputs between steps, with no state pool (``gpudecode.session.step_model.ResidentRows``).
    ``shared_presents``: a left-aligned Hugging Face model whose presents come straight from ONNX
    Runtime's ``GroupQueryAttention`` gets each present bound to its past's buffer (one position
    wider than the bucket), so the op appends the new step in place instead of copying the past.
    """

    enabled: bool = defaults.GRAPHS_ENABLED
    time_step: int = defaults.GRAPH_TIME_STEP
    min_rows: int = defaults.GRAPH_MIN_ROWS
    shared_buffers: bool = defaults.GRAPH_SHARED_BUFFERS
    warm_up_time: int = defaults.GRAPH_WARM_UP_TIME
    resident_greedy: bool = defaults.GRAPH_RESIDENT_GREEDY
    shared_presents: bool = defaults.GRAPH_SHARED_PRESENTS
    auto: bool = False

    def __post_init__(self) -> None:
        for name in ("time_step", "min_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"cuda_graphs.{name}: must be >= 1, got {getattr(self, name)}")
        if self.warm_up_time < 0:
            raise ValueError(f"cuda_graphs.warm_up_time: must be >= 0, got {self.warm_up_time}")


def bucket_rows(rows: int, min_rows: int = 1) -> int:
    """The row bucket of ``rows`` hypotheses: the next power of two, at least ``min_rows``."""
    if rows < 1:
        raise ValueError(f"bucket_rows: rows must be >= 1, got {rows}")
    return max(next_power_of_two(rows), next_power_of_two(min_rows))


def bucket_time(time: int, step: int) -> int:
    """The history bucket of ``time`` token states: at least 1 (an empty history is one padded,
    masked position), powers of two up to ``step``, then multiples of ``step``."""
    if time < 0:
        raise ValueError(f"bucket_time: time must be >= 0, got {time}")
    time = max(time, 1)
    if time <= step:
        return min(next_power_of_two(time), step)
    return -(-time // step) * step


def time_buckets(max_time: int, step: int) -> list[int]:
    """Every history bucket up to the one holding ``max_time``, in increasing order."""
    return sorted({bucket_time(t, step) for t in range(0, max_time + 1)})


def capture_blocker(model: onnx.ModelProto) -> str | None:
    """Why ``model`` cannot be captured in a CUDA graph, or None.

    Control flow (``If``, ``Loop``, ``Scan``) picks its kernels at run time, which a captured
    graph cannot replay.
    """
    for node in model.graph.node:
        if node.op_type in CONTROL_FLOW_OPS:
            return f"it has a control-flow node ({node.op_type} '{node.name}')"
    return None


def host_copy_blocker(optimised: onnx.ModelProto) -> str | None:
    """Why an optimised CUDA graph cannot be captured because it copies from the host, or None.

    A captured host-to-device copy would replay whatever the host buffer holds then.
    """
    for node in optimised.graph.node:
        if node.op_type == "MemcpyFromHost":
            return f"ONNX Runtime copies '{node.input[0]}' from the host every run ({node.name})"
    return None


class GraphBuffers:
    """The buffers captured graphs read and write.

    ``view(name, dtype, shape, bucket)`` is a zero-copy view of the buffer of ``name`` (shared
    across buckets), or of ``(name, bucket)`` when ``shared`` is False. On CUDA, buffers are
    plain ``cudaMalloc`` allocations (not CuPy's pool), so ``cudaMemGetInfo`` sees exactly what
    they hold; on the CPU (padded runs without capture) numpy arrays. ``generation`` changes
    whenever a buffer is replaced by a larger one.
    """

    def __init__(self, device: str = "cuda", device_id: int = 0, *, shared: bool = True):
        self.device = device
        self.device_id = device_id
        self.shared = shared
        self.generation = 0
        self._memory: dict[Any, Any] = {}

    def view(self, name: str, dtype, shape: tuple[int, ...], bucket: Any = None):
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        size = int(np.prod(shape, dtype=np.int64))
        nbytes = max(size * dtype.itemsize, 1)
        key = name if self.shared else (name, bucket)
        memory = self._memory.get(key)
        if memory is None or memory.size < nbytes:
            if memory is not None:
                self.generation += 1
            memory = self._allocate(nbytes)
            self._memory[key] = memory
        if self.device == "cpu":
            return memory[: size * dtype.itemsize].view(dtype).reshape(shape)
        cupy = backend.require_cupy()
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))

    def _allocate(self, nbytes: int):
        # zeroed: a left-aligned merge leaves the padding as it finds it (finite, never read)
        if self.device == "cpu":
            return np.zeros(nbytes, dtype=np.uint8)
        cupy = backend.require_cupy()
        with cupy.cuda.Device(self.device_id):
            memory = cupy.cuda.Memory(nbytes)
            cupy.cuda.MemoryPointer(memory, 0).memset_async(0, nbytes, backend.shared_stream(self.device_id))
            return memory

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(m.size for m in self._memory.values())

    def close(self) -> None:
        self._memory.clear()


class PaddedRuns:
    """Bucketed runs without capture: what :class:`StepGraphs` does, as plain runs (the CPU
    provider, and models that cannot be captured). Results equal the captured ones."""

    captures = 0

    def __init__(self, session, buffers: GraphBuffers):
        self.session = session
        self.buffers = buffers
        self._keys: set = set()

    def run(self, key, inputs: Mapping[str, Any], output_names, make_output: Callable) -> dict:
        self._keys.add((key, self.buffers.generation))
        return self.session.run(inputs, list(output_names))

    def clear(self) -> None:
        self._keys.clear()

    @property
    def num_graphs(self) -> int:
        """Buckets run so far (none is captured)."""
        return len(self._keys)


@dataclass
class _Captured:
    binding: Any
    run_options: Any
    outputs: dict
    plain_options: Any  # the same binding run without ONNX Runtime's graph (inside the caller's capture)


class StepGraphs:
    """The CUDA graphs of one session, keyed by the caller's bucket key.

    ``run(key, inputs, make_output)``: ``inputs`` are views of :class:`GraphBuffers` (or other
    buffers whose address stays fixed for ``key``); on the first call for a key the model runs
    once without a graph to learn its output shapes, ``make_output(name, dtype, shape)`` gives
    the output views, and the views are bound to a new graph id. Returns the output views.
    While the stream is being captured into the caller's own CUDA graph the binding runs without
    ONNX Runtime's graph (its replay synchronises the stream), so that its kernels are captured.
    """

    def __init__(self, session, buffers: GraphBuffers):
        if not session.cuda_graphs:
            raise ValueError(f"{session.source}: the session was not created with CUDA graphs")
        self.session = session
        self.buffers = buffers
        self._captured: dict[Any, _Captured] = {}
        self.captures = 0  # graph ids created (each is captured on its second run)

    def run(self, key, inputs: Mapping[str, Any], output_names, make_output: Callable) -> dict:
        entry = self._captured.get((key, self.buffers.generation))
        if entry is None:
            entry = self._bind(inputs, list(output_names), make_output)
            generation = self.buffers.generation
            # graphs bound to replaced buffers never run again; let their output buffers go
            self._captured = {k: v for k, v in self._captured.items() if k[1] == generation}
            self._captured[(key, generation)] = entry
        with backend.on_shared_stream(self.session.options.device_id) as stream:  # after the static inputs' writes
            options = entry.plain_options if stream.is_capturing() else entry.run_options
            self.session.session.run_with_iobinding(entry.binding, options)
        return entry.outputs

    def _bind(self, inputs, output_names, make_output) -> _Captured:
        ort = self.session.ort
        plain = self.session.run(inputs, output_names)
        outputs = {name: make_output(name, plain[name].dtype, tuple(plain[name].shape)) for name in output_names}
        binding = self.session.session.io_binding()
        device_id = self.session.options.device_id
        for name, value in inputs.items():
            binding.bind_input(name, "cuda", device_id, value.dtype, list(value.shape), value.data.ptr)
        for name, value in outputs.items():
            binding.bind_output(name, "cuda", device_id, value.dtype, list(value.shape), value.data.ptr)
        run_options = ort.RunOptions()
        run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        # ids are unique per session: a later scorer on the same session must never replay
        # (and so write through) an earlier scorer's graph
        run_options.add_run_config_entry("gpu_graph_id", str(self.session.new_graph_id()))
        plain_options = ort.RunOptions()
        plain_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        plain_options.add_run_config_entry("gpu_graph_id", SKIP_GRAPH)
        self.captures += 1
        return _Captured(binding, run_options, outputs, plain_options)

    def clear(self) -> None:
        """Forgets every graph (ONNX Runtime keeps the graph objects of used ids)."""
        self._captured.clear()

    @property
    def num_graphs(self) -> int:
        return len(self._captured)


class CapturedRuns:
    """The buffers of one session's graphs and the runs on them: captured :class:`StepGraphs`, or
    :class:`PaddedRuns` where the session cannot capture. What every holder of graphs shares."""

    def __init__(self, session, *, shared_buffers: bool = True):
        self.buffers = GraphBuffers(session.provider, session.options.device_id, shared=shared_buffers)
        self.runs = (StepGraphs if session.cuda_graphs else PaddedRuns)(session, self.buffers)

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far (0 for padded or plain runs)."""
        return self.runs.captures

    @property
    def bound(self) -> bool:
        """The runs are bound once to fixed buffers (:class:`StepGraphs`): device work only, which
        the caller may capture in its own graph."""
        return isinstance(self.runs, StepGraphs)

    def close(self) -> None:
        """Forgets every graph and returns the buffers' memory."""
        self.runs.clear()
        self.buffers.close()


class GraphBuckets(CapturedRuns):
    """The graphs of one step model: the bucketing rule (the one source of the shapes graphs
    take), the buffers and runs behind the buckets, and the warm-up over every bucket.

    Rows may come in groups of ``group_size`` that share an input row (the beam lanes of one
    utterance); a bucket then holds whole groups.
    """

    def __init__(self, session, options: GraphOptions):
        super().__init__(session, shared_buffers=options.shared_buffers)
        self.options = options

    def rows(self, num_rows: int, group_size: int = 1) -> int:
        """The row bucket of a call of ``num_rows`` rows (whole groups of ``group_size``)."""
        if group_size == 1:
            return bucket_rows(num_rows, self.options.min_rows)
        groups, min_groups = -(-num_rows // group_size), -(-self.options.min_rows // group_size)
        return group_size * bucket_rows(groups, min_groups)

    def time(self, time: int) -> int:
        """The history bucket of ``time`` token states."""
        return bucket_time(time, self.options.time_step)

    def run(self, key, inputs: Mapping[str, Any], output_names, make_output: Callable) -> dict:
        """One run of the bucket ``key`` (see :meth:`StepGraphs.run`)."""
        return self.runs.run(key, inputs, output_names, make_output)

    @property
    def wants_warm_up(self) -> bool:
        """A warm-up is configured and nothing is captured yet."""
        return bool(self.options.warm_up_time) and not self.runs.num_graphs

    def warm_up(self, max_time: int, chunks, run_bucket: Callable[[Any, int], Any]) -> int:
        """Runs every history bucket up to ``max_time`` for each of ``chunks`` through
        ``run_bucket(chunk, time)``, twice (ONNX Runtime captures on the second run of a graph
        id); returns the number of graphs."""
        # largest bucket first: the shared buffers reach their size at once, so no later growth
        # drops the graphs captured before it
        for time in reversed(time_buckets(max_time, self.options.time_step)):
            for chunk in chunks:
                for _ in range(2):
                    run_bucket(chunk, time)
        return self.runs.num_graphs

    @property
    def num_graphs(self) -> int:
        """Graphs (or padded buckets) in use."""
        return self.runs.num_graphs


class FixedShapeGraphs(CapturedRuns):
    """Runs of a whole model (no states) whose input shapes repeat, one CUDA graph per set of
    input shapes: each run copies its inputs into buffers bound once (one per input name, shared
    across shapes, :class:`GraphBuffers`) and replays the graph (plain runs where the session
    cannot capture). The outputs are views of shared buffers, valid until the next run."""

    def run(self, inputs: Mapping[str, Any], output_names) -> dict:
        key = tuple((name, tuple(value.shape), str(value.dtype)) for name, value in inputs.items())
        views = {}
        for name, value in inputs.items():
            view = self.buffers.view(f"in:{name}", value.dtype, tuple(value.shape))
            view[...] = value
            views[name] = view
        return self.runs.run(key, views, output_names,
                             lambda name, dtype, shape: self.buffers.view(f"out:{name}", dtype, shape))
