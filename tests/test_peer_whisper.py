"""Parity with transformers' Whisper ``generate`` on a real Optimum export of a tiny Whisper.

The fixture ``tests/fixtures/peers/whisper/`` (made by ``tools/peer-fixtures/whisper.py``: a random-
initialised Whisper exported by ``optimum-cli export onnx --task automatic-speech-recognition-with-past
--no-post-process``, Hugging Face's ``WhisperFeatureExtractor`` features of the three bundled
recordings in ``examples/whisper/``, and Whisper ``generate``'s outputs on them) is the oracle in
CI. Under ``-m peers`` the same tests run against the peer live: the features from
``WhisperFeatureExtractor`` and the outputs from ``generate`` on the model built again from the seed,
with the transformers the fixture was made with (4.57, which optimum-onnx 0.1.0 needs:
``PYTHONPATH=/path/to/transformers-4.57``).

Both forms Optimum writes are decoded: the pair ``decoder_model`` (prefill) + ``decoder_with_past_model``
(step), and ``decoder_model_merged`` alone, its own prompt run (``use_cache_branch``).

Checked: the ``whisper`` front end against the feature extractor (1e-4); the encoder layout found
for ``input_features`` [N, 80, 3000]; greedy and beam 4 (``search.finished: separate``, transformers'
beam rules) with the forced prompt and the suppressed tokens — tokens equal, scores within 1e-4
(greedy: the sum of the tokens' log-probabilities; beam: ``sequences_scores``); the same with
continuous batching (histories of different lengths in one step, fed to a decoder without
``attention_mask`` one length at a time); the bundled config decoding the bundled wav files.
"""

from __future__ import annotations

import importlib.util
import json
import wave
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpudecode.cli import main as cli_main
from gpudecode.decoder import Decoder
from gpudecode.io.whisper_frontend import WhisperFrontEnd
from gpudecode.scorers.suppress_tokens import SuppressTokensScorer
from gpudecode.scorers.base import LaneLayout
from gpudecode.session import EncoderLayout, ModelError, OnnxSession, discover_encoder, discover_step_model

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "peers" / "whisper"
AUDIO = ROOT / "examples" / "whisper"
CONFIG = ROOT / "configs" / "whisper-optimum.yaml"
DOCUMENT = json.loads((FIXTURE / "expected.json").read_text())
EOS = DOCUMENT["eos"]
IDS = sorted(DOCUMENT["cases"]["greedy"])
TOL = 1e-4


@pytest.fixture(scope="module", params=["fixture", pytest.param("live", marks=pytest.mark.peers)])
def live(request):
    """None: the committed fixture is the oracle; ``live`` (the ``peers`` marker): the fixture
    script's module, to run the peer itself."""
    if request.param == "fixture":
        return None
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("whisper_fixture", ROOT / "tools" / "peer-fixtures" / "whisper.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def samples(name: str) -> np.ndarray:
    with wave.open(str(AUDIO / f"{name}.wav")) as f:
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype=np.int16)
    return pcm.astype(np.float32) / 32768.0


def hf_features(live) -> dict[str, np.ndarray]:
    """[80, 3000] per recording: the fixture's, or the feature extractor's live."""
    if live is None:
        with np.load(FIXTURE / "features.npz") as stored:
            return {name: stored[name] for name in IDS}
    return {name: live.features(samples(name)) for name in IDS}


_LIVE: dict = {}


def expected(live, case: str) -> dict[str, dict]:
    if live is None:
        return DOCUMENT["cases"][case]
    if case in _LIVE:
        return _LIVE[case]
    whisper = _LIVE.setdefault("model", live.model())
    features = hf_features(live)
    got = _LIVE[case] = {name: live.generate(whisper, features[name], case) for name in IDS}
    for name in IDS:  # the fixture is what the peer gives
        assert got[name]["tokens"] == DOCUMENT["cases"][case][name]["tokens"]
    return got


def test_front_end_equals_whisper_feature_extractor(live):
    front_end = WhisperFrontEnd()
    for name, reference in hf_features(live).items():
        ours = front_end(samples(name))
        assert ours.shape == (3000, 80) and reference.shape == (80, 3000)
        assert np.abs(ours - reference.T).max() < TOL, name


def test_front_end_pads_and_cuts_to_30_s():
    front_end = WhisperFrontEnd()
    short = np.sin(np.arange(8000) / 10.0).astype(np.float32)
    long = np.concatenate([short, np.zeros(16000 * 40, np.float32)])
    assert front_end(short).shape == front_end(long).shape == (3000, 80)
    assert np.array_equal(front_end(short), front_end(long[:16000 * 30]))


def test_encoder_layout_of_optimum_whisper():
    tensors = OnnxSession(FIXTURE / "encoder_model.onnx").tensors
    spec = discover_encoder(tensors)
    assert spec.layout == EncoderLayout(channels_first=True, fixed_frames=3000, lengths="none")
    assert spec.names == {"features": "input_features", "encoder-states": "last_hidden_state"}
    assert spec.num_features == 80 and not spec.has_lengths
    with pytest.raises(ModelError, match="fixed_frames is 2000, the model's time axis 2 is 3000"):
        discover_encoder(tensors, layout=EncoderLayout(channels_first=True, fixed_frames=2000, lengths="none"))
    with pytest.raises(ModelError, match="needs fixed_frames"):
        discover_encoder(tensors, layout=EncoderLayout(channels_first=True, lengths="none"))
    with pytest.raises(ModelError, match="no input 'features-size'"):
        discover_encoder(tensors, layout=EncoderLayout(channels_first=True))


def test_unmasked_cross_attention_needs_a_fixed_length_encoder():
    tensors = OnnxSession(FIXTURE / "decoder_with_past_model.onnx").tensors
    with pytest.raises(ModelError, match="padded encoder frames could not be masked"):
        discover_step_model(tensors)
    spec = discover_step_model(tensors, fixed_frames=True)
    assert not spec.masked_frames and "attention_mask" not in spec.hypothesis_inputs


#: form -> overrides of the bundled config: the pair (decoder_model as prefill, decoder_with_past_model
#: as step model), or decoder_model_merged alone (its own prompt run: use_cache_branch False, empty
#: pasts, the encoder states; then steps with use_cache_branch True)
FORMS = {"pair": [], "merged": [f"scorers[0].model={FIXTURE / 'decoder_model_merged.onnx'}"]}


def decoder(beam: int, *overrides: str, form: str = "pair") -> Decoder:
    return Decoder.from_config(CONFIG, [f"search.beam_size={beam}", *FORMS[form], *overrides])


def check(nbest: dict, want: dict[str, dict], beam: int) -> None:
    for name in IDS:
        best = nbest[name][0]
        tokens = want[name]["tokens"]
        # transformers keeps EOS in its sequences; the toolkit's labels end before sentence-end
        assert best.labels == [t for t in tokens if t != EOS], name
        if beam == 1:
            assert abs(best.score - want[name]["score"]) < TOL, name
        else:  # sequences_scores: score / generated length (EOS counted) ** length_penalty 1
            assert abs(best.score / best.length - want[name]["sequences_score"]) < TOL, name


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case, beam", [("greedy", 1), ("beam4", 4)])
def test_generate_parity(live, case, beam, form):
    features = {name: f.T for name, f in hf_features(live).items()}  # the features generate saw
    check(decoder(beam, form=form).decode(features), expected(live, case), beam)


@pytest.mark.parametrize("form", list(FORMS))
def test_continuous_batching_feeds_each_history_length_alone(live, monkeypatch, form):
    """Two utterances in flight: tone-b ends after 4 labels and tone-c takes its lanes while tone-a
    runs on, so rows of different history lengths share steps; the decoder (no attention_mask)
    gets one call per length."""
    from gpudecode.session.step_model import StepModelRunner

    lengths_seen = []
    by_length = StepModelRunner._run_by_length

    def spy(self, histories, *args):
        lengths_seen.append(len(set(histories.lengths[histories.lengths > 0].tolist())))
        return by_length(self, histories, *args)

    monkeypatch.setattr(StepModelRunner, "_run_by_length", spy)
    features = {name: f.T for name, f in hf_features(live).items()}
    nbest = decoder(1, "search.max_active_utterances=2", "search.admission_order=input", form=form).decode(features)
    check(nbest, expected(live, "greedy"), 1)
    assert max(lengths_seen) == 2


def test_bundled_config_decodes_the_bundled_audio(tmp_path, live):
    pytest.importorskip("soundfile")
    result = CliRunner().invoke(cli_main, ["decode", str(CONFIG), "--output", str(tmp_path)])
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "nbest.jsonl").read_text().splitlines())}
    want = expected(live, "beam4")
    assert sorted(records) == IDS
    for name in IDS:
        best = records[name]["nbest"][0]
        assert best["labels"] == [t for t in want[name]["tokens"] if t != EOS], name
        assert abs(best["score"] / len(best["labels"]) - want[name]["sequences_score"]) < TOL, name


def test_suppress_tokens_scorer():
    scorer = SuppressTokensScorer(vocab_size=6, tokens=[0, 2], begin_tokens=[5])
    scorer.begin(LaneLayout(xp=np, num_groups=2, beam_size=2))
    ctx = scorer.initial_context(np.array([0, 1]))
    first = scorer.score(ctx)
    assert np.isneginf(first[:, [0, 2, 5]]).all() and np.isfinite(first[:, [1, 3, 4]]).all()
    ctx = scorer.extend(ctx, np.array([0, 0, 2, 3]), np.array([1, 3, -1, -1]))  # lanes 2, 3 carried
    later = scorer.score(ctx)
    assert np.isneginf(later[:2, [0, 2]]).all() and np.isfinite(later[:2, [1, 3, 4, 5]]).all()
    assert np.isneginf(later[2:, 5]).all()  # carried lanes have emitted nothing yet
    ctx = scorer.initial_context(np.array([0]), ctx)
    assert np.isneginf(scorer.score(ctx)[:2, 5]).all()
    with pytest.raises(ValueError, match=r"tokens \[7\] outside the vocabulary"):
        SuppressTokensScorer(vocab_size=6, tokens=[7])


def test_fixed_length_encoder_refuses_other_lengths():
    with pytest.raises(ValueError, match="'short': 2999 feature frames; the encoder takes exactly 3000"):
        decoder(1).decode({"short": np.zeros((2999, 80), np.float32)})


def test_unmasked_cross_attention_refuses_padded_frames():
    """Encoder states of different lengths padded into one batch cannot reach a decoder that has no
    mask for them: an error at admission, not a silent decode."""
    from gpudecode.scorers import UtteranceBatch

    scorer = decoder(1).scorers[0][1]
    scorer.begin(LaneLayout(xp=np, num_groups=2, beam_size=1))
    states = np.random.default_rng(0).standard_normal((2, 10, 32)).astype(np.float32)
    batch = UtteranceBatch(ids=["a", "b"], input_lengths=np.array([10, 7]), inputs={"encoder-states": states},
                           sizes={"encoder-states": np.array([10, 7])})
    with pytest.raises(ValueError, match=r"utterances of \[7, 10\] frames padded to 10: the model cannot mask"):
        scorer.admit(batch, np.array([0, 1]))


def test_config_keys_of_the_front_end_and_the_encoder_layout():
    from gpudecode.config import ConfigError, load_config

    config = load_config(CONFIG)
    assert config.models.front_end.type == "whisper"
    assert config.models.encoder.layout.lengths == "none" and config.models.encoder.layout.fixed_frames == 3000
    assert load_config(CONFIG, ["models.front_end.type=log-mel"]).models.front_end.type == "log-mel"
    with pytest.raises(ConfigError, match="fixed_frames"):
        load_config(CONFIG, ["models.encoder.layout={lengths: none}"])
    with pytest.raises(ConfigError, match="front_end.type"):
        load_config(CONFIG, ["models.front_end.type=mfcc"])
    with pytest.raises(ConfigError, match="its own scaling"):
        load_config(CONFIG, ["models.front_end.normalisation=utterance"])


def test_inspect_describes_the_whisper_export():
    from gpudecode.inspect import describe_model

    encoder = describe_model(FIXTURE / "encoder_model.onnx")
    assert "convention: encoder" in encoder and "[U, F, T], exactly 3000 frames, no lengths" in encoder
    step = describe_model(FIXTURE / "decoder_with_past_model.onnx")
    assert "convention: huggingface" in step and "state variables (4)" in step
    assert "only behind a fixed-length encoder" in step and "one model call per history length" in step


@pytest.mark.gpu
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("case, beam", [("greedy", 1), ("beam4", 4)])
def test_generate_parity_on_the_gpu(case, beam, graphs, form):
    """CuPy, CUDA graphs asked for (the decoder without attention_mask runs without them, after a
    warning) and not, with continuous batching."""
    features = {name: f.T for name, f in hf_features(None).items()}
    overrides = ["runtime.device=cuda", f"runtime.cuda_graphs={'true' if graphs else 'false'}",
                 "search.max_active_utterances=2", "search.admission_order=input"]
    check(decoder(beam, *overrides, form=form).decode(features), DOCUMENT["cases"][case], beam)


@pytest.mark.parametrize("form, message", [
    ("pair", "the prompts of 'input_ids' differ in length but the model has no 'prompt-size' input"),
    ("merged", r"prompts of different lengths \[3, 4\]: the model takes no attention_mask")])
def test_prompts_of_different_lengths_are_refused(form, message):
    """No attention_mask: the prompt run cannot pad prompts (a prompt file may give each utterance its
    own forced prompt, e.g. its language, of the same length)."""
    features = {name: f.T for name, f in hf_features(None).items()}
    prompts = {"tone-a": [120, 121, 122, 127], "tone-b": [120, 121, 127], "tone-c": [120, 121, 122, 127]}
    with pytest.raises(ValueError, match=message):
        decoder(1, form=form).decode(features, prompts=prompts)


@pytest.mark.parametrize("form", list(FORMS))
def test_per_utterance_forced_prompts(form):
    """Each utterance's own prompt (a prompt file, or Decoder.decode's prompts) replaces the config's:
    the same prompt as the config's gives the same result, another one (task translate) another."""
    features = {name: f.T for name, f in hf_features(None).items()}
    same = {name: [120, 121, 122, 127] for name in IDS}
    check(decoder(1, form=form).decode(features, prompts=same), DOCUMENT["cases"]["greedy"], 1)
    other = decoder(1, form=form).decode(features, prompts={name: [120, 121, 123, 127] for name in IDS})
    want = [DOCUMENT["cases"]["greedy"][n]["score"] for n in IDS]
    assert [other[n][0].score for n in IDS] != pytest.approx(want, abs=TOL)


def test_channels_first_encoder_with_lengths(tmp_path):
    """The layout is general: a channels-first encoder that does take lengths (NeMo style) gets its
    features transposed and its lengths fed; a CTC greedy search over its frame log-probs (here the
    log-softmax of the features themselves) gives each frame's best label."""
    labels = 5
    config = nemo_like_config(tmp_path, labels, {"type": "ctc-greedy"})
    rng = np.random.default_rng(0)
    features = {"long": rng.standard_normal((7, labels)).astype(np.float32),
                "short": rng.standard_normal((3, labels)).astype(np.float32)}
    nbest = Decoder.from_config(config).decode(features)
    for name, f in features.items():
        best = f.argmax(axis=1)  # best path: collapse repeats, drop blanks
        want = [int(b) for i, b in enumerate(best) if b != 0 and (i == 0 or b != best[i - 1])]
        assert nbest[name][0].labels == want, name


def nemo_like_config(folder: Path, labels: int, search: dict) -> dict:
    """A config of a NeMo-style encoder written to ``folder``: channels first, lengths fed, frame
    log-probs = the log-softmax of the features themselves (``labels`` features), no scorers."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Transpose", ["audio_signal"], ["frames"], perm=[0, 2, 1]),
         helper.make_node("LogSoftmax", ["frames"], ["log-probs"], axis=-1),
         helper.make_node("Identity", ["length"], ["log-probs-size"])],
        "nemo_like",
        [helper.make_tensor_value_info("audio_signal", TensorProto.FLOAT, ["B", labels, "T"]),
         helper.make_tensor_value_info("length", TensorProto.INT64, ["B"])],
        [helper.make_tensor_value_info("log-probs", TensorProto.FLOAT, ["B", "T", labels]),
         helper.make_tensor_value_info("log-probs-size", TensorProto.INT64, ["B"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, folder / "encoder.onnx")
    (folder / "vocab.txt").write_text("<blank>\n" + "".join(f"{chr(ord('a') + i)}\n" for i in range(labels - 1)))
    return {
        "models": {"encoder": {"path": str(folder / "encoder.onnx"), "layout": {"channels_first": True},
                               "io_map": {"features": "audio_signal", "features-size": "length",
                                          "encoder-states": "log-probs", "encoder-states-size": "log-probs-size"}},
                   "vocabulary": {"path": str(folder / "vocab.txt"), "blank": "<blank>"}},
        "scorers": [], "search": search,
    }

