"""Label-synchronous search against simple references: exhaustive enumeration, a per-hypothesis
Python beam search (float64), greedy decoding, and sequence scores recomputed from the tables.

"Exact": same label sequences, scores within 1e-4, and every test asserts that
the oracle's gap at each beam cutoff (and threshold boundary, and n-best order) exceeds 1e-3.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from examples.custom_scorer import BigramScorer
from gpudecode.backend import gpu_available
from gpudecode.scorers import LabelScorer, LengthRewardScorer, UtteranceBatch
from gpudecode.search import (
    LabelSyncOptions,
    label_sync_search,
    top_k_indices,
    topk,
)
from gpudecode.search.stats import SearchStats
from gpudecode.search.tuning import SearchTuning

TOL = 1e-4
MIN_GAP = 1e-3


# --- a tiny table scorer: log p(label | last two labels, utterance) --------------------------
class TrigramTableScorer(LabelScorer):
    """Per-utterance trigram table from the input ``table`` [U, V+1, V+1, V] (index V =
    sentence-begin). Context: (prev2 [N], prev1 [N]) int arrays. Records calls in ``events``."""

    def __init__(self, vocab_size: int, input_name: str = "table", events: list | None = None):
        self.vocab_size = vocab_size
        self.input_name = input_name
        self.events = events if events is not None else []

    def begin(self, layout):
        super().begin(layout)
        v = self.vocab_size
        self._tables = layout.xp.zeros((layout.num_groups, v + 1, v + 1, v), dtype=np.float32)
        self._group = layout.lane_groups()
        self.released = None

    def admit(self, utterances, groups):
        xp = self.layout.xp
        self._tables[xp.asarray(groups)] = xp.asarray(utterances.inputs[self.input_name])

    def initial_context(self, groups, ctx=None):
        xp, bos = self.layout.xp, self.vocab_size
        n = self.layout.num_lanes
        prev2, prev1 = (xp.full(n, bos), xp.full(n, bos)) if ctx is None else (
            ctx[0].copy(), ctx[1].copy())
        lanes = xp.asarray(self.layout.lanes_of(groups))
        prev2[lanes] = bos
        prev1[lanes] = bos
        return prev2, prev1

    def score(self, ctx):
        self.events.append("score")
        prev2, prev1 = ctx
        return self._tables[self._group, prev2, prev1]

    def extend(self, ctx, parents, labels):
        xp = self.layout.xp
        prev2, prev1 = ctx
        emitted = labels >= 0
        return (xp.where(emitted, prev1[parents], prev2[parents]),
                xp.where(emitted, labels, prev1[parents]))

    def release(self, groups):
        self.released = list(np.asarray(groups))


def random_tables(seed: int, num_utts: int, vocab_size: int, eos: int, eos_bias: float = 0.0,
                  sharpness: float = 2.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(num_utts, vocab_size + 1, vocab_size + 1, vocab_size)) * sharpness
    logits[..., eos] += eos_bias
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return logp.astype(np.float32)


def table_logp(table: np.ndarray, u: int, prefix: tuple[int, ...]) -> np.ndarray:
    """Oracle: [V] float64 log-probs after ``prefix`` for utterance ``u``."""
    v = table.shape[-1]
    padded = (v, v) + tuple(prefix)
    return table[u, padded[-2], padded[-1]].astype(np.float64)


def sequence_score(table: np.ndarray, u: int, seq: tuple[int, ...]) -> float:
    """Oracle: the full-sequence score of ``seq`` (sentence-end included if present)."""
    return float(sum(table_logp(table, u, seq[:p])[seq[p]] for p in range(len(seq))))


def batch(tables: dict[str, np.ndarray], input_lengths) -> UtteranceBatch:
    num = len(input_lengths)
    return UtteranceBatch(ids=[f"utt{u}" for u in range(num)], input_lengths=input_lengths,
                          inputs=tables)


def full_sequence(hyp, eos: int) -> tuple[int, ...]:
    """The hypothesis' labels with sentence-end re-appended when it emitted one."""
    assert hyp.length in (len(hyp.labels), len(hyp.labels) + 1)
    return tuple(hyp.labels) + ((eos,) if hyp.length == len(hyp.labels) + 1 else ())


# --- the reference beam search: per-hypothesis Python, float64 ---------------------------------
def reference_search(logp_fn, u: int, vocab_size: int, options: LabelSyncOptions, limit: int):
    """Same semantics as the batched search, written the obvious way. Returns (n-best as
    [(sequence incl. sentence-end, score)], the smallest decision gap seen)."""
    lns, thr, eos = options.length_norm_scale, options.score_threshold, options.sentence_end

    def rank(seq, score):
        return score / (len(seq) ** lns) if lns else score

    hyps = [((), 0.0, False)]
    gaps = [np.inf]
    for step in range(1, limit + 1):
        cands = []
        for seq, score, ended in hyps:  # lane order, then label order: the tie-break order
            if ended:
                cands.append((seq, score, True))
                continue
            logp = logp_fn(u, seq)
            cands.extend((seq + (lab,), score + logp[lab], lab == eos)
                         for lab in range(vocab_size))
        ranks = [rank(s, sc) for s, sc, _ in cands]
        if thr is not None:
            bound = max(ranks) - thr
            gaps.append(min(abs(r - bound) for r in ranks))
            keep = [r >= bound for r in ranks]
            cands = [c for c, k in zip(cands, keep) if k]
            ranks = [r for r, k in zip(ranks, keep) if k]
        order = sorted(range(len(cands)), key=lambda i: -ranks[i])  # stable
        if len(order) > options.beam_size:
            b = options.beam_size
            gaps.append(ranks[order[b - 1]] - ranks[order[b]])
        hyps = [cands[i] for i in order[:options.beam_size]]
        if step == limit:
            hyps = [(s, sc, True) for s, sc, _ in hyps]
        if all(e for _, _, e in hyps):
            break
    final = sorted(hyps, key=lambda h: -rank(h[0], h[1]))[:options.num_best]
    final_ranks = [rank(s, sc) for s, sc, _ in final]
    gaps.extend(a - b for a, b in itertools.pairwise(final_ranks))
    return [(s, sc) for s, sc, _ in final], min(gaps)


def assert_matches_reference(result, reference, eos: int):
    assert [full_sequence(h, eos) for h in result] == [s for s, _ in reference]
    for hyp, (_, score) in zip(result, reference):
        assert abs(hyp.score - score) < TOL


def run(scorers, utterances, options, xp=np, **tuning_and_stats):
    return label_sync_search(scorers, utterances, options, xp=xp, **tuning_and_stats)


# --- (a) exhaustive enumeration ----------------------------------------------------------------
def all_sequences(vocab_size: int, eos: int, limit: int):
    words = [lab for lab in range(vocab_size) if lab != eos]
    for k in range(limit):
        for seq in itertools.product(words, repeat=k):
            yield seq + (eos,)
    yield from itertools.product(words, repeat=limit)  # force-ended at the cap


@pytest.mark.parametrize("lns", [0.0, 1.0])
def test_full_beam_equals_exhaustive_enumeration(lns):
    vocab, eos, limit = 4, 1, 3
    seqs = list(all_sequences(vocab, eos, limit))
    assert len(seqs) == 1 + 3 + 9 + 27
    tables = random_tables(seed=3, num_utts=2, vocab_size=vocab, eos=eos)
    options = LabelSyncOptions(beam_size=len(seqs), sentence_end=eos, max_labels=limit,
                               length_norm_scale=lns, max_labels_per_input=10.0)
    result = run([("t", TrigramTableScorer(vocab), 1.0)], batch({"table": tables}, [5, 5]),
                 options)
    for u in range(2):
        scored = [(s, sequence_score(tables, u, s)) for s in seqs]
        ranked = sorted(scored, key=lambda x: -(x[1] / len(x[0]) ** lns))
        ranks = [sc / len(s) ** lns for s, sc in ranked]
        assert min(a - b for a, b in itertools.pairwise(ranks)) > MIN_GAP
        assert [full_sequence(h, eos) for h in result[u]] == [s for s, _ in ranked]
        for hyp, (_, score) in zip(result[u], ranked):
            assert abs(hyp.score - score) < TOL


# --- the batched search equals the reference beam search over a grid -------------------------
def _reference_all(tables, options, input_lengths, vocab):
    limits = options.label_limits(input_lengths)
    out = []
    gap = np.inf
    for u in range(tables.shape[0]):
        ref, g = reference_search(lambda uu, p: table_logp(tables, uu, p), u, vocab, options,
                                  int(limits[u]))
        out.append(ref)
        gap = min(gap, g)
    return out, gap


@pytest.mark.parametrize("beam", [1, 3, 6])
@pytest.mark.parametrize("lns", [0.0, 0.7])
@pytest.mark.parametrize("threshold", [None, 2.5])
def test_matches_reference_beam_search(beam, lns, threshold):
    vocab, eos, input_lengths = 6, 0, [3, 6, 4]
    options = LabelSyncOptions(beam_size=beam, sentence_end=eos, length_norm_scale=lns,
                               score_threshold=threshold, max_labels_per_input=1.5)
    for seed in range(40):  # the first seed whose decisions are all clear of near-ties
        tables = random_tables(seed, 3, vocab, eos, eos_bias=-1.0)
        reference, gap = _reference_all(tables, options, input_lengths, vocab)
        if gap > MIN_GAP:
            break
    assert gap > MIN_GAP, "no seed without near-ties"
    result = run([("t", TrigramTableScorer(vocab), 1.0)],
                 batch({"table": tables}, input_lengths), options)
    for u in range(3):
        assert_matches_reference(result[u], reference[u], eos)


# --- (b) n-best scores equal recomputed sequence scores ---------------------------------------
def test_nbest_scores_equal_recomputed_sequence_scores():
    vocab, eos = 7, 2
    tables = random_tables(seed=11, num_utts=3, vocab_size=vocab, eos=eos)
    options = LabelSyncOptions(beam_size=5, sentence_end=eos, max_labels_per_input=2.0)
    result = run([("t", TrigramTableScorer(vocab), 1.0)], batch({"table": tables}, [2, 3, 4]),
                 options)
    checked = 0
    for u, nbest in enumerate(result):
        assert len(nbest) == 5
        for hyp in nbest:
            seq = full_sequence(hyp, eos)
            assert eos not in hyp.labels
            assert abs(hyp.score - sequence_score(tables, u, seq)) < TOL
            assert abs(hyp.scores["t"] - hyp.score) < TOL
            checked += 1
        assert [h.score for h in nbest] == sorted((h.score for h in nbest), reverse=True)
    assert checked == 15


@pytest.mark.parametrize("max_active", [None, 2])
def test_nbest_below_the_beam_returns_the_best_hypotheses(max_active):
    """nbest < beam_size: each list is the first nbest of the full beam's list (labels, scores,
    lengths), static or under continuous batching (only those lanes are traced)."""
    vocab, eos, input_lengths = 7, 2, [2, 3, 4, 3]
    tables = random_tables(seed=13, num_utts=4, vocab_size=vocab, eos=eos, eos_bias=-0.5)
    utts = batch({"table": tables}, input_lengths)

    def decode(nbest):
        options = LabelSyncOptions(beam_size=5, sentence_end=eos, max_labels_per_input=2.0, nbest=nbest)
        return label_sync_search([("t", TrigramTableScorer(vocab), 1.0)], utts, options,
                                 max_active_utterances=max_active)

    full, best2 = decode(None), decode(2)
    assert [len(h) for h in full] == [5] * 4 and [len(h) for h in best2] == [2] * 4
    for u, (a, b) in enumerate(zip(full, best2)):
        assert b == a[:2]
        assert len({tuple(h.labels) for h in a}) == 5
        for hyp in b:  # each hypothesis's labels are its own: the table's score of them is its score
            assert abs(hyp.score - sequence_score(tables, u, full_sequence(hyp, eos))) < TOL


# --- (c) beam 1 equals greedy ------------------------------------------------------------------
def test_beam_one_equals_greedy():
    vocab, eos, input_lengths = 8, 3, [4, 7, 5, 6]
    tables = random_tables(seed=5, num_utts=4, vocab_size=vocab, eos=eos, eos_bias=-0.5)
    options = LabelSyncOptions(beam_size=1, sentence_end=eos, max_labels_per_input=1.0)
    result = run([("t", TrigramTableScorer(vocab), 1.0)],
                 batch({"table": tables}, input_lengths), options)
    for u, limit in enumerate(options.label_limits(input_lengths)):
        seq: tuple[int, ...] = ()
        while len(seq) < limit and (not seq or seq[-1] != eos):
            logp = table_logp(tables, u, seq)
            top2 = np.sort(logp)[-2:]
            assert top2[1] - top2[0] > MIN_GAP
            seq += (int(np.argmax(logp)),)
        (hyp,) = result[u]
        assert full_sequence(hyp, eos) == seq
        assert abs(hyp.score - sequence_score(tables, u, seq)) < TOL


# --- (d) together equals alone ------------------------------------------------------------------
def test_utterances_together_equal_each_alone():
    vocab, eos, input_lengths = 6, 5, [2, 5, 3, 4]
    tables = random_tables(seed=21, num_utts=4, vocab_size=vocab, eos=eos, eos_bias=-0.5)
    utts = batch({"table": tables}, input_lengths)
    options = LabelSyncOptions(beam_size=4, sentence_end=eos, length_norm_scale=0.5,
                               max_labels_per_input=1.5)
    together = run([("t", TrigramTableScorer(vocab), 1.0)], utts, options)
    for u in range(4):
        (alone,) = run([("t", TrigramTableScorer(vocab), 1.0)], utts.select([u]), options)
        assert [h.labels for h in alone] == [h.labels for h in together[u]]
        assert len(alone) == 4
        for a, b in zip(alone, together[u]):
            assert abs(a.score - b.score) < TOL and a.length == b.length


# --- (f) fusion: Σ scale · score ---------------------------------------------------------------
def test_fusion_of_scorers_equals_weighted_sum():
    vocab, eos, input_lengths = 6, 0, [4, 5]
    scales = {"am": 1.0, "lm": 0.4, "reward": 0.3}
    options = LabelSyncOptions(beam_size=4, sentence_end=eos, max_labels_per_input=1.0)
    for seed in range(40):
        am = random_tables(seed, 2, vocab, eos)
        lm = random_tables(seed + 1000, 2, vocab, eos)

        def fused(u, prefix, am=am, lm=lm):
            reward = np.where(np.arange(vocab) == eos, 0.0, 1.0)
            return (scales["am"] * table_logp(am, u, prefix)
                    + scales["lm"] * table_logp(lm, u, prefix) + scales["reward"] * reward)

        references = [reference_search(fused, u, vocab, options, int(limit))
                      for u, limit in enumerate(options.label_limits(input_lengths))]
        if min(g for _, g in references) > MIN_GAP:
            break
    assert min(g for _, g in references) > MIN_GAP
    scorers = [("am", TrigramTableScorer(vocab, "am"), scales["am"]),
               ("lm", TrigramTableScorer(vocab, "lm"), scales["lm"]),
               ("reward", LengthRewardScorer(vocab_size=vocab, sentence_end=eos, reward=1.0),
                scales["reward"])]
    result = run(scorers, batch({"am": am, "lm": lm}, input_lengths), options)
    for u in range(2):
        assert_matches_reference(result[u], references[u][0], eos)
        for hyp in result[u]:
            seq = full_sequence(hyp, eos)
            assert abs(hyp.scores["am"] - sequence_score(am, u, seq)) < TOL
            assert abs(hyp.scores["lm"] - sequence_score(lm, u, seq)) < TOL
            assert hyp.scores["reward"] == pytest.approx(len(hyp.labels))
            weighted = sum(scales[k] * hyp.scores[k] for k in scales)
            assert abs(hyp.score - weighted) < TOL


# --- length normalisation, threshold, caps -----------------------------------------------------
def _bigram(vocab: int, entries: dict[tuple[int, int], float], default: float = -5.0):
    table = np.full((vocab + 1, vocab), default, dtype=np.float32)
    for (prev, lab), value in entries.items():
        table[prev, lab] = value
    return BigramScorer(log_probs=table)


def test_length_norm_changes_ranking():
    # eos = 0; sentence-begin row = 3. [eos]: -1.0 (rank -1.0 at any scale);
    # [1, eos]: -0.6 - 0.6 = -1.2 (rank -0.6 with scale 1).
    vocab, bos = 3, 3
    entries = {(bos, 0): -1.0, (bos, 1): -0.6, (bos, 2): -4.0, (1, 0): -0.6, (1, 1): -3.0,
               (1, 2): -3.0, (2, 0): -3.0, (2, 1): -3.0, (2, 2): -3.0}
    utts = UtteranceBatch(ids=["a"], input_lengths=[4])
    plain = run([("b", _bigram(vocab, entries), 1.0)], utts,
                LabelSyncOptions(beam_size=3, sentence_end=0, nbest=2))
    normed = run([("b", _bigram(vocab, entries), 1.0)], utts,
                 LabelSyncOptions(beam_size=3, sentence_end=0, nbest=2, length_norm_scale=1.0))
    assert [h.labels for h in plain[0]] == [[], [1]]
    assert [h.labels for h in normed[0]] == [[1], []]
    assert normed[0][0].score == pytest.approx(-1.2) and normed[0][0].length == 2
    ranks = [h.score / h.length for h in normed[0]]
    assert ranks == sorted(ranks, reverse=True)


def test_score_threshold_prunes():
    vocab, eos = 6, 0
    tables = random_tables(seed=8, num_utts=2, vocab_size=vocab, eos=eos)
    utts = batch({"table": tables}, [4, 4])
    wide = run([("t", TrigramTableScorer(vocab), 1.0)], utts,
               LabelSyncOptions(beam_size=6, sentence_end=eos))
    narrow = run([("t", TrigramTableScorer(vocab), 1.0)], utts,
                 LabelSyncOptions(beam_size=6, sentence_end=eos, score_threshold=1.0))
    for u in range(2):
        assert len(wide[u]) == 6
        assert 1 <= len(narrow[u]) < 6
        assert narrow[u][0].labels == wide[u][0].labels
        assert all(narrow[u][0].score - h.score <= 1.0 + TOL for h in narrow[u])
        assert any(wide[u][0].score - h.score > 1.0 for h in wide[u])


def test_max_labels_per_input_force_ends(monkeypatch):
    vocab, eos = 5, 0
    tables = random_tables(seed=2, num_utts=2, vocab_size=vocab, eos=eos, eos_bias=-40.0)
    events: list[str] = []
    options = LabelSyncOptions(beam_size=3, sentence_end=eos, max_labels_per_input=1.5)
    result = run([("t", TrigramTableScorer(vocab, events=events), 1.0)],
                 batch({"table": tables}, [2, 4]), options)
    assert events.count("score") == 6  # floor(1.5 * 4): the longer utterance decides
    for u, limit in enumerate([3, 6]):
        assert len(result[u]) == 3
        for hyp in result[u]:
            assert hyp.length == len(hyp.labels) == limit  # force-ended: no sentence-end
            assert abs(hyp.score - sequence_score(tables, u, tuple(hyp.labels))) < TOL
    capped = run([("t", TrigramTableScorer(vocab), 1.0)], batch({"table": tables}, [2, 4]),
                 LabelSyncOptions(beam_size=3, sentence_end=eos, max_labels_per_input=1.5,
                                  max_labels=2))
    assert all(h.length == 2 for nbest in capped for h in nbest)


def test_stops_when_all_hypotheses_ended():
    vocab, eos = 5, 0
    tables = random_tables(seed=2, num_utts=1, vocab_size=vocab, eos=eos, eos_bias=40.0)
    events: list[str] = []
    result = run([("t", TrigramTableScorer(vocab, events=events), 1.0)],
                 batch({"table": tables}, [50]),
                 LabelSyncOptions(beam_size=2, sentence_end=eos, max_labels_per_input=1.0))
    # step 1: [eos] and one open hypothesis; step 2 ends it; the stop test then ends the loop
    assert events.count("score") == 2
    assert result[0][0].labels == [] and result[0][0].length == 1


def test_step_loop_clock_counts_the_steps_of_each_search():
    stats = SearchStats()
    clock = stats.step_loop
    vocab, eos = 5, 0
    tables = random_tables(seed=2, num_utts=1, vocab_size=vocab, eos=eos, eos_bias=40.0)
    for searches in (1, 2):
        events: list[str] = []
        run([("t", TrigramTableScorer(vocab, events=events), 1.0)], batch({"table": tables}, [50]),
            LabelSyncOptions(beam_size=2, sentence_end=eos, max_labels_per_input=1.0), stats=stats)
        assert clock.count == 2 * searches == searches * events.count("score")
    assert clock.cpu_s > 0 and clock.wall_s > 0
    clock.reset()
    assert (clock.count, clock.cpu_s) == (0, 0.0)


# --- tie-break on exact ties ---------------------------------------------------------------------
@pytest.mark.parametrize("eos, expected", [(3, [[0, 0], [0, 1]]), (0, [[], [1]])])
def test_exact_ties_go_to_lower_lane_then_lower_label(eos, expected):
    vocab = 4
    uniform = np.full((vocab + 1, vocab), np.log(0.25), dtype=np.float32)
    result = run([("u", BigramScorer(log_probs=uniform), 1.0)],
                 UtteranceBatch(ids=["a"], input_lengths=[2]),
                 LabelSyncOptions(beam_size=2, sentence_end=eos, max_labels=2))
    assert [h.labels for h in result[0]] == expected


@pytest.mark.parametrize("top_k", [top_k_indices, topk._top_k_rows, topk._top_k_flat,
                                   pytest.param("kernel", marks=pytest.mark.gpu)])
def test_top_k_indices_tie_break(top_k):
    if top_k == "kernel":
        import cupy

        top_k = lambda keys, k: cupy.asnumpy(topk._top_k_kernel(cupy.asarray(keys), k))  # noqa: E731
    nan, inf = np.nan, np.inf
    keys = np.array([[1.0, 3.0, 3.0, -inf, 3.0, 2.0],
                     [0.0, -0.0, 0.0, nan, -inf, -0.0],
                     [-inf, -inf, -inf, -inf, 5.0, -inf],
                     [-1.5, 2.5, -1.5, inf, -2.0, 1e-30]], dtype=np.float32)
    order = top_k(keys, 4)
    assert order.tolist() == [[1, 2, 4, 5], [0, 1, 2, 5], [4, 0, 1, 2], [3, 1, 5, 0]]
    with pytest.raises(ValueError, match="1 <= k <= M"):
        top_k_indices(keys, 7)


# --- at most one device→host transfer per step -----------------------------------------------
def test_one_small_transfer_per_step():
    events: list = []

    def counting_to_host(arrays):
        events.append(("transfer", sum(int(np.prod(a.shape)) for a in arrays)))

    vocab, eos = 6, 0
    tables = random_tables(seed=4, num_utts=3, vocab_size=vocab, eos=eos, eos_bias=3.0)
    run([("t", TrigramTableScorer(vocab, events=events), 1.0)],
        batch({"table": tables}, [20, 20, 20]),
        LabelSyncOptions(beam_size=3, sentence_end=eos, max_labels_per_input=1.0),
        stats=SearchStats(on_transfer=counting_to_host))
    num_steps = events.count("score")
    assert 2 <= num_steps < 20  # stopped by the stop test, before the length cap
    # between two score calls (one step) at most one transfer, of one element
    step_events: list[list] = []
    for event in events:
        if event == "score":
            step_events.append([])
        else:
            step_events[-1].append(event)
    for during_step in step_events[:-1]:
        assert during_step in ([], [("transfer", 1)])
    *last_step_stop, final = step_events[-1]
    assert last_step_stop == [("transfer", 1)]
    assert final[0] == "transfer"  # the one transfer of the results for the backtrace
    transfers = [e for e in events if e != "score"]
    assert len(transfers) <= num_steps + 1


# --- lifecycle and errors --------------------------------------------------------------------------
def test_scorers_are_released_and_errors_name_the_scorer():
    vocab = 4
    scorer = TrigramTableScorer(vocab)
    tables = random_tables(seed=1, num_utts=2, vocab_size=vocab, eos=0)
    run([("t", scorer, 1.0)], batch({"table": tables}, [2, 2]),
        LabelSyncOptions(beam_size=2, sentence_end=0))
    assert scorer.released == [0, 1]

    class WrongShape(TrigramTableScorer):
        def score(self, ctx):
            return super().score(ctx)[:, :2]

    with pytest.raises(ValueError, match=r"scorer 'bad'.*expected \[N=4, V=4\]"):
        run([("bad", WrongShape(vocab), 1.0)], batch({"table": tables}, [2, 2]),
            LabelSyncOptions(beam_size=2, sentence_end=0))
    with pytest.raises(ValueError, match="duplicate scorer name 't'"):
        run([("t", TrigramTableScorer(vocab), 1.0), ("t", TrigramTableScorer(vocab), 1.0)],
            batch({"table": tables}, [2, 2]), LabelSyncOptions(beam_size=2, sentence_end=0))
    with pytest.raises(ValueError, match="sentence_end 9 is outside"):
        run([("t", TrigramTableScorer(vocab), 1.0)], batch({"table": tables}, [2, 2]),
            LabelSyncOptions(beam_size=2, sentence_end=9))
    with pytest.raises(ValueError, match="nbest"):
        LabelSyncOptions(beam_size=2, sentence_end=0, nbest=3)


def test_label_limits_round_and_clip():
    options = LabelSyncOptions(beam_size=1, sentence_end=0, max_labels_per_input=0.29,
                               max_labels=50)
    assert options.label_limits([100, 1, 1000]).tolist() == [29, 1, 50]


# --- GPU: the same search on CuPy gives the same n-best ---------------------------------------
@pytest.mark.gpu
def test_cupy_matches_numpy():
    import cupy

    vocab, eos, input_lengths = 7, 1, [3, 6, 4, 5]
    tables = random_tables(seed=13, num_utts=4, vocab_size=vocab, eos=eos, eos_bias=-0.5)
    options = LabelSyncOptions(beam_size=4, sentence_end=eos, length_norm_scale=0.6,
                               max_labels_per_input=1.5)
    host = run([("t", TrigramTableScorer(vocab), 1.0)], batch({"table": tables}, input_lengths),
               options)
    device = run([("t", TrigramTableScorer(vocab), 1.0)],
                 batch({"table": cupy.asarray(tables)}, input_lengths), options, xp=cupy)
    for h_nbest, d_nbest in zip(host, device):
        assert [h.labels for h in h_nbest] == [d.labels for d in d_nbest]
        for h, d in zip(h_nbest, d_nbest):
            assert abs(h.score - d.score) < TOL


@pytest.mark.gpu
def test_cupy_matches_numpy_on_a_large_batch():
    # large enough that work left on the wrong stream would be caught by the backtrace
    import cupy

    vocab = 3000
    table = (np.random.default_rng(1).standard_normal((vocab + 1, vocab)) * 3).astype(np.float32)
    table[:, 0] -= 20.0  # sentence-end late
    utts = UtteranceBatch(ids=[str(i) for i in range(32)], input_lengths=[8] * 32)
    options = LabelSyncOptions(beam_size=8, sentence_end=0, max_labels_per_input=1.0)
    host = run([("b", BigramScorer(log_probs=table), 1.0)], utts, options)
    device = run([("b", BigramScorer(log_probs=table), 1.0)], utts, options, xp=cupy)
    assert [[h.labels for h in n] for n in host] == [[h.labels for h in n] for n in device]
    assert all(len(h.labels) == 8 for n in device for h in n)


@pytest.mark.gpu
def test_cupy_top_k_matches_numpy_on_ties():
    import cupy

    rng = np.random.default_rng(0)
    keys = rng.integers(-3, 3, size=(64, 4000)).astype(np.float32)
    keys[rng.random(keys.shape) < 0.1] = -np.inf
    keys[rng.random(keys.shape) < 0.05] = -0.0
    assert gpu_available()
    keys[rng.random(keys.shape) < 0.02] = np.nan
    expected = top_k_indices(keys, 16)
    for top_k in (top_k_indices, topk._top_k_rows, topk._top_k_flat, topk._top_k_kernel):
        assert (cupy.asnumpy(top_k(cupy.asarray(keys), 16)) == expected).all()
    wide = np.repeat(keys, 20, axis=1)  # 80k columns, as beam 8 x vocabulary 10k
    for k in (1, 8, 32, 33):  # 33: beyond the kernel's k, the flat sort
        assert (cupy.asnumpy(top_k_indices(cupy.asarray(wide), k)) == top_k_indices(wide, k)).all(), k
    # a strided (non-contiguous) view, a single column, and no rows at all
    assert (cupy.asnumpy(top_k_indices(cupy.asarray(keys)[::3, 1::2], 5)) == top_k_indices(keys[::3, 1::2], 5)).all()
    assert cupy.asnumpy(top_k_indices(cupy.asarray(keys[:, :1]), 1)).tolist() == [[0]] * 64
    assert top_k_indices(cupy.zeros((0, 9), np.float32), 3).shape == (0, 3)


# --- the stop test read one step late (the default on CuPy) -------------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [
    dict(beam_size=3), dict(beam_size=4, length_norm_scale=0.8), dict(beam_size=5, nbest=2),
    dict(beam_size=4, score_threshold=1.5),
])
@pytest.mark.parametrize("lag", [1, 2])
def test_lagged_stop_test_gives_the_same_nbest_after_lag_more_steps(device, options, lag):
    """Stopping ``lag`` steps after every lane has ended changes nothing: ended lanes carry themselves."""
    xp = np
    if device == "cuda":
        import cupy as xp
    vocab, eos = 6, 0
    tables = random_tables(seed=7, num_utts=4, vocab_size=vocab, eos=eos, eos_bias=3.0)
    opts = LabelSyncOptions(sentence_end=eos, max_labels_per_input=1.0, **options)
    results, steps = {}, {}
    for lagged in (False, True):
        events: list = []
        tuning = SearchTuning(stop_test_lag=lag, lagged_stop_test=lagged)
        utterances = batch({"table": xp.asarray(tables)}, [20, 20, 12, 20])
        results[lagged] = run([("t", TrigramTableScorer(vocab, events=events), 1.0)], utterances, opts, xp=xp,
                              tuning=tuning)
        steps[lagged] = events.count("score")
    assert 2 <= steps[False] < 20  # stopped by the stop test, before the length cap
    assert steps[True] == steps[False] + lag
    for got, expected in zip(results[True], results[False]):
        assert [h.labels for h in got] == [h.labels for h in expected]
        assert [h.score for h in got] == [h.score for h in expected]
        assert [h.scores for h in got] == [h.scores for h in expected]
        assert [h.length for h in got] == [h.length for h in expected]


@pytest.mark.parametrize("lag, every", [(1, 2), (2, 3)])
def test_stop_test_every_few_steps_gives_the_same_nbest(lag, every):
    """Posting the stop flag every few steps: the same n-best, at most lag · every + every - 1
    steps after the unlagged search stops, and never past the length cap."""
    vocab, eos = 6, 0
    tables = random_tables(seed=7, num_utts=4, vocab_size=vocab, eos=eos, eos_bias=3.0)
    opts = LabelSyncOptions(beam_size=3, sentence_end=eos, max_labels_per_input=1.0)
    results, steps = {}, {}
    for every in (1, every):
        for lagged in (False, True):
            events: list = []
            tuning = SearchTuning(stop_test_lag=lag, stop_test_every=every, lagged_stop_test=lagged)
            utterances = batch({"table": tables}, [20, 20, 12, 20])
            results[every, lagged] = run([("t", TrigramTableScorer(vocab, events=events), 1.0)], utterances, opts,
                                         tuning=tuning)
            steps[every, lagged] = events.count("score")
    assert steps[1, False] == steps[every, False] < 20  # the unlagged search ignores stop_test_every
    assert steps[1, True] == steps[1, False] + lag
    assert steps[1, True] <= steps[every, True] <= min(steps[1, False] + lag * every + every - 1, 20)
    assert steps[every, True] % every == 0 or steps[every, True] == 20
    for key in [(1, True), (every, True)]:
        for got, expected in zip(results[key], results[1, False]):
            assert [(h.labels, h.score, h.scores, h.length) for h in got] == \
                [(h.labels, h.score, h.scores, h.length) for h in expected]


@pytest.mark.parametrize("lag", [1, 2])
def test_lagged_stop_test_never_steps_past_the_length_cap(lag):
    vocab, eos = 6, 0
    tables = random_tables(seed=3, num_utts=2, vocab_size=vocab, eos=eos, eos_bias=-6.0)  # rarely ends
    opts = LabelSyncOptions(beam_size=3, sentence_end=eos, max_labels_per_input=1.0)
    counts = {}
    for lagged in (False, True):
        events: list = []
        run([("t", TrigramTableScorer(vocab, events=events), 1.0)], batch({"table": tables}, [5, 5]), opts,
            tuning=SearchTuning(stop_test_lag=lag, lagged_stop_test=lagged))
        counts[lagged] = events.count("score")
    assert counts[True] == counts[False] == 5
