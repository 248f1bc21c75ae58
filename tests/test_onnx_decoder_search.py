"""Label-synchronous search with ONNX scorers against the numpy oracles (exactness: same labels, scores within 1e-4).

Every expected value comes from the reference models' own numpy oracles (full-sequence, no cache),
never from the search or the state managers.
"""

import itertools

import numpy as np
import pytest

from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer, RecurrentLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session import OnnxSession, SessionOptions
from gpudecode.states.options import StateManagerOptions
from gpudecode.testing import build_encoder, build_lstm_lm, build_transformer_decoder, build_transformer_lm

BOS, EOS = 0, 1


class Setup:
    """An encoder + attention decoder pair, encoded utterances and the oracle's sequence scores."""

    def __init__(self, seed, *, vocab_size=12, num_utts=3, device="cpu", kv_layout="bhtd", frames=(14, 9, 11, 6),
                 export=("full", False), dtype=np.float32, model_dim=32):
        self.device = device
        self.dtype = np.dtype(dtype)
        self.encoder = build_encoder(seed, num_decoder_layers=2, num_heads=2, decoder_dim=model_dim)
        self.decoder = build_transformer_decoder(seed, vocab_size=vocab_size, kv_layout=kv_layout,
                                                 state_outputs=export[0], fused_qkv=export[1],
                                                 attention=export[2] if len(export) > 2 else "dense", dtype=dtype,
                                                 fused_ops=len(export) > 3 and export[3],
                                                 history_alignment=export[4] if len(export) > 4 else "right",
                                                 ft_keys=len(export) > 5 and export[5], model_dim=model_dim)
        rng = np.random.default_rng(seed)
        lengths = np.array(frames[:num_utts], np.int32)
        features = rng.standard_normal((num_utts, lengths.max(), 16)).astype(np.float32)
        out = OnnxSession(self.encoder.serialized()).run({"features": features, "features-size": lengths})
        self.sizes = out["encoder-states-size"]
        self.cross = {k: v for k, v in out.items() if k.startswith("cross-")}
        self.ids = [f"utt{u}" for u in range(num_utts)]

    def batch(self, indices=None, xp=np):
        indices = range(len(self.ids)) if indices is None else indices
        indices = list(indices)
        return UtteranceBatch(
            ids=[self.ids[i] for i in indices], input_lengths=self.sizes[indices],
            inputs={k: xp.asarray(v[indices].astype(self.dtype)) for k, v in self.cross.items()},
        )

    def encoder_inputs(self, u):
        feeds = {k: v[u:u + 1] for k, v in self.cross.items()}
        feeds["encoder-states-size"] = self.sizes[u:u + 1]
        return feeds

    def scorer(self, **state_manager):
        sm_type = "transformer-cuda" if self.device == "cuda" else "transformer-cpu"
        return OnnxDecoderScorer(
            model=self.decoder.serialized(), vocab_size=self.decoder.vocab_size, start_labels=[BOS],
            state_manager=StateManagerOptions(type=sm_type, **state_manager),
            session_options=SessionOptions(device=self.device),
        )

    def oracle_score(self, reference, u, labels, terminated, encoder_inputs=True):
        rows = reference.sequence_log_probs([BOS, *labels], self.encoder_inputs(u) if encoder_inputs else None)
        targets = [*labels, EOS] if terminated else list(labels)
        return float(sum(rows[p, t] for p, t in enumerate(targets)))


def xp_of(device):
    if device == "cuda":
        import cupy

        return cupy
    return np


def search(scorers, batch, xp=np, **options):
    options = {"beam_size": 4, "sentence_end": EOS, "max_labels_per_input": 1.0, **options}
    return label_sync_search(scorers, batch, LabelSyncOptions(**options), xp=xp)


def terminated(hyp):
    return hyp.length == len(hyp.labels) + 1


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_exhaustive_enumeration_with_a_beam_larger_than_all_candidates():
    vocab, cap = 4, 3
    setup = Setup(11, vocab_size=vocab, num_utts=2)
    nbest = search([("decoder", setup.scorer(), 1.0)], setup.batch(), beam_size=48, max_labels=cap, nbest=40)
    non_eos = [label for label in range(vocab) if label != EOS]
    for u, hyps in enumerate(nbest):
        everything = []
        for k in range(cap + 1):
            for labels in itertools.product(non_eos, repeat=k):
                if k < cap:
                    everything.append((setup.oracle_score(setup.decoder, u, labels, True), list(labels), True))
                if k == cap:
                    everything.append((setup.oracle_score(setup.decoder, u, labels, False), list(labels), False))
        everything.sort(key=lambda e: -e[0])
        assert len(hyps) == len(everything) == 40
        assert everything[0][0] - everything[1][0] > 1e-3  # no near-tie at the top
        assert hyps[0].labels == everything[0][1] and terminated(hyps[0]) == everything[0][2]
        found = {(tuple(h.labels), terminated(h)): h.score for h in hyps}
        for score, labels, ended in everything:
            assert found[(tuple(labels), ended)] == pytest.approx(score, abs=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_layout, export", [("bhtd", ("full", False)), ("btd", ("full", False)),
                                               ("bhtd", ("new", True)), ("btd", ("new", False)),
                                               ("bhtd", ("new", True, "dense", True)),
                                               ("bhtd", ("new", True, "dense", True, "left"))])
def test_every_nbest_score_equals_the_full_sequence_oracle(device, kv_layout, export):
    """(export: the model outputs the whole history or only the new step; the last two
    with ONNX Runtime's fused ops, the last over left-aligned histories.)"""
    setup = Setup(5, device=device, kv_layout=kv_layout, export=export)
    scorer = setup.scorer()
    nbest = search([("decoder", scorer, 1.0)], setup.batch(xp=xp_of(device)), xp=xp_of(device), beam_size=4)
    checked = 0
    for u, hyps in enumerate(nbest):
        assert len(hyps) == 4
        for hyp in hyps:
            expected = setup.oracle_score(setup.decoder, u, hyp.labels, terminated(hyp))
            assert hyp.score == pytest.approx(expected, abs=1e-4)
            assert hyp.scores["decoder"] == pytest.approx(expected, abs=1e-4)
            checked += 1
    assert checked == 12
    assert scorer.states.statistics().live_slots == 0  # released after the run


@pytest.mark.parametrize("device", DEVICES)
def test_float16_decoder_hands_on_float16_scores_and_matches_the_oracle(device):
    """A float16 decoder's score() returns its log-probs as float16 (no [N, V] float32 copy per
    step; the label-step kernel reads them as they are, the array version converts), and every
    n-best score equals the float32 oracle's score of its labels within float16 rounding."""
    setup = Setup(5, device=device, export=("new", True, "dense", True, "left"), dtype=np.float16)
    scorer = setup.scorer()
    dtypes, score = [], scorer.score

    def recorded(ctx):
        scores = score(ctx)
        dtypes.append(np.dtype(scores.dtype))
        return scores

    scorer.score = recorded
    nbest = search([("decoder", scorer, 1.0)], setup.batch(xp=xp_of(device)), xp=xp_of(device), beam_size=4)
    assert len(dtypes) > 3 and set(dtypes) == {np.dtype(np.float16)}
    for u, hyps in enumerate(nbest):
        assert len(hyps) == 4
        for hyp in hyps:
            expected = setup.oracle_score(setup.decoder, u, hyp.labels, terminated(hyp))
            assert hyp.score == pytest.approx(expected, abs=0.05 + 0.01 * len(hyp.labels))


@pytest.mark.parametrize("device, attention", [("cpu", "ragged"), ("cpu", "gqa"), ("cpu", "fused-left"), ("cpu", "dmmha"),
                                               ("cpu", "fused-dmmha"),
                                               pytest.param("cuda", "ragged", marks=pytest.mark.gpu),
                                               pytest.param("cuda", "fused-left", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("max_history, keep_first", [(None, False), (2, False), (3, True)])
def test_ragged_decoder_with_left_aligned_histories_equals_the_oracle(max_history, keep_first, device, attention):
    """A decoder whose attention reads each row's own history length (ONNX Attention opset 24 or
    ONNX Runtime's GroupQueryAttention, metadata HISTORY_ALIGNMENT=left): the manager merges
    histories left-aligned, and the n-best under continuous batching equals the right-aligned
    decoder's (on the CPU) and the oracle's. (GroupQueryAttention runs on CUDA in float16 only;
    "fused-left": the fused export's dense attention masking the padding after each history.)"""
    frames = (14, 9, 11, 6, 12)
    export = {"fused-left": ("new", True, "dense", True, "left"),
              "fused-dmmha": ("in-place", True, "dmmha", True)}.get(attention, ("new", True, attention))
    dims = {"model_dim": 64} if "dmmha" in attention else {}  # (CUDA: head size 32, 64 or 128)
    ragged = Setup(5, num_utts=5, frames=frames, export=export, device=device, **dims)
    dense = Setup(5, num_utts=5, frames=frames, export=("new", True), **dims)
    options = {} if max_history is None else {"max_history": max_history, "always_include_first_token_state": keep_first}
    scorer = ragged.scorer(**options)
    assert scorer.states.options.history_alignment == "left"

    def continuous(setup, decoder):  # 2 utterances in flight: each call mixes history lengths
        options = LabelSyncOptions(beam_size=4, sentence_end=EOS, max_labels_per_input=1.0)
        xp = xp_of(setup.device)
        return label_sync_search([("decoder", decoder, 1.0)], setup.batch(xp=xp), options, xp=xp,
                                 max_active_utterances=2)

    got = continuous(ragged, scorer)
    expected = continuous(dense, dense.scorer(**options))
    for a, b in zip(expected, got):
        assert [h.labels for h in a] == [h.labels for h in b]
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-4)
    if max_history is None:
        for u, hyps in enumerate(got):
            for hyp in hyps:
                assert hyp.score == pytest.approx(ragged.oracle_score(ragged.decoder, u, hyp.labels, terminated(hyp)),
                                                  abs=1e-4)
    assert scorer.states.statistics().live_slots == 0


@pytest.mark.gpu
@pytest.mark.parametrize("manager, cuda_graphs", [("transformer-cuda", False), ("transformer-cuda", True),
                                                  ("transformer-cpu", False)])
@pytest.mark.parametrize("export", [("new", True, "gqa"), ("new", True, "gqa", True),
                                    ("in-place", True, "dmmha", True, "left", True)], ids=["gqa", "fused-gqa", "dmmha-ft"])
def test_in_place_decoder_in_float16_on_cuda_scores_like_the_oracle(manager, cuda_graphs, export):
    """ONNX Runtime's GroupQueryAttention, or DecoderMaskedMultiHeadAttention over keys in the
    layout its CUDA kernel reads (float16 on CUDA), with its present outputs bound to the past
    buffers, so the new step is written in place: under continuous batching every n-best score
    equals the float32 oracle's score of its labels, within float16 rounding. With the CPU manager
    the past comes from the host and the present outputs are left to ONNX Runtime."""
    import cupy

    from gpudecode.session.graphs import GraphOptions

    setup = Setup(5, num_utts=5, frames=(14, 9, 11, 6, 12), export=export, device="cuda", dtype=np.float16,
                  model_dim=64)
    scorer = OnnxDecoderScorer(model=setup.decoder.serialized(), vocab_size=setup.decoder.vocab_size,
                               start_labels=[BOS], state_manager=StateManagerOptions(type=manager),
                               session_options=SessionOptions(device="cuda", cuda_graphs=cuda_graphs),
                               graphs=GraphOptions(enabled=cuda_graphs))
    assert scorer.spec.in_place_outputs and scorer.states.options.history_alignment == "left"
    options = LabelSyncOptions(beam_size=4, sentence_end=EOS, max_labels_per_input=1.0)
    nbest = label_sync_search([("decoder", scorer, 1.0)], setup.batch(xp=cupy), options, xp=cupy,
                              max_active_utterances=2)
    checked = 0
    for u, hyps in enumerate(nbest):
        assert len(hyps) == 4
        for hyp in hyps:
            expected = setup.oracle_score(setup.decoder, u, hyp.labels, terminated(hyp))
            assert hyp.score == pytest.approx(expected, abs=0.05 + 0.01 * len(hyp.labels))
            checked += 1
    assert checked == 20
    if cuda_graphs:
        assert scorer.captured_graphs >= 2
    assert scorer.states.statistics().live_slots == 0


def test_beam_one_equals_greedy_decoding_with_the_oracle():
    setup = Setup(2, num_utts=3)
    nbest = search([("decoder", setup.scorer(), 1.0)], setup.batch(), beam_size=1)
    for u, (hyp,) in enumerate(nbest):
        labels, limit = [], int(setup.sizes[u])
        while len(labels) < limit:
            row = setup.decoder.sequence_log_probs([BOS, *labels], setup.encoder_inputs(u))[-1]
            top2 = np.sort(row)[-2:]
            assert top2[1] - top2[0] > 1e-3
            best = int(np.argmax(row))
            if best == EOS:
                break
            labels.append(best)
        assert hyp.labels == labels


@pytest.mark.parametrize("device", DEVICES)
def test_decoding_together_equals_decoding_each_alone(device):
    xp = xp_of(device)
    setup = Setup(8, num_utts=4, device=device)
    together = search([("decoder", setup.scorer(), 1.0)], setup.batch(xp=xp), xp=xp, beam_size=3)
    for u in range(4):
        (alone,) = search([("decoder", setup.scorer(), 1.0)], setup.batch([u], xp=xp), xp=xp, beam_size=3)
        assert [h.labels for h in alone] == [h.labels for h in together[u]]
        np.testing.assert_allclose([h.score for h in alone], [h.score for h in together[u]], atol=1e-5)


def truncated_oracle_score(reference, encoder_inputs, labels, ended, max_history, keep_first):
    """Step the numpy oracle token by token, feeding only the kept window of token states."""
    names = sorted(reference.states)  # past-key-i / past-value-i
    axis = reference.time_axis
    tokens = [BOS, *labels]
    targets = [*labels, EOS] if ended else list(labels)
    token_states = {name: [] for name in names}
    total = 0.0
    for p, token in enumerate(tokens[: len(targets)]):
        n = len(token_states[names[0]])
        kept = list(range(n))
        if len(kept) > max_history:
            kept = ([0] + kept[n - (max_history - 1):]) if keep_first and max_history > 0 else kept[n - max_history:]
        feeds = dict(encoder_inputs)
        feeds["token"] = np.array([[token]], np.int32)
        feeds["token-length"] = np.ones(1, np.int32)
        feeds["prefix-length"] = np.array([len(kept)], np.int32)
        for name in names:
            if kept:
                feeds[name] = np.stack([token_states[name][i] for i in kept], axis=axis)
            else:
                dims = [1, reference.num_heads, 0, reference.head_dim] if axis == 2 else [1, 0, reference.num_heads * reference.head_dim]
                feeds[name] = np.zeros(dims, np.float32)
        out = reference.oracle(feeds)
        total += float(out["scores"][0, -1, targets[p]])
        for name in names:
            present = out[reference.states[name]]
            token_states[name].append(np.take(present, [present.shape[axis] - 1], axis=axis).squeeze(axis))
    return total


@pytest.mark.parametrize("max_history, keep_first", [(0, False), (1, False), (2, False), (3, True), (2, True)])
def test_max_history_and_first_token_match_a_truncated_cached_oracle(max_history, keep_first):
    setup = Setup(4, num_utts=2, frames=(16, 12))
    scorer = setup.scorer(max_history=max_history, always_include_first_token_state=keep_first)
    nbest = search([("decoder", scorer, 1.0)], setup.batch(), beam_size=3)
    untruncated = search([("decoder", setup.scorer(), 1.0)], setup.batch(), beam_size=3)
    longest = max(len(h.labels) for hyps in nbest for h in hyps)
    assert longest > max_history + 1  # the truncation really happened
    for u, hyps in enumerate(nbest):
        for hyp in hyps:
            expected = truncated_oracle_score(setup.decoder, setup.encoder_inputs(u), hyp.labels, terminated(hyp),
                                              max_history, keep_first)
            assert hyp.score == pytest.approx(expected, abs=1e-4)
    assert any(a.labels != b.labels or abs(a.score - b.score) > 1e-3
               for x, y in zip(nbest, untruncated) for a, b in zip(x, y))


@pytest.mark.parametrize("device", DEVICES)
def test_lm_fusion_equals_the_oracles_scaled_sum(device):
    xp = xp_of(device)
    setup = Setup(6, device=device)
    lm = build_lstm_lm(6, vocab_size=12)
    lm_scorer = RecurrentLmScorer(
        model=lm.serialized(), vocab_size=12, start_labels=[BOS],
        state_manager=StateManagerOptions(type="lstm-cuda" if device == "cuda" else "lstm-cpu"),
        session_options=SessionOptions(device=device),
    )
    nbest = search([("decoder", setup.scorer(), 1.0), ("lm", lm_scorer, 0.5)], setup.batch(xp=xp), xp=xp)
    for u, hyps in enumerate(nbest):
        for hyp in hyps:
            dec = setup.oracle_score(setup.decoder, u, hyp.labels, terminated(hyp))
            lm_score = setup.oracle_score(lm, u, hyp.labels, terminated(hyp), encoder_inputs=False)
            assert hyp.scores["decoder"] == pytest.approx(dec, abs=1e-4)
            assert hyp.scores["lm"] == pytest.approx(lm_score, abs=1e-4)
            assert hyp.score == pytest.approx(dec + 0.5 * lm_score, abs=1e-4)
    assert lm_scorer.states.statistics().live_slots == 0


@pytest.mark.parametrize("device", DEVICES)
def test_rasr_and_huggingface_conventions_give_the_same_results(device):
    xp = xp_of(device)
    sm = "transformer-cuda" if device == "cuda" else "transformer-cpu"
    batch = UtteranceBatch(ids=["a", "b"], input_lengths=np.array([7, 5]))
    results = {}
    for convention, kind in (("rasr", "log-probs"), ("huggingface", "logits")):
        reference = build_transformer_lm(9, convention=convention)
        scorer = RecurrentLmScorer(model=reference.serialized(), vocab_size=reference.vocab_size, start_labels=[BOS],
                                   scores_kind=kind, state_manager=StateManagerOptions(type=sm),
                                   session_options=SessionOptions(device=device))
        results[convention] = search([("lm", scorer, 1.0)], batch, xp=xp, beam_size=3)
    rasr = build_transformer_lm(9, convention="rasr")
    for u, (a, b) in enumerate(zip(results["rasr"], results["huggingface"])):
        assert [h.labels for h in a] == [h.labels for h in b]
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-4)
        for hyp in a:
            rows = rasr.sequence_log_probs([BOS, *hyp.labels])
            targets = [*hyp.labels, EOS] if terminated(hyp) else hyp.labels
            assert hyp.score == pytest.approx(float(sum(rows[p, t] for p, t in enumerate(targets))), abs=1e-4)


@pytest.mark.gpu
def test_cuda_managers_give_the_cpu_nbest_and_pool_stays_bounded():
    import cupy

    cpu, gpu = Setup(12, num_utts=4), Setup(12, num_utts=4, device="cuda")
    lm = build_lstm_lm(12, vocab_size=12)

    def scorers(setup, device):
        return [("decoder", setup.scorer(slots_per_chunk=256), 1.0),
                ("lm", RecurrentLmScorer(model=lm.serialized(), vocab_size=12, start_labels=[BOS],
                                         state_manager=StateManagerOptions(type=f"lstm-{device}"),
                                         session_options=SessionOptions(device=device)), 0.3)]

    expected = search(scorers(cpu, "cpu"), cpu.batch(), beam_size=4)
    gpu_scorers = scorers(gpu, "cuda")
    for _ in range(3):  # the same scorers, reused run after run
        got = search(gpu_scorers, gpu.batch(xp=cupy), xp=cupy, beam_size=4)
        for a, b in zip(expected, got):
            assert [h.labels for h in a] == [h.labels for h in b]
            np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-4)
    stats = gpu_scorers[0][1].states.statistics()
    assert stats.live_slots == 0
    assert stats.capacity_slots <= -(-stats.peak_live_slots // stats.slots_per_chunk) * stats.slots_per_chunk


@pytest.mark.gpu
def test_pool_capacity_follows_peak_live_over_2000_utterances():
    import cupy

    reference = build_transformer_decoder(21, vocab_size=12)
    scorer = OnnxDecoderScorer(model=reference.serialized(), vocab_size=12, start_labels=[BOS],
                               state_manager=StateManagerOptions(type="transformer-cuda", slots_per_chunk=512),
                               session_options=SessionOptions(device="cuda"))
    rng = np.random.default_rng(21)
    decoded = 0
    for start in range(0, 2000, 250):
        frames = rng.integers(3, 12, 250)
        shape = (250, reference.num_heads, int(frames.max()), reference.head_dim)
        inputs = {f"cross-{kind}-{layer}": cupy.asarray(rng.standard_normal(shape, dtype=np.float32))
                  for layer in range(reference.num_layers) for kind in ("key", "value")}
        batch = UtteranceBatch(ids=[str(start + i) for i in range(250)], input_lengths=frames, inputs=inputs)
        nbest = search([("decoder", scorer, 1.0)], batch, xp=cupy, beam_size=3)
        decoded += sum(1 for n in nbest if n)
        stats = scorer.states.statistics()
        assert stats.live_slots == 0
        assert stats.capacity_slots <= -(-stats.peak_live_slots // 512) * 512
    assert decoded == 2000
