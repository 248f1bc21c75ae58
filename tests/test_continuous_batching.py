"""Continuous batching in the label-synchronous search: the same n-best per utterance as decoding
each utterance alone, for several admission orders and numbers of active utterances; no slot
leaks; one small transfer per step; admitting fewer utterances when memory runs out.

Near-ties: every reference run alone records the smallest gap at a beam cutoff (the
k-th vs the (k+1)-th ranked candidate) and the test asserts it exceeds 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.backend import to_host
from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.base import LaneLayout
from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer, RecurrentLmScorer
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.search.batching import admission_order
from gpudecode.search.stats import SearchStats
from gpudecode.search.tuning import SearchTuning
from gpudecode.session import SessionOptions
from gpudecode.states.options import StateManagerOptions
from gpudecode.testing import build_lstm_lm, build_prefix_lm
from tests.test_onnx_decoder_search import Setup
from tests.test_search_label_sync import TrigramTableScorer, random_tables

BOS, EOS = 0, 1
TOL, MIN_GAP = 1e-4, 1e-3
ORDERS = ("longest-first", "shortest-first", "input")


class CutoffGaps(list):
    """Gaps between the k-th and (k+1)-th key of every top-k of the searches given ``stats``."""

    def __init__(self):
        super().__init__()
        self.stats = SearchStats(on_top_k=self.record)

    def record(self, keys, k):
        host = np.sort(np.asarray(to_host(keys), dtype=np.float64), axis=1)[:, ::-1]
        if host.shape[1] > k:
            kth, nxt = host[:, k - 1], host[:, k]
            finite = np.isfinite(kth) & np.isfinite(nxt)
            self.extend((kth[finite] - nxt[finite]).tolist())


@pytest.fixture
def cutoff_gaps():
    """Records, for every top-k of the reference searches, the gap between the k-th and (k+1)-th key."""
    return CutoffGaps()


def alone(make_scorers, batch: UtteranceBatch, options, xp=np, stats=None):
    return [label_sync_search(make_scorers(), batch.select([u]), options, xp=xp, stats=stats)[0]
            for u in range(batch.num_utterances)]


def assert_same(expected, got):
    assert len(expected) == len(got)
    for u, (a, b) in enumerate(zip(expected, got)):
        assert [h.labels for h in a] == [h.labels for h in b], f"utterance {u}"
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=TOL)
        for ha, hb in zip(a, b):
            assert ha.length == hb.length
            for name in ha.scores:
                assert ha.scores[name] == pytest.approx(hb.scores[name], abs=TOL)


# --- a table scorer: many utterances, fast ----------------------------------------------------------
@pytest.mark.parametrize("lagged", [False, True], ids=["mask-read-at-once", "mask-read-one-step-late"])
@pytest.mark.parametrize("beam", [1, 3])
def test_table_scorer_continuous_equals_alone(beam, lagged, cutoff_gaps):
    """(lagged: the finished-groups mask is read one step late, as on CuPy; a group reset after
    the mask's step must not count as finished, and a finished group carries itself once more.)"""
    vocab, eos, num_utts = 6, 0, 9
    tables = random_tables(seed=21, num_utts=num_utts, vocab_size=vocab, eos=eos, eos_bias=-1.0)
    lengths = np.array([3, 12, 5, 8, 2, 10, 7, 4, 9])
    batch = UtteranceBatch(ids=[f"u{u}" for u in range(num_utts)], input_lengths=lengths,
                           inputs={"table": tables})
    options = LabelSyncOptions(beam_size=beam, sentence_end=eos, max_labels_per_input=1.0,
                               length_norm_scale=0.5)
    expected = alone(lambda: [("t", TrigramTableScorer(vocab), 1.0)], batch, options, stats=cutoff_gaps.stats)
    assert min(cutoff_gaps) > MIN_GAP
    lengths_out = {len(h[0].labels) for h in expected}
    assert len(lengths_out) >= 4  # utterances really finish at different steps
    tuning = SearchTuning(lagged_continuous_mask=lagged)
    for k in (1, 2, 4, 9, 20):
        for order in ORDERS:
            scorer = TrigramTableScorer(vocab)
            got = label_sync_search([("t", scorer, 1.0)], batch, options, max_active_utterances=k,
                                    admission_order=order, tuning=tuning)
            assert_same(expected, got)
            assert scorer.released == list(range(min(k, num_utts)))  # every group released at the end


def test_admission_orders():
    lengths = [3, 9, 3, 1, 9]
    assert admission_order(lengths, "longest-first").tolist() == [1, 4, 0, 2, 3]
    assert admission_order(lengths, "shortest-first").tolist() == [3, 0, 2, 1, 4]
    assert admission_order(lengths, "input").tolist() == [0, 1, 2, 3, 4]
    batch = UtteranceBatch(ids=["a"], input_lengths=[2], inputs={"table": random_tables(0, 1, 4, 0)})
    options = LabelSyncOptions(beam_size=2, sentence_end=0)
    with pytest.raises(ValueError, match="max_active_utterances"):
        label_sync_search([("t", TrigramTableScorer(4), 1.0)], batch, options, max_active_utterances=0)
    with pytest.raises(ValueError, match="admission_order"):
        label_sync_search([("t", TrigramTableScorer(4), 1.0)], batch, options, max_active_utterances=1,
                          admission_order="random")


def test_one_small_transfer_per_step():
    events: list = []

    def counting(arrays):
        events.append(("transfer", sum(int(np.prod(a.shape)) for a in arrays)))

    vocab, eos, k = 6, 0, 3
    tables = random_tables(seed=4, num_utts=7, vocab_size=vocab, eos=eos, eos_bias=1.0)
    batch = UtteranceBatch(ids=list("abcdefg"), input_lengths=[9, 4, 7, 3, 8, 5, 6], inputs={"table": tables})
    label_sync_search([("t", TrigramTableScorer(vocab, events=events), 1.0)], batch,
                      LabelSyncOptions(beam_size=2, sentence_end=eos), max_active_utterances=k,
                      stats=SearchStats(on_transfer=counting))
    steps: list[list] = []
    for event in events:
        if event == "score":
            steps.append([])
        else:
            steps[-1].append(event)
    for during in steps[:-1]:
        assert during == [("transfer", k)]  # the finished-groups mask, nothing else
    assert steps[-1][0] == ("transfer", k) and len(steps[-1]) == 2  # + the results, once


# --- ONNX scorers ---------------------------------------------------------------------------------
def decoder_scorers(setup: Setup, lm, device="cpu", start_labels=(BOS,), chunk=1024):
    sm = "cuda" if device == "cuda" else "cpu"
    decoder = OnnxDecoderScorer(
        model=setup.decoder.serialized(), vocab_size=12, start_labels=list(start_labels),
        state_manager=StateManagerOptions(type=f"transformer-{sm}", slots_per_chunk=chunk),
        session_options=SessionOptions(device=device))
    fused = RecurrentLmScorer(model=lm.serialized(), vocab_size=12, start_labels=[BOS],
                              state_manager=StateManagerOptions(type=f"lstm-{sm}", slots_per_chunk=chunk),
                              session_options=SessionOptions(device=device))
    return [("decoder", decoder, 1.0), ("lm", fused, 0.3)]


@pytest.mark.parametrize("start_labels", [(BOS,), (BOS, 5)])
def test_attention_decoder_with_lm_continuous_equals_alone(start_labels, cutoff_gaps):
    setup = Setup(8, num_utts=4, frames=(14, 5, 11, 8))
    lm = build_lstm_lm(8, vocab_size=12)
    options = LabelSyncOptions(beam_size=3, sentence_end=EOS, max_labels_per_input=1.0)
    batch = setup.batch()
    expected = alone(lambda: decoder_scorers(setup, lm, start_labels=start_labels), batch, options,
                     stats=cutoff_gaps.stats)
    assert min(cutoff_gaps) > MIN_GAP
    for k, order in [(1, "input"), (2, "longest-first"), (3, "shortest-first"), (2, "input")]:
        scorers = decoder_scorers(setup, lm, start_labels=start_labels)
        got = label_sync_search(scorers, batch, options, max_active_utterances=k, admission_order=order)
        assert_same(expected, got)
        for _, scorer, _ in scorers:
            assert scorer.states.statistics().live_slots == 0


def prefix_batch(seed: int, sizes, xp=np):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    states = rng.normal(size=(len(sizes), int(sizes.max()), 32)).astype(np.float32)
    return UtteranceBatch(ids=[f"utt{u}" for u in range(len(sizes))], input_lengths=sizes,
                          inputs={"encoder-states": xp.asarray(states)})


def prefix_lm(pair, device="cpu", chunk=1024, **options):
    sm = "transformer-cuda" if device == "cuda" else "transformer-cpu"
    return PrefixLmScorer(model=pair.step.serialized(), prefill_model=pair.prefill.serialized(), vocab_size=12,
                          initial_prompt_labels=[2], suffix_prompt_labels=[BOS],
                          state_manager=StateManagerOptions(type=sm, slots_per_chunk=chunk),
                          session_options=SessionOptions(device=device), **options)


def test_prefix_lm_continuous_equals_alone(cutoff_gaps):
    pair = build_prefix_lm(3)
    batch = prefix_batch(0, [5, 2, 7, 4, 3, 6])
    options = LabelSyncOptions(beam_size=3, sentence_end=EOS, max_labels_per_input=1.5)
    expected = alone(lambda: [("lm", prefix_lm(pair), 1.0)], batch, options, stats=cutoff_gaps.stats)
    assert min(cutoff_gaps) > MIN_GAP
    for k in (1, 2, 4, 6):
        for order in ORDERS:
            scorer = prefix_lm(pair, max_batch_size=2)
            got = label_sync_search([("lm", scorer, 1.0)], batch, options, max_active_utterances=k,
                                    admission_order=order)
            assert_same(expected, got)
            assert scorer.states.statistics().live_slots == 0


def test_no_slot_leaks_after_a_thousand_admissions():
    pair = build_prefix_lm(6, num_layers=1, model_dim=16, encoder_dim=8)
    rng = np.random.default_rng(1)
    num_utts, chunk, k, beam = 1000, 64, 8, 2
    sizes = rng.integers(1, 4, num_utts).astype(np.int32)
    states = rng.normal(size=(num_utts, 3, 8)).astype(np.float32)
    batch = UtteranceBatch(ids=[str(u) for u in range(num_utts)], input_lengths=sizes,
                           inputs={"encoder-states": states})
    scorer = prefix_lm(pair, chunk=chunk)
    admitted = []
    original = scorer.admit

    def counting_admit(utterances, groups):
        admitted.extend(utterances.ids)
        original(utterances, groups)

    scorer.admit = counting_admit
    nbest = label_sync_search([("lm", scorer, 1.0)], batch,
                              LabelSyncOptions(beam_size=beam, sentence_end=EOS, max_labels_per_input=2.0),
                              max_active_utterances=k)
    assert sorted(admitted, key=int) == [str(u) for u in range(num_utts)]
    assert all(nbest)
    stats = scorer.states.statistics()
    assert stats.live_slots == 0
    # live slots at most: every lane's prompt (1 + 3 + 1) + labels (<= 6) + one new token per lane
    assert stats.peak_live_slots <= k * beam * (5 + 6 + 1) + k * 5
    assert stats.capacity_slots <= -(-stats.peak_live_slots // chunk) * chunk


class FlakyMemory:
    """Wraps a scorer: admitting more than ``limit`` utterances at once raises MemoryError."""

    def __init__(self, scorer, limit: int):
        self.scorer, self.limit, self.refused = scorer, limit, 0
        self.vocab_size = scorer.vocab_size

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def admit(self, utterances, groups):
        if utterances.num_utterances > self.limit:
            self.refused += 1
            raise MemoryError("out of memory (test)")
        self.scorer.admit(utterances, groups)


def test_out_of_memory_while_admitting_admits_fewer():
    vocab, eos = 6, 0
    tables = random_tables(seed=21, num_utts=9, vocab_size=vocab, eos=eos, eos_bias=1.0)
    batch = UtteranceBatch(ids=[f"u{u}" for u in range(9)], input_lengths=[3, 12, 5, 8, 2, 10, 7, 4, 9],
                           inputs={"table": tables})
    options = LabelSyncOptions(beam_size=2, sentence_end=eos)
    expected = label_sync_search([("t", TrigramTableScorer(vocab), 1.0)], batch, options)
    flaky = FlakyMemory(TrigramTableScorer(vocab), limit=1)
    got = label_sync_search([("t", flaky, 1.0)], batch, options, max_active_utterances=4)
    assert flaky.refused >= 2  # 4 -> 2 -> 1 at the start
    assert_same(expected, got)
    with pytest.raises(MemoryError):
        label_sync_search([("t", FlakyMemory(TrigramTableScorer(vocab), limit=0), 1.0)], batch, options,
                          max_active_utterances=4)


# --- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_continuous_equals_cpu_alone():
    import cupy

    setup_cpu, setup_gpu = Setup(8, num_utts=4, frames=(14, 5, 11, 8)), Setup(8, num_utts=4, frames=(14, 5, 11, 8),
                                                                             device="cuda")
    lm = build_lstm_lm(8, vocab_size=12)
    options = LabelSyncOptions(beam_size=3, sentence_end=EOS, max_labels_per_input=1.0)
    expected = alone(lambda: decoder_scorers(setup_cpu, lm), setup_cpu.batch(), options)
    for k in (1, 2, 3):
        scorers = decoder_scorers(setup_gpu, lm, device="cuda", chunk=256)
        got = label_sync_search(scorers, setup_gpu.batch(xp=cupy), options, xp=cupy, max_active_utterances=k)
        assert_same(expected, got)
        for _, scorer, _ in scorers:
            assert scorer.states.statistics().live_slots == 0


@pytest.mark.gpu
def test_cuda_prefix_lm_two_thousand_utterances_pool_stays_bounded():
    import cupy

    pair = build_prefix_lm(6, num_layers=1, model_dim=16, encoder_dim=8)
    rng = np.random.default_rng(2)
    num_utts, chunk = 2000, 256
    sizes = rng.integers(1, 9, num_utts).astype(np.int32)
    batch = UtteranceBatch(ids=[str(u) for u in range(num_utts)], input_lengths=sizes,
                           inputs={"encoder-states": cupy.asarray(rng.normal(size=(num_utts, 8, 8)).astype(np.float32))})
    options = LabelSyncOptions(beam_size=4, sentence_end=EOS, max_labels_per_input=2.0)
    scorer = prefix_lm(pair, device="cuda", chunk=chunk)
    got = label_sync_search([("lm", scorer, 1.0)], batch, options, xp=cupy, max_active_utterances=64)
    stats = scorer.states.statistics()
    assert stats.live_slots == 0
    assert stats.capacity_slots <= -(-stats.peak_live_slots // chunk) * chunk
    # a sample decoded alone on the CPU gives the same n-best
    cpu_batch = UtteranceBatch(ids=batch.ids, input_lengths=sizes,
                               inputs={"encoder-states": cupy.asnumpy(batch.inputs["encoder-states"])})
    sample = [0, 1, 777, 1999]
    expected = alone(lambda: [("lm", prefix_lm(pair), 1.0)], cpu_batch.select(sample), options)
    assert_same(expected, [got[u] for u in sample])


def test_each_chunk_pads_only_to_its_own_longest_history():
    """With max_batch_size chunks, a model call's history axis is its rows' longest history, not
    the whole batch's (refilled lanes sit beside long histories); results stay the same."""
    pair = build_prefix_lm(3)
    batch = prefix_batch(0, [5, 2, 7, 4, 3, 6])
    options = LabelSyncOptions(beam_size=3, sentence_end=EOS, max_labels_per_input=1.5)
    expected = alone(lambda: [("lm", prefix_lm(pair), 1.0)], batch, options)
    scorer = prefix_lm(pair, max_batch_size=3)
    calls = []
    original = scorer.states.merge

    def recording_merge(histories, **kwargs):
        merged = original(histories, **kwargs)
        calls.append((int(merged.time_size), int(np.asarray(to_host(histories.lengths)).max(initial=0)),
                      histories.width))
        return merged

    scorer.states.merge = recording_merge
    got = label_sync_search([("lm", scorer, 1.0)], batch, options, max_active_utterances=2)
    assert_same(expected, got)
    assert calls and all(time_size == longest for time_size, longest, _ in calls)
    assert any(time_size < width for time_size, _, width in calls), "no chunk was shorter than the table"


def test_a_shorter_admission_clears_the_frames_the_longer_one_left():
    """Per-utterance input rows are reused: admitting an utterance with fewer encoder frames into a
    group whose last utterance had more zeroes the old frames beyond the new ones (only then)."""
    setup = Setup(8, num_utts=2, frames=(14, 5))
    scorer = decoder_scorers(setup, build_lstm_lm(8, vocab_size=12))[0][1]
    scorer.begin(LaneLayout(num_groups=2, beam_size=3))
    long_batch = setup.batch([0])
    scorer.admit(long_batch, [1])
    inputs = {u.name: u.time_axis for u in scorer.spec.utterance_inputs if u.time_axis is not None}
    assert inputs, "the decoder has per-utterance inputs with a time axis"
    short = {}
    for name, axis in inputs.items():
        index = [slice(None)] * long_batch.inputs[name].ndim
        index[axis] = slice(0, 5)
        short[name] = long_batch.inputs[name][tuple(index)]
    scorer.admit(UtteranceBatch(ids=["short"], input_lengths=[5], inputs=short), [1])
    first_row = 1 if scorer.lanes.grouped else 3  # group 1's row: one per utterance, or its first lane
    for name, axis in inputs.items():
        row = scorer.lanes.buffers[name][first_row]
        tail = [slice(None)] * row.ndim
        tail[axis - 1] = slice(5, None)
        assert not row[tuple(tail)].any(), name  # the long utterance's frames 5.. are gone
        head = list(tail)
        head[axis - 1] = slice(0, 5)
        np.testing.assert_array_equal(row[tuple(head)], short[name][0])
