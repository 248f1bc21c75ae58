#!/usr/bin/env python
"""Connected-digit utterances from FSDD recordings: audio, log-mel features, transcripts.

    python examples/fsdd/make_data.py [--out examples/fsdd/data] [--num-train 3000 ...]
    python examples/fsdd/make_data.py --test-speaker theo --out examples/fsdd/data/loso/theo

Each utterance is one item of the structured language in ``fsdd_grammar.py`` (1-10 digits),
spoken by one speaker: the speaker's recordings of those digits, drawn from the split's
recording indices (train 10-49, dev 5-9, test 0-4; a recording is never in two splits), each
with a gain of +-3 dB, joined by silences of 50-300 ms, with 100-300 ms of silence at both ends
and white noise at -60 dBFS everywhere (so that silence is not digital zero). With
``--test-speaker NAME`` the data is a leave-one-speaker-out fold (``fsdd_common.FOLD_SPLITS``):
test is spoken only by NAME (its recordings 0-49), train and dev only by the other speakers
(train from their recordings 10-49, dev from their recordings 0-9); nothing else changes. Samples are
quantised to 16 bits; the features are computed from exactly the samples the wav files hold,
with the toolkit's own front end (``gpudecode.io.frontend``), so decoding the wav files through
``models.front_end`` gives the same features.

Writes under ``--out``::

    vocab.txt           labels, one per line (index = line number): <blank> </s> zero .. nine
    front_end.json      the LogMelOptions used (the keys of models.front_end in a config)
    stats.npz           mean, std (F,) of the training features (for the models' normalisation)
    lm_text.txt         --num-lm-sentences sentences of the language (words), for LM training
    {split}/text        utt-id words ...          (reference transcripts)
    {split}/manifest.jsonl   per utterance: category, digits, speaker, recordings, gains, gaps
    {split}/feats.h5    RETURNN layout: inputs (sum T, F), seqLengths (U, 2) = [frames, labels],
                        seqTags (U,), targets/data/classes (sum L,) label indices
    {split}/feats.ark, feats.scp   Kaldi archive and script (absolute paths) of the same features
    {split}/wav/*.wav, wav.scp     16-bit 8 kHz audio (only for --wav-splits)

With ``--synthetic-recordings DIR --num-synthetic-train N`` (``synth_speakers.py``'s espeak-ng
speakers) the train split gets N more utterances, spoken by those synthetic speakers from their
training-range recordings, after the FSDD ones (which stay exactly as without them); dev and test
never hear them, and the normalisation statistics cover the whole train split.

Everything is a function of --seed and the sizes. The data carries FSDD's license, CC BY-SA 4.0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import time
from pathlib import Path

import fsdd_grammar as grammar
import numpy as np
from fsdd_common import (
    DEFAULT_DATA_DIR,
    DEFAULT_RECORDINGS,
    FRONT_END,
    LICENSE_NOTE,
    SPLITS,
    VOCABULARY,
    mean_std,
    resolve,
    split_indices,
    split_speakers,
    write_json,
)

RECORDING_NAME = re.compile(r"([0-9])_([a-z]+)_([0-9]+)\.wav")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recordings", type=Path, default=DEFAULT_RECORDINGS,
                   help="FSDD recordings folder ({digit}_{speaker}_{index}.wav)")
    p.add_argument("--out", type=Path, default=DEFAULT_DATA_DIR, help="output folder")
    p.add_argument("--test-speaker", default=None, metavar="NAME",
                   help="a leave-one-speaker-out fold: test only NAME, train and dev the others")
    p.add_argument("--synthetic-recordings", type=Path, default=None, metavar="DIR",
                   help="synthetic speakers' recordings (synth_speakers.py), for training only")
    p.add_argument("--num-synthetic-train", type=int, default=0,
                   help="training utterances spoken by the synthetic speakers, after the FSDD ones")
    p.add_argument("--seed", type=int, default=20240502)
    p.add_argument("--num-train", type=int, default=3000)
    p.add_argument("--num-dev", type=int, default=500)
    p.add_argument("--num-test", type=int, default=600)
    p.add_argument("--num-lm-sentences", type=int, default=20000,
                   help="sentences of lm_text.txt (0: none)")
    p.add_argument("--wav-splits", default="dev,test",
                   help="comma-separated splits whose audio is written as wav files ('' none)")
    p.add_argument("--gap-ms", type=float, nargs=2, default=(50.0, 300.0), metavar=("MIN", "MAX"))
    p.add_argument("--edge-ms", type=float, nargs=2, default=(100.0, 300.0),
                   metavar=("MIN", "MAX"), help="silence before the first and after the last digit")
    p.add_argument("--gain-db", type=float, default=3.0, help="gain jitter: uniform in +-GAIN_DB")
    p.add_argument("--noise-dbfs", type=float, default=-60.0,
                   help="RMS of the white noise added everywhere, dB re full scale")
    args = p.parse_args(argv)
    args.recordings, args.out = resolve(args.recordings), resolve(args.out)
    args.wav_splits = [s for s in args.wav_splits.split(",") if s]
    unknown = set(args.wav_splits) - set(SPLITS)
    if unknown:
        p.error(f"--wav-splits: unknown split(s) {sorted(unknown)}; valid: {', '.join(SPLITS)}")
    for name in ("num_train", "num_dev", "num_test", "num_lm_sentences"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    return args


# --- recordings --------------------------------------------------------------------------------

class Recordings:
    """FSDD recordings indexed by (speaker, digit) -> {index: path}; audio read once, cached."""

    def __init__(self, folder: Path, sample_rate_hz: int):
        if not folder.is_dir():
            raise SystemExit(f"{folder}: FSDD recordings folder does not exist (pass --recordings)")
        self.sample_rate_hz = sample_rate_hz
        self.paths: dict[tuple[str, int], dict[int, Path]] = {}
        for path in sorted(folder.glob("*.wav")):
            match = RECORDING_NAME.fullmatch(path.name)
            if match is None:
                raise SystemExit(f"{path}: not an FSDD name {{digit}}_{{speaker}}_{{index}}.wav")
            digit, speaker, index = int(match[1]), match[2], int(match[3])
            self.paths.setdefault((speaker, digit), {})[index] = path
        if not self.paths:
            raise SystemExit(f"{folder}: no .wav files")
        self.speakers = sorted({speaker for speaker, _ in self.paths})
        self._audio: dict[Path, np.ndarray] = {}

    def indices(self, speaker: str, digit: int, split: str, test_speaker: str | None = None) -> list[int]:
        available = self.paths.get((speaker, digit), {})
        allowed = split_indices(split, test_speaker)
        indices = [i for i in allowed if i in available]
        if not indices:
            raise SystemExit(f"no recording of digit {digit} by {speaker} in the {split} split "
                             f"(indices {allowed.start}-{allowed.stop - 1})")
        return indices

    def audio(self, path: Path) -> np.ndarray:
        if path not in self._audio:
            import soundfile

            samples, rate = soundfile.read(path, dtype="float64")
            if rate != self.sample_rate_hz or samples.ndim != 1:
                raise SystemExit(f"{path}: {rate} Hz, shape {samples.shape}; expected mono "
                                 f"{self.sample_rate_hz} Hz")
            self._audio[path] = samples
        return self._audio[path]


def check_splits_disjoint(speakers: list[str], test_speaker: str | None = None) -> None:
    """No (speaker, recording index) pair is allowed in two splits."""
    names = list(SPLITS)
    allowed = {split: {(speaker, index) for speaker in split_speakers(split, speakers, test_speaker)
                       for index in split_indices(split, test_speaker)} for split in names}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            common = allowed[a] & allowed[b]
            assert not common, f"splits {a} and {b} share recordings {sorted(common)[:5]}"


# --- one utterance -----------------------------------------------------------------------------

def make_utterance(digits: str, speaker: str, split: str, recordings: Recordings,
                   rng: np.random.Generator, args) -> tuple[np.ndarray, dict]:
    """16-bit samples ``(num_samples,)`` and the manifest record of one utterance."""
    rate = recordings.sample_rate_hz

    def silence_samples(range_ms) -> int:
        return int(round(rng.uniform(*range_ms) * rate / 1000.0))

    pieces, used, gains_db, gaps_ms = [], [], [], []
    pieces.append(np.zeros(silence_samples(args.edge_ms)))
    for position, char in enumerate(digits):
        digit = int(char)
        index = int(rng.choice(recordings.indices(speaker, digit, split, args.test_speaker)))
        path = recordings.paths[(speaker, digit)][index]
        gain_db = float(rng.uniform(-args.gain_db, args.gain_db))
        pieces.append(recordings.audio(path) * 10.0 ** (gain_db / 20.0))
        used.append(path.name)
        gains_db.append(round(gain_db, 3))
        if position + 1 < len(digits):
            gap = silence_samples(args.gap_ms)
            pieces.append(np.zeros(gap))
            gaps_ms.append(round(1000.0 * gap / rate, 3))
    pieces.append(np.zeros(silence_samples(args.edge_ms)))
    signal = np.concatenate(pieces)
    signal += rng.normal(0.0, 10.0 ** (args.noise_dbfs / 20.0), size=signal.shape)
    pcm = np.clip(np.round(signal * 32768.0), -32768, 32767).astype(np.int16)
    record = {"speaker": speaker, "recordings": used, "gains_db": gains_db, "gaps_ms": gaps_ms,
              "num_samples": int(pcm.shape[0])}
    return pcm, record


# --- writers -----------------------------------------------------------------------------------

class Hdf5Writer:
    """RETURNN-layout HDF5, written utterance by utterance (``inputs`` grows in place)."""

    def __init__(self, path: Path, num_features: int):
        import h5py

        self.file = h5py.File(path, "w")
        self.inputs = self.file.create_dataset("inputs", shape=(0, num_features),
                                               maxshape=(None, num_features), dtype="float32",
                                               chunks=(4096, num_features))
        self.tags: list[str] = []
        self.lengths: list[tuple[int, int]] = []
        self.labels: list[np.ndarray] = []

    def add(self, utt_id: str, features: np.ndarray, labels: list[int]) -> None:
        start = self.inputs.shape[0]
        self.inputs.resize(start + features.shape[0], axis=0)
        self.inputs[start:] = features
        self.tags.append(utt_id)
        self.lengths.append((features.shape[0], len(labels)))
        self.labels.append(np.asarray(labels, dtype=np.int32))

    def close(self) -> None:
        import h5py

        f = self.file
        f.create_dataset("seqTags", data=np.array([t.encode() for t in self.tags], dtype="S"))
        f.create_dataset("seqLengths", data=np.array(self.lengths, dtype=np.int32).reshape(-1, 2))
        f.create_dataset("targets/data/classes",
                         data=np.concatenate(self.labels or [np.zeros(0, np.int32)]))
        f.create_dataset("targets/labels/classes", data=list(VOCABULARY),
                         dtype=h5py.string_dtype("utf-8"))
        size = f.create_group("targets/size")
        size.attrs["classes"] = np.array([len(VOCABULARY), 1], dtype=np.int32)
        f.attrs["inputPattSize"] = self.inputs.shape[1]
        f.attrs["numSeqs"] = len(self.tags)
        f.attrs["numTimesteps"] = self.inputs.shape[0]
        f.attrs["license"] = LICENSE_NOTE
        f.close()


def write_split(split: str, num_utterances: int, recordings: Recordings, front_end, args,
                seed_seq: np.random.SeedSequence, synthetic: tuple[Recordings, int] | None = None) -> dict:
    """Writes ``split``: ``num_utterances`` spoken by the split's FSDD speakers, then (``synthetic``:
    the synthetic speakers' recordings and a count) that many by synthetic speakers, drawn with
    their own random streams. Returns the recordings used (FSDD and synthetic apart) and the
    features' sums."""
    import kaldiio
    import soundfile

    out = args.out / split
    out.mkdir(parents=True, exist_ok=True)
    text_rng, audio_rng = (np.random.default_rng(s) for s in seed_seq.spawn(2))
    write_wav = split in args.wav_splits
    wav_dir = out / "wav"
    if write_wav:
        wav_dir.mkdir(exist_ok=True)
    hdf5 = Hdf5Writer(out / "feats.h5", front_end.num_features)
    feat_sum = np.zeros(front_end.num_features)
    feat_sq_sum = np.zeros(front_end.num_features)
    num_frames = 0
    used_recordings: set[str] = set()
    synthetic_recordings: set[str] = set()
    speakers = split_speakers(split, recordings.speakers, args.test_speaker)
    plan = [(number, recordings, speakers, text_rng, audio_rng, "", used_recordings)
            for number in range(num_utterances)]
    if synthetic is not None:  # their own streams: the FSDD utterances stay as they are without them
        synthetic_text_rng, synthetic_audio_rng = (np.random.default_rng(s) for s in seed_seq.spawn(2))
        plan += [(number, synthetic[0], synthetic[0].speakers, synthetic_text_rng, synthetic_audio_rng, "s",
                  synthetic_recordings) for number in range(synthetic[1])]
    with (open(out / "text", "w", encoding="utf-8") as text,
          open(out / "manifest.jsonl", "w", encoding="utf-8") as manifest,
          open(out / "wav.scp", "w", encoding="utf-8") if write_wav else _null() as wav_scp,
          kaldiio.WriteHelper(f"ark,scp:{out / 'feats.ark'},{out / 'feats.scp'}") as ark):
        for number, source, source_speakers, text_rng, audio_rng, prefix, used_here in plan:
            category, digits = grammar.sample(text_rng)
            speaker = source_speakers[int(text_rng.integers(len(source_speakers)))]
            utt_id = f"{split}-{prefix}{number:05d}-{speaker}"
            pcm, record = make_utterance(digits, speaker, split, source, audio_rng, args)
            features = front_end(pcm.astype(np.float64) / 32768.0)
            words = grammar.digits_to_words(digits)
            text.write(f"{utt_id} {' '.join(words)}\n")
            manifest.write(json.dumps({"id": utt_id, "category": category, "digits": digits,
                                       "num_frames": int(features.shape[0]), **record}) + "\n")
            hdf5.add(utt_id, features, [VOCABULARY.index(w) for w in words])
            ark(utt_id, features)
            if write_wav:
                wav_path = wav_dir / f"{utt_id}.wav"
                soundfile.write(wav_path, pcm, recordings.sample_rate_hz, subtype="PCM_16")
                wav_scp.write(f"{utt_id} wav/{wav_path.name}\n")
            used_here.update(record["recordings"])
            feat_sum += features.sum(axis=0)
            feat_sq_sum += np.square(features.astype(np.float64)).sum(axis=0)
            num_frames += features.shape[0]
    hdf5.close()
    if not write_wav:
        (out / "wav.scp").unlink(missing_ok=True)
    return {"recordings": used_recordings, "synthetic_recordings": synthetic_recordings, "sum": feat_sum,
            "sq_sum": feat_sq_sum, "num_frames": num_frames}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def check_recordings_in_split(split: str, used: set[str], speakers: list[str],
                              test_speaker: str | None = None) -> None:
    """Every recording used by ``split`` has one of its indices and is spoken by one of its
    speakers (``speakers``: all speakers of the recordings)."""
    allowed_indices = split_indices(split, test_speaker)
    allowed_speakers = split_speakers(split, speakers, test_speaker)
    for name in used:
        match = RECORDING_NAME.fullmatch(name)
        index, speaker = int(match[3]), match[2]
        assert index in allowed_indices, f"{name} (index {index}) used in the {split} split"
        assert speaker in allowed_speakers, f"{name} (speaker {speaker}) used in the {split} split"


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # gpudecode from this checkout
    from gpudecode.io.frontend import LogMelFrontEnd, LogMelOptions

    started = time.perf_counter()
    front_end = LogMelFrontEnd(LogMelOptions(**FRONT_END))  # raises on an empty mel filter
    recordings = Recordings(args.recordings, int(FRONT_END["sample_rate_hz"]))
    if args.test_speaker is not None and args.test_speaker not in recordings.speakers:
        raise SystemExit(f"--test-speaker {args.test_speaker}: not a speaker of {args.recordings} "
                         f"({', '.join(recordings.speakers)})")
    check_splits_disjoint(recordings.speakers, args.test_speaker)
    synthetic = None
    if args.num_synthetic_train:
        if args.synthetic_recordings is None:
            raise SystemExit("--num-synthetic-train needs --synthetic-recordings (synth_speakers.py's output)")
        synthetic = (Recordings(args.synthetic_recordings, int(FRONT_END["sample_rate_hz"])), args.num_synthetic_train)
        shared = set(synthetic[0].speakers) & set(recordings.speakers)
        if shared:
            raise SystemExit(f"{args.synthetic_recordings}: speakers {sorted(shared)} are FSDD speakers")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vocab.txt").write_text("\n".join(VOCABULARY) + "\n", encoding="utf-8")
    write_json(args.out / "front_end.json", FRONT_END)

    seeds = dict(zip([*SPLITS, "lm"], np.random.SeedSequence(args.seed).spawn(len(SPLITS) + 1)))
    sizes = {"train": args.num_train, "dev": args.num_dev, "test": args.num_test}
    used: dict[str, set[str]] = {}
    for split in SPLITS:
        result = write_split(split, sizes[split], recordings, front_end, args, seeds[split],
                             synthetic if split == "train" else None)
        used[split] = result["recordings"]
        if result["synthetic_recordings"]:
            print(f"{split}: {args.num_synthetic_train} more utterances by {len(synthetic[0].speakers)} synthetic "
                  f"speakers ({len(result['synthetic_recordings'])} recordings)", flush=True)
        check_recordings_in_split(split, used[split], recordings.speakers, args.test_speaker)
        fold = (f", speakers {','.join(split_speakers(split, recordings.speakers, args.test_speaker))}"
                if args.test_speaker else "")
        num_synthetic = args.num_synthetic_train if result["synthetic_recordings"] else 0
        count = sizes[split] + num_synthetic
        synthetic_part = f" ({sizes[split]} FSDD + {num_synthetic} synthetic)" if num_synthetic else ""
        print(f"{split}: {count} utterances{synthetic_part}, {result['num_frames']} frames "
              f"({result['num_frames'] / 100 / 3600:.2f} h), {len(used[split])} FSDD recordings{fold}",
              flush=True)
        if split == "train" and result["num_frames"]:
            mean, std = mean_std(result["sum"], result["sq_sum"], result["num_frames"])
            np.savez(args.out / "stats.npz", mean=mean, std=std)
    for a, b in itertools.combinations(SPLITS, 2):
        common = used[a] & used[b]
        assert not common, f"splits {a} and {b} share recordings {sorted(common)[:5]}"

    lm_rng = np.random.default_rng(seeds["lm"])
    with open(args.out / "lm_text.txt", "w", encoding="utf-8") as lm_text:
        for _ in range(args.num_lm_sentences):
            lm_text.write(" ".join(grammar.digits_to_words(grammar.sample(lm_rng)[1])) + "\n")
    print(f"wrote {args.out} in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
