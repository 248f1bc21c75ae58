"""A step model's own label positions (learned position embeddings, a rotary table) against the
label-synchronous search's length limit, checked when the search is built.

A model declares them in its ONNX metadata (``max_positions``, see
:data:`gpudecode.session.discovery.MAX_POSITIONS_KEY`; ONNX Runtime GenAI's ``context_length``
says the same); a search whose ``max_labels`` could run past them is refused at load, rather than
have the model score positions it never learned.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpudecode.session.discovery import MAX_POSITIONS_KEY, ModelError


def declared_positions(scorer) -> tuple[int, str, str] | None:
    """(positions, model file, where they are declared) of a scorer's step model, or None when it
    declares none."""
    spec = getattr(scorer, "spec", None)
    max_time = getattr(spec, "max_time", None)
    if max_time is None:
        return None
    tensors = getattr(spec, "tensors", None)
    declared_in = (f"ONNX metadata {MAX_POSITIONS_KEY}" if MAX_POSITIONS_KEY in getattr(tensors, "metadata", {})
                   else "genai_config.json context_length")
    return int(max_time) + 1, str(spec.source), declared_in


def check_max_labels(scorers: Sequence, max_labels: int) -> None:
    """Raises :class:`ModelError` when a scorer's model (``scorers``: (name, scorer, scale)) has
    fewer label positions than ``max_labels`` (``search.max_labels``; a prompt takes positions
    too, checked as the search runs)."""
    for name, scorer, _ in scorers:
        declared = declared_positions(scorer)
        if declared is None or max_labels <= declared[0]:
            continue
        positions, source, declared_in = declared
        raise ModelError(
            f"{source}: scorer {name!r}: the model has {positions} label positions ({declared_in}), but "
            f"search.max_labels is {max_labels}: longer hypotheses would be scored at positions it does not "
            f"have; set search.max_labels to at most {positions} (less the longest prompt)")
