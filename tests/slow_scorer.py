"""A custom scorer that adds nothing but time: makes a decoding run slow enough to interrupt."""

import time

import numpy as np

from gpudecode.scorers import LabelScorer


class SlowScorer(LabelScorer):
    def __init__(self, *, vocab_size: int, seconds: float = 0.02):
        self.vocab_size, self.seconds = vocab_size, seconds

    def initial_context(self, groups, ctx=None):
        return None

    def score(self, ctx):
        time.sleep(self.seconds)
        return self.layout.xp.zeros((self.layout.num_lanes, self.vocab_size), np.float32)

    def extend(self, ctx, parents, labels):
        return None
