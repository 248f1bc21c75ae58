"""The selection of a transducer symbol step without label scorers in one kernel launch
(``kernels/transducer_step.cu``).

:meth:`gpudecode.search.transducer._TransducerSearch._select` runs the selection of a step —
stays and emissions, the merge of lanes that spell the same sequence, the best ``beam`` per
utterance and the new lane state — as ~50 array operations. Without label scorers utterances
never interact, so one thread block per utterance does it in one launch; the prediction network
still runs between the steps. :func:`select_reference` is the selection written utterance by
utterance and lane by lane in Python (what each thread block does), the oracle of the kernel's
structure; the tests check it against the array version.
"""

from __future__ import annotations

import numpy as np

from gpudecode.search.ctc_frame import _paths_equal

_NEG_INF = np.float32(-np.inf)


def select_reference(search, t: int, s: int, forced: bool, logp, exact: bool):
    """``search._select(t, s, forced, logp, exact)`` for a search without scorers, on numpy,
    utterance by utterance: the per-thread-block algorithm of ``transducer_step.cu``."""
    from gpudecode.search.ctc import _HASH_MULTIPLIER

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
                (int(old["hash"][p]) * _HASH_MULTIPLIER + label + 1) % options.hash_modulus)
            new["last"][b] = old["last"][p] if is_stay else label
            new["length"][b] = old["length"][p] + (0 if is_stay else 1)
            parents[b], labels[b], alive_out[b], emitted_out[b] = p, label, alive_new, not is_stay
    for name, value in new.items():
        setattr(search, name, value)
    search.unresolved = search.unresolved | np.bool_(unresolved)
    return parents, labels, alive_out, emitted_out


# -- the kernel ------------------------------------------------------------------------------------
MAX_BEAM = 32  # TRANSDUCER_MAX_BEAM of kernels/transducer_step.cu
_THREADS = 256  # TRANSDUCER_THREADS
_STATE = ("score", "done", "node", "last", "length", "hash", "prev_hash")

def use_kernel(search) -> bool:
    """Whether ``search``'s selection can run as ``transducer_select_<K>`` (CuPy, no scorers, beam <= 32;
    ``SearchTuning.fused_transducer_step`` decides whether it does)."""
    return search.xp is not np and not search.entries and search.layout.beam_size <= MAX_BEAM


def select_kernel(search, t: int, s: int, forced: bool, logp):
    """``search._select(...)`` as one launch of ``transducer_select_<K>``: a thread block per
    utterance, on the current stream, no host synchronisation. The lane state arrays are updated
    in place; returns (parents, labels, alive, emitted) [N] on the device. Hash-equal pairs are
    compared to the end in the kernel, so it never makes the search run again."""
    from gpudecode.kernels import load_module
    from gpudecode.search.ctc import _HASH_MULTIPLIER

    cupy = search.xp
    options, layout = search.options, search.layout
    num_utts, beam, num_lanes = layout.num_groups, layout.beam_size, layout.num_lanes
    logp = cupy.ascontiguousarray(logp, dtype=np.float32)
    vocab_size = int(logp.shape[1])
    base = search._new_nodes(t)
    state = [cupy.ascontiguousarray(getattr(search, name)) for name in _STATE]
    state[1] = state[1].astype(bool, copy=False)
    parents = cupy.empty(num_lanes, dtype=np.int64)
    labels = cupy.empty(num_lanes, dtype=np.int64)
    alive = cupy.empty(num_lanes, dtype=bool)
    emitted = cupy.empty(num_lanes, dtype=bool)
    if search.unresolved.ndim != 0 or search.unresolved.dtype != bool:
        search.unresolved = cupy.asarray(search.unresolved, dtype=bool).reshape(())
    steps = -1  # the kernel walks hash-equal pairs to the end: it never leaves one undecided
    threshold = options.score_threshold
    kept = next(k for k in (8, 16, 32) if k >= beam)  # the kernel's per-thread list
    kernel = load_module("transducer_step", (), logp.device.id).get_function(f"transducer_select_{kept}")
    kernel((num_utts,), (_THREADS,), (
        logp, np.int32(vocab_size), np.int32(options.blank), np.int32(beam),
        state[0], state[1].view(np.uint8), *state[2:], search.node_parent, search.node_label, np.int64(base),
        np.int32(s > 0), np.int32(bool(forced)), np.int32(steps), np.int32(threshold is not None),
        np.float32(threshold or 0), np.int32(options.recombination == "max"), np.int64(_HASH_MULTIPLIER),
        np.int64(options.hash_modulus), parents, labels, alive.view(np.uint8), emitted.view(np.uint8),
        search.unresolved.view(np.uint8),
    ))
    for name, array in zip(_STATE, state):
        setattr(search, name, array)
    return parents, labels, alive, emitted
