"""Per-utterance inputs with one row per utterance (metadata ``PER_UTTERANCE_ROWS=utterance``).

The grouped reference decoder has the per-lane decoder's weights; each group of beam rows attends
to its utterance's one row of cross-attention keys/values. Expected values come from the numpy
oracles (full sequence, no cache) and from the per-lane model, never from the grouped run itself.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session import ModelError, OnnxSession, SessionOptions, discover_step_model
from gpudecode.session.graphs import GraphOptions
from gpudecode.states.options import StateManagerOptions
from gpudecode.testing import build_transformer_decoder
from tests.test_onnx_decoder_search import BOS, EOS, Setup, terminated, xp_of

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class GroupedSetup(Setup):
    def __init__(self, seed, **kwargs):
        super().__init__(seed, **kwargs)
        vocab_size = self.decoder.vocab_size
        self.grouped = build_transformer_decoder(seed, vocab_size=vocab_size, utterance_rows="utterance")

    def scorer_of(self, reference, graphs=GraphOptions(), max_batch_size=None):
        manager = "transformer-cuda" if self.device == "cuda" else "transformer-cpu"
        return OnnxDecoderScorer(
            model=reference.serialized(), vocab_size=reference.vocab_size, start_labels=[BOS],
            state_manager=StateManagerOptions(type=manager), max_batch_size=max_batch_size,
            session_options=SessionOptions(device=self.device, use_tf32=False), graphs=graphs,
        )


def _step_feeds(rng, reference, num_rows, history):
    feeds = {
        "token": rng.integers(2, reference.vocab_size, (num_rows, 1)).astype(np.int32),
        "token-length": np.ones(num_rows, np.int32),
        "prefix-length": rng.integers(0, history + 1, num_rows).astype(np.int32),
    }
    for name in reference.states:
        feeds[name] = rng.standard_normal((num_rows, reference.num_heads, history, reference.head_dim)).astype(
            np.float32)
    return feeds


def test_grouped_model_equals_its_oracle_and_the_per_lane_model():
    lane = build_transformer_decoder(3, vocab_size=10)
    grouped = build_transformer_decoder(3, vocab_size=10, utterance_rows="utterance")
    rng = np.random.default_rng(0)
    groups, beam, frames = 2, 3, 7
    feeds = _step_feeds(rng, lane, groups * beam, history=4)
    per_utterance = {f"cross-{kind}-{i}": rng.standard_normal((groups, 2, frames, lane.head_dim)).astype(np.float32)
                     for i in range(lane.num_layers) for kind in ("key", "value")}
    per_utterance["encoder-states-size"] = np.array([frames, 4], np.int32)
    repeated = {k: np.repeat(v, beam, axis=0) for k, v in per_utterance.items()}

    got = OnnxSession(grouped.serialized()).run({**feeds, **per_utterance})
    oracle = grouped.oracle({**feeds, **per_utterance})
    per_lane = OnnxSession(lane.serialized()).run({**feeds, **repeated})
    for name, value in oracle.items():
        np.testing.assert_allclose(got[name], value, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(got[name], per_lane[name], atol=1e-5, err_msg=name)
    # each group of beam rows sees its own utterance: the second group's masked frames matter
    assert not np.allclose(got["scores"][:beam], got["scores"][beam:])


def test_discovery_reads_the_row_layout_and_rejects_unknown_values():
    lane = build_transformer_decoder(3, vocab_size=10)
    grouped = build_transformer_decoder(3, vocab_size=10, utterance_rows="utterance")
    assert discover_step_model(OnnxSession(lane.serialized()).tensors).utterance_rows == "lane"
    assert discover_step_model(OnnxSession(grouped.serialized()).tensors).utterance_rows == "utterance"
    model = onnx.load_from_string(grouped.serialized())
    for prop in model.metadata_props:
        if prop.key == "PER_UTTERANCE_ROWS":
            prop.value = "beam"
    with pytest.raises(ModelError, match="PER_UTTERANCE_ROWS='beam'"):
        discover_step_model(OnnxSession(model.SerializeToString()).tensors)
    with pytest.raises(ValueError, match="utterance_rows"):
        build_transformer_decoder(3, utterance_rows="group")


def _search(scorer, batch, xp, beam, **kwargs):
    options = LabelSyncOptions(beam_size=beam, sentence_end=EOS, max_labels_per_input=1.0)
    return label_sync_search([("decoder", scorer, 1.0)], batch, options, xp=xp, **kwargs)


def _assert_same_nbest(got, expected, setup, reference):
    assert len(got) == len(expected)
    for u, (hyps, wanted) in enumerate(zip(got, expected)):
        assert [h.labels for h in hyps] == [h.labels for h in wanted]
        for hyp, other in zip(hyps, wanted):
            assert hyp.score == pytest.approx(other.score, abs=1e-4)
            oracle = setup.oracle_score(reference, u, hyp.labels, terminated(hyp))
            assert hyp.score == pytest.approx(oracle, abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beam, max_batch_size", [(1, None), (3, None), (4, None), (3, 7), (4, 2)])
def test_grouped_search_equals_the_per_lane_search_and_the_oracle(device, beam, max_batch_size):
    setup = GroupedSetup(5, device=device)
    xp = xp_of(device)
    lane = setup.scorer_of(setup.decoder, max_batch_size=max_batch_size)
    grouped = setup.scorer_of(setup.grouped, max_batch_size=max_batch_size)
    expected = _search(lane, setup.batch(xp=xp), xp, beam)
    got = _search(grouped, setup.batch(xp=xp), xp, beam)
    _assert_same_nbest(got, expected, setup, setup.decoder)
    # one row per utterance (max_batch_size rounds down to whole utterances, at least one)
    rows = {name: buffer.shape[0] for name, buffer in grouped.lanes.buffers.items()}
    assert set(rows.values()) == {len(setup.ids)}
    num_lanes = beam * len(setup.ids)
    size = num_lanes if max_batch_size is None else max(beam, max_batch_size // beam * beam)
    assert grouped._chunks() == [slice(s, min(s + size, num_lanes)) for s in range(0, num_lanes, size)]


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_search_through_graph_buckets_equals_the_per_lane_search(device):
    """Buckets pad whole utterances (rows a multiple of the beam); on the CPU as padded runs."""
    setup = GroupedSetup(7, device=device, num_utts=3)
    xp = xp_of(device)
    graphs = GraphOptions(enabled=True, time_step=4, min_rows=4)
    expected = _search(setup.scorer_of(setup.decoder), setup.batch(xp=xp), xp, 3)
    grouped = setup.scorer_of(setup.grouped, graphs=graphs)
    got = _search(grouped, setup.batch(xp=xp), xp, 3)
    _assert_same_nbest(got, expected, setup, setup.decoder)
    buckets, group = grouped.runner.graphs, grouped.lanes.group_size
    assert buckets.rows(9, group) == 12 and buckets.rows(3, group) == 6  # 4 utterances; floor 2
    if device == "cuda":
        assert grouped.captured_graphs > 0


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_continuous_batching_equals_decoding_alone(device):
    setup = GroupedSetup(9, device=device, num_utts=4)
    xp = xp_of(device)
    alone = [_search(setup.scorer_of(setup.grouped), setup.batch([u], xp=xp), xp, 3)[0] for u in range(4)]
    for k in (1, 2, 3):
        got = _search(setup.scorer_of(setup.grouped), setup.batch(xp=xp), xp, 3, max_active_utterances=k)
        for hyps, wanted in zip(got, alone):
            assert [h.labels for h in hyps] == [h.labels for h in wanted]
            assert [h.score for h in hyps] == pytest.approx([h.score for h in wanted], abs=1e-4)
