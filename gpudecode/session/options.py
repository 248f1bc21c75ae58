"""Typed options of an ONNX Runtime session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpudecode import defaults

CUDNN_SEARCH = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")


@dataclass(frozen=True, kw_only=True)
class SessionOptions:
    """Where and how a model runs.

    ``arena_limit_bytes`` caps ONNX Runtime's CUDA arena (``gpu_mem_limit``); ``use_tf32`` is off by
    default so float32 results match the CPU within 1e-5. ``check_placement`` verifies on CUDA that
    the optimised graph copies no float data between providers. ``dump_inputs`` names a folder that
    receives every call's inputs as ``.npz``. ``cuda_graphs``: create the CUDA session with ONNX
    Runtime's CUDA graphs (``enable_cuda_graph``); plain runs then use graph id -1 and
    :class:`gpudecode.session.graphs.StepGraphs` captures one graph per bucket. A model that
    cannot be captured runs without graphs (``OnnxSession.graph_blocker`` says why). ``gqa_xqa``:
    ONNX Runtime's XQA kernel for ``GroupQueryAttention`` decoding steps whose past and present
    share a buffer (``ORT_ENABLE_XQA`` while a CUDA session of such a model is created).
    """

    device: Literal["cpu", "cuda"] = "cpu"
    device_id: int = 0
    use_tf32: bool = False
    arena_limit_bytes: int | None = None
    arena_extend_strategy: Literal["kNextPowerOfTwo", "kSameAsRequested"] = "kNextPowerOfTwo"
    cudnn_conv_algo_search: str = "HEURISTIC"
    intra_op_threads: int = 0
    check_placement: bool = True
    dump_inputs: Path | None = None
    cuda_graphs: bool = False
    gqa_xqa: bool = defaults.GQA_XQA

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu' or 'cuda', got {self.device!r}")
        if self.cudnn_conv_algo_search not in CUDNN_SEARCH:
            raise ValueError(
                f"cudnn_conv_algo_search: expected one of {', '.join(CUDNN_SEARCH)}, "
                f"got {self.cudnn_conv_algo_search!r}"
            )
