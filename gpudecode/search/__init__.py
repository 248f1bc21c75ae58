"""Beam searches over batched label scorers.

Python entry::

    from gpudecode.search import LabelSyncOptions, label_sync_search
    nbest = label_sync_search([("decoder", decoder, 1.0), ("lm", lm, 0.3)], utterances,
                              LabelSyncOptions(beam_size=8, sentence_end=eos), xp=numpy)
"""

from gpudecode.search.ctc import CtcPrefixOptions, ctc_greedy_search, ctc_prefix_search
from gpudecode.search.label_sync import LabelSyncOptions, label_sync_search
from gpudecode.search.nonfinite import NonFiniteScores
from gpudecode.search.results import Hypothesis
from gpudecode.search.stats import SearchStats
from gpudecode.search.topk import top_k_indices
from gpudecode.search.transducer import TransducerOptions, transducer_greedy_search, transducer_search
from gpudecode.search.tuning import SearchTuning

__all__ = [
    "CtcPrefixOptions",
    "Hypothesis",
    "LabelSyncOptions",
    "NonFiniteScores",
    "SearchStats",
    "SearchTuning",
    "TransducerOptions",
    "ctc_greedy_search",
    "ctc_prefix_search",
    "label_sync_search",
    "top_k_indices",
    "transducer_greedy_search",
    "transducer_search",
]
