"""Discovery of conventions and state variables, and every load-time validation error."""

import numpy as np
import pytest

from gpudecode.session import ModelError, OnnxSession, discover_encoder, discover_step_model, from_onnx_model
from tests.onnx_builders import interface_model, rasr_step_interface


def discover(model, **kwargs):
    return discover_step_model(from_onnx_model(model, "dec.onnx"), **kwargs)


def test_rasr_interface_is_recognised():
    spec = discover(rasr_step_interface())
    assert spec.convention == "rasr"
    assert spec.hypothesis_inputs == {"token": "token", "token-length": "token-length", "prefix-length": "prefix-length"}
    assert [(v.input_name, v.output_name, v.batch_axis, v.time_axis) for v in spec.state_variables] == [
        ("past-key-0", "present-key-0", 0, 2), ("past-value-0", "present-value-0", 0, 2)]
    assert spec.state_variables[0].token_shape == (2, 4)
    assert [(u.name, u.source) for u in spec.utterance_inputs] == [("cross-key-0", "cross-key-0"), ("encoder-states-size", None)]
    assert spec.vocab_size == 12


def test_state_pattern_from_config_and_lstm_without_time_axis():
    model = rasr_step_interface(
        inputs={"past-key-0": None, "past-value-0": None, "cross-key-0": None, "encoder-states-size": None,
                "h": (np.float32, [2, "batch", 8])},
        outputs={"present-key-0": None, "present-value-0": None, "h_out": (np.float32, [2, "batch", 8])},
        metadata={"STATE_past-key-0": None, "STATE_past-value-0": None, "UTTERANCE_cross-key-0": None},
    )
    spec = discover(model, state_patterns=[(r"h", "h_out")])
    (var,) = spec.state_variables
    assert (var.input_name, var.output_name, var.batch_axis, var.time_axis, var.token_shape) == ("h", "h_out", 1, None, (2, 8))


def test_io_map_renames_logical_inputs():
    model = rasr_step_interface(inputs={"token": None, "labels": (np.int64, ["batch", 1])})
    spec = discover(model, io_map={"token": "labels"})
    assert spec.hypothesis_inputs["token"] == "labels"


def test_huggingface_interface_is_recognised():
    model = interface_model(
        [("input_ids", np.int64, ["batch", 1]), ("attention_mask", np.int64, ["batch", "total"]),
         ("position_ids", np.int64, ["batch", 1]),
         ("past_key_values.0.key", np.float32, ["batch", 2, "past", 4]),
         ("past_key_values.0.value", np.float32, ["batch", 2, "past", 4])],
        [("logits", np.float32, ["batch", 1, 10]), ("present.0.key", np.float32, ["batch", 2, "t", 4]),
         ("present.0.value", np.float32, ["batch", 2, "t", 4])],
    )
    spec = discover(model)
    assert spec.convention == "huggingface"
    assert spec.scores_output == "logits"
    assert [(v.input_name, v.output_name, v.time_axis) for v in spec.state_variables] == [
        ("past_key_values.0.key", "present.0.key", 2), ("past_key_values.0.value", "present.0.value", 2)]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(inputs={"token": None}), r"dec\.onnx: no label input: expected 'token' .* or 'input_ids'"),
        (dict(inputs={"prefix-length": None}), r"dec\.onnx: no input 'prefix-length'"),
        (dict(outputs={"scores": None}), r"dec\.onnx: no output 'scores'"),
        (dict(inputs={"token": (np.float32, ["batch", 1])}), r"label input 'token': expected dtype int32 or int64, got float32"),
        (dict(inputs={"token": (np.int32, ["batch"])}), r"label input 'token': expected rank 2, got rank 1"),
        (dict(inputs={"prefix-length": (np.int32, ["batch", 1])}), r"input 'prefix-length': expected rank 1, got rank 2"),
        (dict(outputs={"scores": (np.int32, ["batch", 12])}), r"score output 'scores': expected dtype float32"),
        (dict(outputs={"present-value-0": None}), r"state input 'past-value-0' has no output 'present-value-0'"),
        (dict(outputs={"present-key-0": (np.float16, ["batch", 2, "t", 4])}),
         r"state output 'present-key-0': expected dtype float32 \(as input 'past-key-0'\), got float16"),
        (dict(outputs={"present-key-0": (np.float32, ["batch", 2, 4])}),
         r"state output 'present-key-0': expected rank 4 \(as input 'past-key-0'\), got rank 3"),
        (dict(inputs={"past-key-0": (np.float32, ["batch", "heads", "time", 4])}),
         r"state input 'past-key-0' .*expected at most one dynamic axis"),
        (dict(metadata={"STATE_ghost": "present-ghost"}), r"state variable 'ghost' -> 'present-ghost' names no input"),
        (dict(inputs={"mystery": (np.float32, ["batch", 3])}), r"input 'mystery' float32\[batch,3\] is provided by nothing"),
        (dict(inputs={"encoder-states-size": None}), r"per-utterance inputs \['cross-key-0'\] come without 'encoder-states-size'"),
    ],
)
def test_validation_errors_name_model_tensor_and_expectation(changes, message):
    with pytest.raises(ModelError, match=message):
        discover(rasr_step_interface(**changes))


def test_vocabulary_size_mismatch():
    with pytest.raises(ModelError, match=r"score output 'scores' float32\[batch,1,12\]: expected vocabulary size 30 .*got 12"):
        discover(rasr_step_interface(), vocab_size=30)
    assert discover(rasr_step_interface(), vocab_size=12).vocab_size == 12


def test_validation_through_a_loaded_session(tmp_path):
    path = tmp_path / "dec.onnx"
    path.write_bytes(rasr_step_interface(outputs={"present-value-0": None}).SerializeToString())
    session = OnnxSession(path)
    with pytest.raises(ModelError, match=r"dec\.onnx: state input 'past-value-0' has no output"):
        discover_step_model(session.tensors)


def test_encoder_validation():
    good = interface_model(
        [("features", np.float32, ["U", "T", 16]), ("features-size", np.int32, ["U"])],
        [("encoder-states", np.float32, ["U", "S", 32]), ("encoder-states-size", np.int32, ["U"]),
         ("cross-key-0", np.float32, ["U", 2, "S", 16])],
    )
    spec = discover_encoder(from_onnx_model(good, "enc.onnx"))
    assert spec.num_features == 16 and spec.extra_outputs == ("cross-key-0",)
    bad = interface_model(
        [("features", np.float32, ["U", "T", 16]), ("features-size", np.float32, ["U"])],
        [("encoder-states", np.float32, ["U", "S", 32]), ("encoder-states-size", np.int32, ["U"])],
    )
    with pytest.raises(ModelError, match=r"enc\.onnx: input 'features-size': expected dtype int32 or int64, got float32"):
        discover_encoder(from_onnx_model(bad, "enc.onnx"))


def test_in_place_outputs_are_recognised_and_checked():
    import onnx

    from gpudecode.testing import build_transformer_decoder

    model = onnx.load_from_string(build_transformer_decoder(cross_attention=None, state_outputs="new", fused_qkv=True,
                                                            attention="gqa").serialized())
    spec = discover(model)
    assert spec.history_alignment == "left"
    assert spec.in_place_outputs == {f"kv-cache-{k}-{i}": f"past-{k}-{i}" for i in range(2) for k in ("key", "value")}

    def with_metadata(**changes):
        changed = onnx.ModelProto()
        changed.CopyFrom(model)
        props = {p.key: p.value for p in changed.metadata_props} | changes
        del changed.metadata_props[:]
        onnx.helper.set_model_props(changed, props)
        return changed

    for changes, message in [({"IN_PLACE_kv-cache-nothing": "past-key-0"}, "no output 'kv-cache-nothing'"),
                             ({"IN_PLACE_kv-cache-key-0": "token"}, "not a state input"),
                             ({"IN_PLACE_scores": "past-key-0"}, "cannot share the buffer"),
                             ({"HISTORY_ALIGNMENT": "right"}, "needs HISTORY_ALIGNMENT=left")]:
        with pytest.raises(ModelError, match=message) as error:
            discover(with_metadata(**changes))
        assert "dec.onnx" in str(error.value)
