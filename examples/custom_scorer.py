"""A custom label scorer in ~30 lines: log p(label | previous label) from a bigram table.

From a config::

    scorers:
      - {type: "examples.custom_scorer:BigramScorer", scale: 0.5,
         options: {log_probs: bigram.npy}}

From Python::

    scorer = BigramScorer(log_probs=table)          # table [V + 1, V]; row V = sentence-begin
    label_sync_search([("bigram", scorer, 1.0)], utterances, options)

Works on numpy and CuPy alike: the table moves to the run's array module in ``begin``; the
context is one int array [N] (each lane's last label) — no per-hypothesis objects.
"""

import numpy as np

from gpudecode.scorers import LabelScorer


class BigramScorer(LabelScorer):
    def __init__(self, *, log_probs):
        table = np.load(log_probs) if isinstance(log_probs, str) else np.asarray(log_probs)
        self.vocab_size = table.shape[-1]
        if table.shape != (self.vocab_size + 1, self.vocab_size):
            raise ValueError(f"BigramScorer: log_probs must be [V + 1, V], got {table.shape}")
        self.table = table.astype(np.float32)

    def begin(self, layout):
        super().begin(layout)
        self._table = layout.xp.asarray(self.table)  # on the run's device, once

    def initial_context(self, groups, ctx=None):
        xp, sentence_begin = self.layout.xp, self.vocab_size
        prev = xp.full(self.layout.num_lanes, sentence_begin) if ctx is None else ctx.copy()
        prev[xp.asarray(self.layout.lanes_of(groups))] = sentence_begin
        return prev  # [N] int64: the last label of each lane

    def score(self, prev):
        return self._table[prev]  # [N, V]

    def extend(self, prev, parents, labels):
        return self.layout.xp.where(labels >= 0, labels, prev[parents])
