"""A custom label scorer in ~30 lines: log p(label | previous label) from a bigram table.

From a config (``examples/custom_scorer.yaml`` decodes the FSDD test recordings with it)::

    scorers:
      - {type: "custom_scorer:BigramScorer", name: bigram, scale: 0.5,
         options: {log_probs: custom_scorer_bigram.npy}}

    gpudecode decode examples/custom_scorer.yaml

``custom_scorer`` is found because a ``module:Class`` scorer that the Python path does not hold
is imported from the config file's folder (then the working directory); ``log_probs`` is listed
in ``path_options``, so its relative path resolves against the config file's folder, like every
path of a config. ``custom_scorer_bigram.npy`` is a flat table over the FSDD labels ([13, 12]:
the same log-probability for every label but ``<blank>``): a demonstration, not a language model.

From Python::

    scorer = BigramScorer(log_probs=table)          # table [V + 1, V]; row V = sentence-begin
    label_sync_search([("bigram", scorer, 1.0)], utterances, options)

Works on numpy and CuPy alike: the table moves to the run's array module in ``begin``; the
context is one int array [N] (each lane's last label) — no per-hypothesis objects.
"""

from pathlib import Path

import numpy as np

from gpudecode.scorers import LabelScorer


class BigramScorer(LabelScorer):
    path_options = ("log_probs",)  # file options: resolved against the config's folder

    def __init__(self, *, log_probs):
        table = np.load(log_probs) if isinstance(log_probs, (str, Path)) else np.asarray(log_probs)
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
