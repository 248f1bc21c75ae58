"""Scoring only the open lanes on the CPU (``LabelScorer.score_lanes``): the label-synchronous search
asks its scorers for the rows of its open lanes, and the ONNX step-model scorers run the model on
those rows alone. The oracle is the same scorer behind a delegating scorer that keeps the base
class's ``score_lanes`` (every row, :meth:`score`): the n-best lists must be the same — labels,
lengths and scores — statically and with continuous batching, in every finished mode, on prompts
of different lengths; and the rows the model is fed must be the open lanes only.
"""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.scorers.base import LabelScorer
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from tests.test_onnx_decoder_search import EOS as DECODER_EOS, Setup
from tests.test_peer_genai import EOS, FIXTURE, PROMPTS, prompt_batch


class EveryLane(LabelScorer):
    """``inner`` with the base class's :meth:`score_lanes`: every row scored, every lane run."""

    def __init__(self, inner: LabelScorer):
        self.inner = inner
        self.vocab_size = inner.vocab_size

    def begin(self, layout):
        self.inner.begin(layout)

    def admit(self, utterances, groups):
        self.inner.admit(utterances, groups)

    def initial_context(self, groups, ctx=None):
        return self.inner.initial_context(groups, ctx)

    def score(self, ctx):
        return self.inner.score(ctx)

    def extend(self, ctx, parents, labels):
        return self.inner.extend(ctx, parents, labels)

    def release(self, groups):
        self.inner.release(groups)


@pytest.fixture(scope="module")
def genai() -> PrefixLmScorer:
    return PrefixLmScorer(model=str(FIXTURE), vocab_size=128, scores_kind="logits")


def assert_same_nbest(ours, oracle):
    assert len(ours) == len(oracle)
    for mine, theirs in zip(ours, oracle):
        assert [h.labels for h in mine] == [h.labels for h in theirs]
        assert [h.length for h in mine] == [h.length for h in theirs]
        np.testing.assert_allclose([h.score for h in mine], [h.score for h in theirs], rtol=0, atol=1e-5)


MODES = [
    dict(beam_size=1),
    dict(beam_size=3),
    dict(beam_size=3, length_norm_scale=1.0),
    dict(beam_size=3, finished="separate", length_norm_scale=1.0, nbest=3),
    dict(beam_size=4, finished="separate-genai", early_stopping=True, length_norm_scale=1.0,
         length_counts="prompt-and-labels", nbest=2),
    dict(beam_size=3, finished="separate-genai", early_stopping=False, length_norm_scale=1.0,
         length_counts="prompt-and-labels", min_length=12),
]


@pytest.mark.parametrize("continuous", [None, 2], ids=["static", "continuous"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_open_lanes_give_the_every_lane_nbest_on_the_genai_export(genai, mode, continuous):
    options = LabelSyncOptions(sentence_end=EOS, max_labels_per_input=1.0, **mode)
    batch = prompt_batch()
    assert len({len(p) for p in PROMPTS}) > 1  # prompts of different lengths
    oracle = label_sync_search([("lm", EveryLane(genai), 1.0)], batch, options, xp=np,
                               max_active_utterances=continuous)
    ours = label_sync_search([("lm", genai, 1.0)], batch, options, xp=np, max_active_utterances=continuous)
    assert_same_nbest(ours, oracle)


def step_rows(scorer, run):
    """The rows of every step-model call (one label per row) made by ``run()``."""
    session = scorer.runner.session
    name = scorer.runner.label_name
    original, rows = session.run, []

    def counting(feeds, *args, **kwargs):
        if feeds[name].shape[1] == 1:  # the prompt runs feed whole prompts
            rows.append(int(feeds[name].shape[0]))
        return original(feeds, *args, **kwargs)

    session.run = counting
    try:
        result = run()
    finally:
        del session.run
    return rows, result


def test_the_model_is_fed_the_open_lanes_only(genai):
    """Greedy, static batching: at step t >= 2 (step 1 scores from the prompt run) utterance u's lane
    is open while t <= its hypothesis length (labels with sentence-end), and only those rows run."""
    options = LabelSyncOptions(beam_size=1, sentence_end=EOS, max_labels_per_input=1.0)
    batch = prompt_batch()
    label_sync_search([("lm", genai, 1.0)], batch, options, xp=np)  # any first-call check done
    rows, nbest = step_rows(genai, lambda: label_sync_search([("lm", genai, 1.0)], batch, options, xp=np))
    lengths = np.array([hyps[0].length for hyps in nbest])
    expected = [int((lengths >= t).sum()) for t in range(2, lengths.max() + 1)]
    assert rows == expected
    assert min(rows) < len(PROMPTS)  # some steps really skip finished utterances
    every, _ = step_rows(genai, lambda: label_sync_search([("lm", EveryLane(genai), 1.0)], batch, options, xp=np))
    assert every == [len(PROMPTS)] * len(expected)


def test_separate_lists_skip_the_lanes_of_done_utterances(genai):
    """Beam 4, GenAI's finished lists: once an utterance is done its 4 lanes are never run again."""
    options = LabelSyncOptions(beam_size=4, sentence_end=EOS, max_labels_per_input=1.0, finished="separate-genai",
                               early_stopping=True, length_norm_scale=1.0, length_counts="prompt-and-labels")
    batch = prompt_batch()
    rows, _ = step_rows(genai, lambda: label_sync_search([("lm", genai, 1.0)], batch, options, xp=np))
    every, _ = step_rows(genai, lambda: label_sync_search([("lm", EveryLane(genai), 1.0)], batch, options, xp=np))
    assert len(rows) == len(every) and set(every) == {4 * len(PROMPTS)}
    assert all(r % 4 == 0 for r in rows)  # whole utterances: open lanes of a running one are never ended
    assert rows == sorted(rows, reverse=True) and rows[-1] < rows[0]


@pytest.mark.parametrize("continuous", [None, 2], ids=["static", "continuous"])
@pytest.mark.parametrize("finished", ["in-beam", "separate"])
def test_open_lanes_with_per_utterance_inputs(finished, continuous):
    """An attention decoder (cross-attention inputs per lane): the skipped lanes' input rows are left
    out too; the n-best lists equal the every-lane run's."""
    setup = Setup(5, num_utts=4)
    scorer = setup.scorer()
    options = LabelSyncOptions(beam_size=3, sentence_end=DECODER_EOS, max_labels_per_input=1.0, finished=finished,
                               length_norm_scale=1.0, nbest=3)
    oracle = label_sync_search([("dec", EveryLane(scorer), 1.0)], setup.batch(), options, xp=np,
                               max_active_utterances=continuous)
    rows, ours = step_rows(scorer, lambda: label_sync_search([("dec", scorer, 1.0)], setup.batch(), options, xp=np,
                                                             max_active_utterances=continuous))
    assert_same_nbest(ours, oracle)
    assert min(rows) < max(rows)  # lanes were left out
