"""The selection of a label-synchronous step as one compiled CPU call (numba): with separate
finished lists, and in the beam.

:func:`gpudecode.search.beam.select_separate` (``finished="separate"`` / ``"separate-genai"``) runs a
step's selection — candidates, the best ``2 × beam_size`` by score, the open lanes, the finished
lists' merge and the stop tests — as ~150 numpy operations, :func:`gpudecode.search.beam.select`
(``"in-beam"``) as ~30; on a small model their fixed cost is much of a step. Here one compiled
function does it utterance by utterance: the same candidates in the same float32 arithmetic, the
same deterministic top-k (equal keys to the lower lane, then the lower label, old list entries
first; NaN ranks as -inf), the same threshold, and length normalisers read from a table that numpy
computes as the array version does, so the beams and lists are the same (the tests compare them
with the array versions, which stay the oracle).

numba is optional (the ``cpu-jit`` extra): without it, with ``SearchTuning.compiled_cpu_loops``
off, or with a top-k observer (``SearchStats.on_top_k``), the search runs the array versions.
"""

from __future__ import annotations

import functools

import numpy as np

from gpudecode.search.ctc_cpu import available
from gpudecode.search.prune import length_normaliser
from gpudecode.sizes import next_power_of_two

#: ``LabelSyncOptions.early_stopping`` as the compiled step takes it
EARLY_STOPPING_CODES = {False: 0, True: 1, "never": 2}


def use_compiled(xp, tuning, stats) -> bool:
    """Whether a separate-lists step's selection runs compiled: numpy, numba importable,
    ``SearchTuning.compiled_cpu_loops`` on and no top-k observer."""
    return (xp is np and tuning.compiled_cpu_loops and (stats is None or stats.on_top_k is None)
            and available())


@functools.lru_cache(maxsize=16)
def normaliser_table(length_norm_scale: float, size: int) -> np.ndarray:
    """[size] float32: the length normaliser of every counted length 0 .. size - 1, computed by
    :func:`length_normaliser` (read-only)."""
    table = length_normaliser(np.arange(size, dtype=np.int64), length_norm_scale, np)
    table.setflags(write=False)
    return table


def _stacked(log_probs) -> np.ndarray:
    """[S, N, V] float32: the scorers' log-probs (a view for one scorer)."""
    if len(log_probs) == 1:
        return np.ascontiguousarray(log_probs[0], dtype=np.float32)[None]
    return np.ascontiguousarray(np.stack([np.asarray(lp, dtype=np.float32) for lp in log_probs]))


def separate_outputs(xp, num_lanes: int, num_groups: int, beam_size: int, num_scorers: int, extra: int, prompts):
    """The output arrays of a ``finished="separate"`` step on ``xp``, as rows of a few blocks (one
    allocation per dtype): the new lanes' scores [N], scorer_scores [S, N], lengths [N], ended [N],
    parents [N], labels [N], and the new finished lists' fields by name (``Finished``'s; ``extra``
    step candidates per group: B, or 2B for GenAI's semantics)."""
    floats = xp.empty((3 + 2 * num_scorers, num_lanes), np.float32)
    ints = xp.empty((7, num_lanes), np.int64)
    flags = xp.empty(num_lanes + 2 * num_groups, np.bool_)
    candidates = xp.empty((2, num_groups * extra + num_groups * beam_size), np.int64)
    new = dict(ranks=floats[1], scores=floats[2], scorer_scores=floats[3 + num_scorers:],
               lengths=ints[3], steps=ints[4], lanes=ints[5], labels=ints[6],
               prompt_lengths=prompts, hopeful=flags[num_lanes:num_lanes + num_groups],
               done=flags[num_lanes + num_groups:],
               picked=candidates[1, num_groups * extra:].reshape(num_groups, beam_size),
               candidate_lanes=candidates[0, :num_groups * extra],
               candidate_labels=candidates[1, :num_groups * extra])
    return floats[0], floats[3:3 + num_scorers], ints[0], flags[:num_lanes], ints[1], ints[2], new


def early_stopping_code(value) -> int:
    """``early_stopping`` as the compiled selections take it: 0 False, 1 True, 2 "never"."""
    for mode, code in EARLY_STOPPING_CODES.items():
        if value is mode or (isinstance(mode, str) and value == mode):
            return code
    raise ValueError(f"early_stopping: expected True, False or 'never', got {value!r}")


def select_separate(beam, combined, log_probs, deadline, step: int, layout, options) -> tuple[dict, dict, object, object]:
    """:func:`gpudecode.search.beam.select_separate` on numpy arrays, compiled: the fields of the
    same new ``Beam`` and of its ``Finished`` lists (dicts of arrays), parents [N] and labels [N]."""
    from gpudecode.search.label_sync_cpu_jit import select_separate as run

    finished = beam.finished
    beam_size, num_lanes = layout.beam_size, layout.num_lanes
    num_groups = num_lanes // beam_size
    num_scorers = len(log_probs)
    genai = options.finished == "separate-genai"
    extra = 2 * beam_size if genai else beam_size
    combined = np.ascontiguousarray(combined, dtype=np.float32)
    stacked = _stacked(log_probs)
    early = early_stopping_code(options.early_stopping)
    never_norm = early == 2 and options.length_norm_scale > 0
    prompts = finished.prompt_lengths
    use_norm = options.length_norm_scale != 0
    norm = np.ones(1, np.float32)
    if use_norm:  # counted lengths stay below this bound
        bound = int(prompts.max(initial=0)) + int(beam.lengths.max(initial=0)) + 2
        if never_norm:
            bound += max(int(deadline.max(initial=0)) - step, 0)
        norm = normaliser_table(float(options.length_norm_scale), next_power_of_two(max(bound, 64)))
    scores, scorer_scores, lengths, ended, parents, labels, new = separate_outputs(
        np, num_lanes, num_groups, beam_size, num_scorers, extra, prompts)
    run(beam.scores, beam.ended, beam.lengths, beam.scorer_scores, combined, stacked,
        np.asarray(deadline, dtype=np.int64), int(step),
        finished.ranks, finished.scores, finished.scorer_scores, finished.lengths, finished.steps,
        finished.lanes, finished.labels, prompts, finished.hopeful, finished.done,
        int(beam_size), int(options.sentence_end), int(options.min_length), genai,
        options.length_counts == "prompt-and-labels", norm, use_norm, early, never_norm,
        scores, scorer_scores, lengths, ended, parents, labels,
        new["ranks"], new["scores"], new["scorer_scores"], new["lengths"], new["steps"], new["lanes"], new["labels"],
        new["hopeful"], new["done"], new["picked"], new["candidate_lanes"], new["candidate_labels"])
    return dict(scores=scores, scorer_scores=scorer_scores, lengths=lengths, ended=ended), new, parents, labels


def select_in_beam(beam, combined, log_probs, deadline, step: int, layout, options) -> tuple[dict, object, object]:
    """:func:`gpudecode.search.beam.select` (``finished="in-beam"``, its candidates normalised by
    :func:`gpudecode.search.beam.candidate_normaliser`) on numpy arrays, compiled: the fields of the
    same new ``Beam`` (a dict of arrays), parents [N] and labels [N]."""
    from gpudecode.search.label_sync_cpu_jit import select_in_beam as run

    num_lanes, num_scorers = layout.num_lanes, len(log_probs)
    combined = np.ascontiguousarray(combined, dtype=np.float32)
    stacked = _stacked(log_probs)
    use_norm = options.length_norm_scale != 0
    norm = normaliser_table(float(options.length_norm_scale),
                        next_power_of_two(max(int(beam.lengths.max(initial=0)) + 2, 64))) if use_norm else \
        np.ones(1, np.float32)
    threshold = options.score_threshold
    scores, ended = np.empty(num_lanes, np.float32), np.empty(num_lanes, np.bool_)
    scorer_scores = np.empty((num_scorers, num_lanes), np.float32)
    lengths = np.empty(num_lanes, np.int64)
    parents, labels = np.empty(num_lanes, np.int64), np.empty(num_lanes, np.int64)
    run(beam.scores, beam.ended, beam.lengths, beam.scorer_scores, combined, stacked,
        np.asarray(deadline, dtype=np.int64), int(step), int(layout.beam_size), int(options.sentence_end),
        int(options.min_length), norm, use_norm, threshold is not None, np.float32(threshold or 0),
        scores, scorer_scores, lengths, ended, parents, labels)
    return dict(scores=scores, scorer_scores=scorer_scores, lengths=lengths, ended=ended), parents, labels
