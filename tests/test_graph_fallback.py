"""The CUDA-graph fallback: when ONNX Runtime refuses graph capture, the session is created again
without the graph-enabled provider options, after one warning naming why. On the CPU, with a fake
session factory that refuses ``enable_cuda_graph`` as ONNX Runtime does for a model with Memcpy
nodes."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from gpudecode.session import OnnxSession, SessionError
from gpudecode.session.runner import create_inference_session

REFUSAL = ("This session cannot use the CUDA Graph feature as requested by the user as the model has "
           "Memcpy nodes")
CUDA = ("CUDAExecutionProvider", {"device_id": "0", "has_user_compute_stream": "1"})


class FakeFactory:
    """Records every call's providers; refuses graph-enabled options (or everything)."""

    def __init__(self, refuse_all: bool = False):
        self.calls = []
        self.refuse_all = refuse_all

    def __call__(self, model, *, sess_options=None, providers=()):
        self.calls.append([tuple(p) if isinstance(p, tuple) else p for p in providers])
        graphs = any(isinstance(p, tuple) and p[1].get("enable_cuda_graph") == "1" for p in providers)
        if graphs or self.refuse_all:
            raise RuntimeError(REFUSAL if graphs else "invalid model")
        return ("session", model)


def test_a_refused_capture_retries_without_graph_options_after_one_warning(caplog):
    factory = FakeFactory()
    with caplog.at_level(logging.WARNING, logger="gpudecode.session.runner"):
        session, blocker = create_inference_session(factory, b"model", None, [CUDA, "CPUExecutionProvider"],
                                                    cuda_graphs=True, source="decoder.onnx")
    assert session == ("session", b"model")
    assert len(factory.calls) == 2
    first, retry = factory.calls
    assert first[0] == ("CUDAExecutionProvider", {**CUDA[1], "enable_cuda_graph": "1"})
    assert retry == [CUDA, "CPUExecutionProvider"]  # the options as given: no graph key
    assert "enable_cuda_graph" not in retry[0][1]
    assert "Memcpy" in blocker
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "decoder.onnx" in warnings[0].getMessage() and "Memcpy" in warnings[0].getMessage()
    assert "CUDA graphs are off" in warnings[0].getMessage()


def test_without_graphs_there_is_one_call_and_no_warning(caplog):
    factory = FakeFactory()
    with caplog.at_level(logging.WARNING, logger="gpudecode.session.runner"):
        session, blocker = create_inference_session(factory, b"m", None, [CUDA], cuda_graphs=False, source="m")
    assert blocker is None and factory.calls == [[CUDA]] and not caplog.records
    assert session == ("session", b"m")


def test_a_model_that_cannot_load_at_all_is_a_session_error():
    factory = FakeFactory(refuse_all=True)
    with pytest.raises(SessionError, match="decoder.onnx: ONNX Runtime cannot load the model: invalid model"):
        create_inference_session(factory, b"m", None, [CUDA], cuda_graphs=True, source="decoder.onnx")
    assert len(factory.calls) == 2  # with graphs, then without


def test_the_session_takes_its_factory_from_the_constructor():
    """OnnxSession builds its ONNX Runtime session through ``session_factory``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "double",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "t"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "t"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    made = []

    def factory(model, *, sess_options=None, providers=()):
        made.append(list(providers))
        return ort.InferenceSession(model, sess_options=sess_options, providers=providers)

    session = OnnxSession(model.SerializeToString(), session_factory=factory)
    assert made == [["CPUExecutionProvider"]]
    np.testing.assert_array_equal(session.run({"x": np.ones((1, 2), np.float32)})["y"], [[2, 2]])
