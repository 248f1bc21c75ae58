"""The CTC prefix beam search without label scorers in one kernel launch (``kernels/ctc_frame.cu``).

:meth:`gpudecode.search.ctc._PrefixSearch._full_frame` runs a frame as ~80 array operations and
the search launches them frame by frame. Without label scorers utterances never interact, so
here one thread block per utterance loops over all frames — candidates, recombination with the
collision check, score threshold, top-k and the new lanes — in one launch.
:func:`full_frame_reference` is a full frame written utterance by utterance and lane by lane in
Python (what each thread block does per frame), the oracle of the kernel's structure; the tests
check it against the array version.
"""

from __future__ import annotations

import numpy as np

_NEG_INF = np.float32(-np.inf)


def _logaddexp(a, b):
    return np.logaddexp(np.float32(a), np.float32(b)).astype(np.float32)


def _paths_equal(a: int, b: int, node_label, node_parent, steps: int | None) -> tuple[bool, bool]:
    """(equal, undecided) for one pair of emission nodes, as ``same_label_paths``."""
    equal, pending, step = a == b, a != b, 0
    while True:
        if steps is None:
            if not pending:
                return equal, False
        elif step >= steps:
            return equal, pending
        pending = pending and node_label[a] == node_label[b]
        a, b = int(node_parent[a]), int(node_parent[b])
        met = pending and a == b
        equal, pending = equal or met, pending and not met
        step += 1


def top_labels_reference(row: np.ndarray, blank: int, count: int) -> list[int]:
    """The ``count`` best labels of one frame's log-probs other than ``blank``: larger first,
    equal ones by lower label, NaN as -inf (``ctc_top_labels_<P>``)."""
    keys = np.where(np.isnan(row), _NEG_INF, row).astype(np.float32)
    labels = [v for v in np.lexsort((np.arange(len(row)), -keys)).tolist() if v != blank]
    return labels[:count]


def full_frame_reference(search, t: int, exact: bool, num_top: int | None = None) -> None:
    """``search._full_frame(t, exact)`` for a search without scorers, on numpy, utterance by
    utterance: the per-thread-block algorithm of ``ctc_frame.cu``. ``num_top``: with the label
    prefilter (``top_labels``), the kernel's candidate set and full-scan fallback."""
    from gpudecode.search.ctc import _HASH_MULTIPLIER

    options, layout = search.options, search.layout
    num_utts, beam, num_lanes = layout.num_groups, layout.beam_size, layout.num_lanes
    log_probs = search.log_probs
    vocab_size, blank = log_probs.shape[2], options.blank
    steps = None if exact else options.history_compare_steps
    threshold = options.score_threshold
    skip = getattr(search, "skip", None)
    k = len(search.node_frames)
    search.node_frames.append(t)
    base = 1 + k * num_lanes
    old = {name: getattr(search, name).copy() for name in
           ("blank_logp", "label_logp", "last", "length", "hash", "prev_hash", "node")}
    node_parent, node_label = search.node_parent, search.node_label
    new = {name: value.copy() for name, value in old.items()}
    unresolved = False
    for u in range(num_utts):
        active = t < int(search.lengths[u])
        keep = active and not (skip is not None and bool(skip[u, t]))
        frame = log_probs[u, t]

        def x(v: int) -> np.float32:
            if keep:
                return frame[v]
            if v == blank:
                return frame[blank] if active else np.float32(0)
            return _NEG_INF

        lanes = range(u * beam, (u + 1) * beam)
        total = {i: _logaddexp(old["blank_logp"][i], old["label_logp"][i]) for i in lanes}
        stay_blank = {i: np.float32(total[i] + x(blank)) for i in lanes}
        stay_label = {i: (np.float32(old["label_logp"][i] + x(int(old["last"][i]))) if old["last"][i] >= 0
                          else _NEG_INF) for i in lanes}

        def emit(i: int, v: int) -> np.float32:
            if v == blank:
                return _NEG_INF
            if old["last"][i] >= 0 and v == old["last"][i]:
                return np.float32(old["blank_logp"][i] + x(v))
            return np.float32(total[i] + x(v))

        # recombination: lane j's prefix = lane i's prefix + j's last label
        match, matched, merged, retime, killed = {}, {}, {}, {}, set()
        for j in lanes:
            match[j], matched[j] = u * beam, False
            for i in lanes:
                if not (old["hash"][i] == old["prev_hash"][j] and old["length"][i] + 1 == old["length"][j]
                        and total[i] > _NEG_INF and total[j] > _NEG_INF):
                    continue
                equal, undecided = _paths_equal(int(old["node"][i]), int(node_parent[old["node"][j]]),
                                                node_label, node_parent, steps)
                unresolved |= undecided
                if equal and not matched[j]:
                    match[j], matched[j] = i, True
            merged[j] = emit(match[j], max(int(old["last"][j]), 0))
        for j in lanes:
            retime[j] = matched[j] and merged[j] > _logaddexp(stay_blank[j], stay_label[j])
            if matched[j]:
                stay_label[j] = _logaddexp(stay_label[j], merged[j])
                killed.add((match[j], max(int(old["last"][j]), 0)))

        # candidates in lane-major, then label order; the stay candidate in the blank column
        ranks = np.full(beam * vocab_size, _NEG_INF, dtype=np.float32)
        for i in lanes:
            for v in range(vocab_size):
                if v == blank:
                    value = _logaddexp(stay_blank[i], stay_label[i])
                else:
                    value = _NEG_INF if (i, v) in killed else emit(i, v)
                ranks[(i - u * beam) * vocab_size + v] = value
        present = np.ones(beam * vocab_size, dtype=bool)
        if num_top is not None:  # the prefilter, unless a live lane ties its last two listed labels
            top = top_labels_reference(frame, blank, num_top)
            tie = any(total[i] > _NEG_INF and np.float32(total[i] + x(top[-2])) == np.float32(total[i] + x(top[-1]))
                      and np.float32(total[i] + x(top[-2])) > _NEG_INF for i in lanes)
            search.full_scans = getattr(search, "full_scans", 0) + tie
            if not tie:
                present[:] = False
                for i in lanes:
                    base_column = (i - u * beam) * vocab_size
                    listed = {blank, *top[:-1]} | ({int(old["last"][i])} if old["last"][i] >= 0 else set())
                    present[[base_column + v for v in listed]] = True
        if threshold is not None:
            best = ranks[present].max()
            ranks = np.where(ranks >= best - np.float32(threshold), ranks, _NEG_INF)
        # best first: present, larger rank, lower column
        order = np.lexsort((np.arange(beam * vocab_size), -(ranks + np.float32(0)), ~present))[:beam]

        for b, column in zip(lanes, order.tolist()):
            alive = ranks[column] > _NEG_INF
            p = u * beam + column // vocab_size
            label = column % vocab_size
            stay = label == blank or not alive
            retimed = stay and alive and retime[p]
            parent_node = int(old["node"][p])
            node_parent[base + b] = node_parent[parent_node] if retimed else parent_node
            node_label[base + b] = old["last"][p] if retimed else label
            new["blank_logp"][b] = stay_blank[p] if (stay and alive) else _NEG_INF
            new["label_logp"][b] = (stay_label[p] if alive else _NEG_INF) if stay else emit(p, label)
            new["node"][b] = parent_node if (stay and not retimed) else base + b
            new["prev_hash"][b] = old["prev_hash"][p] if stay else old["hash"][p]
            new["hash"][b] = old["hash"][p] if stay else (
                (int(old["hash"][p]) * _HASH_MULTIPLIER + label + 1) % options.hash_modulus)
            new["last"][b] = old["last"][p] if stay else label
            new["length"][b] = old["length"][p] + (0 if stay else 1)
    for name, value in new.items():
        setattr(search, name, value)
    search.unresolved = search.unresolved | np.bool_(unresolved)


# -- the kernel ------------------------------------------------------------------------------------
MAX_BEAM = 32  # CTC_MAX_BEAM of kernels/ctc_frame.cu
_THREADS = 256  # CTC_THREADS
#: The frame's log-prob row goes to dynamic shared memory up to this size (the default 48 KiB
#: limit less the kernel's static shared memory); larger vocabularies read it from global memory.
_MAX_ROW_BYTES = 40 * 1024
_STATE = ("blank_logp", "label_logp", "last", "length", "hash", "prev_hash", "node")
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
    :func:`top_labels_reference`, and their log-probs — (labels [..., num_top] int32 (-1 past the
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


def use_kernel(search) -> bool:
    """Whether ``search`` can run as ``ctc_prefix_frames_<K>`` (CuPy, no scorers, beam <= 32;
    ``SearchTuning.fused_ctc_frames`` decides whether it does)."""
    return search.xp is not np and not search.entries and search.layout.beam_size <= MAX_BEAM


def search_kernel(search, frame_kinds: np.ndarray, prefilter: bool = True) -> None:
    """Every frame of ``search`` (what its frame loop does) as one launch of ``ctc_prefix_frames_<K>``:
    a thread block per utterance, on the current stream, no host synchronisation. The lane
    state arrays are updated in place; ``frame_kinds`` is the host [T] int8 of ``_frame_kinds``.
    Hash-equal pairs are compared to the end in the kernel (``history_compare_steps`` is for the
    array version), so the kernel never makes the search run again. ``prefilter`` False: every
    frame scans every label (:func:`top_label_count`)."""
    from gpudecode.kernels import load_module
    from gpudecode.search.ctc import _HASH_MULTIPLIER

    cupy = search.xp
    options, layout = search.options, search.layout
    log_probs = cupy.ascontiguousarray(search.log_probs, dtype=np.float32)
    num_utts, num_frames, vocab_size = log_probs.shape
    skip = getattr(search, "skip", None)
    skip = np.uint64(0) if skip is None else cupy.ascontiguousarray(skip).view(np.uint8)
    kinds = np.asarray(frame_kinds, dtype=np.int8)
    search.node_frames = np.flatnonzero(kinds == 2).tolist()
    state = [cupy.ascontiguousarray(getattr(search, name)) for name in _STATE]
    search.unresolved = cupy.zeros((), dtype=bool)
    steps = -1  # the kernel walks hash-equal pairs to the end: it never leaves one undecided
    threshold = options.score_threshold
    kept = next(k for k in (8, 16, 32) if k >= layout.beam_size)  # the kernel's per-thread list
    module = load_module("ctc_frame", (), log_probs.device.id)
    kernel = module.get_function(f"ctc_prefix_frames_{kept}")
    rows = num_utts * num_frames
    num_top = top_label_count(layout.beam_size, vocab_size, prefilter) if rows else 0
    top_labels = top_values = np.uint64(0)  # null: no prefilter
    if num_top:  # every frame's best labels, all frames at once (a warp per frame)
        top_labels, top_values = top_labels_kernel(log_probs, options.blank, num_top)
    row_in_shared = not num_top and vocab_size * 4 <= _MAX_ROW_BYTES
    kernel((num_utts,), (_THREADS,), (
        log_probs, np.int32(num_frames), np.int32(vocab_size), np.int32(options.blank),
        cupy.asarray(kinds), cupy.ascontiguousarray(search.lengths_dev, dtype=np.int64), skip,
        np.int32(layout.beam_size), *state, search.node_parent, search.node_label,
        np.int32(steps), np.int32(threshold is not None), np.float32(threshold or 0),
        np.int64(_HASH_MULTIPLIER), np.int64(options.hash_modulus), search.unresolved.view(np.uint8),
        np.int32(row_in_shared), top_labels, top_values, np.int32(num_top),
    ), shared_mem=vocab_size * 4 if row_in_shared else 0)
    for name, array in zip(_STATE, state):
        setattr(search, name, array)
