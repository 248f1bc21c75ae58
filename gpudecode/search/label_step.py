"""The selection of a label-synchronous search step in one kernel launch (``kernels/label_step.cu``).

:func:`gpudecode.search.label_sync._select` builds the candidates of a step, ranks them, keeps the
best ``beam_size`` per utterance and makes the new lanes in ~40 array operations, each a launch
with its own host cost. Utterances never interact there, so on CuPy one thread block per
utterance does all of it in one launch (the scorers still run before, and extend after).
"""

from __future__ import annotations

import numpy as np

MAX_BEAM = 32  # LABEL_MAX_BEAM of kernels/label_step.cu
MAX_SCORERS = 4  # logp0 .. logp3
_THREADS = 256  # LABEL_THREADS

#: Off: CuPy runs the array version too (the tests compare both).
enabled = True


def use_kernel(xp, beam_size: int, num_scorers: int) -> bool:
    """Whether a step's selection runs as ``label_select_<K>`` (CuPy, beam <= 32, <= 4 scorers)."""
    return enabled and xp is not np and beam_size <= MAX_BEAM and 1 <= num_scorers <= MAX_SCORERS


def select_kernel(beam, combined, log_probs, norm, deadline, step: int, layout, options):
    """``label_sync._select`` as one launch: returns (new beam fields as a dict, parents, labels).

    ``norm``: [N] float32 length normalisers of each lane's candidates, or None for none;
    ``deadline``: [N] int64, a lane ends once ``deadline <= step``."""
    from gpudecode.kernels import load_module

    cupy = layout.xp
    num_lanes, beam_size = layout.num_lanes, layout.beam_size
    vocab_size = int(combined.shape[1])
    combined = cupy.ascontiguousarray(combined, dtype=np.float32)
    log_probs = [cupy.ascontiguousarray(logp, dtype=np.float32) for logp in log_probs]
    pointers = log_probs + [log_probs[0]] * (MAX_SCORERS - len(log_probs))  # unused ones are never read
    ended = cupy.ascontiguousarray(beam.ended, dtype=bool)
    scorer_scores = cupy.ascontiguousarray(beam.scorer_scores, dtype=np.float32)
    parents = cupy.empty(num_lanes, dtype=np.int64)
    labels = cupy.empty(num_lanes, dtype=np.int64)
    scores = cupy.empty(num_lanes, dtype=np.float32)
    lengths = cupy.empty(num_lanes, dtype=np.int64)
    ended_out = cupy.empty(num_lanes, dtype=bool)
    scorer_out = cupy.empty_like(scorer_scores)
    threshold = options.score_threshold
    kept = next(k for k in (8, 16, 32) if k >= beam_size)  # the kernel's per-thread list
    kernel = load_module("label_step", (), combined.device.id).get_function(f"label_select_{kept}")
    kernel((layout.num_groups,), (_THREADS,), (
        combined, np.int32(vocab_size), np.int32(beam_size), cupy.ascontiguousarray(beam.scores, dtype=np.float32),
        cupy.ascontiguousarray(beam.lengths, dtype=np.int64), ended.view(np.uint8),
        np.uint64(0) if norm is None else cupy.ascontiguousarray(norm, dtype=np.float32),
        np.int32(threshold is not None), np.float32(threshold or 0), np.int64(options.sentence_end),
        cupy.ascontiguousarray(deadline, dtype=np.int64), np.int64(step), np.int32(len(log_probs)), *pointers,
        scorer_scores, np.int64(num_lanes), parents, labels, scores, lengths, ended_out.view(np.uint8), scorer_out,
    ))
    return dict(scores=scores, scorer_scores=scorer_out, lengths=lengths, ended=ended_out), parents, labels
