"""A toy search type from outside the library, in one file: best label per input frame.

It reads the decoder's encoder output (without an encoder: the features themselves) as frame
scores [U, T, V] and returns, per utterance, the best label of each frame with repeats collapsed
and labels below ``search.options.min_label`` dropped: enough to prove that a search type needs
only its module and its registration.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpudecode.backend import to_host
from gpudecode.hypothesis import Hypothesis
from gpudecode.search.registry import SearchSetup, SearchType, register_search

NAME = "toy-best-label"


@dataclass(frozen=True)
class ToyOptions:
    min_label: int = 0


def _options(setup: SearchSetup) -> ToyOptions:
    return ToyOptions(**setup.config.options)


def _decode(setup: SearchSetup, batch) -> list[list[Hypothesis]]:
    scores = to_host(batch.inputs["encoder-states"])
    lengths = np.asarray(batch.input_lengths)
    results = []
    for u, length in enumerate(lengths.tolist()):  # a toy: one utterance at a time
        best = scores[u, :length].argmax(axis=1)
        kept = [int(v) for i, v in enumerate(best)
                if (i == 0 or v != best[i - 1]) and v >= setup.options.min_label]
        score = float(scores[u, np.arange(length), best].sum())
        results.append([Hypothesis(labels=kept, score=score, length=len(kept))])
    return results


TOY_SEARCH = register_search(SearchType(name=NAME, title="the toy search", decode=_decode, make_options=_options,
                                        options_class=ToyOptions, scorers="forbidden"))
