"""What a search returns: n-best hypotheses per utterance."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hypothesis:
    """One entry of an utterance's n-best list.

    - ``labels``: label indices, without sentence-begin and sentence-end;
    - ``score``: the combined log score Σ scale · score (not length-normalised);
    - ``scores``: each scorer's own (unscaled) log score of the sequence, by scorer name;
    - ``length``: labels counted for length normalisation (including sentence-end when the
      hypothesis emitted it; a hypothesis force-ended at the length cap has none).
    """

    labels: list[int]
    score: float
    scores: dict[str, float]
    length: int
