"""The ONNX Runtime session layer on the CPU provider."""

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from gpudecode import backend
from gpudecode.session import OnnxSession, SessionError, SessionOptions, hf_attention_inputs

ROOT = Path(__file__).resolve().parents[1]


def double_model():
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"]), helper.make_node("Shape", ["x"], ["shape"])],
        "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "t"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "t"]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        initializer=[helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_cpu_run_returns_named_outputs(tmp_path):
    path = tmp_path / "double.onnx"
    path.write_bytes(double_model().SerializeToString())
    session = OnnxSession(path)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = session.run({"x": x})
    assert set(out) == {"y", "shape"}
    np.testing.assert_array_equal(out["y"], 2 * x)
    np.testing.assert_array_equal(out["shape"], [2, 3])
    only = session.run({"x": x}, ["shape"])
    assert list(only) == ["shape"]
    assert session.provider == "cpu" and session.input_names == ["x"]


def test_dump_inputs_round_trip(tmp_path):
    session = OnnxSession(double_model().SerializeToString(), SessionOptions(dump_inputs=tmp_path / "dump"))
    first = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    second = np.zeros((0, 4), np.float32)
    session.run({"x": first})
    session.run({"x": second})
    files = sorted((tmp_path / "dump").glob("*.npz"))
    assert [f.name for f in files] == ["model-000000.npz", "model-000001.npz"]
    np.testing.assert_array_equal(np.load(files[0])["x"], first)
    assert np.load(files[1])["x"].shape == (0, 4)


def test_missing_and_corrupt_model_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model file .*nothere\.onnx does not exist"):
        OnnxSession(tmp_path / "nothere.onnx")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"this is not a protobuf")
    with pytest.raises(SessionError, match=r"corrupt\.onnx: ONNX Runtime cannot load the model"):
        OnnxSession(corrupt)


def test_cuda_without_gpu_is_one_clear_error(no_gpu):
    with pytest.raises(backend.GpuUnavailableError, match=r"the GPU was requested but cannot be used: CuPy cannot be imported"):
        OnnxSession(double_model().SerializeToString(), SessionOptions(device="cuda"))


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match=r"device: expected 'cpu' or 'cuda', got 'tpu'"):
        SessionOptions(device="tpu")
    with pytest.raises(ValueError, match=r"cudnn_conv_algo_search: expected one of EXHAUSTIVE"):
        SessionOptions(cudnn_conv_algo_search="FAST")


NEW_STEP_SHAPES = [((5, 3, 7, 4), 2), ((4, 7, 6), 1), ((3, 2, 5, 1), 2), ((6, 9), 1)]


def _new_steps_match_take_along_axis(xp):
    from gpudecode.session.hf import new_step_states

    rng = np.random.default_rng(0)
    for shape, axis in NEW_STEP_SHAPES:
        present = rng.standard_normal(shape).astype(np.float32)
        lengths = rng.integers(0, shape[axis], shape[0])
        along = [1] * len(shape)
        along[0] = shape[0]
        want = np.take_along_axis(present, lengths.reshape(along), axis=axis)
        cache = {}
        for shift in (0, 1):  # the second output of the shape reuses the first's positions
            got = new_step_states(xp.asarray(present + shift), xp.asarray(lengths), axis, "left", index_cache=cache)
            np.testing.assert_array_equal(got.get() if hasattr(got, "get") else got, want + shift)
        assert len(cache) == 1
        wide = np.repeat(present, 2, axis=-1)  # every other column: a non-contiguous view, the general way
        view = xp.asarray(wide)[..., ::2]
        assert not view.flags.c_contiguous
        got = new_step_states(view, xp.asarray(lengths), axis, "left")
        np.testing.assert_array_equal(got.get() if hasattr(got, "get") else got, want)


def test_left_aligned_new_steps_are_each_rows_own_position():
    """A present output's new step at each row's length: one take of cached flat positions equals
    ``take_along_axis`` (the oracle), for keys / values / other ranks and a non-contiguous output."""
    _new_steps_match_take_along_axis(np)


@pytest.mark.gpu
def test_left_aligned_new_steps_on_cuda():
    _new_steps_match_take_along_axis(pytest.importorskip("cupy"))


def test_hf_attention_inputs_from_prefix_lengths():
    mask, positions = hf_attention_inputs(np.array([0, 2, 3], np.int32), past_time=3)
    np.testing.assert_array_equal(mask, [[0, 0, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    np.testing.assert_array_equal(positions, [[0], [2], [3]])
    assert mask.dtype == np.int64 and positions.dtype == np.int64
    mask, positions = hf_attention_inputs(np.array([0, 0]), past_time=0)
    np.testing.assert_array_equal(mask, [[1], [1]])


def test_xqa_is_set_only_for_group_query_attention_graphs():
    from gpudecode.session.runner import xqa_setting

    genai = onnx.load(str(ROOT / "tests" / "fixtures" / "peers" / "genai" / "model.onnx"), load_external_data=False)
    gpt2 = onnx.load(str(ROOT / "tests" / "fixtures" / "peers" / "gpt2" / "decoder_with_past_model.onnx"),
                     load_external_data=False)
    assert xqa_setting(genai, False) == "0" and xqa_setting(genai, True) == "1"
    assert xqa_setting(gpt2, False) is None and xqa_setting(gpt2, True) is None


@pytest.mark.parametrize("before", [None, "1"])
def test_xqa_environment_holds_only_while_the_session_is_made(monkeypatch, before):
    from gpudecode.session.runner import XQA_VARIABLE, xqa_environment

    if before is None:
        monkeypatch.delenv(XQA_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(XQA_VARIABLE, before)
    with xqa_environment("0"):
        assert os.environ[XQA_VARIABLE] == "0"
    assert os.environ.get(XQA_VARIABLE) == before
    with pytest.raises(RuntimeError), xqa_environment("0"):
        raise RuntimeError("the session failed")
    assert os.environ.get(XQA_VARIABLE) == before
    with xqa_environment(None):
        assert os.environ.get(XQA_VARIABLE) == before
