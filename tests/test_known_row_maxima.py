"""Row maxima a host scorer already knows (the in-place log-softmax's ``0 - log Σ exp``) equal the
reference ``scores.max(axis=1)`` of the rows it returns: bit for bit where not NaN, NaN where the
reference is NaN (rows with NaN, +inf, only -inf; ±0); and the non-finite maxima folded from them
equal :func:`group_maxima`, the reference, for live, dead and all lanes."""

import numpy as np

from gpudecode.scorers.onnx_decoder import log_softmax, log_softmax_in_place
from gpudecode.search.nonfinite import folded_group_maxima, group_maxima


def _same(got, want, message=""):
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=message)
    np.testing.assert_array_equal(got[~nan].view(np.int32), want[~nan].view(np.int32), err_msg=message)


def _logits(rng, rows, vocab, trial):
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)
    x = (rng.standard_normal((rows, vocab)) * rng.choice([0.1, 3.0, 40.0, 1e4])).astype(np.float32)
    mask = rng.random((rows, vocab)) < rng.choice([0.0, 0.02, 0.3])
    x[mask] = rng.choice(special, int(mask.sum()))
    if rows and trial % 5 == 0:
        x[int(rng.integers(rows))] = -np.inf  # every label impossible
    if rows and trial % 7 == 0:
        x[int(rng.integers(rows))] = rng.choice([0.0, -0.0, 5.0])  # one value everywhere
    if rows and trial % 11 == 0:  # one label far ahead: the others' exponentials underflow, log Σ = 0
        x[0] = -np.inf
        x[0, 0] = 1.0
    return x


def test_log_softmax_in_place_row_maxima_equal_the_rows_maxima():
    rng = np.random.default_rng(23)
    for trial in range(400):
        rows, vocab = int(rng.integers(0, 9)), int(rng.integers(1, 300))
        x = _logits(rng, rows, vocab, trial)
        maxima = np.full(rows, 7.0, np.float32)
        got = x.copy()
        log_softmax_in_place(got, None if trial % 2 else np.empty(rows * vocab, np.float32), maxima)
        np.testing.assert_array_equal(got.view(np.int32), log_softmax(np, x.copy()).view(np.int32))
        _same(maxima, got.max(axis=1) if vocab else maxima, f"trial {trial}")


def test_folded_maxima_from_known_row_maxima_equal_group_maxima():
    rng = np.random.default_rng(5)
    for trial in range(200):
        groups, beam, vocab = int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.integers(1, 60))
        lanes = groups * beam
        arrays, known = [], []
        for _ in range(int(rng.integers(1, 3))):
            scores = log_softmax_in_place(_logits(rng, lanes, vocab, trial), None, maxima := np.empty(lanes, np.float32))
            arrays.append(scores)
            known.append(maxima if rng.random() < 0.7 else None)
        dead = rng.random(lanes) < rng.choice([0.0, 0.4, 1.0])
        for s, maxima in enumerate(known):  # a dead lane's known maximum is never read
            if maxima is not None:
                maxima[dead] = rng.choice([np.nan, np.inf, 3.0])
        previous = rng.choice(np.array([-np.inf, -1.0, 0.0, np.nan, np.inf], np.float32), (len(arrays), groups))
        want = np.maximum(previous, group_maxima(arrays, ~dead, groups, np))
        got = folded_group_maxima(previous, arrays, groups, np, dead=dead, row_maxima=known)
        _same(got, want, f"trial {trial}")
        got = folded_group_maxima(previous, arrays, groups, np, live=~dead, row_maxima=known)
        _same(got, want, f"trial {trial} (live)")


def test_the_genai_scorer_knows_the_maxima_of_the_lanes_it_ran():
    """Beam 4, GenAI's finished lists on the GenAI export: every step the scorer's known row maxima
    on the lanes asked for equal the returned rows' maxima bit for bit, and the search gives the
    same n-best lists as with no known maxima."""
    from gpudecode.scorers.prefix_lm import PrefixLmScorer
    from gpudecode.search import LabelSyncOptions, label_sync_search
    from tests.test_open_lanes import EveryLane, assert_same_nbest
    from tests.test_peer_genai import EOS, FIXTURE, prompt_batch

    class Spy(EveryLane):
        def score_lanes(self, ctx, lanes):
            scores = self.inner.score_lanes(ctx, lanes)
            known = self.inner.row_maxima(scores)
            if known is not None:
                lanes = np.asarray(lanes)
                _same(known[lanes], scores[lanes].max(axis=1))
                checked.append(lanes.size)
            return scores

        def row_maxima(self, scores):
            return self.inner.row_maxima(scores)

    checked = []
    genai = PrefixLmScorer(model=str(FIXTURE), vocab_size=128, scores_kind="logits")
    options = LabelSyncOptions(beam_size=4, sentence_end=EOS, max_labels_per_input=1.0, finished="separate-genai",
                               early_stopping=True, length_norm_scale=1.0, length_counts="prompt-and-labels", nbest=2)
    batch = prompt_batch()
    ours = label_sync_search([("lm", Spy(genai), 1.0)], batch, options, xp=np)
    assert len(checked) > 5
    assert_same_nbest(ours, label_sync_search([("lm", EveryLane(genai), 1.0)], batch, options, xp=np))
