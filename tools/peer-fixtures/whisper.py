"""Builds the Whisper fixture: a tiny Optimum export of a random-initialised Whisper, Hugging Face's
log-mel features of three synthetic recordings and transformers' own Whisper ``generate`` on them.

Run in the peers environment with transformers 4.57 (optimum-onnx needs transformers < 4.58), from
the repository root::

    PYTHONPATH=.peers-tf4:. .venv-peers/bin/python tools/peer-fixtures/whisper.py

1. A ``WhisperForConditionalGeneration`` from a ``WhisperConfig`` (``SEED``; d_model 32, 2 encoder
   and 2 decoder layers, 4 heads, FFN 64, 80 mel bins, ``max_source_positions`` 1500 — the encoder
   takes Whisper's [N, 80, 3000] — vocabulary 128, ``init_std`` 0.3 so that the distributions are
   peaked enough for beam decisions not to hinge on float rounding; d_model 32 keeps the three
   files under 1 MB) is saved and exported with the real Optimum CLI::

       optimum-cli export onnx --model MODEL --task automatic-speech-recognition-with-past OUT

   giving ``encoder_model.onnx`` (``input_features`` [N, 80, 3000] -> ``last_hidden_state``
   [N, 1500, 32]), ``decoder_model.onnx`` (``input_ids``, ``encoder_hidden_states`` -> ``logits``,
   ``present.{i}.decoder|encoder.key|value``) and ``decoder_with_past_model.onnx`` (``input_ids``,
   ``past_key_values.{i}.decoder|encoder.*`` -> ``logits``, ``present.{i}.decoder.*``; no
   ``attention_mask``, no ``position_ids``: positions come from the past length) and
   ``decoder_model_merged.onnx`` (both in one, ``use_cache_branch`` choosing the branch).
2. ``RECORDINGS`` (sine mixtures plus noise, 16 kHz, quantised to 16 bit) are written as wav files
   into ``examples/whisper/`` and their ``WhisperFeatureExtractor`` features ([80, 3000] each) into
   ``features.npz``.
3. transformers' Whisper ``generate`` (``language="en"``, ``task="transcribe"``: the forced prompt
   ``SOT, <|en|>, <|transcribe|>, <|notimestamps|>``; ``suppress_tokens`` at every step,
   ``begin_suppress_tokens`` at the first generated one) decodes the three feature arrays, one per
   call, greedy and with 4 beams; ``expected.json`` records the generated tokens (prompt cut off,
   EOS kept), the greedy tokens' log-softmax sum (of the raw logits), the beams' ``sequences_scores`` and the versions.

Made with: torch 2.13.0+cpu, transformers 4.57.3, optimum-onnx 0.1.0, optimum 2.1.0,
onnxruntime 1.32.0, onnx 1.23.2 (also in ``versions`` of expected.json).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "peers" / "whisper"
AUDIO = ROOT / "examples" / "whisper"
SEED = 0
VOCAB = 128
#: EOS: a token the random decoder reaches (greedy at its 4th label)
#: the special tokens at the end of the vocabulary, as Whisper's: Whisper's generate takes every id
#: above <|notimestamps|> for a timestamp (so it is the last id here: no timestamp tokens)
EOS, SOT, EN, TRANSCRIBE, TRANSLATE, NO_TIMESTAMPS = 118, 120, 121, 122, 123, 127
#: the embedding's padding row (zeroed at initialisation): a suppressed token, so that EOS keeps a row
PAD = 0
PROMPT = [SOT, EN, TRANSCRIBE, NO_TIMESTAMPS]
#: 111: the random decoder's favourite (it would repeat it to the label limit)
SUPPRESS = [0, 40, 41, 111, SOT, EN, TRANSCRIBE, TRANSLATE, NO_TIMESTAMPS]
BEGIN_SUPPRESS = [EOS, 9]
MAX_NEW_TOKENS = 12
#: id -> (seconds, [(frequency Hz, amplitude)], noise amplitude)
RECORDINGS = {
    "tone-a": (1.0, [(440.0, 0.3), (1250.0, 0.1)], 0.01),
    "tone-b": (2.3, [(300.0, 0.2), (2200.0, 0.15), (5000.0, 0.05)], 0.03),
    "tone-c": (0.6, [(800.0, 0.5)], 0.002),
}
CASES = {"greedy": dict(num_beams=1), "beam4": dict(num_beams=4)}
SPECIAL = {EOS: "<|endoftext|>", SOT: "<|startoftranscript|>", EN: "<|en|>", TRANSCRIBE: "<|transcribe|>",
           TRANSLATE: "<|translate|>", NO_TIMESTAMPS: "<|notimestamps|>"}


def model():
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(SEED)
    config = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=80, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=1500, max_target_positions=64, pad_token_id=PAD, bos_token_id=EOS,
        eos_token_id=EOS, decoder_start_token_id=SOT, init_std=0.3)
    whisper = WhisperForConditionalGeneration(config).eval()
    whisper.generation_config = GenerationConfig(
        decoder_start_token_id=SOT, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=EOS,
        suppress_tokens=SUPPRESS, begin_suppress_tokens=BEGIN_SUPPRESS, is_multilingual=True,
        lang_to_id={"<|en|>": EN}, task_to_id={"transcribe": TRANSCRIBE, "translate": TRANSLATE},
        no_timestamps_token_id=NO_TIMESTAMPS, max_length=64)
    return whisper


def waveform(name: str) -> np.ndarray:
    """The recording as the 16-bit wav holds it, in float32 (as soundfile reads it)."""
    seconds, tones, noise = RECORDINGS[name]
    rng = np.random.default_rng(abs(hash(name)) % 1000 if False else sorted(RECORDINGS).index(name))
    t = np.arange(int(seconds * 16000)) / 16000.0
    x = sum(a * np.sin(2 * np.pi * f * t) for f, a in tones) + noise * rng.standard_normal(t.shape)
    pcm = np.clip(np.round(x * 32767), -32768, 32767).astype(np.int16)
    return pcm.astype(np.float32) / 32768.0, pcm


def features(samples) -> np.ndarray:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=80, sampling_rate=16000)
    return extractor(samples, sampling_rate=16000, return_tensors="np").input_features[0]


def generate(whisper, feats: np.ndarray, case: str) -> dict:
    """transformers' Whisper generate on one [80, 3000] feature array: tokens after the prompt
    (EOS kept) and the score."""
    import torch

    options = CASES[case]
    with torch.no_grad():
        out = whisper.generate(torch.from_numpy(feats[None]), language="en", task="transcribe",
                               max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True,
                               output_scores=True, output_logits=True, **options)
    sequence = out.sequences[0].tolist()
    if sequence[:len(PROMPT)] == PROMPT:
        sequence = sequence[len(PROMPT):]
    row = {"tokens": [int(t) for t in sequence]}
    if options["num_beams"] == 1:
        # the model's own log-probabilities (the raw logits: the suppression acts after them)
        logprobs = [torch.log_softmax(s[0].float(), -1) for s in out.logits]
        row["score"] = float(sum(lp[t] for lp, t in zip(logprobs, sequence)))
    else:
        row["sequences_score"] = float(out.sequences_scores[0])
    return row


def export(whisper) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        whisper.save_pretrained(Path(tmp) / "model")
        subprocess.run([str(Path(sys.executable).parent / "optimum-cli"), "export", "onnx", "--model",
                        str(Path(tmp) / "model"), "--task", "automatic-speech-recognition-with-past",
                        str(Path(tmp) / "onnx")], check=True)
        for name in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx",
                     "decoder_model_merged.onnx"):
            (OUT / name).write_bytes((Path(tmp) / "onnx" / name).read_bytes())


def main() -> None:
    import importlib.metadata as metadata

    OUT.mkdir(parents=True, exist_ok=True)
    AUDIO.mkdir(parents=True, exist_ok=True)
    whisper = model()
    export(whisper)
    labels = [SPECIAL.get(i, f"t{i}") for i in range(VOCAB)]
    (OUT / "vocab.txt").write_text("\n".join(labels) + "\n")
    feats = {}
    for name in RECORDINGS:
        samples, pcm = waveform(name)
        with wave.open(str(AUDIO / f"{name}.wav"), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(16000)
            f.writeframes(pcm.tobytes())
        feats[name] = features(samples).astype(np.float32)
    np.savez_compressed(OUT / "features.npz", **feats)
    expected = {
        "versions": {p: metadata.version(p) for p in
                     ("torch", "transformers", "optimum-onnx", "optimum", "onnxruntime", "onnx", "numpy")},
        "prompt": PROMPT, "suppress_tokens": SUPPRESS, "begin_suppress_tokens": BEGIN_SUPPRESS, "eos": EOS,
        "max_new_tokens": MAX_NEW_TOKENS,
        "cases": {case: {name: generate(whisper, feats[name], case) for name in RECORDINGS} for case in CASES},
    }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(json.dumps(expected["cases"], indent=None))


if __name__ == "__main__":
    main()
