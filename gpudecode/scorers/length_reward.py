"""``length-reward``: a constant reward for every label except sentence-end."""

from __future__ import annotations

import numpy as np

from gpudecode.scorers.base import Context, LabelScorer, LaneLayout
from gpudecode.scorers.registry import register_scorer


@register_scorer("length-reward")
class LengthRewardScorer(LabelScorer):
    """Adds ``reward`` per emitted label other than ``sentence_end`` (0 for sentence-end).

    Stateless: the context is ``None``. With scale s in a search, a hypothesis of k labels
    before sentence-end gains s · reward · k.
    """

    def __init__(self, *, vocab_size: int, sentence_end: int, reward: float = 1.0) -> None:
        if not 0 <= sentence_end < vocab_size:
            raise ValueError(f"length-reward: sentence_end {sentence_end} is outside the "
                             f"vocabulary [0, {vocab_size})")
        self.vocab_size = int(vocab_size)
        self.sentence_end = int(sentence_end)
        self.reward = float(reward)
        self._scores = None

    def begin(self, layout: LaneLayout) -> None:
        super().begin(layout)
        row = np.full(self.vocab_size, self.reward, dtype=np.float32)
        row[self.sentence_end] = 0.0
        self._scores = layout.xp.broadcast_to(layout.xp.asarray(row),
                                              (layout.num_lanes, self.vocab_size))

    def initial_context(self, groups, ctx: Context | None = None) -> Context:
        return None

    def score(self, ctx: Context):
        """[N, V] float32 (a read-only broadcast view: the same row for every lane)."""
        return self._scores

    def extend(self, ctx: Context, parents, labels) -> Context:
        return None
