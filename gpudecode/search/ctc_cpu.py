"""The CTC prefix beam search as compiled CPU loops (numba): without label scorers one call for
every frame, with scorers a call per full frame (ranked with the scorers' cached terms, as the
scored CUDA kernel does).

:meth:`gpudecode.search.ctc._PrefixSearch._full_frame` runs a frame as ~80 numpy operations; for
one utterance per call, or small beams, their fixed cost dominates. Without label scorers the
utterances never interact, so here one compiled function loops over the utterances (spread over
threads with ``SearchTuning.cpu_threads``), and per utterance over its frames and lanes — candidates, recombination with the collision check (label
paths walked to the end), label pruning (``token_min_logp``, applied to each frame's log-probs as
``ctc.prune_labels`` does), score threshold, the deterministic top-k (equal ranks to the lower lane,
then the lower label; NaN ranks as -inf) and the new lanes — as ``kernels/ctc_frame.cu`` does on
CUDA and ``gpudecode.testing.search_reference.full_frame_reference`` in Python. The float32
arithmetic is the array version's (``logaddexp`` as numpy computes it), so the n-best lists are
the same; the tests compare them.

numba is optional (the ``cpu-jit`` extra): :func:`available` says whether it imports; the search
then runs its array version. The first call compiles (cached on disk).
"""

from __future__ import annotations

import functools

import numpy as np

from gpudecode.search.emission_tree import HASH_MULTIPLIER

#: The lane state taken and returned, in this order (``ctc._PrefixSearch``'s arrays, as
#: ``ctc_frame.LANE_STATE``).
LANE_STATE = ("blank_logp", "label_logp", "last", "length", "hash", "prev_hash", "node")


@functools.cache
def available() -> bool:
    """Whether numba imports (the compiled loops run only then)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def use_loop(xp, tuning, stats=None) -> bool:
    """Whether a prefix search runs as the compiled loop: numpy, numba importable,
    ``SearchTuning.compiled_cpu_loops`` on and no top-k observer (``SearchStats.on_top_k``: only the
    array version ranks through top-k calls) — without scorers every frame in one call
    (:func:`search_frames`), with scorers a call per full frame (:class:`ScoredFrameLoop`)."""
    return (xp is np and tuning.compiled_cpu_loops and (stats is None or stats.on_top_k is None)
            and available())


class ScoredFrameLoop:
    """The compiled frames of a prefix search with scorers, a call per full frame: what
    ``ctc_frame.FrameLauncher`` launches on CUDA (the same ``launch`` and moves), on numpy arrays,
    the utterances spread over ``threads`` of numba's threads. Arguments as for :func:`search_frames`;
    the log-probs are pruned in the loop (``options.token_min_logp``)."""

    def __init__(self, log_probs, lengths, skip, frame_kinds: np.ndarray, options, beam_size: int, *,
                 threads: int = 1) -> None:
        import numba

        self.log_probs = np.ascontiguousarray(log_probs, dtype=np.float32)
        num_utts, self.num_frames, _ = self.log_probs.shape
        self.lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        self.has_skip = skip is not None
        self.skip = np.ascontiguousarray(skip, dtype=np.bool_) if self.has_skip else np.zeros((1, 1), np.bool_)
        self.kinds = np.ascontiguousarray(frame_kinds, dtype=np.int8)
        self.options, self.beam_size = options, int(beam_size)
        self.threads = max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS, num_utts))
        num_lanes = num_utts * self.beam_size
        self.parents = np.zeros(num_lanes, dtype=np.int64)
        self.labels = np.full(num_lanes, -1, dtype=np.int64)
        self.transitions = np.zeros(num_lanes, dtype=np.int8)

    def launch(self, state, node_parent, node_label, frame_begin: int, frame_end: int, full_begin: int,
               lm_term=None, lm_total=None) -> None:
        """``FrameLauncher.launch`` on the host: ``state`` (C-contiguous numpy arrays in
        :data:`LANE_STATE` order) updated in place; without ``lm_term`` the frames hold no full one."""
        import numba

        from gpudecode.search import ctc_cpu_jit

        options = self.options
        threshold, token_min = options.score_threshold, options.token_min_logp
        if lm_term is None:  # blank-only frames after the last full one: no term is read
            lm_term, lm_total = np.zeros((1, 1), np.float32), np.zeros(1, np.float32)
        run = ctc_cpu_jit.scored_frames_threaded if self.threads > 1 else ctc_cpu_jit.scored_frames
        previous = numba.get_num_threads()
        if self.threads > 1:
            numba.set_num_threads(self.threads)
        try:
            run(
                self.log_probs, self.lengths, self.skip, self.has_skip, self.kinds, self.beam_size,
                int(options.blank), threshold is not None, np.float32(threshold or 0), token_min is not None,
                np.float32(token_min or 0), np.int64(HASH_MULTIPLIER), np.int64(options.hash_modulus), *state,
                node_parent, node_label, int(frame_begin), int(frame_end), int(full_begin),
                np.ascontiguousarray(lm_term, dtype=np.float32), np.ascontiguousarray(lm_total, dtype=np.float32),
                self.parents, self.labels, self.transitions)
        finally:
            if self.threads > 1:
                numba.set_num_threads(previous)


def search_frames(log_probs, lengths, skip, frame_kinds: np.ndarray, state: tuple, node_parent, node_label,
                  options, beam_size: int, *, threads: int = 1) -> tuple[tuple, list[int], np.bool_]:
    """Every frame of a prefix search without scorers, compiled (``ctc_frame.search_kernel``'s
    contract on numpy arrays): ``log_probs`` [U, T, V] float32, ``lengths`` [U], ``skip`` [U, T]
    bool or None, ``frame_kinds`` [T] int8 (0 idle, 1 blank only, 2 full), ``state`` the lane
    arrays in :data:`LANE_STATE` order; ``node_parent`` / ``node_label`` written in place;
    ``threads`` > 1: utterances spread over that many of numba's threads (at most its pool).
    Returns (the new lane state, the frame of each full frame, False: pairs are compared to the end)."""
    import numba

    from gpudecode.search import ctc_cpu_jit

    threads = min(int(threads), numba.config.NUMBA_NUM_THREADS, int(log_probs.shape[0]))
    frames = ctc_cpu_jit.frames_threaded if threads > 1 else ctc_cpu_jit.frames
    log_probs = np.ascontiguousarray(log_probs, dtype=np.float32)
    state = [np.ascontiguousarray(array).copy() for array in state]
    blank_logp, label_logp, last, length, hsh, prev_hash, node = state
    kinds = np.ascontiguousarray(frame_kinds, dtype=np.int8)
    has_skip = skip is not None
    skip = np.ascontiguousarray(skip, dtype=np.bool_) if has_skip else np.zeros((1, 1), np.bool_)
    threshold, token_min = options.score_threshold, options.token_min_logp
    previous = numba.get_num_threads()
    if threads > 1:
        numba.set_num_threads(threads)
    try:
        frames(log_probs, np.ascontiguousarray(lengths, dtype=np.int64), skip, has_skip, kinds, int(beam_size),
               int(options.blank), threshold is not None, np.float32(threshold or 0), token_min is not None,
               np.float32(token_min or 0), np.int64(HASH_MULTIPLIER),
               np.int64(options.hash_modulus), blank_logp, label_logp, last, length, hsh, prev_hash, node,
               node_parent, node_label)
    finally:
        if threads > 1:
            numba.set_num_threads(previous)
    return tuple(state), np.flatnonzero(kinds == 2).tolist(), np.bool_(False)
