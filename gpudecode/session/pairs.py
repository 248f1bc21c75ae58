"""Checks that models loaded together fit each other, before anything runs: an encoder's outputs
against a decoder's per-utterance (cross-attention) inputs, and the vocabulary sizes of every
model that scores labels. Each failure is a :class:`ModelError` naming both models."""

from __future__ import annotations

from collections.abc import Sequence

from gpudecode.session.discovery import EncoderSpec, ModelError, ModelSpec
from gpudecode.session.tensors import TensorInfo

__all__ = ["check_cross_inputs", "check_vocab_sizes", "encoder_outputs", "last_dim"]


def encoder_outputs(encoder: EncoderSpec) -> dict[str, TensorInfo]:
    """The encoder's outputs under the names the utterances carry them (``encoder-states`` for its
    main output, the others by their own names)."""
    main = encoder.names["encoder-states"]
    outputs = {"encoder-states": encoder.tensors.output(main)}
    for name in encoder.extra_outputs:
        outputs[name] = encoder.tensors.output(name)
    return {k: v for k, v in outputs.items() if v is not None}


def check_cross_inputs(decoder: ModelSpec, encoder: EncoderSpec, *, who: str) -> None:
    """Each per-utterance input of ``decoder`` fed from an encoder output has that output's rank and
    static sizes (batch and time axes left out). ``who`` names the decoder (``scorers[0] 'decoder'``)."""
    outputs = encoder_outputs(encoder)
    for u in decoder.utterance_inputs:
        source = u.source or u.name
        given = outputs.get(source)
        if given is None:
            continue
        taken = decoder.tensors.input(u.name)
        shape = taken.shape if taken is not None else u.shape
        where = (f"{who} ({decoder.source}) does not fit the encoder ({encoder.source}): its input "
                 f"'{u.name}' {_describe(shape, u.dtype)} is fed the encoder's output "
                 f"'{given.name}' {given.describe()}")
        if len(shape) != given.rank:
            raise ModelError(f"{where}: rank {len(shape)} against {given.rank}")
        for axis, (want, have) in enumerate(zip(shape, given.shape)):
            if axis == 0 or axis == u.time_axis:
                continue
            if isinstance(want, int) and isinstance(have, int) and want != have:
                raise ModelError(f"{where}: axis {axis} is {want} in the decoder but {have} from the encoder "
                                 "(cross-attention width: the two models were not trained together)")


def check_vocab_sizes(sizes: Sequence[tuple[str, int | None]], vocabulary: tuple[str, int]) -> None:
    """Every ``(model, label count)`` of ``sizes`` (None: not declared) equals the vocabulary's
    ``(file, size)``; the error lists every model with its count."""
    path, size = vocabulary
    known = [(who, n) for who, n in sizes if n is not None]
    wrong = [(who, n) for who, n in known if n != size]
    if wrong:
        listing = "; ".join(f"{who}: {n}" for who, n in known)
        first, count = wrong[0]
        raise ModelError(f"{first} scores {count} labels but the vocabulary {path} has {size} "
                         f"(labels per model: {listing}); the models and the vocabulary must share one "
                         "label set")


def last_dim(info: TensorInfo | None) -> int | None:
    """The static last dimension of a tensor (None: absent or symbolic)."""
    if info is None or not info.shape:
        return None
    last = info.shape[-1]
    return last if isinstance(last, int) else None


def _describe(shape: Sequence, dtype) -> str:
    dims = ",".join("?" if not isinstance(d, int) else str(d) for d in shape)
    return f"{getattr(dtype, 'name', dtype)}[{dims}]"




def check_state_kind(spec: ModelSpec, manager_type: str, family: str) -> None:
    """The model's state variables are of the kind the state manager keeps: growing histories (a
    time axis) for a ``transformer`` manager, fixed-size states for an ``lstm`` one. The error names
    the model, the manager and the first state variable of the other kind."""
    growing = family == "transformer"
    odd = next((v for v in spec.state_variables if (v.time_axis is None) == growing), None)
    if odd is None:
        return
    shape = _describe(odd.shape, odd.dtype)
    if growing:
        raise ModelError(
            f"{spec.source}: state_manager {manager_type!r} keeps histories that grow by one state per label, "
            f"but the model's state variable '{odd.input_name}' {shape} has no time axis (fixed-size states, as "
            "an LSTM's): give this scorer an lstm state manager, or check that it names the model meant for it")
    raise ModelError(
        f"{spec.source}: state_manager {manager_type!r} keeps fixed-size states (an LSTM's), but the model's "
        f"state variable '{odd.input_name}' {shape} grows along axis {odd.time_axis} (the history of an attention "
        "decoder or a transformer LM): check that this scorer names the model meant for it (a decoder where the "
        "LM belongs?), or give it a transformer state manager")
