"""The CTC prefix beam search without label scorers in one kernel launch (``kernels/ctc_frame.cu``).

:meth:`gpudecode.search.ctc._PrefixSearch._full_frame` runs a frame as ~80 array operations and
the search launches them frame by frame. Without label scorers utterances never interact, so
here one thread block per utterance loops over all frames — candidates, recombination with the
collision check, score threshold, top-k and the new lanes — in one launch.
``gpudecode.testing.search_reference.full_frame_reference`` is a full frame written utterance by
utterance and lane by lane in Python (what each thread block does per frame), the oracle of the
kernel's structure; the tests check it against the array version.
"""

from __future__ import annotations

import numpy as np

from gpudecode.search.emission_tree import HASH_MULTIPLIER

# -- the kernel ------------------------------------------------------------------------------------
MAX_BEAM = 32  # CTC_MAX_BEAM of kernels/ctc_frame.cu
_THREADS = 256  # CTC_THREADS
#: The frame's log-prob row goes to dynamic shared memory up to this size (the default 48 KiB
#: limit less the kernel's static shared memory); larger vocabularies read it from global memory.
_MAX_ROW_BYTES = 40 * 1024
#: The lane state the kernel takes and returns, in this order (``ctc._PrefixSearch``'s arrays).
LANE_STATE = ("blank_logp", "label_logp", "last", "length", "hash", "prev_hash", "node")
#: The prefilter's list lengths (``ctc_top_labels_<P>``), P >= 2 * beam + 1, by largest beam.
_TOP_LABELS = ((4, 9), (8, 17), (16, 33))


def top_label_count(beam_size: int, vocab_size: int, prefilter: bool = True) -> int:
    """How many best labels per frame the kernel's prefilter lists (0: no prefilter — switched
    off, a beam above 16, or too few labels for the list to leave any out)."""
    if not prefilter:
        return 0
    count = next((p for b, p in _TOP_LABELS if beam_size <= b), 0)
    return count if count and vocab_size - 1 > count else 0


def top_labels_kernel(log_probs, blank: int, num_top: int):
    """``ctc_top_labels_<num_top>`` (num_top 9, 17 or 33) on log_probs [..., V], a C-contiguous
    float32 CuPy array: per row its num_top best labels other than ``blank``, as
    ``gpudecode.testing.search_reference.top_labels_reference``, and their log-probs — (labels [..., num_top] int32 (-1 past the
    row's labels), values [..., num_top] float32 (-inf there)). A warp per row, no host sync."""
    from gpudecode.backend import require_cupy
    from gpudecode.kernels import load_module

    cupy = require_cupy()
    vocab_size = log_probs.shape[-1]
    rows = log_probs.size // vocab_size if vocab_size else 0
    labels = cupy.empty((*log_probs.shape[:-1], num_top), dtype=np.int32)
    values = cupy.empty((*log_probs.shape[:-1], num_top), dtype=np.float32)
    if rows:
        load_module("ctc_frame", (), log_probs.device.id).get_function(f"ctc_top_labels_{num_top}")(
            ((rows + _THREADS // 32 - 1) // (_THREADS // 32),), (_THREADS,),
            (log_probs, np.int64(rows), np.int32(vocab_size), np.int32(blank), labels, values))
    return labels, values


def use_kernel(xp, num_scorers: int, beam_size: int) -> bool:
    """Whether a prefix search can run as ``ctc_prefix_frames_<K>`` (CuPy, no scorers, beam <= 32;
    ``SearchTuning.fused_ctc_frames`` decides whether it does)."""
    return xp is not np and num_scorers == 0 and beam_size <= MAX_BEAM


def search_kernel(log_probs, lengths, skip, frame_kinds: np.ndarray, state: tuple, node_parent, node_label,
                  options, beam_size: int, *, prefilter: bool = True) -> tuple[tuple, list[int], object]:
    """Every frame of a prefix search without scorers (what its frame loop does) as one launch of
    ``ctc_prefix_frames_<K>``: a thread block per utterance, on the current stream, no host
    synchronisation.

    ``log_probs`` [U, T, V] (already label-pruned where ``options.token_min_logp`` is set:
    ``ctc.prune_labels``) and ``lengths`` [U] (device), ``skip`` [U, T] bool (blank-skipped
    frames; None: none), ``frame_kinds`` the host [T] int8 of ``_frame_kinds``; ``state``: the
    lane arrays in :data:`LANE_STATE` order; ``node_parent`` and ``node_label`` (one node per lane
    and full frame, after node 0) are written in place; ``options``: the ``CtcPrefixOptions``.
    Returns (the new lane state, in :data:`LANE_STATE` order; the frame of each full frame; the
    device bool "some comparison stayed undecided", always False: hash-equal pairs are compared to
    the end in the kernel, so it never makes the search run again). ``prefilter`` False: every
    frame scans every label (:func:`top_label_count`)."""
    from gpudecode.kernels import load_module
    from gpudecode.backend import get_array_module

    cupy = get_array_module(log_probs)
    log_probs = cupy.ascontiguousarray(log_probs, dtype=np.float32)
    num_utts, num_frames, vocab_size = log_probs.shape
    skip = np.uint64(0) if skip is None else cupy.ascontiguousarray(skip).view(np.uint8)
    kinds = np.asarray(frame_kinds, dtype=np.int8)
    node_frames = np.flatnonzero(kinds == 2).tolist()
    state = [cupy.ascontiguousarray(array) for array in state]
    unresolved = cupy.zeros((), dtype=bool)
    steps = -1  # the kernel walks hash-equal pairs to the end: it never leaves one undecided
    threshold = options.score_threshold
    kept = next(k for k in (8, 16, 32) if k >= beam_size)  # the kernel's per-thread list
    module = load_module("ctc_frame", (), log_probs.device.id)
    kernel = module.get_function(f"ctc_prefix_frames_{kept}")
    rows = num_utts * num_frames
    num_top = top_label_count(beam_size, vocab_size, prefilter) if rows else 0
    top_labels = top_values = np.uint64(0)  # null: no prefilter
    if num_top:  # every frame's best labels, all frames at once (a warp per frame)
        top_labels, top_values = top_labels_kernel(log_probs, options.blank, num_top)
    row_in_shared = not num_top and vocab_size * 4 <= _MAX_ROW_BYTES
    kernel((num_utts,), (_THREADS,), (
        log_probs, np.int32(num_frames), np.int32(vocab_size), np.int32(options.blank),
        cupy.asarray(kinds), cupy.ascontiguousarray(lengths, dtype=np.int64), skip,
        np.int32(beam_size), *state, node_parent, node_label,
        np.int32(steps), np.int32(threshold is not None), np.float32(threshold or 0),
        np.int64(HASH_MULTIPLIER), np.int64(options.hash_modulus), unresolved.view(np.uint8),
        np.int32(row_in_shared), top_labels, top_values, np.int32(num_top),
    ), shared_mem=vocab_size * 4 if row_in_shared else 0)
    return tuple(state), node_frames, unresolved
