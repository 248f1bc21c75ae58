"""Batches padded where they are read: a source's batches carry their features padded
(``PaddedBatch``, built in ``gpudecode decode``'s reader thread), the decoder takes that array
instead of padding again (bit for bit the same n-best), refuses one of another shape, and a batch
split after running out of memory or with utterances dropped is padded again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpudecode.decoder import Decoder, _pad
from gpudecode.io import BatchSizing, Utterance, open_features
from gpudecode.io.features import PaddedBatch, pad_features
from gpudecode.job import RunSummary, decode_fitting, whole_batch_padding
from gpudecode.search.nonfinite import NonFiniteScores
from tests.test_peer_whisper import nemo_like_config
from tests.test_readers import WRITERS

ROOT = Path(__file__).resolve().parent.parent
AED = ROOT / "configs" / "random-aed.yaml"  # label-sync, attention decoder; 16 features
CTC = ROOT / "configs" / "ctc.yaml"  # CTC prefix search with an LSTM LM; 16 features
NUM_F = 16


def random_utterances(count: int = 23, seed: int = 0, num_features: int = NUM_F) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, size=count)
    lengths[len(lengths) // 2:][:2] = 31  # a tie
    return {f"utt-{i:02d}": rng.normal(size=(int(n), num_features)).astype(np.float32)
            for i, n in enumerate(lengths)}


def nbest_key(nbests):
    """Everything a hypothesis says, floats compared exactly."""
    return [[(h.labels, h.score, h.scores, h.length, h.frames, h.truncated) for h in nbest] for nbest in nbests]


SIZINGS = [BatchSizing(4), BatchSizing(5, frames=150), BatchSizing(100, frames=400), BatchSizing(6, first=2),
           BatchSizing(1), BatchSizing(1000)]


# --- the reader's batches ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(WRITERS))
@pytest.mark.parametrize("sizing", SIZINGS, ids=str)
def test_batches_carry_their_features_padded_bit_for_bit(tmp_path, fmt, sizing):
    utts = random_utterances()
    with open_features(WRITERS[fmt](tmp_path, utts)) as source:
        batches = list(source.batches(sizing, exclude={"utt-05"}))
    assert sorted(u.id for b in batches for u in b) == sorted(set(utts) - {"utt-05"})
    for batch in batches:
        assert isinstance(batch, PaddedBatch) and isinstance(batch, list)
        padded = batch.padded
        want = _pad([utts[u.id] for u in batch])
        assert padded.dtype == np.float32 and padded.flags.c_contiguous
        assert padded.shape == want.shape == (len(batch), max(u.num_frames for u in batch), NUM_F)
        assert padded.tobytes() == want.tobytes()  # bit for bit, zeros after each utterance's frames
        assert padded.tobytes() == _pad([u.features for u in batch]).tobytes()
        for i, u in enumerate(batch):  # each utterance's features: its own frames, a view of its row
            assert u.features.tobytes() == utts[u.id].tobytes()
            assert u.features.dtype == np.float32 and u.features.flags.c_contiguous
            assert u.features.shape == utts[u.id].shape and np.shares_memory(u.features, padded[i])
        assert whole_batch_padding(batch) is padded


def test_the_padding_rule_has_one_home():
    assert _pad is pad_features
    features = [np.ones((3, 2), np.float32), np.full((5, 2), 2, np.float64), np.ones((1, 2), np.float32)]
    got = pad_features(features)
    assert got.dtype == np.float32 and got.shape == (3, 5, 2) and got.flags.c_contiguous
    assert (got[0, 3:] == 0).all() and (got[2, 1:] == 0).all() and (got[1] == 2).all()


def test_a_padded_batch_is_a_list_of_utterances():
    rng = np.random.default_rng(1)
    utterances = [Utterance(f"u{n}", rng.normal(size=(n, 3)).astype(np.float32), prompt=np.arange(n))
                  for n in (4, 6, 2)]
    batch = PaddedBatch.of(utterances)
    assert [u.id for u in batch] == ["u4", "u6", "u2"] and batch[1].id == "u6" and len(batch) == 3
    assert [u.prompt.tolist() for u in batch] == [u.prompt.tolist() for u in utterances]
    assert batch.padded.tobytes() == _pad([u.features for u in utterances]).tobytes()
    # a slice or a filtered copy is a plain list, without the padding
    assert type(batch[:2]) is list and whole_batch_padding(batch[:2]) is None
    assert whole_batch_padding([u for u in batch if u.id != "u6"]) is None
    # prompt-only utterances (no features): no padded array
    prompts_only = PaddedBatch.of([Utterance("p", None, prompt=np.arange(3))])
    assert prompts_only.padded is None and whole_batch_padding(prompts_only) is None
    assert PaddedBatch.of([]).padded is None


def test_a_skipped_utterance_is_left_out_of_the_padding(tmp_path):
    utts = random_utterances(9)
    utts["utt-04"] = utts["utt-04"].copy()
    utts["utt-04"][0, 0] = np.nan
    with open_features(WRITERS["npy-dir"](tmp_path, utts), on_error="skip") as source:
        batches = list(source.batches(BatchSizing(100)))
        assert [e.utterance_id for e in source.skipped] == ["utt-04"]
    (batch,) = batches
    assert "utt-04" not in [u.id for u in batch] and len(batch) == 8
    assert batch.padded.tobytes() == _pad([utts[u.id] for u in batch]).tobytes()


# --- the decoder takes the padded array ----------------------------------------------------------

@pytest.fixture(scope="module")
def decoders():
    return {"aed": Decoder.from_config(AED, ["search.beam_size=3", "search.max_labels=6"]),
            "ctc": Decoder.from_config(CTC, ["search.beam_size=4"])}


@pytest.mark.parametrize("name", ["aed", "ctc"])
def test_decode_batch_with_the_padded_array_gives_the_same_nbest(decoders, name):
    decoder = decoders[name]
    utts = random_utterances(7, seed=2)
    ids, features = list(utts), list(utts.values())
    want = decoder.decode_batch(ids, features)
    got = decoder.decode_batch(ids, features, padded=_pad(features))
    assert nbest_key(got) == nbest_key(want)
    assert all(len(n) > 0 for n in want)
    # the array is taken, not padded again: other numbers of the same shape give another result
    other = decoder.decode_batch(ids, features, padded=_pad(features) + np.float32(0.5))
    assert nbest_key(other) != nbest_key(want)


class Spy:
    """A decoder that notes what each decode_batch call was given."""

    def __init__(self, decoder, fail=None):
        self.decoder, self.fail, self.calls = decoder, fail, []

    def decode_batch(self, ids, features, prompts=None, *, padded=None):
        self.calls.append((list(ids), padded))
        if self.fail is not None:
            self.fail(ids)
        if prompts is None:
            return self.decoder.decode_batch(ids, features, padded=padded)
        return self.decoder.decode_batch(ids, features, prompts, padded=padded)


@pytest.mark.parametrize("name", ["aed", "ctc"])
@pytest.mark.parametrize("sizing", [BatchSizing(4), BatchSizing(100, frames=200), BatchSizing(50)], ids=str)
def test_decode_fitting_passes_the_readers_padding_and_changes_no_result(tmp_path, decoders, name, sizing):
    utts = random_utterances(11, seed=3)
    with open_features(WRITERS["npz"](tmp_path, utts)) as source:
        batches = list(source.batches(sizing))
    spy = Spy(decoders[name])
    for batch in batches:
        got = list(decode_fitting(spy, batch, RunSummary(), "stop"))
        want = list(decode_fitting(decoders[name], list(batch), RunSummary(), "stop"))  # padded again
        assert [u.id for u, _ in got] == [u.id for u, _ in want] == [u.id for u in batch]
        assert nbest_key([n for _, n in got]) == nbest_key([n for _, n in want])
        assert spy.calls[-1][1] is batch.padded
        reference = decoders[name].decode_batch([u.id for u in batch], [utts[u.id] for u in batch])
        assert nbest_key([n for _, n in got]) == nbest_key(reference)
    assert len(spy.calls) == len(batches)


class FakeOutOfMemory(RuntimeError):
    pass


FakeOutOfMemory.__name__ = "OutOfMemoryError"


def test_after_an_out_of_memory_split_the_halves_are_padded_again(tmp_path, decoders):
    utts = random_utterances(8, seed=5)
    with open_features(WRITERS["npy-dir"](tmp_path, utts)) as source:
        (batch,) = list(source.batches(100))

    def fail(ids):
        if len(ids) > 2:
            raise FakeOutOfMemory("out of memory allocating 1 GiB")

    spy, summary = Spy(decoders["ctc"], fail), RunSummary()
    got = list(decode_fitting(spy, batch, summary, "stop"))
    assert summary.retried_batches == 3 and [u.id for u, _ in got] == [u.id for u in batch]
    assert spy.calls[0] == ([u.id for u in batch], batch.padded)
    assert [len(ids) for ids, _ in spy.calls] == [8, 4, 2, 2, 4, 2, 2]
    assert all(padded is None for _, padded in spy.calls[1:])
    want = decoders["ctc"].decode_batch([u.id for u in batch], [u.features for u in batch])
    assert nbest_key([n for _, n in got]) == nbest_key(want)  # CTC: utterances decode independently


def test_after_a_non_finite_drop_the_rest_is_padded_again(tmp_path, decoders):
    utts = random_utterances(6, seed=6)
    with open_features(WRITERS["npy-dir"](tmp_path, utts)) as source:
        (batch,) = list(source.batches(100))
    bad = batch[2].id

    def fail(ids):
        if bad in ids:
            raise NonFiniteScores([bad], ["lm"])

    spy, summary = Spy(decoders["ctc"], fail), RunSummary()
    got = list(decode_fitting(spy, batch, summary, "skip"))
    assert [u.id for u, _ in got] == [u.id for u in batch if u.id != bad] and len(summary.skipped) == 1
    assert [padded is batch.padded for _, padded in spy.calls] == [True, False]
    assert spy.calls[1][1] is None


# --- a wrong array is refused --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["aed", "ctc"])
def test_a_padded_array_of_another_shape_is_refused(decoders, name):
    decoder = decoders[name]
    utts = random_utterances(4, seed=7)
    ids, features = list(utts), list(utts.values())
    right = _pad(features)
    wrong = {
        "one utterance less": right[1:],
        "one frame more": np.concatenate([right, np.zeros_like(right[:, :1])], axis=1),
        "one frame less": np.ascontiguousarray(right[:, :-1]),
        "other features": np.zeros(right.shape[:2] + (NUM_F + 1,), np.float32),
        "float64": right.astype(np.float64),
        "not C-contiguous": np.asfortranarray(right),
        "a list": right.tolist(),
    }
    for what, padded in wrong.items():
        with pytest.raises(ValueError, match="padded features"):
            decoder.decode_batch(ids, features, padded=padded)
        with pytest.raises(ValueError, match="padded features"):
            decoder.encode(ids, features, padded=padded)
    # decode_fitting hands over no array of another number of utterances than its batch: it pads again
    mismatched = PaddedBatch([Utterance(u, f) for u, f in utts.items()], right[:-1])
    assert whole_batch_padding(mismatched) is None


# --- the other encoder layouts -------------------------------------------------------------------

def test_an_encoderless_model_takes_the_padded_array_as_its_states(tmp_path):
    """Without an encoder the features are the encoder states: the padded array itself."""
    from gpudecode.testing.transformer import build_transformer_decoder

    model = build_transformer_decoder(0, cross_attention="encoder-states").save(tmp_path / "decoder.onnx")
    decoder = Decoder.from_config(AED, ["models.encoder=null", "io.features.num_features=null",
                                        f"scorers.0.model={model}", "search.max_labels=6"])
    assert decoder.encoder is None
    utts = random_utterances(5, seed=8, num_features=32)
    ids, features = list(utts), list(utts.values())
    padded = _pad(features)
    assert decoder.encode(ids, features, padded=padded).inputs["encoder-states"] is padded  # numpy: no copy
    want = decoder.decode_batch(ids, features)
    assert nbest_key(decoder.decode_batch(ids, features, padded=_pad(features))) == nbest_key(want)
    with pytest.raises(ValueError, match="padded features"):
        decoder.decode_batch(ids, features, padded=padded[:, :-1].copy())


def test_a_channels_first_encoder_gets_the_padded_array_transposed(tmp_path):
    labels = 5
    decoder = Decoder.from_config(nemo_like_config(tmp_path, labels, {"type": "ctc-prefix", "beam_size": 3}))
    utts = random_utterances(6, seed=9, num_features=labels)
    ids, features = list(utts), list(utts.values())
    want = decoder.decode_batch(ids, features)
    assert nbest_key(decoder.decode_batch(ids, features, padded=_pad(features))) == nbest_key(want)
    with pytest.raises(ValueError, match="padded features"):
        decoder.decode_batch(ids, features, padded=np.ascontiguousarray(_pad(features).transpose(0, 2, 1)))
