"""What the FSDD recipe's scripts share: paths, splits, the front end, the vocabulary, readers.

Not imported by the library. The scripts run as ``python examples/fsdd/<script>.py`` from any
folder; relative defaults resolve against the repository root.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from fsdd_grammar import DIGIT_WORDS

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE_DIR = Path(__file__).resolve().parent
DEFAULT_RECORDINGS = REPO_ROOT.parent / "shared" / "data" / "fsdd" / "recordings"
DEFAULT_DATA_DIR = RECIPE_DIR / "data"

# Recording indices of each split (FSDD's own test split is 0-4; dev is carved out of training).
SPLITS: dict[str, range] = {"train": range(10, 50), "dev": range(5, 10), "test": range(0, 5)}

# A leave-one-speaker-out fold (make_data.py --test-speaker NAME): test holds every recording of
# NAME (indices 0-49); train and dev hold only the other speakers, train from their indices
# 10-49 and dev from their indices 0-9 (a part of those speakers held out of training).
FOLD_SPLITS: dict[str, range] = {"train": range(10, 50), "dev": range(0, 10), "test": range(0, 50)}


def split_indices(split: str, test_speaker: str | None = None) -> range:
    """Recording indices of ``split``: SPLITS' rule, or FOLD_SPLITS' in a fold."""
    return (SPLITS if test_speaker is None else FOLD_SPLITS)[split]


def split_speakers(split: str, speakers, test_speaker: str | None = None) -> list[str]:
    """Speakers of ``split`` (sorted as given): all of them, or in a fold only ``test_speaker``
    for test and every other speaker for train and dev."""
    speakers = list(speakers)
    if test_speaker is None:
        return speakers
    if test_speaker not in speakers:
        raise ValueError(f"test speaker {test_speaker!r} is not one of {speakers}")
    return [test_speaker] if split == "test" else [s for s in speakers if s != test_speaker]

# The toolkit's log-mel front end (gpudecode.io.frontend.LogMelOptions / models.front_end in a
# config). 40 bins on a 256-point FFT from 20 Hz leave no mel filter empty at 8 kHz; the
# default 80 bins would not. Features are written without normalisation: the models hold the
# global mean and variance of the training features (stats.npz) as constants.
FRONT_END: dict[str, object] = {
    "sample_rate_hz": 8000,
    "window_ms": 25.0,
    "hop_ms": 10.0,
    "fft_size": 256,
    "num_mel_bins": 40,
    "low_freq_hz": 20.0,
    "window_type": "hann",
    "normalisation": "none",
}

# One vocabulary for every model of the recipe (CTC, transducer, AED, LMs): label index =
# line number. Blank only matters to CTC and the transducer; "</s>" is sentence begin and end
# for the attention decoder and the LMs.
BLANK = "<blank>"
SENTENCE_END = "</s>"
VOCABULARY: tuple[str, ...] = (BLANK, SENTENCE_END, *DIGIT_WORDS)
FIRST_DIGIT_INDEX = VOCABULARY.index("zero")

LICENSE_NOTE = ("Derived from the Free Spoken Digit Dataset (Jakobovski/free-spoken-digit-dataset, "
                "commit 26eb9aaf), CC BY-SA 4.0; this file carries the same license.")


def resolve(path: str | Path) -> Path:
    """A path from the command line: absolute, or relative to the current folder."""
    return Path(path).expanduser().resolve()


def read_text(path: Path) -> dict[str, list[str]]:
    """Reference transcripts: ``{utt-id: words}`` from ``utt-id word word ...`` lines."""
    refs: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if parts[0] in refs:
            raise ValueError(f"{path}:{number}: duplicate utterance id {parts[0]!r}")
        refs[parts[0]] = parts[1:]
    return refs


def words_to_labels(words: list[str]) -> list[int]:
    return [VOCABULARY.index(w) for w in words]


def load_hdf5_split(path: Path) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    """``(ids, features (T, F) float32 each, labels (L,) int64 each)`` from a RETURNN-layout
    HDF5 written by make_data.py (labels from ``targets/data/classes``)."""
    import h5py

    with h5py.File(path, "r") as f:
        inputs = f["inputs"][...]
        lengths = np.asarray(f["seqLengths"][...])
        tags = [t.decode() if isinstance(t, bytes) else str(t) for t in f["seqTags"][...]]
        classes = f["targets/data/classes"][...]
    frame_ends = np.cumsum(lengths[:, 0])
    label_ends = np.cumsum(lengths[:, 1])
    feats = np.split(inputs, frame_ends[:-1])
    labels = [x.astype(np.int64) for x in np.split(classes, label_ends[:-1])]
    return tags, feats, labels


def utterance_speaker(utt_id: str) -> str:
    """The speaker of an utterance id such as ``train-00012-george`` (its last ``-`` part)."""
    return utt_id.rsplit("-", 1)[-1]


def hold_out_speaker(utt_ids: list[str], speaker: str) -> tuple[list[int], list[int]]:
    """``(kept, held)``: indices of ``utt_ids`` not spoken by ``speaker`` and of those that are,
    each in the given order. Raises ValueError when ``speaker`` has no utterance or every one."""
    held = [i for i, u in enumerate(utt_ids) if utterance_speaker(u) == speaker]
    kept = [i for i, u in enumerate(utt_ids) if utterance_speaker(u) != speaker]
    if not held:
        speakers = sorted({utterance_speaker(u) for u in utt_ids})
        raise ValueError(f"hold-out speaker {speaker!r} has no utterance; speakers: {speakers}")
    if not kept:
        raise ValueError(f"hold-out speaker {speaker!r} speaks every utterance; nothing left to train on")
    return kept, held


def mean_std(total: np.ndarray, squares: np.ndarray, num_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and std from the sums of the frames and of their squares (the variance
    floored at 1e-8): the models' normalisation statistics (stats.npz)."""
    mean = total / num_frames
    return mean, np.sqrt(np.maximum(squares / num_frames - mean**2, 1e-8))


def frame_stats(feats: list[np.ndarray]) -> dict[str, np.ndarray]:
    """``{"mean", "std"}`` (F,) over every frame of ``feats``, as make_data.py's stats.npz."""
    frames = np.concatenate(feats).astype(np.float64)
    mean, std = mean_std(frames.sum(axis=0), (frames**2).sum(axis=0), frames.shape[0])
    return {"mean": mean.astype(np.float32), "std": std.astype(np.float32)}


def load_training_data(data: Path, max_train: int | None = None, max_dev: int | None = None,
                       held_out_speaker: str | None = None):
    """(train features, train labels, dev features, dev labels, normalisation stats) of
    make_data.py's output, the splits cut to their first ``max_train`` / ``max_dev`` utterances.

    With ``held_out_speaker``, train drops that speaker's utterances and dev is those utterances
    (from the train split; the dev split is not read), and the stats are recomputed from the
    kept training features, so nothing of that speaker reaches the model."""
    train_ids, train_feats, train_labels = load_hdf5_split(data / "train" / "feats.h5")
    if held_out_speaker is None:
        _, dev_feats, dev_labels = load_hdf5_split(data / "dev" / "feats.h5")
        stats = np.load(data / "stats.npz")
    else:
        kept, held = hold_out_speaker(train_ids, held_out_speaker)
        dev_feats, dev_labels = [train_feats[i] for i in held], [train_labels[i] for i in held]
        train_feats, train_labels = [train_feats[i] for i in kept], [train_labels[i] for i in kept]
        stats = frame_stats(train_feats)
    return (train_feats[:max_train], train_labels[:max_train], dev_feats[:max_dev], dev_labels[:max_dev],
            stats)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
