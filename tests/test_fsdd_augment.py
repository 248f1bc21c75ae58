"""The FSDD CTC recipe's training augmentations (examples/fsdd/fsdd_augment.py, numpy) and, where
torch is installed (not in CI), train_ctc.py's options and the encoder's per-utterance mean."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

RECIPE_DIR = Path(__file__).resolve().parents[1] / "examples" / "fsdd"
if str(RECIPE_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPE_DIR))

from fsdd_augment import Augment, change_tempo, shift_mel  # noqa: E402


def _parse_args(argv):
    pytest.importorskip("torch")
    from train_ctc import parse_args

    return parse_args(argv)


def _feats(t=57, f=40, seed=0):
    return np.random.default_rng(seed).normal(-6.0, 3.0, (t, f)).astype(np.float32)


def test_default_is_off_and_identity():
    args = _parse_args(["--data", "x"])
    assert args.augment == Augment() and not args.augment.active
    assert args.utterance_mean is False
    feats = _feats()
    rng = np.random.default_rng(3)
    state = rng.bit_generator.state
    assert args.augment(feats, rng) is feats
    assert rng.bit_generator.state == state  # draws nothing either


def test_options_parse():
    args = _parse_args(["--aug-tempo", "0.1", "--aug-mel-shift", "2", "--aug-gain", "1.5", "--aug-noise", "0.2",
                       "--utterance-mean"])
    assert args.augment == Augment(tempo=0.1, mel_shift=2.0, gain=1.5, noise=0.2) and args.augment.active
    assert args.utterance_mean is True


@pytest.mark.parametrize("factor", [0.9, 0.95, 1.0, 1.05, 1.1])
def test_tempo_frame_count_and_shape(factor):
    feats = _feats(t=83)
    out = change_tempo(feats, factor)
    assert out.shape == (round(83 / factor), 40) and out.dtype == np.float32


def test_tempo_one_is_identity_and_resamples_a_ramp():
    feats = _feats()
    np.testing.assert_allclose(change_tempo(feats, 1.0), feats)
    ramp = np.repeat(np.arange(40, dtype=np.float32)[:, None], 3, axis=1)  # frame k holds k
    slow = change_tempo(ramp, 0.8)  # 50 frames over the same span: frame j at (j + 0.5) * 0.8 - 0.5
    expected = np.clip((np.arange(50) + 0.5) * 0.8 - 0.5, 0, 39)
    np.testing.assert_allclose(slow[:, 0], expected, atol=1e-5)


def test_mel_shift_moves_bins():
    feats = _feats()
    np.testing.assert_array_equal(shift_mel(feats, 2.0)[:, 2:], feats[:, :-2])
    np.testing.assert_array_equal(shift_mel(feats, 2.0)[:, :2], feats[:, [0, 0]])  # edge held
    np.testing.assert_allclose(shift_mel(feats, 0.5)[:, 1:], 0.5 * (feats[:, 1:] + feats[:, :-1]), rtol=1e-6)
    assert shift_mel(feats, 1.3).shape == feats.shape and shift_mel(feats, 1.3).dtype == np.float32


def test_gain_and_noise_alone():
    feats = _feats()
    gained = Augment(gain=2.0)(feats, np.random.default_rng(5))
    offset = gained - feats
    assert np.ptp(offset) < 1e-5 and 0 < abs(offset[0, 0]) <= 2.0
    noisy = Augment(noise=0.5)(feats, np.random.default_rng(5))
    assert noisy.shape == feats.shape and noisy.dtype == np.float32
    assert 0.4 < float(np.std(noisy - feats)) < 0.6


def test_all_together_deterministic_under_seed():
    aug = Augment(tempo=0.1, mel_shift=1.5, gain=2.0, noise=0.3)
    feats = _feats(t=100)
    a = aug(feats, np.random.default_rng(11))
    b = aug(feats, np.random.default_rng(11))
    c = aug(feats, np.random.default_rng(12))
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.float32 and a.shape[1] == 40 and 90 <= a.shape[0] <= 112
    assert a.shape != c.shape or not np.array_equal(a, c)
    np.testing.assert_array_equal(feats, _feats(t=100))  # input untouched


def _model(torch, utterance_mean):
    from fsdd_models import CtcModel, EncoderOptions

    torch.manual_seed(0)
    opts = EncoderOptions(num_features=40, num_labels=12, num_layers=1, utterance_mean=utterance_mean)
    return CtcModel(opts, np.full(40, -6.0), np.full(40, 3.0)).eval()


def test_utterance_mean_cancels_a_constant_offset_and_ignores_padding():
    torch = pytest.importorskip("torch")
    model, plain = _model(torch, True), _model(torch, False)
    feats = torch.from_numpy(_feats(t=60))[None]
    lengths = torch.tensor([60])
    with torch.no_grad():
        base, _ = model(feats, lengths)
        shifted, _ = model(feats + 2.5, lengths)
        padded, _ = model(torch.cat([feats, torch.full((1, 20, 40), 9.0)], dim=1), lengths)
        plain_base, _ = plain(feats, lengths)
        plain_shifted, _ = plain(feats + 2.5, lengths)
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(padded[:, : base.shape[1]], base, atol=1e-4, rtol=1e-4)
    assert float((plain_shifted - plain_base).abs().max()) > 1e-2  # without the option it does not


# --- a held-out dev speaker (train_ctc.py --hold-out-speaker; fsdd_common, numpy only) -------------

import fsdd_common  # noqa: E402

_SPEAKERS = ["theo", "nicolas", "jackson", "theo", "yweweler", "jackson", "nicolas", "jackson"]
_IDS = [f"train-{i:05d}-{s}" for i, s in enumerate(_SPEAKERS)]


def test_hold_out_speaker_splits_by_the_last_id_part():
    kept, held = fsdd_common.hold_out_speaker(_IDS, "jackson")
    assert held == [2, 5, 7]
    assert kept == [0, 1, 3, 4, 6]
    assert fsdd_common.utterance_speaker("dev-00012-george") == "george"


@pytest.mark.parametrize("speaker, message", [("george", "no utterance"), ("jack", "no utterance")])
def test_hold_out_speaker_without_utterances_is_an_error(speaker, message):
    with pytest.raises(ValueError, match=message):
        fsdd_common.hold_out_speaker(_IDS, speaker)


def test_hold_out_the_only_speaker_is_an_error():
    with pytest.raises(ValueError, match="nothing left"):
        fsdd_common.hold_out_speaker(["train-00000-theo", "train-00001-theo"], "theo")


def test_frame_stats_match_numpy_over_all_frames():
    feats = [_feats(t, 40, seed) for t, seed in ((5, 1), (17, 2), (9, 3))]
    stats = fsdd_common.frame_stats(feats)
    frames = np.vstack(feats)
    np.testing.assert_allclose(stats["mean"], frames.mean(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats["std"], frames.std(axis=0), rtol=1e-4, atol=1e-5)


def _fake_fold(tmp_path, monkeypatch):
    """A fold folder with stats.npz and load_hdf5_split answering from memory (no h5py)."""
    rng = np.random.default_rng(5)
    splits = {
        "train": (_IDS, [rng.normal(i, 1.0, (4 + i, 3)).astype(np.float32) for i in range(len(_IDS))],
                  [np.array([2 + i % 10]) for i in range(len(_IDS))]),
        "dev": (["dev-00000-theo"], [np.zeros((3, 3), np.float32)], [np.array([5])]),
    }
    np.savez(tmp_path / "stats.npz", mean=np.full(3, 7.0), std=np.full(3, 2.0))
    monkeypatch.setattr(fsdd_common, "load_hdf5_split", lambda path: splits[path.parent.name])
    return splits


def test_load_training_data_holds_the_speaker_out(tmp_path, monkeypatch):
    splits = _fake_fold(tmp_path, monkeypatch)
    train_f, train_l, dev_f, dev_l, stats = fsdd_common.load_training_data(tmp_path, held_out_speaker="jackson")
    _, feats, labels = splits["train"]
    jackson = [i for i, s in enumerate(_SPEAKERS) if s == "jackson"]
    others = [i for i, s in enumerate(_SPEAKERS) if s != "jackson"]
    assert [f is feats[i] for f, i in zip(dev_f, jackson)] == [True] * 3 and len(dev_f) == 3
    assert [int(x[0]) for x in dev_l] == [int(labels[i][0]) for i in jackson]
    assert len(train_f) == 5 and all(any(f is feats[i] for i in others) for f in train_f)
    # the stats come from the kept training frames, not from stats.npz (which saw the speaker)
    np.testing.assert_allclose(stats["mean"], np.vstack([feats[i] for i in others]).mean(axis=0), rtol=1e-5)


def test_load_training_data_default_reads_dev_split_and_stats(tmp_path, monkeypatch):
    _fake_fold(tmp_path, monkeypatch)
    train_f, _, dev_f, _, stats = fsdd_common.load_training_data(tmp_path)
    assert len(train_f) == len(_IDS) and len(dev_f) == 1
    np.testing.assert_array_equal(stats["mean"], np.full(3, 7.0))


def test_hold_out_speaker_option_default_none():
    assert _parse_args(["--data", "x"]).hold_out_speaker is None
    assert _parse_args(["--data", "x", "--hold-out-speaker", "jackson"]).hold_out_speaker == "jackson"


@pytest.mark.parametrize("keep_by, kept_epoch", [("dev-loss", 2), ("dev-wer", 4)])
def test_the_kept_checkpoint_is_the_lowest_dev_figure_chosen(tmp_path, keep_by, kept_epoch):
    """A dev loss lowest at epoch 2 while the dev WER keeps falling to epoch 4 (and ties it at 5):
    ``--keep-by`` decides which epoch's checkpoint stays."""
    torch = pytest.importorskip("torch")
    import argparse

    from train_ctc import train_epochs

    (tmp_path / "front_end.json").write_text("{}")
    args = argparse.Namespace(exp=tmp_path / "exp", data=tmp_path, seed=0, epochs=5, batch_frames=100, grad_clip=1.0,
                              log_every=1000, max_minutes=None)
    weight = torch.nn.Parameter(torch.zeros(1))
    optimiser = torch.optim.SGD([weight], lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, lambda step: 1.0)
    records = iter([{"dev_loss": loss, "dev_wer": wer} for loss, wer in
                    ((3.0, 0.5), (1.0, 0.4), (2.0, 0.3), (2.5, 0.2), (2.6, 0.2))])
    train_epochs(args, [weight], optimiser, schedule, [10, 20, 30], lambda ids: (weight.sum() * 0, torch.zeros(())),
                 lambda: next(records), lambda: {"model": "stub"}, keep_by=keep_by)
    assert torch.load(args.exp / "checkpoint.pt", weights_only=False)["epoch"] == kept_epoch
    from loso import last_records

    assert last_records(args.exp / "log.jsonl")["kept_epoch"] == kept_epoch  # the log marks the kept epoch
    assert _parse_args(["--keep-by", "dev-wer"]).keep_by == "dev-wer" and _parse_args([]).keep_by == "dev-loss"


def test_the_summary_reads_the_kept_epoch_from_the_log(tmp_path):
    """loso.py's summary of a training log: the last dev record marked ``kept`` (whatever rule kept
    it), or, in a log without the marks, the best dev-loss epoch."""
    import json

    from loso import last_records

    records = [{"epoch": e, "minutes": e, "dev_loss": loss, "dev_wer": wer, "kept": kept}
               for e, loss, wer, kept in ((1, 3.0, 0.5, True), (2, 1.0, 0.4, True), (3, 2.0, 0.3, True),
                                          (4, 2.5, 0.35, False))]
    marked, unmarked = tmp_path / "marked.jsonl", tmp_path / "unmarked.jsonl"
    marked.write_text("".join(json.dumps(r) + "\n" for r in records))
    unmarked.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "kept"}) + "\n" for r in records))
    assert last_records(marked) == {"epochs_run": 4, "train_minutes_logged": 4, "kept_epoch": 3,
                                    "kept_dev_loss": 2.0, "kept_dev_greedy_wer": 0.3}
    assert last_records(unmarked)["kept_epoch"] == 2


@pytest.mark.parametrize("trainer", ["train_aed", "train_transducer"])
def test_the_decoder_trainers_take_the_same_options(trainer):
    """train_aed.py and train_transducer.py: the augmentations, the held-out dev speaker and the
    checkpoint rule of train_ctc.py (all off or the dev loss by default)."""
    pytest.importorskip("torch")
    import importlib

    parse_args = importlib.import_module(trainer).parse_args
    args = parse_args(["--aug-tempo", "0.1", "--aug-mel-shift", "1", "--hold-out-speaker", "jackson",
                       "--keep-by", "dev-wer", "--device", "cpu"])
    assert args.augment == Augment(tempo=0.1, mel_shift=1.0)
    assert (args.hold_out_speaker, args.keep_by, args.device) == ("jackson", "dev-wer", "cpu")
    default = parse_args([])
    assert not default.augment.active and default.hold_out_speaker is None and default.keep_by == "dev-loss"
