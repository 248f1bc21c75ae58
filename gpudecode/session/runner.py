"""ONNX Runtime session on host or device tensors.

On the CUDA provider, ONNX Runtime runs on the CUDA stream CuPy uses (``user_compute_stream``)
and does not synchronise after a run, so CuPy kernels before and after a call are ordered by the
stream alone. CuPy inputs are bound by pointer; outputs stay on the device as CuPy arrays, either
caller-preallocated buffers or zero-copy views of ONNX-Runtime-owned memory.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from gpudecode import backend
from gpudecode.session.cuda_libs import preload_cuda_libraries, provider_failure
from gpudecode.session.genai import gqa_present_pairs, uses_group_query_attention
from gpudecode.session.graphs import SKIP_GRAPH, capture_blocker, host_copy_blocker
from gpudecode.session.options import SessionOptions
from gpudecode.session.placement import data_copies
from gpudecode.session.tensors import ModelTensors, from_ort_session

if TYPE_CHECKING:  # onnx (protobuf) is imported only where a model proto is read
    import onnx

log = logging.getLogger(__name__)


class SessionError(RuntimeError):
    """A session cannot run where it was asked to."""


def _import_ort():
    try:
        import onnxruntime
    except ImportError as exc:
        raise SessionError(
            "onnxruntime is not installed: install one runtime extra, 'cpu', 'cuda12' or 'cuda13'"
        ) from exc
    return onnxruntime


class OnnxSession:
    """One ONNX model, loaded once, run on numpy (CPU provider) or CuPy (CUDA provider) tensors."""

    def __init__(self, model: str | os.PathLike | bytes, options: SessionOptions = SessionOptions(), *,
                 session_factory=None):
        ort = _import_ort()
        self.options = options
        #: makes the ONNX Runtime session: ``factory(model, sess_options=..., providers=...)``
        self._session_factory = session_factory or ort.InferenceSession
        self.source = "<bytes>" if isinstance(model, bytes) else str(model)
        self.name = "model" if isinstance(model, bytes) else Path(model).stem
        if not isinstance(model, bytes) and not Path(model).is_file():
            raise FileNotFoundError(f"model file {self.source} does not exist")
        self._calls = itertools.count()
        ort_options = ort.SessionOptions()
        ort_options.log_severity_level = 3
        if options.intra_op_threads:
            ort_options.intra_op_num_threads = options.intra_op_threads
        optimised_path = None
        if options.device == "cuda":
            cupy = backend.require_cupy()
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise SessionError(
                    f"{self.source}: CUDA was requested but onnxruntime {ort.__version__} has no CUDA "
                    f"execution provider (available: {', '.join(ort.get_available_providers())}); install "
                    "onnxruntime-gpu through the 'cuda12' or 'cuda13' extra, without the CPU onnxruntime"
                )
            if not 0 <= options.device_id < cupy.cuda.runtime.getDeviceCount():
                raise SessionError(
                    f"{self.source}: CUDA device {options.device_id} was requested but this machine has "
                    f"{cupy.cuda.runtime.getDeviceCount()} device(s)"
                )
            self.stream = backend.shared_stream(options.device_id)
            self._preload_report = preload_cuda_libraries(ort)  # NVIDIA's pip wheels, before the provider loads
            providers = [("CUDAExecutionProvider", self._cuda_provider_options()), "CPUExecutionProvider"]
            if options.check_placement:
                handle, optimised_path = tempfile.mkstemp(suffix=".onnx")
                os.close(handle)
                ort_options.optimized_model_filepath = optimised_path
        else:
            self.stream = None
            providers = ["CPUExecutionProvider"]
        self.ort = ort
        self._graph_ids = itertools.count(1)  # 0 is ONNX Runtime's own default graph id
        #: why CUDA graphs were asked for but are off for this model (None: on, or not asked for)
        self.graph_blocker: str | None = None
        self.cuda_graphs = options.device == "cuda" and options.cuda_graphs
        proto = _load_proto(model) if options.device == "cuda" else None  # (external weights left out)
        #: present output -> past input of the GroupQueryAttention caches a call may append to in place
        #: (:func:`gqa_present_pairs`; found on CUDA only, where the step runner binds them)
        self.gqa_present_pairs: dict[str, str] = {} if proto is None else gqa_present_pairs(proto)
        if self.cuda_graphs:
            self.graph_blocker = capture_blocker(proto)
            self.cuda_graphs = self.graph_blocker is None
            # captured graphs keep the addresses of their first runs: no per-shape memory patterns
            ort_options.enable_mem_pattern = False
        warned = False
        xqa = None if proto is None else xqa_setting(proto, options.gqa_xqa)
        try:
            with xqa_environment(xqa):
                self.session, refused = create_inference_session(
                    self._session_factory, model, ort_options, providers, cuda_graphs=self.cuda_graphs,
                    source=self.source)
            if refused is not None:
                self.graph_blocker, self.cuda_graphs, warned = refused, False, True
            if options.device == "cuda":
                self._check_cuda(optimised_path)
        finally:
            if optimised_path:
                Path(optimised_path).unlink(missing_ok=True)
        if self.graph_blocker is not None and not warned:
            log.warning("%s: CUDA graphs are off for this model (plain runs): %s", self.source, self.graph_blocker)
        self.tensors: ModelTensors = from_ort_session(self.session, self.source)
        self._run_options = ort.RunOptions()
        #: a CPU run's IO binding, reused (per thread), and the names it binds (None: clear it first)
        self._host = threading.local()
        #: bind a CPU run's tensors through the runtime's own binding object (where this onnxruntime
        #: exposes it, :func:`_raw_binding`): the same bindings without the Python wrapper's per-call
        #: device construction and capture checks; False: through the wrapper
        self.host_raw_binds = True
        if options.device == "cuda":
            self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
            # plain runs stay out of any graph (a session may have graphs on though capture is off)
            self._run_options.add_run_config_entry("gpu_graph_id", SKIP_GRAPH)
            self._empty = backend.require_cupy().empty(64, np.uint8)  # bound for zero-size tensors

    def _cuda_provider_options(self) -> dict[str, str]:
        o = self.options
        provider = {
            "device_id": str(o.device_id),
            "use_tf32": "1" if o.use_tf32 else "0",
            "cudnn_conv_algo_search": o.cudnn_conv_algo_search,
            "arena_extend_strategy": o.arena_extend_strategy,
            "user_compute_stream": str(self.stream.ptr),
            "has_user_compute_stream": "1",
        }
        if o.arena_limit_bytes:
            provider["gpu_mem_limit"] = str(o.arena_limit_bytes)
        return provider

    def _check_cuda(self, optimised_path: str | None) -> None:
        active = self.session.get_providers()
        if not active or active[0] != "CUDAExecutionProvider":
            raise SessionError(provider_failure(self.ort, self.source, active,
                                                preload_report=getattr(self, "_preload_report", "")))
        if optimised_path and Path(optimised_path).stat().st_size:
            import onnx

            optimised = onnx.load(optimised_path, load_external_data=False)
            copies = data_copies(optimised)
            if copies:
                raise SessionError(
                    f"{self.source}: nodes were placed on the CPU and data is copied between providers "
                    f"every call: {'; '.join(copies)}"
                )
            if self.cuda_graphs and host_copy_blocker(optimised):
                self.graph_blocker = host_copy_blocker(optimised)
                self.cuda_graphs = False

    def new_graph_id(self) -> int:
        """A CUDA graph id (``gpu_graph_id``) not used before on this session."""
        return next(self._graph_ids)

    @property
    def provider(self) -> str:
        """``"cpu"`` or ``"cuda"``: where the model really runs."""
        return self.options.device

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.tensors.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.tensors.outputs]

    def run(
        self,
        inputs: Mapping[str, object],
        output_names: Sequence[str] | None = None,
        *,
        outputs: Mapping[str, object] | None = None,
        upload_outputs: bool = False,
    ) -> dict[str, object]:
        """Run the model once.

        ``inputs`` are numpy or CuPy arrays. ``outputs`` optionally gives preallocated buffers that
        the model writes in place: CuPy arrays on CUDA, C-contiguous numpy arrays on the CPU (bound
        through IO binding; an output may be the very buffer of an input, as a shared past/present
        buffer). On CUDA every output is a CuPy array; on the CPU
        a numpy array, or a CuPy array when ``upload_outputs`` is set (host outputs uploaded).
        """
        names = list(output_names) if output_names is not None else self.output_names
        if self.options.dump_inputs is not None:
            self._dump(inputs)
        if self.options.device == "cpu":
            # exact numpy arrays as they are (to_host would return them unchanged, at a cost per feed)
            feeds = {k: v if type(v) is np.ndarray else backend.to_host(v) for k, v in inputs.items()}
            results = self._run_cpu_bound(feeds, names, outputs) if outputs else \
                dict(zip(names, self.session.run(names, feeds)))
            if upload_outputs:
                results = {k: backend.to_device(v, self.options.device_id) for k, v in results.items()}
            return results
        return self._run_cuda(inputs, names, dict(outputs or {}))

    def _run_cpu_bound(self, feeds: dict, names: list[str], outputs: Mapping[str, object]) -> dict:
        """A CPU run with the numpy buffers ``outputs`` bound as those outputs (IO binding)."""
        binding = self._host_binding(tuple(feeds), tuple(names))
        host = self._host
        raw, kept = host.raw, host.kept
        inputs = {name: np.ascontiguousarray(value) for name, value in feeds.items()}  # alive until the run ends
        for name, value in inputs.items():
            if value.dtype.kind == "f" and _still_bound(kept, name, value):
                continue  # the runtime reads a float array's own memory: still bound, still alive
            kept.pop(name, None)
            if raw is None:
                binding.bind_cpu_input(name, value)
            else:
                raw[0].bind_input(name, value)
            if value.dtype.kind == "f":
                kept[name] = (value, value.shape)
        for name in names:
            buffer = outputs.get(name)
            if buffer is not None and not (isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous):
                raise ValueError(f"{self.source}: output buffer for '{name}' must be a C-contiguous numpy array")
            if buffer is not None and _still_bound(kept, name, buffer):
                continue  # bound to this very buffer (kept alive) by an earlier call
            kept.pop(name, None)
            if raw is None and buffer is None:
                binding.bind_output(name, "cpu")
            elif raw is None:
                binding.bind_output(name, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
            elif buffer is None:
                raw[0].bind_output(name, raw[1])
            else:
                raw[0].bind_output(name, raw[1], buffer.dtype, list(buffer.shape), buffer.ctypes.data)
            if buffer is not None:
                kept[name] = (buffer, buffer.shape)
        host.names = (tuple(feeds), tuple(names))  # every name of this call is bound
        self.session.run_with_iobinding(binding)  # no run options: none are set on the CPU
        if all(name in outputs for name in names):  # every output bound: nothing to wrap
            return {name: outputs[name] for name in names}
        return {name: outputs[name] if name in outputs else value.numpy()
                for name, value in zip(names, binding.get_outputs())}

    def _host_binding(self, inputs: tuple, outputs: tuple):
        """This thread's IO binding of CPU runs, made once (a run on a reused binding is cheaper
        than making and freeing one per run): a call binding other names than the last starts
        from a cleared binding, one binding the same names replaces every binding (no stale
        buffer stays bound either way) except those still bound to the very same numpy array
        (``host.kept``: name -> (array, its shape) bound and kept alive; float inputs, whose memory
        the runtime reads in place, and output buffers)."""
        host = self._host
        binding = getattr(host, "binding", None)
        if binding is None:
            binding = host.binding = self.session.io_binding()
            host.raw = _raw_binding(binding) if self.host_raw_binds else None
            host.kept = {}
        elif host.names != (inputs, outputs):
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            host.kept = {}
        host.names = None  # until every name of this call is bound
        return binding

    def _run_cuda(self, inputs: Mapping[str, object], names: list[str], outputs: dict) -> dict:
        cupy = backend.require_cupy()
        device_id = self.options.device_id
        # on the shared stream, after the caller's queued work (inputs, and any contiguous copies
        # below); the caller's stream then waits for the outputs
        with backend.on_shared_stream(device_id):
            binding = self.session.io_binding()
            for name, value in inputs.items():
                if backend.is_device_array(value):
                    value = cupy.ascontiguousarray(value)
                    pointer = value.data.ptr if value.size else self._empty.data.ptr
                    binding.bind_input(name, "cuda", device_id, value.dtype, list(value.shape), pointer)
                else:
                    binding.bind_cpu_input(name, np.ascontiguousarray(value))
            for name in names:
                buffer = outputs.get(name)
                if buffer is None:
                    binding.bind_output(name, "cuda", device_id)
                else:
                    if not (backend.is_device_array(buffer) and buffer.flags.c_contiguous):
                        raise ValueError(f"{self.source}: output buffer for '{name}' must be a contiguous CuPy array")
                    binding.bind_output(name, "cuda", device_id, buffer.dtype, list(buffer.shape), buffer.data.ptr)
            self.session.run_with_iobinding(binding, self._run_options)
        if all(name in outputs for name in names):  # every output in the caller's buffers
            return {name: outputs[name] for name in names}
        results = {}
        for name, value in zip(names, binding.get_outputs()):
            if name in outputs:
                results[name] = outputs[name]
            else:
                results[name] = _wrap_device_output(cupy, value, device_id)
        return results

    def _dump(self, inputs: Mapping[str, object]) -> None:
        folder = Path(self.options.dump_inputs)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.name}-{next(self._calls):06d}.npz"
        np.savez(path, **{k: backend.to_host(v) for k, v in inputs.items()})


def _still_bound(kept: dict, name: str, array: np.ndarray) -> bool:
    """Whether ``name`` is bound to the very numpy ``array`` (same object, same shape; kept alive
    since, so its memory is the bound memory)."""
    bound = kept.get(name)
    return bound is not None and bound[0] is array and bound[1] == array.shape


def _raw_binding(binding):
    """(the runtime's own binding object behind the ``onnxruntime.IOBinding`` ``binding``, its CPU
    device), or None where this onnxruntime lacks them: binding through them is what the wrapper's
    ``bind_cpu_input`` / ``bind_output`` do after making the device and checking for WebGPU graph
    capture, which a CPU session never does. The caller keeps the bound arrays alive until the run
    ends (the wrapper would keep the inputs)."""
    try:
        from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

        raw, device = binding._iobinding, OrtDevice.make("cpu", 0)._get_c_device()
    except (AttributeError, ImportError, TypeError):
        return None
    if not (callable(getattr(raw, "bind_input", None)) and callable(getattr(raw, "bind_output", None))):
        return None
    return raw, device


#: the environment variable ONNX Runtime's CUDA GroupQueryAttention reads (when its kernel is made)
XQA_VARIABLE = "ORT_ENABLE_XQA"
_XQA_LOCK = threading.Lock()  # one session creation at a time changes the variable


def xqa_setting(model_proto, enabled: bool) -> str | None:
    """``ORT_ENABLE_XQA``'s value for creating a CUDA session of ``model_proto``: "1" / "0" for a graph
    that runs ``GroupQueryAttention`` (``SessionOptions.gqa_xqa``), None (left alone) otherwise."""
    if not uses_group_query_attention(model_proto):
        return None
    return "1" if enabled else "0"


@contextlib.contextmanager
def xqa_environment(value: str | None):
    """``ORT_ENABLE_XQA`` = ``value`` while the block runs (None: nothing changes), then as before."""
    if value is None:
        yield
        return
    with _XQA_LOCK:
        before = os.environ.get(XQA_VARIABLE)
        os.environ[XQA_VARIABLE] = value
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(XQA_VARIABLE, None)
            else:
                os.environ[XQA_VARIABLE] = before


def create_inference_session(factory, model, sess_options, providers: Sequence, *, cuda_graphs: bool,
                             source: str):
    """(session, why CUDA graphs are off or None) from ``factory`` (``onnxruntime.InferenceSession``).

    With ``cuda_graphs`` the first provider (CUDA, as ``(name, options)``) gets
    ``enable_cuda_graph``; when ONNX Runtime refuses that (e.g. a graph with Memcpy nodes or nodes
    on the CPU provider), one warning names why and the session is created again from
    ``providers`` as given, without graphs. A model that cannot be loaded at all is a
    :class:`SessionError`.
    """
    def create(with_providers):
        try:
            return factory(model, sess_options=sess_options, providers=list(with_providers))
        except Exception as exc:
            raise SessionError(f"{source}: ONNX Runtime cannot load the model: {exc}") from exc

    if not cuda_graphs:
        return create(providers), None
    name, provider_options = providers[0]
    try:
        return factory(model, sess_options=sess_options,
                       providers=[(name, {**provider_options, "enable_cuda_graph": "1"}), *providers[1:]]), None
    except Exception as exc:
        blocker = f"ONNX Runtime cannot capture it: {exc}"
    log.warning("%s: CUDA graphs are off for this model (plain runs): %s", source, blocker)
    return create(providers), blocker


def _load_proto(model) -> onnx.ModelProto:
    import onnx

    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(str(model), load_external_data=False)


_NP_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
}


def _wrap_device_output(cupy, value, device_id: int):
    """A CuPy view of an ONNX-Runtime-owned device tensor; the OrtValue stays alive with it."""
    dtype = np.dtype(_NP_TYPES[value.data_type()])
    shape = tuple(value.shape())
    if value.device_name().lower() != "cuda":
        return cupy.asarray(value.numpy())
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size == 0:
        return cupy.empty(shape, dtype)
    memory = cupy.cuda.UnownedMemory(value.data_ptr(), size, value, device_id)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))
