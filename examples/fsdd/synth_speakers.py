#!/usr/bin/env python
"""Synthetic digit speakers from espeak-ng, for training only.

    python examples/fsdd/synth_speakers.py [--out examples/fsdd/data/synthetic-recordings] [--speakers 16]

Each synthetic speaker is one espeak-ng English voice with a voice variant, a base pitch and a
speaking rate (drawn from ``--seed``); it says every digit ("zero" .. "nine") ``--takes`` times,
each take with its own small pitch and rate jitter. The recordings are written as FSDD names them,
``{digit}_{speaker}_{index}.wav`` (mono, 16-bit, 8 kHz: espeak-ng's 22,050 Hz output resampled by
cutting its spectrum, silence trimmed, peak-normalised), with indices in the training range
(``fsdd_common.SPLITS["train"]``), and ``speakers.json`` lists each speaker's voice settings.
``make_data.py --synthetic-recordings DIR --num-synthetic-train N`` adds N training utterances
spoken by them; they never reach dev or test. Needs ``espeak-ng`` (Debian: ``apt install
espeak-ng``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np
from fsdd_common import DEFAULT_DATA_DIR, SPLITS

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: English voices of espeak-ng (accents) and its voice variants (timbres)
VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan", "en-gb-x-gbcwmd")
VARIANTS = ("m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4", "f5", "klatt", "croak")
SAMPLE_RATE_HZ = 8000
TRIM_LEVEL = 0.02  # of the peak: samples below it at either end are silence
PEAK = 0.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_DATA_DIR / "synthetic-recordings")
    p.add_argument("--speakers", type=int, default=16)
    p.add_argument("--takes", type=int, default=20, help="recordings of each digit per speaker")
    p.add_argument("--seed", type=int, default=20261202)
    p.add_argument("--espeak", default="espeak-ng")
    return p.parse_args(argv)


def speaker_name(number: int) -> str:
    """``synth`` and two letters (FSDD speaker names are lower-case letters): synthaa, synthab, ..."""
    if not 0 <= number < 26 * 26:
        raise ValueError(f"speaker number {number}: at most {26 * 26} synthetic speakers")
    return "synth" + chr(ord("a") + number // 26) + chr(ord("a") + number % 26)


def draw_speakers(count: int, seed: int) -> list[dict]:
    """``count`` distinct voice settings: voice, variant, pitch (0-99) and rate (words/minute)."""
    rng = np.random.default_rng(seed)
    pairs = [(v, w) for v in VOICES for w in VARIANTS]
    if count > len(pairs):
        raise ValueError(f"--speakers {count}: at most {len(pairs)} voice/variant pairs")
    chosen = rng.choice(len(pairs), size=count, replace=False)
    return [{"name": speaker_name(n), "voice": pairs[c][0], "variant": pairs[c][1],
             "pitch": int(rng.integers(25, 75)), "rate": int(rng.integers(130, 200))}
            for n, c in enumerate(chosen)]


def resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """``samples`` at ``rate_out``: the spectrum cut (or zero-padded) to the new band, so that
    nothing above the new Nyquist frequency folds back."""
    n_out = int(round(len(samples) * rate_out / rate_in))
    if n_out < 1:
        return np.zeros(0)
    spectrum = np.fft.rfft(samples)
    kept = np.zeros(n_out // 2 + 1, dtype=complex)
    width = min(len(kept), len(spectrum))
    kept[:width] = spectrum[:width]
    return np.fft.irfft(kept, n_out) * (n_out / len(samples))


def trimmed(samples: np.ndarray, margin: int) -> np.ndarray:
    """``samples`` without the silence at both ends (below ``TRIM_LEVEL`` of the peak), keeping
    ``margin`` samples of it on each side."""
    peak = np.abs(samples).max() if samples.size else 0.0
    if peak == 0:  # silence only
        return samples[:0]
    loud = np.flatnonzero(np.abs(samples) >= TRIM_LEVEL * peak)
    return samples[max(0, loud[0] - margin):loud[-1] + 1 + margin]


def pcm16(samples: np.ndarray) -> np.ndarray:
    """Peak-normalised to ``PEAK``, as 16-bit integers."""
    peak = np.abs(samples).max() if samples.size else 0.0
    scaled = samples * (PEAK / peak) if peak > 0 else samples
    return np.clip(np.round(scaled * 32768.0), -32768, 32767).astype(np.int16)


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as f:
        if f.getsampwidth() != 2 or f.getnchannels() != 1:
            raise SystemExit(f"{path}: expected mono 16-bit audio from espeak-ng")
        data = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2").astype(np.float64) / 32768.0
        return data, f.getframerate()


def write_wav(path: Path, pcm: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.astype("<i2").tobytes())


def say(espeak: str, word: str, voice: str, variant: str, pitch: int, rate: int, scratch: Path) -> np.ndarray:
    """One take of ``word`` at 8 kHz, trimmed."""
    subprocess.run([espeak, "-v", f"{voice}+{variant}", "-p", str(pitch), "-s", str(rate), "-w", str(scratch), word],
                   check=True, capture_output=True)
    samples, rate_in = read_wav(scratch)
    audio = trimmed(resample(samples, rate_in, SAMPLE_RATE_HZ), margin=SAMPLE_RATE_HZ // 100)
    if not audio.size:
        raise SystemExit(f"{espeak} -v {voice}+{variant}: {word!r} came out silent")
    return audio


def main(argv=None) -> None:
    args = parse_args(argv)
    if shutil.which(args.espeak) is None:
        raise SystemExit(f"{args.espeak}: not found (Debian: apt install espeak-ng)")
    first = SPLITS["train"].start
    if args.takes > len(SPLITS["train"]):
        raise SystemExit(f"--takes {args.takes}: at most {len(SPLITS['train'])} (the training indices)")
    args.out.mkdir(parents=True, exist_ok=True)
    speakers = draw_speakers(args.speakers, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "take.wav"
        for speaker in speakers:
            for digit, word in enumerate(WORDS):
                for take in range(args.takes):
                    pitch = int(np.clip(speaker["pitch"] + rng.integers(-6, 7), 0, 99))
                    rate = int(speaker["rate"] * rng.uniform(0.9, 1.1))
                    audio = say(args.espeak, word, speaker["voice"], speaker["variant"], pitch, rate, scratch)
                    write_wav(args.out / f"{digit}_{speaker['name']}_{first + take}.wav", pcm16(audio),
                              SAMPLE_RATE_HZ)
            print(f"{speaker['name']}: {speaker['voice']}+{speaker['variant']} pitch {speaker['pitch']} "
                  f"rate {speaker['rate']}", flush=True)
    (args.out / "speakers.json").write_text(json.dumps(
        {"seed": args.seed, "takes": args.takes, "speakers": speakers}, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {len(speakers) * len(WORDS) * args.takes} recordings to {args.out}")


if __name__ == "__main__":
    main()
