"""The reference ONNX models of gpudecode.testing agree with their numpy oracles (ONNX Runtime, CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from gpudecode.testing import (
    ReferenceModel,
    build_encoder,
    build_lstm_lm,
    build_transformer_decoder,
    build_transformer_lm,
    hf_attention_inputs,
    write_examples,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "models"
MODES = ["precomputed", "encoder-states", None]
LAYOUTS = ["bhtd", "btd"]
DTYPES = [np.float32, np.float16]
# (state_outputs, fused_qkv): the history concatenated in the model, or the new step alone with
# the three self-attention projections fused (the bench decoder's export)
EXPORTS = [("full", False), ("new", True)]
GARBAGE = 5.0  # scale of the random values written into padded positions


def _tolerance(dtype) -> dict:
    return dict(atol=2e-2, rtol=1e-2) if np.dtype(dtype) == np.float16 else dict(atol=1e-5, rtol=1e-6)


def _run(ref: ReferenceModel, feeds: dict, provider: str = "CPUExecutionProvider") -> dict[str, np.ndarray]:
    options = {"use_tf32": "0"} if provider == "CUDAExecutionProvider" else {}  # float32 products in float32
    session = ort.InferenceSession(ref.serialized(), providers=[(provider, options)])
    return dict(zip(ref.output_names, session.run(None, feeds)))


def _assert_outputs_close(got: dict, expected: dict, dtype) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        np.testing.assert_allclose(
            got[name].astype(np.float64), value.astype(np.float64), err_msg=name, **_tolerance(dtype)
        )


def _padded(valid: np.ndarray, rng, garbage: bool) -> np.ndarray:
    """Draws [*valid.shape] values; where ``valid`` is False: zeros, or garbage if asked."""
    values = rng.normal(size=valid.shape)
    filler = GARBAGE * rng.normal(size=valid.shape)  # drawn either way: same valid values
    return np.where(valid, values, filler if garbage else 0.0)


def _past_states(ref: ReferenceModel, prefix_length, past_time: int, rng, garbage=False, left=False) -> dict:
    """Right-aligned past states: row n is valid in its last prefix_length[n] time positions
    (``left``: in its first)."""
    first_valid = past_time - np.asarray(prefix_length)[:, None]
    valid_time = np.arange(past_time)[None, :] >= first_valid  # [N, T]
    if left:
        valid_time = np.arange(past_time)[None, :] < np.asarray(prefix_length)[:, None]
    num = len(prefix_length)
    feeds = {}
    for name in ref.states:
        if ref.time_axis == 2:  # [N, H, T, Dh]
            shape = (num, ref.num_heads, past_time, ref.head_dim)
            valid = np.broadcast_to(valid_time[:, None, :, None], shape)
        else:  # [N, T, D]
            valid = np.broadcast_to(valid_time[:, :, None], (num, past_time, ref.hidden_dim))
        feeds[name] = _padded(valid, rng, garbage).astype(ref.dtype)
    return feeds


def _utterance_inputs(ref: ReferenceModel, mode, sizes, num_s: int, rng, garbage=False) -> dict:
    """Per-utterance decoder inputs with keys s >= sizes[n] padded."""
    sizes = np.asarray(sizes, dtype=np.int32)
    valid_s = np.arange(num_s)[None, :] < sizes[:, None]  # [N, S]
    num = len(sizes)
    feeds = {}
    if mode == "precomputed":
        shape = (num, ref.num_heads, num_s, ref.head_dim)
        for i in range(ref.num_layers):
            for kind in ("key", "value"):
                valid = np.broadcast_to(valid_s[:, None, :, None], shape)
                feeds[f"cross-{kind}-{i}"] = _padded(valid, rng, garbage).astype(ref.dtype)
    elif mode == "encoder-states":
        valid = np.broadcast_to(valid_s[:, :, None], (num, num_s, 32))
        feeds["encoder-states"] = _padded(valid, rng, garbage).astype(ref.dtype)
    if mode is not None:
        feeds["encoder-states-size"] = sizes
    return feeds


def _step_feeds(tokens, prefix_length) -> dict:
    return {
        "token": np.asarray(tokens, dtype=np.int32)[:, None],
        "token-length": np.ones(len(tokens), dtype=np.int32),
        "prefix-length": np.asarray(prefix_length, dtype=np.int32),
    }


def _decoder_feeds(ref, mode, prefix_length, past_time, sizes, num_s, seed, garbage=False, left=False) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, ref.vocab_size, size=len(prefix_length))
    feeds = _step_feeds(tokens, prefix_length)
    feeds.update(_past_states(ref, prefix_length, past_time, rng, garbage, left))
    feeds.update(_utterance_inputs(ref, mode, sizes, num_s, rng, garbage))
    return feeds


def _features(sizes, num_t: int, seed: int, dtype, garbage=False) -> dict:
    rng = np.random.default_rng(seed)
    valid = np.broadcast_to((np.arange(num_t)[None, :] < np.asarray(sizes)[:, None])[:, :, None],
                            (len(sizes), num_t, 16))
    features = _padded(valid, rng, garbage).astype(dtype)
    return {"features": features, "features-size": np.asarray(sizes, np.int32)}


# -- encoder ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("subsampling", [2, 4])
def test_encoder_matches_oracle(subsampling, dtype):
    ref = build_encoder(subsampling=subsampling, dtype=dtype)
    session = ort.InferenceSession(ref.serialized(), providers=["CPUExecutionProvider"])
    for sizes, num_t in [([11, 5, 1], 11), ([8, 3], 8), ([2], 3)]:  # dynamic U and T
        feeds = _features(sizes, num_t, seed=num_t, dtype=dtype)
        got = dict(zip(ref.output_names, session.run(None, feeds)))
        _assert_outputs_close(got, ref.oracle(feeds), dtype)
        num_out = -(-num_t // subsampling)
        assert got["encoder-states"].shape == (len(sizes), num_out, 32)
        assert got["cross-key-1"].shape == (len(sizes), 2, num_out, 16)
        expected_sizes = [int(np.ceil(s / subsampling)) for s in sizes]
        assert got["encoder-states-size"].tolist() == expected_sizes
        for n, size in enumerate(expected_sizes):
            assert np.all(got["encoder-states"][n, size:] == 0)
            assert np.any(got["encoder-states"][n, :size] != 0)


@pytest.mark.parametrize("subsampling", [2, 4])
def test_encoder_ignores_features_beyond_size(subsampling):
    ref = build_encoder(subsampling=subsampling)
    sizes, num_t = [9, 4, 13], 13
    clean = _run(ref, _features(sizes, num_t, seed=5, dtype=np.float32))
    noisy_feeds = _features(sizes, num_t, seed=5, dtype=np.float32, garbage=True)
    assert np.abs(noisy_feeds["features"][0, 9:]).max() > 1
    noisy = _run(ref, noisy_feeds)
    for name in clean:
        np.testing.assert_array_equal(noisy[name], clean[name], err_msg=name)
    noisy_feeds["features"][1, 3] += 1.0  # a valid frame does matter
    changed = _run(ref, noisy_feeds)
    assert np.abs(changed["encoder-states"][1] - clean["encoder-states"][1]).max() > 1e-3


# -- transformer decoder (RASR convention) ---------------------------------------------------------


@pytest.mark.parametrize("state_outputs, fused_qkv", EXPORTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_decoder_step_matches_oracle(mode, kv_layout, dtype, state_outputs, fused_qkv):
    ref = build_transformer_decoder(cross_attention=mode, kv_layout=kv_layout, dtype=dtype,
                                    state_outputs=state_outputs, fused_qkv=fused_qkv)
    for prefix_length, past_time in [([0, 3, 5, 1], 5), ([0, 0], 0)]:
        sizes = [7, 4, 1, 2][: len(prefix_length)]
        feeds = _decoder_feeds(ref, mode, prefix_length, past_time, sizes, 7, seed=past_time,
                               garbage=True)
        got = _run(ref, feeds)
        _assert_outputs_close(got, ref.oracle(feeds), dtype)
        assert got["scores"].shape == (len(prefix_length), 1, ref.vocab_size)
        total = np.log(np.exp(got["scores"].astype(np.float64)).sum(-1))
        np.testing.assert_allclose(total, 0, atol=_tolerance(dtype)["atol"])
        for past, present in ref.states.items():  # the full time axis: past, then the new token
            if state_outputs == "new":  # or the new token alone
                assert got[present].shape[ref.time_axis] == 1
                continue
            assert got[present].shape[ref.time_axis] == past_time + 1
            np.testing.assert_array_equal(
                np.take(got[present], range(past_time), axis=ref.time_axis), feeds[past])


@pytest.mark.parametrize("utterance_rows", ["lane", "utterance"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_fused_decoder_matches_oracle_in_fewer_nodes(mode, dtype, utterance_rows):
    """The export with ONNX Runtime's fused ops (SkipLayerNormalization, the attention scale in the
    query weights, reshapes for one-step head splits) computes the oracle's function, in fewer nodes
    than the new-step export it fuses."""
    options = dict(cross_attention=mode, dtype=dtype, state_outputs="new", fused_qkv=True,
                   utterance_rows=utterance_rows)
    ref, plain = build_transformer_decoder(**options, fused_ops=True), build_transformer_decoder(**options)
    for prefix_length, past_time in [([0, 3, 5, 1], 5), ([0, 0], 0)]:
        sizes = [7, 4, 1, 2][: len(prefix_length)]
        feeds = _decoder_feeds(ref, mode, prefix_length, past_time, sizes, 7, seed=past_time, garbage=True)
        if utterance_rows == "utterance" and mode is not None:  # one row per utterance, beam 2 rows each
            feeds = {k: v[::2] if k.startswith(("cross-", "encoder-")) else v for k, v in feeds.items()}
        got = _run(ref, feeds)
        _assert_outputs_close(got, ref.oracle(feeds), dtype)
        _assert_outputs_close(got, _run(plain, feeds), dtype)
    ops = [node.op_type for node in onnx.load_from_string(ref.serialized()).graph.node]
    plain_ops = [node.op_type for node in onnx.load_from_string(plain.serialized()).graph.node]
    assert ops.count("SkipLayerNormalization") == (3 if mode else 2) * 2  # every LayerNorm but the first
    assert ops.count("LayerNormalization") == 1
    assert len(ops) < len(plain_ops) - 10
    with pytest.raises(ValueError, match="fused_ops needs"):
        build_transformer_decoder(kv_layout="btd", state_outputs="new", fused_qkv=True, fused_ops=True)


@pytest.mark.parametrize("attention, fused_ops", [("ragged", False), ("gqa", False), ("gqa", True)])
@pytest.mark.parametrize("mode", MODES)
def test_ragged_decoder_matches_oracle_on_left_aligned_histories(mode, attention, fused_ops):
    """ONNX Attention (opset 24) or ONNX Runtime's GroupQueryAttention over each row's first
    prefix-length + 1 positions: padding after them (garbage here) is never read, and the new
    step's own slot is written by the model. (fused_ops: GroupQueryAttention on the packed
    projection.)"""
    ref = build_transformer_decoder(cross_attention=mode, state_outputs="new", fused_qkv=True, attention=attention,
                                    fused_ops=fused_ops)
    metadata = {p.key: p.value for p in onnx.load_from_string(ref.serialized()).metadata_props}
    assert metadata["HISTORY_ALIGNMENT"] == "left"
    room = attention == "gqa"  # GroupQueryAttention writes the new step into the past: T > history
    for prefix_length, past_time in [([0, 3, 5, 1], 5), ([0, 0], 0), ([2, 2], 6)]:
        past_time += room
        sizes = [7, 4, 1, 2][: len(prefix_length)]
        feeds = _decoder_feeds(ref, mode, prefix_length, past_time, sizes, 7, seed=past_time, garbage=True,
                               left=True)
        got = _run(ref, feeds)
        expected = ref.oracle(feeds)
        _assert_outputs_close({k: got[k] for k in expected}, expected, np.float32)
        assert_in_place_caches(ref, got, feeds, prefix_length)
        clean = _run(ref, _decoder_feeds(ref, mode, prefix_length, past_time, sizes, 7, seed=past_time, left=True))
        np.testing.assert_allclose(got["scores"], clean["scores"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("fused_ops", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_dense_decoder_on_left_aligned_histories_matches_oracle(mode, dtype, fused_ops):
    """history_alignment="left": the dense attention masks the positions after each row's
    prefix-length (garbage here, as a left-aligned merge leaves them) and attends to the new step."""
    ref = build_transformer_decoder(cross_attention=mode, state_outputs="new", fused_qkv=True, dtype=dtype,
                                    fused_ops=fused_ops, history_alignment="left")
    metadata = {p.key: p.value for p in onnx.load_from_string(ref.serialized()).metadata_props}
    assert metadata["HISTORY_ALIGNMENT"] == "left"
    for prefix_length, past_time in [([0, 3, 5, 1], 5), ([0, 0], 0), ([2, 2], 6)]:
        sizes = [7, 4, 1, 2][: len(prefix_length)]
        feeds = _decoder_feeds(ref, mode, prefix_length, past_time, sizes, 7, seed=past_time, garbage=True,
                               left=True)
        got = _run(ref, feeds)
        _assert_outputs_close(got, ref.oracle(feeds), dtype)
        clean = _run(ref, _decoder_feeds(ref, mode, prefix_length, past_time, sizes, 7, seed=past_time, left=True))
        np.testing.assert_allclose(got["scores"], clean["scores"], atol=1e-6 if dtype == np.float32 else 1e-3, rtol=0)
    with pytest.raises(ValueError, match="left-aligned histories"):
        build_transformer_decoder(kv_layout="btd", state_outputs="new", history_alignment="left")


def _to_ft_keys(state: np.ndarray, chunk: int) -> np.ndarray:
    """[N, H, T, Dh] keys in FasterTransformer's layout [N, H, Dh/x, T, x], as [N, H·Dh/x, T, x]."""
    rows, heads, num_t, head_dim = state.shape
    ft = state.reshape(rows, heads, num_t, head_dim // chunk, chunk).transpose(0, 1, 3, 2, 4)
    return np.ascontiguousarray(ft).reshape(rows, heads * head_dim // chunk, num_t, chunk)


@pytest.mark.parametrize("provider, fused_ops, ft_keys", [
    ("CPUExecutionProvider", False, False), ("CPUExecutionProvider", True, False),
    pytest.param("CUDAExecutionProvider", True, True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_dmmha_decoder_matches_oracle_on_left_aligned_histories(mode, dtype, fused_ops, provider, ft_keys):
    """ONNX Runtime's DecoderMaskedMultiHeadAttention over each row's first prefix-length positions
    (garbage after them is never read); it writes the new step into its in-place present outputs at
    position T - 1, after every row's history. Head size 32 (CUDA takes 32, 64 or 128). The CUDA
    kernel reads the past keys in FasterTransformer's layout, which only the fused export declares
    (ft_keys); the CPU kernel reads [N, H, T, Dh]. The fused export's state outputs are those
    present outputs, whole (the oracle's: the past's bytes with the new step at T - 1)."""
    ref = build_transformer_decoder(cross_attention=mode, dtype=dtype, model_dim=64, num_heads=2,
                                    state_outputs="in-place" if fused_ops else "new", fused_qkv=True,
                                    attention="dmmha", fused_ops=fused_ops, ft_keys=ft_keys)
    chunk = 16 // np.dtype(dtype).itemsize
    for prefix_length, past_time in [([0, 3, 5, 1], 6), ([0, 0], 1), ([2, 2], 7)]:
        sizes = [7, 4, 1, 2][: len(prefix_length)]
        feeds = _decoder_feeds(ref, mode, prefix_length, past_time, sizes, 7, seed=past_time, garbage=True, left=True)
        if ft_keys:
            feeds = {k: _to_ft_keys(v, chunk) if k.startswith("past-key-") else v for k, v in feeds.items()}
        got = _run(ref, feeds, provider)
        expected = ref.oracle(feeds)
        _assert_outputs_close({k: got[k] for k in expected}, expected, dtype)
        for past, present in ref.states.items():
            cache = got[past.replace("past-", "kv-cache-")].reshape(feeds[past].shape)  # the past's bytes
            for row, length in enumerate(prefix_length):
                np.testing.assert_array_equal(cache[row, :, :length], feeds[past][row, :, :length])
            if not fused_ops:  # (fused: the caches are the state outputs, compared whole above)
                np.testing.assert_allclose(cache[:, :, past_time - 1].astype(np.float32),
                                           got[present][:, :, 0].astype(np.float32), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ft_keys_oracle_reads_fastertransformer_layout(dtype):
    """The ft_keys export's oracle on keys in [N, H·Dh/x, T, x] equals the plain one's on the same
    keys as [N, H, T, Dh]; its key caches are the plain ones in that layout."""
    options = dict(cross_attention="precomputed", dtype=dtype, model_dim=64, num_heads=2, state_outputs="in-place",
                   fused_qkv=True, attention="dmmha", fused_ops=True)
    ft, plain = build_transformer_decoder(**options, ft_keys=True), build_transformer_decoder(**options)
    feeds = _decoder_feeds(plain, "precomputed", [0, 3, 5, 1], 6, [7, 4, 1, 2], 7, seed=3, garbage=True, left=True)
    chunk = 16 // np.dtype(dtype).itemsize
    got = ft.oracle({k: _to_ft_keys(v, chunk) if k.startswith("past-key-") else v for k, v in feeds.items()})
    want = plain.oracle(feeds)
    for name, value in want.items():
        if name.startswith("kv-cache-key-"):  # declared [N, H, T, Dh] as the op makes them
            value = _to_ft_keys(value, chunk).reshape(value.shape)
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert got["kv-cache-key-0"].shape == (4, 2, 6, 32)


def test_ft_keys_need_the_fused_dmmha_export():
    with pytest.raises(ValueError, match="ft_keys needs"):
        build_transformer_decoder(model_dim=64, state_outputs="new", fused_qkv=True, ft_keys=True)


@pytest.mark.parametrize("options", [dict(state_outputs="in-place", attention="dmmha"),
                                     dict(state_outputs="in-place", attention="gqa", fused_ops=True),
                                     dict(state_outputs="new", attention="dmmha", fused_ops=True)])
def test_in_place_state_outputs_go_with_the_fused_dmmha_export_alone(options):
    with pytest.raises(ValueError, match="'in-place' goes with the fused dmmha export"):
        build_transformer_decoder(model_dim=64, fused_qkv=True, **options)


def assert_in_place_caches(ref: ReferenceModel, got: dict, feeds: dict, prefix_length, dtype=np.float32) -> None:
    """The ``IN_PLACE_`` outputs (GroupQueryAttention's present) hold each row's history and then
    the new step at position prefix-length; what lies after is not specified."""
    in_place = {p.key[len("IN_PLACE_"):]: p.value for p in onnx.load_from_string(ref.serialized()).metadata_props
                if p.key.startswith("IN_PLACE_")}
    assert set(in_place) == {name for name in got if name.startswith("kv-cache-")}
    for cache, past in in_place.items():
        new = got[ref.states[past]]
        for row, length in enumerate(prefix_length):
            np.testing.assert_array_equal(got[cache][row, :, :length], feeds[past][row, :, :length])
            np.testing.assert_allclose(got[cache][row, :, length].astype(np.float32), new[row, :, 0].astype(np.float32),
                                       **_tolerance(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("fused_ops", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_gqa_decoder_on_cuda_matches_oracle_in_float16(mode, fused_ops):
    """GroupQueryAttention runs on ONNX Runtime's CUDA provider in float16 only: there too it
    reads each row's own positions and never the (garbage) padding."""
    ref = build_transformer_decoder(cross_attention=mode, state_outputs="new", fused_qkv=True, attention="gqa",
                                    dtype=np.float16, fused_ops=fused_ops)
    for prefix_length, past_time in [([0, 3, 5, 1], 6), ([2, 2], 6)]:
        sizes = [7, 4, 1, 2][: len(prefix_length)]
        feeds = _decoder_feeds(ref, mode, prefix_length, past_time, sizes, 7, seed=past_time, garbage=True,
                               left=True)
        got = _run(ref, feeds, "CUDAExecutionProvider")
        expected = ref.oracle(feeds)
        _assert_outputs_close({k: got[k] for k in expected}, expected, np.float16)
        assert_in_place_caches(ref, got, feeds, prefix_length, np.float16)


@pytest.mark.parametrize("state_outputs, fused_qkv", EXPORTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_decoder_ignores_padding(mode, kv_layout, dtype, state_outputs, fused_qkv):
    ref = build_transformer_decoder(cross_attention=mode, kv_layout=kv_layout, dtype=dtype,
                                    state_outputs=state_outputs, fused_qkv=fused_qkv)
    args = (ref, mode, [2, 0, 6], 6, [5, 8, 1], 8)
    clean_feeds, noisy_feeds = _decoder_feeds(*args, seed=1), _decoder_feeds(*args, seed=1, garbage=True)
    assert np.abs(noisy_feeds["past-key-0"].astype(np.float32) - clean_feeds["past-key-0"]).max() > 1
    clean, noisy = _run(ref, clean_feeds), _run(ref, noisy_feeds)
    np.testing.assert_allclose(noisy["scores"], clean["scores"], atol=1e-6, rtol=0)
    # a valid past position (row 0 has its 2 valid positions last) does change the scores
    key = np.moveaxis(noisy_feeds["past-key-0"], ref.time_axis, 1)
    key[0, -1] += 1.0
    changed = _run(ref, noisy_feeds)
    assert np.abs(changed["scores"][0] - clean["scores"][0]).max() > 1e-3
    np.testing.assert_array_equal(changed["scores"][1:], noisy["scores"][1:])
    if mode is not None:  # and so does a valid encoder position (row 0 has 5)
        if mode == "precomputed":
            noisy_feeds["cross-value-0"][0, :, 4] += 1.0
        else:
            noisy_feeds["encoder-states"][0, 4] += 1.0
        changed_again = _run(ref, noisy_feeds)
        assert np.abs(changed_again["scores"][0] - changed["scores"][0]).max() > 1e-3


def _step_through(ref: ReferenceModel, mode, sequences, starts, utterance_of, encoder: dict, seed=0):
    """Steps the ONNX model over several hypotheses at once, RASR merge layout.

    Hypothesis n feeds sequences[n][p] at global step starts[n] + p. Each step merges the active
    hypotheses' token states right-aligned (left padding filled with garbage, sometimes one
    extra padded column) and splits the new token state off the presents (time index T).
    Returns per hypothesis the scores [len(sequence), V].
    """
    rng = np.random.default_rng(seed)
    history: list[list[dict]] = [[] for _ in sequences]
    scores = [np.zeros((len(s), ref.vocab_size), np.float32) for s in sequences]
    num_steps = max(start + len(s) for start, s in zip(starts, sequences))
    session = ort.InferenceSession(ref.serialized(), providers=["CPUExecutionProvider"])
    for step in range(num_steps):
        active = [n for n, (st, s) in enumerate(zip(starts, sequences)) if st <= step < st + len(s)]
        positions = [step - starts[n] for n in active]
        past_time = max(positions) + step % 2
        feeds = _step_feeds([sequences[n][p] for n, p in zip(active, positions)], positions)
        for name in ref.states:
            token_shape = (ref.num_heads, ref.head_dim) if ref.time_axis == 2 else (ref.hidden_dim,)
            padded = GARBAGE * rng.normal(size=(len(active), past_time, *token_shape))  # time second
            for row, (n, p) in enumerate(zip(active, positions)):
                if p:
                    padded[row, past_time - p:] = np.stack([state[name] for state in history[n]])
            feeds[name] = np.moveaxis(padded, 1, ref.time_axis).astype(ref.dtype)
        for name, value in encoder.items():
            feeds[name] = value[[utterance_of[n] for n in active]]
        got = dict(zip(ref.output_names, session.run(None, feeds)))
        for row, (n, p) in enumerate(zip(active, positions)):
            scores[n][p] = got["scores"][row, 0]
            history[n].append({  # the new token state is the presents' last time index
                name: np.take(got[out][row], got[out].shape[ref.time_axis] - 1, axis=ref.time_axis - 1)
                for name, out in ref.states.items()
            })
    return scores


@pytest.mark.parametrize("state_outputs, fused_qkv", EXPORTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_decoder_steps_match_sequence_log_probs(mode, kv_layout, dtype, state_outputs, fused_qkv):
    ref = build_transformer_decoder(cross_attention=mode, kv_layout=kv_layout, dtype=dtype,
                                    state_outputs=state_outputs, fused_qkv=fused_qkv)
    rng = np.random.default_rng(7)
    sequences = [rng.integers(0, ref.vocab_size, size=n).tolist() for n in (6, 3, 5, 1)]
    starts, utterance_of = [0, 2, 1, 4], [0, 1, 1, 2]
    encoder = _utterance_inputs(ref, mode, [6, 2, 9], 9, rng, garbage=True)
    stepped = _step_through(ref, mode, sequences, starts, utterance_of, encoder)
    atol = 1e-4 if dtype == np.float32 else 5e-2
    for n, tokens in enumerate(sequences):
        u = utterance_of[n]
        expected = ref.sequence_log_probs(tokens, {k: v[u : u + 1] for k, v in encoder.items()} or None)
        assert expected.shape == (len(tokens), ref.vocab_size)
        np.testing.assert_allclose(stepped[n], expected, atol=atol, rtol=0, err_msg=f"hypothesis {n}")


@pytest.mark.parametrize("kv_layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_decoder_names_and_metadata(mode, kv_layout):
    ref = build_transformer_decoder(cross_attention=mode, kv_layout=kv_layout, num_layers=3)
    states = [f"past-{kind}-{i}" for i in range(3) for kind in ("key", "value")]
    cross = [f"cross-{kind}-{i}" for i in range(3) for kind in ("key", "value")]
    utterance = {
        "precomputed": [*cross, "encoder-states-size"],
        "encoder-states": ["encoder-states", "encoder-states-size"],
        None: [],
    }[mode]
    assert ref.input_names == ["token", "token-length", "prefix-length", *states, *utterance]
    assert ref.output_names == ["scores", *(s.replace("past", "present") for s in states)]
    expected = {f"STATE_{s}": s.replace("past", "present") for s in states}
    if mode == "precomputed":
        expected.update({f"UTTERANCE_{name}": name for name in utterance[:-1]})
    assert {p.key: p.value for p in ref.model.metadata_props} == expected
    assert ref.states == {s: s.replace("past", "present") for s in states}
    past = next(i for i in ref.model.graph.input if i.name == "past-key-0")
    dims = [d.dim_param or d.dim_value for d in past.type.tensor_type.shape.dim]
    assert dims == (["batch", 2, "time", 16] if kv_layout == "bhtd" else ["batch", "time", 32])
    assert dims.index("time") == ref.time_axis


@pytest.mark.parametrize("subsampling", [2, 4])
def test_encoder_cross_projections_match_the_decoder(subsampling):
    """encoder(seed) + precomputed decoder(seed) == encoder-states decoder(seed)."""
    encoder = build_encoder(3, subsampling=subsampling)
    enc = _run(encoder, _features([12, 7], 12, seed=2, dtype=np.float32))
    precomputed = build_transformer_decoder(3, cross_attention="precomputed")
    from_states = build_transformer_decoder(3, cross_attention="encoder-states")
    prefix_length = [0, 2]
    feeds = _step_feeds([4, 5], prefix_length)
    feeds.update(_past_states(precomputed, prefix_length, 2, np.random.default_rng(0)))
    feeds["encoder-states-size"] = enc["encoder-states-size"]
    a = _run(precomputed, {**feeds, **{k: v for k, v in enc.items() if k.startswith("cross-")}})
    b = _run(from_states, {**feeds, "encoder-states": enc["encoder-states"]})
    np.testing.assert_allclose(a["scores"], b["scores"], atol=1e-5)
    tokens = [1, 4, 2]
    np.testing.assert_allclose(
        precomputed.sequence_log_probs(
            tokens, {k: v[1:2] for k, v in enc.items() if k != "encoder-states"}),
        from_states.sequence_log_probs(
            tokens, {k: enc[k][1:2] for k in ("encoder-states", "encoder-states-size")}),
        atol=1e-5,
    )
    other = _run(build_transformer_decoder(4, cross_attention="encoder-states"),
                 {**feeds, "encoder-states": enc["encoder-states"]})
    assert np.abs(other["scores"] - b["scores"]).max() > 1e-2


# -- transformer LM (RASR and Hugging Face conventions) ----------------------------------------------


def _hf_feeds(hf: ReferenceModel, rasr_feeds: dict, past_time: int) -> dict:
    mask, positions = hf_attention_inputs(rasr_feeds["prefix-length"], past_time)
    feeds = {
        "input_ids": rasr_feeds["token"].astype(np.int64),
        "attention_mask": mask,
        "position_ids": positions,
    }
    for i in range(hf.num_layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = rasr_feeds[f"past-{kind}-{i}"]
    return feeds


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_lm_matches_oracle_and_rasr(dtype):
    rasr = build_transformer_lm(5, convention="rasr", dtype=dtype)
    hf = build_transformer_lm(5, convention="huggingface", dtype=dtype)
    past_time = 4
    rasr_feeds = _decoder_feeds(rasr, None, [4, 0, 2], past_time, [], 0, seed=3, garbage=True)
    hf_feeds = _hf_feeds(hf, rasr_feeds, past_time)
    got = _run(hf, hf_feeds)
    _assert_outputs_close(got, hf.oracle(hf_feeds), dtype)
    assert got["logits"].shape == (3, 1, hf.vocab_size)
    assert np.abs(np.log(np.exp(got["logits"].astype(np.float64)).sum(-1))).max() > 1e-2  # raw logits
    rasr_got = _run(rasr, rasr_feeds)
    logits = got["logits"].astype(np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(log_probs, rasr_got["scores"], **_tolerance(dtype))
    for i in range(hf.num_layers):
        np.testing.assert_allclose(
            got[f"present.{i}.key"], rasr_got[f"present-key-{i}"], **_tolerance(dtype))
    np.testing.assert_allclose(  # the sequence oracle of the HF model gives log-probabilities too
        hf.sequence_log_probs([3, 1, 2]), rasr.sequence_log_probs([3, 1, 2]), atol=1e-6)


def test_hf_lm_names_and_shapes():
    hf = build_transformer_lm(convention="huggingface", num_layers=2)
    states = {f"past_key_values.{i}.{k}": f"present.{i}.{k}" for i in range(2) for k in ("key", "value")}
    assert hf.input_names == ["input_ids", "attention_mask", "position_ids", *states]
    assert hf.output_names == ["logits", *states.values()]
    assert hf.states == states and hf.time_axis == 2
    assert len(hf.model.metadata_props) == 0
    types = {i.name: i.type.tensor_type.elem_type for i in hf.model.graph.input}
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert types[name] == onnx.TensorProto.INT64, name


def test_rasr_lm_is_the_decoder_without_cross_attention():
    lm = build_transformer_lm(2, convention="rasr", kv_layout="btd")
    decoder = build_transformer_decoder(2, cross_attention=None, kv_layout="btd")
    assert lm.serialized() == decoder.serialized()


# -- LSTM LM --------------------------------------------------------------------------------------------


def _lstm_feeds(ref: ReferenceModel, stacked: bool, tokens, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    num, hid = len(tokens), ref.hidden_dim
    feeds = {"token": np.asarray(tokens, np.int32)[:, None], "token-length": np.ones(num, np.int32)}
    for k in "hc":
        value = rng.normal(size=(ref.num_layers, num, hid)).astype(ref.dtype)
        if stacked:
            feeds[f"lstm-{k}"] = value
        else:
            feeds.update({f"lstm-{k}-{i}": value[i] for i in range(ref.num_layers)})
    return feeds


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stacked", [False, True])
def test_lstm_matches_oracle(stacked, dtype):
    ref = build_lstm_lm(stacked=stacked, dtype=dtype)
    feeds = _lstm_feeds(ref, stacked, [1, 7, 0, 11], seed=0)
    got = _run(ref, feeds)
    _assert_outputs_close(got, ref.oracle(feeds), dtype)
    assert got["scores"].shape == (4, 1, 12)
    names = ["lstm-h", "lstm-c"] if stacked else [f"lstm-{k}-{i}" for i in range(2) for k in "hc"]
    assert ref.states == {n: f"new-{n}" for n in names}
    metadata = {p.key: p.value for p in ref.model.metadata_props}
    assert metadata == {f"STATE_{n}": f"new-{n}" for n in names}


def test_lstm_stacked_equals_unstacked():
    flat, stacked = build_lstm_lm(1), build_lstm_lm(1, stacked=True)
    stacked_feeds = _lstm_feeds(stacked, True, [3, 4], seed=1)
    flat_feeds = {k: v for k, v in stacked_feeds.items() if not k.startswith("lstm")}
    for k in "hc":
        flat_feeds.update({f"lstm-{k}-{i}": stacked_feeds[f"lstm-{k}"][i] for i in range(2)})
    a, b = _run(flat, flat_feeds), _run(stacked, stacked_feeds)
    np.testing.assert_array_equal(a["scores"], b["scores"])
    np.testing.assert_array_equal(np.stack([a["new-lstm-c-0"], a["new-lstm-c-1"]]), b["new-lstm-c"])


@pytest.mark.parametrize("stacked", [False, True])
def test_lstm_steps_match_sequence_log_probs(stacked):
    ref = build_lstm_lm(stacked=stacked)
    sequences = [[1, 5, 2, 9], [3, 3, 0, 11]]
    session = ort.InferenceSession(ref.serialized(), providers=["CPUExecutionProvider"])
    feeds = _lstm_feeds(ref, stacked, [0, 0], seed=0)
    feeds.update({name: np.zeros_like(feeds[name]) for name in ref.states})  # initial state
    for p in range(4):
        feeds["token"] = np.array([[s[p]] for s in sequences], np.int32)
        got = dict(zip(ref.output_names, session.run(None, feeds)))
        feeds.update({name: got[out] for name, out in ref.states.items()})
        for n, tokens in enumerate(sequences):
            np.testing.assert_allclose(got["scores"][n, 0], ref.sequence_log_probs(tokens)[p], atol=1e-5)


# -- all models ----------------------------------------------------------------------------------------

BUILDERS = {
    "encoder": lambda seed: build_encoder(seed),
    "encoder-fp16-s4": lambda seed: build_encoder(seed, subsampling=4, dtype=np.float16),
    "decoder-precomputed": lambda seed: build_transformer_decoder(seed),
    "decoder-encoder-states-btd": lambda seed: build_transformer_decoder(
        seed, cross_attention="encoder-states", kv_layout="btd"),
    "decoder-lm-fp16": lambda seed: build_transformer_decoder(
        seed, cross_attention=None, dtype=np.float16),
    "lm-huggingface": lambda seed: build_transformer_lm(seed, convention="huggingface"),
    "lstm": lambda seed: build_lstm_lm(seed),
    "lstm-stacked": lambda seed: build_lstm_lm(seed, stacked=True),
}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_models_are_valid_and_deterministic(name):
    ref = BUILDERS[name](0)
    onnx.checker.check_model(ref.model, full_check=True)
    assert ref.model.ir_version == 9
    assert [(o.domain, o.version) for o in ref.model.opset_import] == [("", 17)]
    assert BUILDERS[name](0).serialized() == ref.serialized()
    assert BUILDERS[name](1).serialized() != ref.serialized()


@pytest.mark.parametrize(
    "build",
    [
        lambda: build_transformer_decoder(cross_attention="encoder"),
        lambda: build_transformer_decoder(kv_layout="tbd"),
        lambda: build_transformer_decoder(model_dim=30, num_heads=4),
        lambda: build_transformer_lm(convention="fairseq"),
        lambda: build_transformer_lm(convention="huggingface", kv_layout="btd"),
    ],
)
def test_bad_options_raise(build):
    with pytest.raises(ValueError):
        build()


def test_write_examples(tmp_path):
    paths = write_examples(tmp_path)
    assert sorted(p.name for p in paths) == sorted([
        "ctc-encoder.onnx", "decoder.onnx", "encoder.onnx", "lstm-lm.onnx", "prefix-lm-prefill.onnx",
        "prefix-lm-step.onnx", "transducer-encoder.onnx", "transducer-joint.onnx", "transducer-prediction.onnx"])
    for path in paths:
        assert path.stat().st_size < 200_000
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        shipped = EXAMPLES / path.name
        assert shipped.read_bytes() == path.read_bytes(), f"{shipped} is stale: rerun write_examples"
    decoder = onnx.load(str(tmp_path / "decoder.onnx"))
    assert {p.key for p in decoder.metadata_props} >= {"STATE_past-key-0", "UTTERANCE_cross-key-0"}
