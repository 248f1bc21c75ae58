"""What a search returns per utterance: an n-best list of :class:`Hypothesis`.

A leaf module (it imports nothing from gpudecode): the searches make hypotheses, and the result
writers (``gpudecode.io``) read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Hypothesis:
    """One entry of an utterance's n-best list.

    - ``labels``: label indices, without sentence-begin and sentence-end;
    - ``score``: the combined log score Σ scale · score (not length-normalised);
    - ``scores``: each scorer's own (unscaled) log score of the sequence, by scorer name;
    - ``length``: labels counted for length normalisation (including sentence-end when the
      hypothesis emitted it; a hypothesis force-ended at the length cap has none);
    - ``frames``: per label, the input frame at which it was emitted (time-synchronous
      searches), else ``None``;
    - ``truncated``: the search cut the hypothesis short — force-ended at the label limit
      (``max_labels`` / ``max_labels_per_input``) without a sentence-end, or (transducer) a frame's
      ``max_symbols_per_frame`` stopped it while its best continuation was a label, not blank.
    """

    labels: list[int]
    score: float
    scores: dict[str, float] = field(default_factory=dict)
    length: int | None = None
    frames: list[int] | None = None
    truncated: bool = False

    def __post_init__(self) -> None:
        if self.frames is not None and len(self.frames) != len(self.labels):
            raise ValueError(f"{len(self.frames)} frame indices for {len(self.labels)} labels")

    @classmethod
    def made(cls, labels: list[int], score: float, scores: dict[str, float], length: int,
             frames: list[int] | None, truncated: bool = False) -> Hypothesis:
        """The constructor's hypothesis without its checks, for values that hold them by
        construction (``frames`` None or as long as ``labels``), in half its time: a search's
        n-best lists hold thousands (the dataclass's frozen ``__init__`` sets each field through
        ``object.__setattr__``)."""
        hyp = object.__new__(cls)
        fields = hyp.__dict__
        (fields["labels"], fields["score"], fields["scores"], fields["length"], fields["frames"],
         fields["truncated"]) = (labels, score, scores, length, frames, truncated)
        return hyp
