"""The CTC prefix beam search as launches of ``kernels/ctc_frame.cu``.

:meth:`gpudecode.search.ctc._PrefixSearch._full_frame` runs a frame as ~80 array operations and
the search launches them frame by frame. Here one thread block per utterance loops over frames —
candidates, recombination with the collision check, score threshold, top-k and the new lanes.
Without label scorers utterances never interact, so every frame runs in one launch
(:func:`search_kernel`). With scorers a launch runs up to one full frame, ranking with the
scorers' cached terms, and reports each new lane's parent, label and transition; the search then
moves the scorer contexts and scores the lanes that emitted before the next launch
(:class:`FrameLauncher`, ``ctc_prefix_frames_scored_<K>``) — a handful of launches per frame,
none reading back to the host.
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


def use_kernel(xp, beam_size: int) -> bool:
    """Whether a prefix search can run as ``ctc_prefix_frames_<K>`` (CuPy, beam <= 32;
    ``SearchTuning.fused_ctc_frames`` decides whether it does): without scorers every frame in one
    launch (:func:`search_kernel`), with scorers one launch per full frame (:class:`FrameLauncher`)."""
    return xp is not np and beam_size <= MAX_BEAM


class FrameLauncher:
    """Launches of ``ctc_prefix_frames_<K>`` (with scorers ``ctc_prefix_frames_scored_<K>``) over one
    search's inputs, each on a range of frames.

    ``log_probs`` [U, T, V] (already label-pruned where ``options.token_min_logp`` is set:
    ``ctc.prune_labels``) and ``lengths`` [U] (device), ``skip`` [U, T] bool (blank-skipped
    frames; None: none), ``frame_kinds`` the host [T] int8 of ``ctc._PrefixSearch._frame_kinds``;
    ``options``: the ``CtcPrefixOptions``. ``with_scorers``: the launches rank with scorer terms
    (no label prefilter: the scorers reorder a frame's labels). Nothing here synchronises.
    """

    def __init__(self, log_probs, lengths, skip, frame_kinds: np.ndarray, options, beam_size: int, *,
                 prefilter: bool = True, with_scorers: bool = False) -> None:
        from gpudecode.backend import get_array_module
        from gpudecode.kernels import load_module

        cupy = self.cupy = get_array_module(log_probs)
        self.log_probs = cupy.ascontiguousarray(log_probs, dtype=np.float32)
        num_utts, num_frames, vocab_size = self.log_probs.shape
        self.num_utts, self.num_frames, self.vocab_size = num_utts, num_frames, vocab_size
        self.skip = np.uint64(0) if skip is None else cupy.ascontiguousarray(skip).view(np.uint8)
        self.kinds = cupy.asarray(np.asarray(frame_kinds, dtype=np.int8))
        self.lengths = cupy.ascontiguousarray(lengths, dtype=np.int64)
        self.options, self.beam_size = options, beam_size
        self.unresolved = cupy.zeros((), dtype=bool)
        kept = next(k for k in (8, 16, 32) if k >= beam_size)  # the kernel's per-thread list
        name = f"ctc_prefix_frames_scored_{kept}" if with_scorers else f"ctc_prefix_frames_{kept}"
        self.kernel = load_module("ctc_frame", (), self.log_probs.device.id).get_function(name)
        rows = num_utts * num_frames
        self.num_top = top_label_count(beam_size, vocab_size, prefilter and not with_scorers) if rows else 0
        self.top_labels = self.top_values = np.uint64(0)  # null: no prefilter
        if self.num_top:  # every frame's best labels, all frames at once (a warp per frame)
            self.top_labels, self.top_values = top_labels_kernel(self.log_probs, options.blank, self.num_top)
        self.row_in_shared = not self.num_top and vocab_size * 4 <= _MAX_ROW_BYTES
        if with_scorers:  # where each launch says how its full frame moved the lanes
            num_lanes = num_utts * beam_size
            self.parents = cupy.empty(num_lanes, dtype=np.int64)
            self.labels = cupy.empty(num_lanes, dtype=np.int64)
            self.transitions = cupy.empty(num_lanes, dtype=np.int8)

    def launch(self, state, node_parent, node_label, frame_begin: int, frame_end: int, full_begin: int,
               lm_term=None, lm_total=None, step=None) -> None:
        """Frames [frame_begin, frame_end) of every utterance, the first full one the search's
        ``full_begin``-th; ``state``: the lane arrays in :data:`LANE_STATE` order (C-contiguous,
        updated in place), ``node_parent`` / ``node_label`` written in place. With ``lm_term``
        [N, V] and ``lm_total`` [N] (float32, Σ scale · scorer score of each label after each lane /
        of each lane's prefix) the frames hold at most one full frame, ranked with them; its moves
        are in :attr:`parents`, :attr:`labels` (-1: no label) and :attr:`transitions`
        (``Transition`` values). ``step`` ([3] int64 on the device, or None): frame_begin,
        frame_end and full_begin read from it when the kernel runs instead (a launch captured in a
        CUDA graph and replayed frame after frame)."""
        null = np.uint64(0)
        scored = lm_term is not None
        threshold = self.options.score_threshold
        self.kernel((self.num_utts,), (_THREADS,), (
            self.log_probs, np.int32(self.num_frames), np.int32(self.vocab_size), np.int32(self.options.blank),
            self.kinds, self.lengths, self.skip, np.int32(self.beam_size), *state, node_parent, node_label,
            np.int32(-1), np.int32(threshold is not None), np.float32(threshold or 0),  # -1: compare to the end
            np.int64(HASH_MULTIPLIER), np.int64(self.options.hash_modulus), self.unresolved.view(np.uint8),
            np.int32(self.row_in_shared), self.top_labels, self.top_values, np.int32(self.num_top),
            np.int32(frame_begin), np.int32(frame_end), np.int64(full_begin),
            lm_term if scored else null, lm_total if scored else null,
            self.parents if scored else null, self.labels if scored else null,
            self.transitions if scored else null, null if step is None else step,
        ), shared_mem=self.vocab_size * 4 if self.row_in_shared else 0)


def search_kernel(log_probs, lengths, skip, frame_kinds: np.ndarray, state: tuple, node_parent, node_label,
                  options, beam_size: int, *, prefilter: bool = True) -> tuple[tuple, list[int], object]:
    """Every frame of a prefix search without scorers (what its frame loop does) as one launch of
    ``ctc_prefix_frames_<K>``: a thread block per utterance, on the current stream, no host
    synchronisation. Arguments as for :class:`FrameLauncher`; ``state``: the lane arrays in
    :data:`LANE_STATE` order; ``node_parent`` and ``node_label`` (one node per lane and full frame,
    after node 0) are written in place.
    Returns (the new lane state, in :data:`LANE_STATE` order; the frame of each full frame; the
    device bool "some comparison stayed undecided", always False: hash-equal pairs are compared to
    the end in the kernel, so it never makes the search run again). ``prefilter`` False: every
    frame scans every label (:func:`top_label_count`)."""
    launcher = FrameLauncher(log_probs, lengths, skip, frame_kinds, options, beam_size, prefilter=prefilter)
    cupy = launcher.cupy
    node_frames = np.flatnonzero(np.asarray(frame_kinds) == 2).tolist()
    state = tuple(cupy.ascontiguousarray(array) for array in state)
    launcher.launch(state, node_parent, node_label, 0, launcher.num_frames, 0)
    return state, node_frames, launcher.unresolved
