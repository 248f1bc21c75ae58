"""Numpy references of the fused search kernels, written utterance by utterance and lane by lane
as each thread block works (``kernels/ctc_frame.cu``, ``kernels/transducer_step.cu``): the oracles
the tests and the kernel emulator check the array searches against. Only tests and tools import
this module.

:func:`full_frame_reference` and :func:`select_reference` take the search object of the array
version (``ctc._PrefixSearch``, ``transducer._TransducerSearch``) and update its lane state as
its own ``_full_frame`` / ``_select`` would.
"""

from __future__ import annotations

import numpy as np

from gpudecode.search.emission_tree import HASH_MULTIPLIER

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
                (int(old["hash"][p]) * HASH_MULTIPLIER + label + 1) % options.hash_modulus)
            new["last"][b] = old["last"][p] if stay else label
            new["length"][b] = old["length"][p] + (0 if stay else 1)
    for name, value in new.items():
        setattr(search, name, value)
    search.unresolved = search.unresolved | np.bool_(unresolved)


def select_reference(search, t: int, s: int, forced: bool, logp, exact: bool):
    """``search._select(t, s, forced, logp, exact)`` for a search without scorers, on numpy,
    utterance by utterance: the per-thread-block algorithm of ``transducer_step.cu``."""
    options, layout = search.options, search.layout
    num_utts, beam, num_lanes = layout.num_groups, layout.beam_size, layout.num_lanes
    vocab_size, blank = logp.shape[1], options.blank
    steps = None if exact else options.history_compare_steps
    threshold = options.score_threshold
    combine = np.logaddexp if options.recombination == "sum" else np.maximum
    old = {name: np.array(getattr(search, name)) for name in
           ("score", "done", "node", "last", "length", "hash", "prev_hash")}
    base = search._new_nodes(t)
    node_parent, node_label = search.node_parent, search.node_label
    new = {name: value.copy() for name, value in old.items()}
    parents = np.zeros(num_lanes, np.int64)
    labels = np.zeros(num_lanes, np.int64)
    alive_out = np.zeros(num_lanes, bool)
    emitted_out = np.zeros(num_lanes, bool)
    unresolved = False
    score, node, last = old["score"], old["node"], old["last"]
    for u in range(num_utts):
        lanes = list(range(u * beam, (u + 1) * beam))
        alive = {i: bool(score[i] > _NEG_INF) for i in lanes}
        active = {i: alive[i] and not bool(old["done"][i]) for i in lanes}
        stay = {i: np.float32(score[i] + logp[i, blank]) if active[i] else np.float32(score[i]) for i in lanes}
        stay_node = {i: int(node[i]) for i in lanes}
        stay_new = {i: False for i in lanes}
        stay_node_parent = {i: 0 for i in lanes}
        safe_last = {i: max(int(last[i]), 0) for i in lanes}
        killed = set()

        def emit(i: int, v: int) -> np.float32:
            if v == blank or not active[i]:
                return _NEG_INF
            return np.float32(score[i] + logp[i, v])

        if s > 0:  # a done lane and an active lane may spell the same sequence: merge their stays
            equal = {}
            for i in lanes:
                for j in lanes:
                    pair = (i < j and old["hash"][i] == old["hash"][j] and old["length"][i] == old["length"][j]
                            and alive[i] and alive[j])
                    if pair:
                        eq, undecided = _paths_equal(int(node[i]), int(node[j]), node_label, node_parent, steps)
                        unresolved |= undecided
                    equal[i, j] = pair and eq
            before = dict(stay)
            for i in lanes:
                absorbs = any(equal[i, j] for j in lanes)
                absorbed = any(equal[j, i] for j in lanes)
                partner = next((j for j in lanes if equal[i, j]), lanes[0])
                if absorbs and before[partner] > before[i]:
                    stay_node[i] = int(node[partner])
                if absorbs:
                    stay[i] = combine(before[i], before[partner]).astype(np.float32)
                if absorbed:
                    stay[i] = _NEG_INF

        if forced:  # an extension that spells an existing lane's sequence joins that lane's stay
            before = dict(stay)
            for j in lanes:
                match, matched = lanes[0], False
                for i in lanes:
                    if not (old["hash"][i] == old["prev_hash"][j] and old["length"][i] + 1 == old["length"][j]
                            and active[i] and before[j] > _NEG_INF):
                        continue
                    eq, undecided = _paths_equal(int(node[i]), int(node_parent[node[j]]), node_label, node_parent,
                                                 steps)
                    unresolved |= undecided
                    if eq and not matched:
                        match, matched = i, True
                merged = emit(match, safe_last[j])
                stay_new[j] = matched and merged > before[j]
                stay_node_parent[j] = int(node[match])
                if matched:
                    stay[j] = combine(before[j], merged).astype(np.float32)
                    killed.add((match, safe_last[j]))

        # candidates in lane-major, then label order; the stay in the blank column
        ranks = np.full(beam * vocab_size, _NEG_INF, np.float32)
        for i in lanes:
            for v in range(vocab_size):
                value = stay[i] if v == blank else (_NEG_INF if (i, v) in killed else emit(i, v))
                ranks[(i - lanes[0]) * vocab_size + v] = value
        if threshold is not None:
            best = ranks.max()
            ranks = np.where(ranks >= best - np.float32(threshold), ranks, _NEG_INF)
        order = np.argsort(-(ranks + np.float32(0)), kind="stable")[:beam]

        for b, column in zip(lanes, order.tolist()):
            alive_new = bool(ranks[column] > _NEG_INF)
            p = lanes[0] + column // vocab_size
            label = column % vocab_size
            is_stay = label == blank or not alive_new
            fresh = (not is_stay) or (alive_new and stay_new[p])
            node_parent[base + b] = stay_node_parent[p] if is_stay else int(node[p])
            node_label[base + b] = safe_last[p] if is_stay else label
            new["node"][b] = base + b if fresh else stay_node[p]
            new["score"][b] = (stay[p] if alive_new else _NEG_INF) if is_stay else emit(p, label)
            new["done"][b] = is_stay or forced
            new["prev_hash"][b] = old["prev_hash"][p] if is_stay else old["hash"][p]
            new["hash"][b] = old["hash"][p] if is_stay else (
                (int(old["hash"][p]) * HASH_MULTIPLIER + label + 1) % options.hash_modulus)
            new["last"][b] = old["last"][p] if is_stay else label
            new["length"][b] = old["length"][p] + (0 if is_stay else 1)
            parents[b], labels[b], alive_out[b], emitted_out[b] = p, label, alive_new, not is_stay
    for name, value in new.items():
        setattr(search, name, value)
    search.unresolved = search.unresolved | np.bool_(unresolved)
    return parents, labels, alive_out, emitted_out
