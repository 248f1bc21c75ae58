"""The session layer on the CUDA provider (run with -m gpu on the GPU test machine)."""

import numpy as np
import onnx
import pytest

from gpudecode import backend
from gpudecode.session import OnnxSession, SessionError, SessionOptions
from gpudecode.session.placement import data_copies
from tests.feeds import random_feeds
from tests.test_session import double_model

pytestmark = pytest.mark.gpu

SPIN_SOURCE = r"""
extern "C" __global__ void spin_then_fill(float* x, int n, float value, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = value;
}
"""


@pytest.fixture(scope="module")
def cp():
    return backend.require_cupy()


def decoder(**kwargs):
    from gpudecode.testing import build_transformer_decoder

    return build_transformer_decoder(seed=3, **kwargs)


def test_cupy_in_cupy_out_without_memcpy_nodes(cp, tmp_path):
    reference = decoder()
    session = OnnxSession(reference.serialized(), SessionOptions(device="cuda"))  # raises on data Memcpy
    optimised = tmp_path / "optimised.onnx"
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(optimised)
    ort.InferenceSession(reference.serialized(), options, providers=["CUDAExecutionProvider"])
    graph = onnx.load(str(optimised)).graph
    producers = {o: n for n in graph.node for o in n.output}
    copies = [(n.op_type, n.input[0], producers[n.input[0]].op_type if n.input[0] in producers else "graph input")
              for n in graph.node if n.op_type.startswith("Memcpy")]
    print("Memcpy nodes (op, copied tensor, its producer):", copies)
    # Only small shape subgraphs placed on the CPU may be copied; no float data moves.
    assert data_copies(onnx.load(str(optimised))) == []
    assert len(copies) <= 1, copies

    feeds = random_feeds(reference.model)
    with session.stream:
        device_feeds = {k: cp.asarray(v) for k, v in feeds.items()}
    out = session.run(device_feeds)
    assert all(isinstance(v, cp.ndarray) for v in out.values())
    expected = reference.oracle(feeds)
    for name, value in out.items():
        np.testing.assert_allclose(backend.to_host(value), expected[name], atol=1e-5, rtol=1e-5, err_msg=name)


def test_preallocated_outputs_are_written_in_place(cp):
    reference = decoder()
    session = OnnxSession(reference.serialized(), SessionOptions(device="cuda"))
    feeds = random_feeds(reference.model)
    expected = reference.oracle(feeds)
    with session.stream:
        buffers = {k: cp.full(v.shape, np.nan, v.dtype) for k, v in expected.items()}
        out = session.run({k: cp.asarray(v) for k, v in feeds.items()}, outputs=buffers)
    for name, buffer in buffers.items():
        assert out[name].data.ptr == buffer.data.ptr
        np.testing.assert_allclose(backend.to_host(buffer), expected[name], atol=1e-5, rtol=1e-5, err_msg=name)


def test_empty_history_binds_zero_size_device_tensors(cp):
    reference = decoder()
    session = OnnxSession(reference.serialized(), SessionOptions(device="cuda"))
    feeds = random_feeds(reference.model, past=0)
    feeds["prefix-length"][:] = 0
    out = session.run({k: cp.asarray(v) for k, v in feeds.items()})
    np.testing.assert_allclose(backend.to_host(out["scores"]), reference.oracle(feeds)["scores"], atol=1e-5)


def test_work_is_ordered_on_the_shared_stream(cp):
    session = OnnxSession(double_model().SerializeToString(), SessionOptions(device="cuda"))
    spin = cp.RawKernel(SPIN_SOURCE, "spin_then_fill")
    with session.stream:
        x = cp.zeros((4, 256), cp.float32)
        spin((1,), (256,), (x, np.int32(x.size), np.float32(3.0), np.int64(20_000_000)))  # ~10 ms at ~2 GHz
        y = session.run({"x": x}, ["y"])["y"]
        z = y + 1.0  # a CuPy kernel reading ORT's output, no sync in between
    result = backend.to_host(z)  # the only synchronisation
    assert np.all(result == 7.0), np.unique(result)


def test_tf32_off_matches_cpu_provider(cp):
    reference = decoder(model_dim=64, num_heads=4, ffn_dim=256)
    feeds = random_feeds(reference.model, batch=8, past=9, frames=20)
    cpu = OnnxSession(reference.serialized()).run(feeds)
    gpu = OnnxSession(reference.serialized(), SessionOptions(device="cuda", use_tf32=False)).run(
        {k: cp.asarray(v) for k, v in feeds.items()})
    worst = max(float(np.abs(backend.to_host(gpu[k]) - cpu[k]).max()) for k in cpu)
    assert worst <= 1e-5, worst


def test_cuda_that_cannot_load_is_an_error(cp, monkeypatch):
    count = cp.cuda.runtime.getDeviceCount()
    with pytest.raises(SessionError, match=rf"CUDA device {count} was requested but this machine has {count}"):
        OnnxSession(double_model().SerializeToString(), SessionOptions(device="cuda", device_id=count))
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(SessionError, match=r"has no CUDA execution provider"):
        OnnxSession(double_model().SerializeToString(), SessionOptions(device="cuda"))


def test_dump_inputs_copies_device_tensors_to_host(cp, tmp_path):
    session = OnnxSession(double_model().SerializeToString(), SessionOptions(device="cuda", dump_inputs=tmp_path))
    x = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    session.run({"x": x})
    (dump,) = tmp_path.glob("*.npz")
    np.testing.assert_array_equal(np.load(dump)["x"], backend.to_host(x))


def test_host_outputs_uploaded_on_request(cp):
    session = OnnxSession(double_model().SerializeToString())  # CPU provider, e.g. a prefill model
    out = session.run({"x": np.ones((2, 2), np.float32)}, upload_outputs=True)
    assert isinstance(out["y"], cp.ndarray) and float(out["y"].sum()) == 8.0


def test_to_host_copies_any_device_array_through_pinned_memory(cp):
    from gpudecode.backend import to_host

    base = cp.arange(60, dtype=cp.float32).reshape(3, 4, 5)
    for array in (base, base[:, ::2, 1:], base.T, base[0, 0, 0], base[:0], cp.asarray([True, False]),
                  cp.arange(7, dtype=cp.int64)):
        host = to_host(array)
        assert isinstance(host, np.ndarray) and host.shape == array.shape and host.dtype == array.dtype
        assert np.array_equal(host, cp.asnumpy(array))


@pytest.mark.gpu
def test_to_host_all_copies_every_array(cp):
    """Strided, transposed, 0-d, empty, bool and host arrays, and one just written on the caller's stream."""
    from gpudecode.backend import to_host_all

    base = cp.arange(60, dtype=cp.float32).reshape(3, 4, 5)
    late = cp.zeros(1000, dtype=cp.float32)
    late += 3  # queued on the default stream before the copies
    arrays = (base, base[:, ::2, 1:], base.T, base[0, 0, 0], base[:0], cp.asarray([True, False]),
              np.arange(3), cp.arange(7, dtype=cp.int64), late)
    hosts = to_host_all(*arrays)
    for array, host in zip(arrays, hosts):
        assert isinstance(host, np.ndarray) and host.shape == array.shape and host.dtype == array.dtype
        assert np.array_equal(host, array.get() if isinstance(array, cp.ndarray) else array)
