"""``suppress-tokens``: labels a model may never emit (−inf), and labels it may not emit first.

What Hugging Face's ``SuppressTokensLogitsProcessor`` and ``SuppressTokensAtBeginLogitsProcessor``
do in Whisper's ``generate`` (``suppress_tokens``, ``begin_suppress_tokens``): added to the other
scorers' log-probabilities (scale 1), it sets ``tokens`` to −inf at every step and
``begin_tokens`` at a hypothesis' first label (after its prompt). The chosen labels' scores stay
the model's own log-probabilities, as in ``generate``, where the processors act after the
log-softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gpudecode.scorers.base import Context, LabelScorer, LaneLayout
from gpudecode.scorers.registry import register_scorer


@register_scorer("suppress-tokens")
class SuppressTokensScorer(LabelScorer):
    """−inf for ``tokens`` at every step and for ``begin_tokens`` at each hypothesis' first step.

    The context is the number of labels each lane has emitted ([N] int32).
    """

    def __init__(self, *, vocab_size: int, tokens: Sequence[int] = (), begin_tokens: Sequence[int] = ()) -> None:
        self.vocab_size = int(vocab_size)
        for name, labels in (("tokens", tokens), ("begin_tokens", begin_tokens)):
            bad = [int(t) for t in labels if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"suppress-tokens: {name} {bad} outside the vocabulary [0, {self.vocab_size})")
        self.tokens = sorted({int(t) for t in tokens})
        self.begin_tokens = sorted({int(t) for t in begin_tokens})
        self._rows = None

    def begin(self, layout: LaneLayout) -> None:
        super().begin(layout)
        always = np.zeros(self.vocab_size, dtype=np.float32)
        always[self.tokens] = -np.inf
        first = always.copy()
        first[self.begin_tokens] = -np.inf
        self._rows = layout.xp.asarray(np.stack([always, first]))  # [2, V]: later steps, first step

    def initial_context(self, groups, ctx: Context | None = None) -> Context:
        xp, layout = self.layout.xp, self.layout
        counts = xp.zeros(layout.num_lanes, dtype=np.int32) if ctx is None else ctx.copy()
        counts[xp.asarray(layout.lanes_of(np.asarray(groups, dtype=np.int64).reshape(-1)))] = 0
        return counts

    def score(self, ctx: Context):
        """[N, V] float32: 0, or −inf where the lane may not emit the label."""
        return self._rows[(ctx == 0).astype(np.int64)]

    def extend(self, ctx: Context, parents, labels) -> Context:
        return ctx[parents] + (labels >= 0).astype(np.int32)
