"""The selection of a label-synchronous search step in two kernel launches (``kernels/label_step.cu``).

:func:`gpudecode.search.beam.select` builds the candidates of a step, ranks them, keeps the
best ``beam_size`` per utterance and makes the new lanes in ~40 array operations, each a launch
with its own host cost. On CuPy two launches do all of it (the scorers still run before, and
extend after): one thread block per 2,048 labels of a lane keeps their best ``beam_size``
candidates, then one per utterance picks from those lists. The combined score Σ scale ·
log-probs is formed inside, never as an [N, V] array, and float16 scores are read as they are
(converted exactly to float32 in the kernels, as ``astype(float32)`` converts them).

With separate finished lists (``finished="separate"`` / ``"separate-genai"``, beam <= 16) the
lanes keep their best ``2 × beam_size`` candidates by score, and the utterance's block also makes
its finished list (:func:`select_separate_kernel`; the array version is
:func:`gpudecode.search.beam.select_separate`, the compiled CPU one
:mod:`gpudecode.search.label_sync_cpu`, whose normalisers it reads, so CPU and CUDA rank alike).
"""

from __future__ import annotations

import functools

import numpy as np

MAX_BEAM = 32  # LABEL_MAX_BEAM of kernels/label_step.cu
MAX_SEPARATE_BEAM = MAX_BEAM // 2  # finished="separate": 2 × beam candidates per utterance (SEPARATE_MAX_SIZE)
MAX_SCORERS = 4  # logp0 .. logp3
_THREADS = 256  # LABEL_THREADS
SEGMENT = 8 * _THREADS  # LABEL_SEGMENT: labels per block of label_lane_top_<K>

def use_kernel(xp, beam_size: int, num_scorers: int, finished: str = "in-beam") -> bool:
    """Whether a step's selection can run in the kernels (CuPy, <= 4 scorers, beam <= 32, or <= 16
    with separate finished lists; ``SearchTuning.fused_label_step`` decides whether it does)."""
    limit = MAX_BEAM if finished == "in-beam" else MAX_SEPARATE_BEAM
    return xp is not np and beam_size <= limit and 1 <= num_scorers <= MAX_SCORERS


def _scores_on_device(cupy, scores):
    """A contiguous float16 or float32 [N, V] array for the kernels (other types as float32), or its
    one row [V] where every lane's row is the same memory (a broadcast view, stride 0 over the
    lanes: a length reward's row is read once, never copied to [N, V])."""
    dtype = None if scores.dtype == np.float16 else np.float32
    if scores.ndim == 2 and scores.shape[0] > 1 and scores.strides[0] == 0:
        return cupy.ascontiguousarray(scores[0], dtype=dtype)
    return cupy.ascontiguousarray(scores, dtype=dtype)


def _half_bits(arrays) -> np.int32:
    """Bit s set where array s is float16 (the kernels' term_half / logp_half)."""
    return np.int32(sum(1 << s for s, array in enumerate(arrays) if array.dtype == np.float16))


def _row_bits(arrays) -> np.int32:
    """Bit s set where array s is one row [V] for every lane (the kernels' term_row / logp_row)."""
    return np.int32(sum(1 << s for s, array in enumerate(arrays) if array.ndim == 1))


def _kernel_inputs(cupy, terms, log_probs):
    """The kernels' combine arguments (4 term arrays, 4 scales, count, float16 bits, row bits), the
    number of terms, the scorers' log-probs on the device and their 4 pointer arguments."""
    terms = [(t, scale) for t, scale in terms if scale != 0]  # left out, as combine_scores does
    if not terms:  # every scale 0: the combined score is 0 (one row of zeros for every lane)
        terms = [(cupy.broadcast_to(cupy.zeros(log_probs[0].shape[1], dtype=np.float32), log_probs[0].shape), 1.0)]
    arrays = [_scores_on_device(cupy, t) for t, _ in terms]
    term_half, term_row = _half_bits(arrays), _row_bits(arrays)
    arrays += [arrays[0]] * (MAX_SCORERS - len(arrays))  # unused ones are never read
    scales = [np.float32(scale) for _, scale in terms] + [np.float32(0)] * (MAX_SCORERS - len(terms))
    combine = (*arrays, *scales, np.int32(len(terms)), term_half, term_row)
    log_probs = [_scores_on_device(cupy, logp) for logp in log_probs]
    pointers = (*log_probs, *[log_probs[0]] * (MAX_SCORERS - len(log_probs)))
    return combine, len(terms), log_probs, pointers


def select_kernel(beam, terms, log_probs, norm, deadline, step: int, layout, options):
    """``beam.select`` as two launches: returns (new beam fields as a dict, parents, labels).

    ``terms``: up to 4 (array [N, V], scale) whose Σ scale · array is the combined score (as
    :func:`gpudecode.scorers.combine.combine_scores` sums it); ``log_probs``: each scorer's [N, V]
    (arrays float32 or float16);
    ``norm``: [N] float32 length normalisers of each lane's candidates, or None for none;
    ``deadline``: [N] int64, a lane ends once ``deadline <= step``."""
    from gpudecode.kernels import kernel_function

    cupy = layout.xp
    num_lanes, beam_size = layout.num_lanes, layout.beam_size
    vocab_size = int(log_probs[0].shape[-1])
    combine, num_terms, log_probs, pointers = _kernel_inputs(cupy, terms, log_probs)
    scores = cupy.ascontiguousarray(beam.scores, dtype=np.float32)
    ended = cupy.ascontiguousarray(beam.ended, dtype=bool).view(np.uint8)
    scorer_scores = cupy.ascontiguousarray(beam.scorer_scores, dtype=np.float32)
    lengths_in = cupy.ascontiguousarray(beam.lengths, dtype=np.int64)
    segments = -(-vocab_size // SEGMENT)
    lane_keys = cupy.empty((num_lanes, segments, beam_size), dtype=np.uint64)
    parents = cupy.empty(num_lanes, dtype=np.int64)
    labels = cupy.empty(num_lanes, dtype=np.int64)
    new_scores = cupy.empty(num_lanes, dtype=np.float32)
    lengths = cupy.empty(num_lanes, dtype=np.int64)
    ended_out = cupy.empty(num_lanes, dtype=bool)
    scorer_out = cupy.empty_like(scorer_scores)
    threshold = options.score_threshold
    kept = next(k for k in (8, 16, 32) if k >= beam_size)  # the kernels' per-thread list
    device = log_probs[0].device.id
    kernel_function("label_step", f"label_lane_top_{kept}_{num_terms}", device)((num_lanes * segments,), (_THREADS,), (
        *combine, np.int32(vocab_size), np.int32(beam_size), np.int32(beam_size), scores, ended,
        np.uint64(0) if norm is None else cupy.ascontiguousarray(norm, dtype=np.float32), lengths_in,
        np.int64(options.min_length), np.int64(options.sentence_end), lane_keys))
    kernel_function("label_step", f"label_select_{kept}", device)((layout.num_groups,), (_THREADS,), (
        *combine, np.int32(vocab_size), np.int32(beam_size), lane_keys, scores,
        lengths_in, ended, np.int32(threshold is not None),
        np.float32(threshold or 0), np.int64(options.sentence_end), cupy.ascontiguousarray(deadline, dtype=np.int64),
        np.int64(step), np.int32(len(log_probs)), *pointers, _half_bits(log_probs), _row_bits(log_probs), scorer_scores,
        np.int64(num_lanes), parents, labels, new_scores, lengths, ended_out.view(np.uint8), scorer_out,
    ))
    return dict(scores=new_scores, scorer_scores=scorer_out, lengths=lengths, ended=ended_out), parents, labels


#: counted lengths whose normaliser the separate kernels read from numpy's table (powf beyond)
NORMALISER_TABLE_SIZE = 4096


@functools.cache
def _normaliser_table(device_id: int, length_norm_scale: float):
    """numpy's length normalisers of counted lengths 0 .. NORMALISER_TABLE_SIZE - 1 on a device (as
    the compiled CPU selection reads them; one element for a scale of 0, never read)."""
    import cupy

    from gpudecode.search.label_sync_cpu import normaliser_table

    with cupy.cuda.Device(device_id):
        if length_norm_scale == 0:
            return cupy.ones(1, dtype=np.float32)
        return cupy.asarray(normaliser_table(length_norm_scale, NORMALISER_TABLE_SIZE))


def select_separate_kernel(beam, terms, log_probs, deadline, step: int, layout, options):
    """``beam.select_separate`` (``finished="separate"`` or ``"separate-genai"``) as two launches:
    the lanes' best ``2 × beam`` candidates by score (``label_lane_top``), then one block per
    utterance for its best ``2 × beam``, the new lanes and the finished lists
    (``label_separate``). Returns what ``label_sync_cpu.select_separate`` returns: the new beam's
    fields, the new finished lists' fields (dicts), parents [N] and labels [N]."""
    from gpudecode.kernels import kernel_function
    from gpudecode.search.label_sync_cpu import early_stopping_code, separate_outputs

    cupy = layout.xp
    num_lanes, beam_size, num_groups = layout.num_lanes, layout.beam_size, layout.num_groups
    vocab_size = int(log_probs[0].shape[-1])
    genai = options.finished == "separate-genai"
    extra = 2 * beam_size if genai else beam_size
    size = min(2 * beam_size, beam_size * vocab_size)
    combine, num_terms, log_probs, pointers = _kernel_inputs(cupy, terms, log_probs)
    scores_in = cupy.ascontiguousarray(beam.scores, dtype=np.float32)
    ended_in = cupy.ascontiguousarray(beam.ended, dtype=bool).view(np.uint8)
    scorer_in = cupy.ascontiguousarray(beam.scorer_scores, dtype=np.float32)
    lengths_in = cupy.ascontiguousarray(beam.lengths, dtype=np.int64)
    finished = beam.finished
    segments = -(-vocab_size // SEGMENT)
    lane_keys = cupy.empty((num_lanes, segments, size), dtype=np.uint64)
    scores, scorer_scores, lengths, ended, parents, labels, new = separate_outputs(
        cupy, num_lanes, num_groups, beam_size, len(log_probs), extra, finished.prompt_lengths)
    kept = next(k for k in (8, 16, 32) if k >= size)  # the kernels' per-thread list
    early = early_stopping_code(options.early_stopping)
    device = log_probs[0].device.id
    norm_table = _normaliser_table(device, float(options.length_norm_scale))
    kernel_function("label_step", f"label_lane_top_{kept}_{num_terms}", device)((num_lanes * segments,), (_THREADS,), (
        *combine, np.int32(vocab_size), np.int32(beam_size), np.int32(size), scores_in, ended_in, np.uint64(0),
        lengths_in, np.int64(options.min_length), np.int64(options.sentence_end), lane_keys))

    def contiguous(array, dtype):
        return cupy.ascontiguousarray(array, dtype=dtype)

    kernel_function("label_step", f"label_separate_{kept}", device)((num_groups,), (_THREADS,), (
        *combine, np.int32(vocab_size), np.int32(beam_size), np.int32(size), lane_keys, scores_in, lengths_in,
        ended_in, np.int64(options.min_length), np.int64(options.sentence_end), contiguous(deadline, np.int64),
        np.int64(step), np.int32(len(log_probs)), *pointers, _half_bits(log_probs), _row_bits(log_probs), scorer_in,
        np.int64(num_lanes), contiguous(finished.ranks, np.float32), contiguous(finished.scores, np.float32),
        contiguous(finished.scorer_scores, np.float32), contiguous(finished.lengths, np.int64),
        contiguous(finished.steps, np.int64), contiguous(finished.lanes, np.int64),
        contiguous(finished.labels, np.int64), contiguous(finished.prompt_lengths, np.int64),
        contiguous(finished.hopeful, bool).view(np.uint8), contiguous(finished.done, bool).view(np.uint8),
        np.int32(genai), np.int32(options.length_counts == "prompt-and-labels"),
        np.float32(options.length_norm_scale), norm_table, np.int64(norm_table.size), np.int32(early),
        np.int32(early == 2 and options.length_norm_scale > 0), parents, labels, scores, lengths,
        ended.view(np.uint8), scorer_scores, new["ranks"], new["scores"], new["scorer_scores"], new["lengths"],
        new["steps"], new["lanes"], new["labels"], new["hopeful"].view(np.uint8), new["done"].view(np.uint8),
        new["picked"], new["candidate_lanes"], new["candidate_labels"]))
    return dict(scores=scores, scorer_scores=scorer_scores, lengths=lengths, ended=ended), new, parents, labels
