"""The YAML config schema: the example loads, errors name key paths and list valid keys or
choices, overrides, relative paths, the resolved dump, path checks."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from gpudecode import defaults
from gpudecode.config import (
    Config,
    ConfigError,
    apply_overrides,
    check_paths,
    dump_resolved,
    load_config,
    validate_config,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "configs" / "random-aed.yaml"

MINIMAL = {"models": {"vocabulary": {"path": "vocab.txt"}}}


def _write(tmp_path, data, name="config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def _error(data, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(apply_overrides(data, overrides), "/cfg")
    return str(info.value)


def test_example_config_loads():
    config = load_config(EXAMPLE)
    assert config.search.type == "label-sync"
    assert config.models.encoder.path == REPO / "examples" / "models" / "encoder.onnx"
    assert config.scorers[0].model == REPO / "examples" / "models" / "decoder.onnx"
    assert config.scorers[0].state_manager.type == "transformer"
    assert config.models.front_end.num_mel_bins == config.io.features.num_features


def test_defaults_come_from_the_defaults_module():
    config = validate_config(MINIMAL, "/cfg")
    assert config.search.beam_size == defaults.BEAM_SIZE
    assert config.runtime.cudnn_conv_algo_search == defaults.CUDNN_CONV_ALGO_SEARCH
    assert config.io.formats == defaults.OUTPUT_FORMATS
    assert config.models.front_end.num_mel_bins == defaults.NUM_MEL_BINS
    assert config.io.output == Path("/cfg") / defaults.OUTPUT_FOLDER


def test_sections_are_frozen():
    config = validate_config(MINIMAL, "/cfg")
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.search.beam_size = 3


def test_unknown_key_lists_valid_keys():
    message = _error(MINIMAL, ["search.beam=4"])
    assert "search.beam: unknown key (did you mean 'beam_size'?)" in message
    assert "valid keys in search: type, beam_size, nbest," in message
    assert "max_symbols_per_frame" in message
    message = _error(MINIMAL, ["scorers=[{type: ctc-prefix}, {type: onnx-decoder, "
                               "state_manager: {kind: lstm}}]"])
    assert message.startswith("config: scorers[1].state_manager.kind: unknown key;")
    assert "valid keys in scorers[1].state_manager: type, max_history," in message
    assert "valid keys in the top level: runtime, models, scorers, search, io" in _error(
        {**MINIMAL, "decoding": {}})


def test_bad_choice_lists_choices():
    assert ("scorers[1].state_manager.type: invalid choice 'transformer-gpu'; valid choices: "
            "transformer, transformer-cpu, transformer-cuda, transformer-16bit, "
            "transformer-8bit, lstm, lstm-cpu, lstm-cuda") in _error(
        MINIMAL, ["scorers=[{type: ctc-prefix}, {type: onnx-decoder, "
                  "state_manager: {type: transformer-gpu}}]"])
    assert "runtime.device: invalid choice 'gpu'; valid choices: cpu, cuda" in _error(
        MINIMAL, ["runtime.device=gpu"])
    assert "io.formats[1]: invalid choice 'xml'; valid choices: text, jsonl, ctm" in _error(
        MINIMAL, ["io.formats=[text, xml]"])
    message = _error(MINIMAL, ["scorers=[{type: ctc-prefx}]"])
    assert "scorers[0].type: invalid choice 'ctc-prefx' (did you mean 'ctc-prefix'?)" in message
    assert "or a custom scorer as 'module:Class'" in message


def test_search_tuning_keys_make_the_searches_tuning():
    from gpudecode.backend import HostWait
    from gpudecode.search.tuning import DEFAULT_TUNING, SearchTuning

    assert validate_config(MINIMAL).search.tuning.to_options() == DEFAULT_TUNING
    config = validate_config(apply_overrides(MINIMAL, ["search.tuning.host_wait=spin", "search.tuning.stop_test_lag=3",
                                                       "search.tuning.fused_label_step=false",
                                                       "search.tuning.lagged_stop_test=true"]))
    assert config.search.tuning.to_options() == SearchTuning(
        stop_test_lag=3, fused_label_step=False, lagged_stop_test=True, host_wait=HostWait("spin"))
    assert "search.tuning.host_wait_nap_s: host_wait_nap_s (0.01) exceeds host_wait_max_nap_s (0.001)" in _error(
        MINIMAL, ["search.tuning.host_wait_nap_s=0.01"])
    assert "search.tuning.host_wait: invalid choice 'doze'" in _error(MINIMAL, ["search.tuning.host_wait=doze"])


def test_cpu_keys_reach_the_options():
    from gpudecode.search.tuning import SearchTuning

    config = validate_config(apply_overrides(MINIMAL, [
        "search.tuning.compiled_cpu_loops=false", "search.tuning.cpu_threads=3",
        "scorers=[{type: onnx-decoder, model: x.onnx, state_manager: {cpu_in_place: false}}]"]))
    assert config.search.tuning.to_options() == SearchTuning(compiled_cpu_loops=False, cpu_threads=3)
    assert config.scorers[0].state_manager.to_options().cpu_in_place is False
    default = validate_config(apply_overrides(MINIMAL, ["scorers=[{type: onnx-decoder, model: x.onnx, state_manager: {}}]"]))
    assert default.scorers[0].state_manager.to_options().cpu_in_place is True
    assert default.search.tuning.to_options().compiled_cpu_loops is True


@pytest.mark.parametrize("override, key", [
    ("search.tuning.cpu_threads=0", "search.tuning.cpu_threads: input should be greater than 0"),
    ("search.tuning.cpu_threads=true", "search.tuning.cpu_threads: input should be a valid integer"),
    ("search.tuning.cpu_threads=1.5", "search.tuning.cpu_threads: input should be a valid integer"),
    ("search.tuning.stop_test_lag=yes", "search.tuning.stop_test_lag: input should be a valid integer"),
    ("search.tuning.compiled_cpu_loops=maybe", "search.tuning.compiled_cpu_loops: input should be a valid boolean"),
    ("scorers=[{type: onnx-decoder, model: x.onnx, state_manager: {cpu_in_place: maybe}}]",
     "scorers[0].state_manager.cpu_in_place: input should be a valid boolean"),
])
def test_bad_cpu_key_values_name_the_key(override, key):
    assert key in _error(MINIMAL, [override])


def test_search_types_are_not_scorer_types():
    """``ctc`` and ``transducer`` are searches (``search.type``), not label scorers."""
    for name in ("ctc", "transducer"):
        assert f"scorers[0].type: invalid choice {name!r}" in _error(MINIMAL, [f"scorers=[{{type: {name}}}]"])


def test_wrong_types_and_values_name_the_key():
    assert "search.beam_size: input should be a valid integer" in _error(
        MINIMAL, ["search.beam_size=four"])
    assert "search.beam_size: input should be greater than 0 (got 0)" in _error(
        MINIMAL, ["search.beam_size=0"])
    assert "models.vocabulary.path: required key is missing" in _error(
        {"models": {"vocabulary": {}}})
    assert "models.vocabulary.blank: expected a label string or an index" in _error(
        MINIMAL, ["models.vocabulary.blank=true"])
    assert "scorers[0].model.step: expected a path (got 3)" in _error(
        MINIMAL, ["scorers=[{type: ctc-prefix, model: {step: 3}}]"])
    assert "search.nbest: nbest (9) exceeds beam_size (8)" in _error(
        MINIMAL, ["search.nbest=9"])
    assert "scorers[1].name: duplicate scorer name 'ctc-prefix'" in _error(
        MINIMAL, ["scorers=[{type: ctc-prefix}, {type: ctc-prefix}]"])
    assert "models.front_end.stats_file: normalisation 'global' needs stats_file" in _error(
        MINIMAL, ["models.front_end.normalisation=global"])


def test_several_errors_are_reported_together():
    with pytest.raises(ConfigError) as info:
        validate_config(apply_overrides(MINIMAL, ["search.beam_size=0", "runtime.tf33=1"]),
                        "/cfg")
    assert [key for key, _ in info.value.errors] == ["runtime.tf33", "search.beam_size"]


def test_empty_mel_filter_is_a_config_error():
    message = _error(MINIMAL, ["models.front_end={sample_rate_hz: 8000, window_ms: 16, "
                               "fft_size: 128, num_mel_bins: 80}"])
    assert "models.front_end: mel filter 0 of 80" in message and "num_mel_bins" in message
    ok = validate_config(apply_overrides(MINIMAL, [
        "models.front_end={sample_rate_hz: 8000, fft_size: 256, num_mel_bins: 40, "
        "low_freq_hz: 20}"]), "/cfg")
    assert ok.models.front_end.frame_shift_s == pytest.approx(0.01)


def test_special_labels_by_label_or_index():
    config = validate_config(apply_overrides(MINIMAL, [
        "models.vocabulary.blank=0", "models.vocabulary.sentence_end='0'",
        "models.vocabulary.unknown=<unk>"]), "/cfg")
    vocabulary = config.models.vocabulary
    assert (vocabulary.blank, vocabulary.sentence_end, vocabulary.unknown) == (0, "0", "<unk>")


def test_overrides(tmp_path):
    data = {**MINIMAL, "scorers": [{"type": "onnx-decoder", "scale": 1.0},
                                   {"type": "recurrent-lm", "scale": 0.3}]}
    path = _write(tmp_path, data)
    config = load_config(path, ["search.beam_size=3", "scorers.1.scale=0.5",
                                "scorers[0].state_manager.max_history=16",
                                "io.formats=[text, ctm]", "io.features.path=feats.npz",
                                "runtime.ort_arena_limit_bytes=1000000"])
    assert config.search.beam_size == 3
    assert [s.scale for s in config.scorers] == [1.0, 0.5]
    assert config.scorers[0].state_manager.max_history == 16
    assert config.io.formats == ("text", "ctm")
    assert config.io.features.path == tmp_path / "feats.npz"
    assert config.runtime.ort_arena_limit_bytes == 1_000_000
    assert yaml.safe_load(path.read_text()) == data  # the file itself is untouched


@pytest.mark.parametrize("override,match", [
    ("search.beam_size", r"override 'search.beam_size': expected key.path=value"),
    ("scorers.5.scale=1", r"index 5 is out of range: scorers has 2 entries"),
    ("scorers.x.scale=1", r"scorers is a list; expected an index, got 'x'"),
    ("search.beam_size.x=1", r"search.beam_size is 8, not a section or list"),
    ("search..beam_size=1", r"the key has an empty part"),
    ("search.beam_size=[1", r"the value is not valid YAML"),
])
def test_bad_overrides(override, match):
    data = {**MINIMAL, "search": {"beam_size": 8}, "scorers": [{"type": "a:B"}, {"type": "c:D"}]}
    with pytest.raises(ConfigError, match=match):
        apply_overrides(data, [override])


def test_relative_paths_resolve_against_the_config_folder(tmp_path, monkeypatch):
    folder = tmp_path / "exp" / "conf"
    folder.mkdir(parents=True)
    _write(folder, {"models": {"vocabulary": {"path": "../data/vocab.txt"},
                               "encoder": {"path": "/abs/enc.onnx"}},
                    "scorers": [{"type": "onnx-decoder", "model": ["a.onnx", "~/b.onnx"]}],
                    "io": {"output": "out", "references": "ref.txt"}})
    monkeypatch.chdir(tmp_path)
    config = load_config(Path("exp/conf/config.yaml"))
    assert config.models.vocabulary.path == tmp_path / "exp" / "data" / "vocab.txt"
    assert config.models.encoder.path == Path("/abs/enc.onnx")
    assert config.scorers[0].model == (folder / "a.onnx", Path.home() / "b.onnx")
    assert config.io.output == folder / "out"
    assert config.io.references == folder / "ref.txt"


def test_resolved_dump_round_trip(tmp_path):
    config = load_config(EXAMPLE, ["search.beam_size=2", "scorers.0.options={alpha: 1}"])
    dumped = dump_resolved(config, tmp_path / "out" / defaults.RESOLVED_CONFIG_FILE)
    text = dumped.read_text()
    assert "max_symbols_per_frame: 10" in text  # defaults are written out
    assert str(REPO / "examples" / "models" / "decoder.onnx") in text  # absolute paths
    again = load_config(dumped)
    assert again == config
    assert again.scorers[0].options == {"alpha": 1}


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.yaml: config file does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = _write(tmp_path, "search:\n  beam_size: [1\n", "bad.yaml")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML \(line \d+, column \d+\)"):
        load_config(bad)
    listed = _write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(ConfigError, match=r"list\.yaml: \(top level\): expected a mapping"):
        load_config(listed)
    wrong = _write(tmp_path, {**MINIMAL, "search": {"type": "viterbi"}}, "wrong.yaml")
    with pytest.raises(ConfigError, match=r"wrong\.yaml \(with -o overrides\): search\.type: "
                                          r"invalid choice 'viterbi'"):
        load_config(wrong, ["search.beam_size=2"])


def test_check_paths_lists_every_missing_input(tmp_path):
    (tmp_path / "vocab.txt").write_text("a\n")
    path = _write(tmp_path, {**MINIMAL, "models": {**MINIMAL["models"],
                                                  "encoder": {"path": "enc.onnx"}},
                             "scorers": [{"type": "prefix-lm", "model": {"step": "step.onnx"}}],
                             "io": {"output": "not-yet", "features": {"path": "feats"}}})
    config = load_config(path)
    with pytest.raises(ConfigError) as info:
        check_paths(config, source=str(path))
    assert [key for key, _ in info.value.errors] == [
        "models.encoder.path", "scorers[0].model.step", "io.features.path"]
    assert f"does not exist: {tmp_path / 'enc.onnx'}" in str(info.value)
    for name in ("enc.onnx", "step.onnx"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "feats").mkdir()
    check_paths(config)  # the output folder need not exist


def test_config_is_a_plain_pydantic_model():
    assert issubclass(ConfigError, ValueError)
    schema = Config.model_json_schema()
    assert set(schema["properties"]) == {"runtime", "models", "scorers", "search", "io"}


def test_override_appends_to_a_list_at_its_length():
    data = apply_overrides({"scorers": [{"type": "ctc"}]}, ["scorers.1={type: a:B}",
                                                             "scorers.1.scale=2"])
    assert data["scorers"] == [{"type": "ctc"}, {"type": "a:B", "scale": 2}]


@pytest.mark.parametrize(
    "state_manager, message",
    [
        ({"type": "lstm", "max_history": 3},
         "scorers[0].state_manager.max_history: 'lstm' keeps one state per hypothesis"),
        ({"always_include_first_token_state": True},
         "scorers[0].state_manager.always_include_first_token_state: needs max_history"),
        ({"state_compression": "fixed-quantisation"},
         "scorers[0].state_manager.state_compression_scale: fixed-quantisation needs a positive scale"),
        ({"type": "transformer-cuda"}, "scorers[0].state_manager.type: 'transformer-cuda' needs CUDA"),
    ],
)
def test_state_manager_options_are_checked_at_config_load(no_gpu, state_manager, message):
    data = {"models": {}, "scorers": [{"type": "onnx-decoder", "model": "x.onnx", "state_manager": state_manager}]}
    with pytest.raises(ConfigError) as error:
        validate_config(data)
    assert message in str(error.value)


def test_state_manager_config_converts_to_typed_options():
    config = validate_config({"models": {"vocabulary": {"path": "v.txt"}}, "scorers": [{"type": "onnx-decoder", "model": "x.onnx",
                              "state_manager": {"type": "transformer-cpu", "max_history": 0}}]})
    options = config.scorers[0].state_manager.to_options()
    assert (options.type, options.max_history) == ("transformer-cpu", 0)


def test_batch_size_defaults_by_device_and_an_explicit_one_wins():
    assert validate_config(MINIMAL, "/cfg").batch_size == defaults.SEARCH_BATCH_SIZE == 16
    cuda = apply_overrides(MINIMAL, ["runtime.device=cuda"])
    assert validate_config(cuda, "/cfg").batch_size == defaults.SEARCH_BATCH_SIZE_CUDA == 1024
    assert validate_config(apply_overrides(cuda, ["search.batch_size=7"]), "/cfg").batch_size == 7
    assert "search.batch_size" in _error(MINIMAL, ["search.batch_size=0"])


def test_batch_sizing_bounds_frames_on_cuda_and_starts_small_only_by_default():
    from gpudecode.io import BatchSizing

    assert validate_config(MINIMAL, "/cfg").batch_sizing == BatchSizing(16)
    cuda = apply_overrides(MINIMAL, ["runtime.device=cuda"])
    assert validate_config(cuda, "/cfg").batch_sizing == BatchSizing(
        defaults.SEARCH_BATCH_SIZE_CUDA, defaults.SEARCH_BATCH_FRAMES_CUDA, defaults.SEARCH_FIRST_BATCH_SIZE_CUDA)
    assert validate_config(apply_overrides(cuda, ["search.batch_size=7"]), "/cfg").batch_sizing == BatchSizing(
        7, defaults.SEARCH_BATCH_FRAMES_CUDA)
    assert validate_config(apply_overrides(MINIMAL, ["search.batch_frames=500"]), "/cfg").batch_sizing == \
        BatchSizing(16, 500)
    assert "search.batch_frames" in _error(MINIMAL, ["search.batch_frames=0"])


def test_cuda_graphs_auto_is_on_with_cuda_only_and_true_needs_cuda():
    config = validate_config(MINIMAL, "/cfg")
    assert config.runtime.cuda_graphs.enabled == defaults.CUDA_GRAPHS == "auto"
    graphs = config.runtime.cuda_graphs
    assert graphs.to_options(device="cuda").enabled is True and graphs.to_options(device="cpu").enabled is False
    assert graphs.to_options(False, device="cuda").enabled is False  # a scorer's own switch wins
    for value in ("true", "false", "auto"):
        on_cuda = validate_config(apply_overrides(MINIMAL, ["runtime.device=cuda", f"runtime.cuda_graphs={value}"]),
                                  "/cfg").runtime.cuda_graphs.to_options(device="cuda").enabled
        assert on_cuda is (value != "false")
    assert "CUDA graphs need runtime.device cuda" in _error(MINIMAL, ["runtime.cuda_graphs=true"])
    assert validate_config(apply_overrides(MINIMAL, ["runtime.cuda_graphs=auto"]), "/cfg")  # auto on the CPU: off


def test_shipped_configs_carry_no_batch_size():
    """Batching is a performance key: the bundled configs leave it to the device's default."""
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert load_config(path).search.batch_size is None, path.name


def test_token_min_logp_reaches_the_ctc_prefix_options():
    from gpudecode.search.builtin import _ctc_prefix_options
    from gpudecode.search.registry import SearchSetup

    config = validate_config(apply_overrides(MINIMAL, ["search.type=ctc-prefix", "search.token_min_logp=-5"]), "/cfg")
    assert config.search.token_min_logp == -5.0
    assert "search.token_min_logp" in _error(MINIMAL, ["search.token_min_logp=1"])
    assert validate_config(MINIMAL, "/cfg").search.token_min_logp is None
    options = _ctc_prefix_options(SearchSetup(config=config.search, blank=0))
    assert options.token_min_logp == -5.0 and options.score_threshold is None
