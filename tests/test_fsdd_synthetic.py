"""Synthetic training speakers for the FSDD recipe: ``examples/fsdd/synth_speakers.py`` (espeak-ng
voices; its signal helpers in numpy) and ``make_data.py --synthetic-recordings`` (they speak extra
training utterances only; the FSDD utterances stay exactly as without them)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from tests.test_fsdd_recipe import FSDD_DIR, RECIPE_DIR, REPO_ROOT, needs_fsdd

import synth_speakers  # noqa: E402  (examples/fsdd is on sys.path through test_fsdd_recipe)

RATE = synth_speakers.SAMPLE_RATE_HZ


def _tone(freq_hz: float, rate: int, seconds: float = 0.5) -> np.ndarray:
    return np.sin(2 * np.pi * freq_hz * np.arange(int(rate * seconds)) / rate)


def _peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.argmax(spectrum) * rate / len(samples))


def test_resampling_keeps_the_band_and_drops_what_lies_above_it():
    low = synth_speakers.resample(_tone(1000.0, 22050), 22050, RATE)
    assert len(low) == 4000 and abs(_peak_hz(low, RATE) - 1000.0) < 5
    assert 0.6 < np.sqrt(np.mean(low ** 2)) < 0.8  # a unit sine keeps its level (rms 0.707)
    high = synth_speakers.resample(_tone(6000.0, 22050), 22050, RATE)  # above the new 4 kHz Nyquist
    assert np.sqrt(np.mean(high ** 2)) < 1e-3


def test_trimming_cuts_the_quiet_ends_and_keeps_a_margin():
    signal = np.concatenate([np.zeros(500), _tone(440.0, RATE, 0.1), np.full(300, 1e-4)])
    cut = synth_speakers.trimmed(signal, margin=80)
    assert 800 <= len(cut) <= 800 + 2 * 80 and np.abs(cut).max() == np.abs(signal).max()
    assert len(synth_speakers.trimmed(np.zeros(100), margin=10)) == 0
    pcm = synth_speakers.pcm16(cut)
    assert pcm.dtype == np.int16 and abs(int(np.abs(pcm).max()) - 16384) <= 1


def test_speakers_are_distinct_named_as_fsdd_names_speakers_and_fixed_by_the_seed():
    speakers = synth_speakers.draw_speakers(20, seed=5)
    assert speakers == synth_speakers.draw_speakers(20, seed=5)
    assert speakers != synth_speakers.draw_speakers(20, seed=6)
    assert len({(s["voice"], s["variant"]) for s in speakers}) == 20
    assert [s["name"] for s in speakers[:3]] == ["synthaa", "synthab", "synthac"]
    assert all(s["name"].isalpha() and s["name"].islower() for s in speakers)
    assert all(0 <= s["pitch"] <= 99 and 130 <= s["rate"] < 200 for s in speakers)
    with pytest.raises(ValueError, match="at most"):
        synth_speakers.draw_speakers(len(synth_speakers.VOICES) * len(synth_speakers.VARIANTS) + 1, seed=0)


def _write_fake_speakers(folder: Path, names=("synthaa", "synthab")) -> None:
    """Tones standing in for espeak-ng's recordings (CI has no espeak-ng): every digit, takes 10-13."""
    folder.mkdir(parents=True)
    for s, name in enumerate(names):
        for digit in range(10):
            for index in range(10, 14):
                audio = 0.3 * _tone(300.0 + 40 * digit + 7 * index + 100 * s, RATE, 0.3)
                synth_speakers.write_wav(folder / f"{digit}_{name}_{index}.wav", synth_speakers.pcm16(audio), RATE)


def _make(out: Path, *extra: str) -> None:
    subprocess.run(
        [sys.executable, str(RECIPE_DIR / "make_data.py"), "--recordings", str(FSDD_DIR / "recordings"),
         "--out", str(out), "--test-speaker", "theo", "--num-train", "8", "--num-dev", "4", "--num-test", "4",
         "--num-lm-sentences", "0", "--wav-splits", "", *extra],
        check=True, capture_output=True, text=True, cwd=REPO_ROOT)


def _manifest(folder: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (folder / split / "manifest.jsonl").read_text().splitlines()]


@needs_fsdd
def test_synthetic_speakers_only_add_training_utterances(tmp_path):
    synthetic = tmp_path / "synthetic"
    _write_fake_speakers(synthetic)
    _make(tmp_path / "plain")
    _make(tmp_path / "mixed", "--synthetic-recordings", str(synthetic), "--num-synthetic-train", "6")
    plain, mixed = _manifest(tmp_path / "plain", "train"), _manifest(tmp_path / "mixed", "train")
    assert mixed[:len(plain)] == plain  # the FSDD utterances as without synthetic speakers
    added = mixed[len(plain):]
    assert len(added) == 6 and all(r["speaker"] in ("synthaa", "synthab") for r in added)
    assert all(r["id"].startswith("train-s") for r in added)
    assert all(name.split("_")[1] == r["speaker"] for r in added for name in r["recordings"])
    for split in ("dev", "test"):
        assert _manifest(tmp_path / "mixed", split) == _manifest(tmp_path / "plain", split)
        assert (tmp_path / "mixed" / split / "text").read_text() == (tmp_path / "plain" / split / "text").read_text()
    text = (tmp_path / "mixed" / "train" / "text").read_text().splitlines()
    assert len(text) == 14 and text[:8] == (tmp_path / "plain" / "train" / "text").read_text().splitlines()
    stats = np.load(tmp_path / "mixed" / "stats.npz")
    assert not np.allclose(stats["mean"], np.load(tmp_path / "plain" / "stats.npz")["mean"])  # over all of train


@needs_fsdd
def test_synthetic_speakers_need_their_folder_and_other_names(tmp_path):
    result = subprocess.run(
        [sys.executable, str(RECIPE_DIR / "make_data.py"), "--recordings", str(FSDD_DIR / "recordings"),
         "--out", str(tmp_path / "data"), "--num-synthetic-train", "3", "--num-lm-sentences", "0"],
        capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode != 0 and "--synthetic-recordings" in result.stderr
    clash = tmp_path / "clash"
    _write_fake_speakers(clash, names=("theo",))
    result = subprocess.run(
        [sys.executable, str(RECIPE_DIR / "make_data.py"), "--recordings", str(FSDD_DIR / "recordings"),
         "--out", str(tmp_path / "data"), "--synthetic-recordings", str(clash), "--num-synthetic-train", "3",
         "--num-lm-sentences", "0"],
        capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode != 0 and "are FSDD speakers" in result.stderr


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed (apt install espeak-ng)")
def test_espeak_speakers_say_every_digit_at_8khz(tmp_path):
    subprocess.run([sys.executable, str(RECIPE_DIR / "synth_speakers.py"), "--out", str(tmp_path), "--speakers", "2",
                    "--takes", "2"], check=True, capture_output=True, text=True, cwd=RECIPE_DIR)
    names = sorted(p.name for p in tmp_path.glob("*.wav"))
    assert len(names) == 2 * 10 * 2 and names[0] == "0_synthaa_10.wav"
    for name in names:
        with wave.open(str(tmp_path / name)) as f:
            assert f.getframerate() == RATE and f.getnchannels() == 1
            assert 0.15 < f.getnframes() / RATE < 1.5
    assert len(json.loads((tmp_path / "speakers.json").read_text())["speakers"]) == 2
