"""Label scorers: the batched interface, the registry, combination and built-in scorers."""

from gpudecode.scorers.base import (
    Context,
    LabelScorer,
    LaneLayout,
    Transition,
    UtteranceBatch,
)
from gpudecode.scorers.combine import ScorerEntry, check_scorers, combine_scores
from gpudecode.scorers.length_reward import LengthRewardScorer
from gpudecode.scorers.suppress_tokens import SuppressTokensScorer
from gpudecode.scorers.registry import (
    ScorerTypeError,
    create_scorer,
    register_scorer,
    registered_scorer_types,
    scorer_class,
)

__all__ = [
    "Context",
    "LabelScorer",
    "LaneLayout",
    "LengthRewardScorer",
    "ScorerEntry",
    "ScorerTypeError",
    "SuppressTokensScorer",
    "Transition",
    "UtteranceBatch",
    "check_scorers",
    "combine_scores",
    "create_scorer",
    "register_scorer",
    "registered_scorer_types",
    "scorer_class",
]
