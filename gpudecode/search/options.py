"""Shared by the searches: validation of option dataclasses and batches of frames, and the stream
the time-synchronous searches run on."""

from __future__ import annotations

import operator

import numpy as np

from gpudecode.backend import is_device_array, on_shared_stream


def option_error(options, name: str, expected: str) -> ValueError:
    """``ValueError`` naming the option class, the field, what it expects and what it got."""
    return ValueError(f"{type(options).__name__}.{name}: expected {expected}, got {getattr(options, name)!r}")


def coerce_ints(options, names) -> None:
    """Turns integer-like fields (numpy integers too, never floats or bools) into ints, in place."""
    for name in names:
        value = getattr(options, name)
        if value is not None and not isinstance(value, bool):
            try:
                object.__setattr__(options, name, operator.index(value))
            except TypeError:
                raise option_error(options, name, "an int") from None


#: Fields the time-synchronous searches (CTC prefix, transducer) share.
TIME_SYNC_INT_FIELDS = ("beam_size", "blank", "sentence_end", "max_cached_score_vectors", "nbest",
                        "hash_modulus", "history_compare_steps")


def check_time_sync_options(options) -> None:
    """Coerces and checks the fields of :data:`TIME_SYNC_INT_FIELDS` and ``score_threshold``."""
    def bad(name: str, expected: str) -> ValueError:
        return option_error(options, name, expected)

    coerce_ints(options, TIME_SYNC_INT_FIELDS)
    if not isinstance(options.beam_size, int) or options.beam_size < 1:
        raise bad("beam_size", "an int >= 1")
    if not isinstance(options.blank, int) or options.blank < 0:
        raise bad("blank", "a label index >= 0")
    if options.sentence_end is not None and not (isinstance(options.sentence_end, int) and options.sentence_end >= 0):
        raise bad("sentence_end", "None or a label index >= 0")
    if options.score_threshold is not None and not options.score_threshold > 0:
        raise bad("score_threshold", "None or a number > 0")
    if not isinstance(options.max_cached_score_vectors, int) or options.max_cached_score_vectors < 0:
        raise bad("max_cached_score_vectors", "an int >= 0")
    if options.nbest is not None and not (isinstance(options.nbest, int) and 1 <= options.nbest <= options.beam_size):
        raise bad("nbest", f"None or an int in [1, beam_size={options.beam_size}]")
    if not isinstance(options.hash_modulus, int) or not 1 <= options.hash_modulus <= 2**31 - 1:
        raise bad("hash_modulus", "an int in [1, 2**31 - 1]")
    if options.history_compare_steps is not None and not (
            isinstance(options.history_compare_steps, int) and options.history_compare_steps >= 0):
        raise bad("history_compare_steps", "None or an int >= 0")


def check_frames(frames, host_lengths, xp, name: str, last_axis: str) -> np.ndarray:
    """Checks a ``[U, T, last_axis]`` batch of frames (on the search's array module) and its
    lengths (already on the host); returns the lengths as int64. Errors name ``name``."""
    if frames.ndim != 3:
        raise ValueError(f"{name}: expected [U, T, {last_axis}], got shape {tuple(frames.shape)}")
    if is_device_array(frames) != (xp is not np):
        raise ValueError(f"{name}: a {type(frames).__module__} array, but the search runs on {xp.__name__}")
    num_utts, num_frames, _ = frames.shape
    lengths = np.asarray(host_lengths).astype(np.int64, copy=False)
    if lengths.shape != (num_utts,):
        raise ValueError(f"lengths: expected shape ({num_utts},) for {name} of shape "
                         f"{tuple(frames.shape)}, got {lengths.shape}")
    outside = (lengths < 0) | (lengths > num_frames)
    if outside.any():
        u = int(np.argmax(outside))
        raise ValueError(f"lengths[{u}] = {lengths[u]} is outside [0, T={num_frames}]")
    return lengths


def on_search_stream(xp, run):
    """``run()`` on the stream shared with ONNX Runtime (CuPy), after the caller's queued work."""
    if xp is np:
        return run()
    with on_shared_stream(xp.cuda.Device().id):
        return run()
