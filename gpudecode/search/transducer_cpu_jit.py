"""The numba-compiled body of :mod:`gpudecode.search.transducer_cpu` (imported only where numba is)."""

from __future__ import annotations

import numpy as np
from numba import njit

from gpudecode.search.ctc_cpu_jit import NEG_INF, best_columns, drop_below_threshold, logaddexp, paths_equal


@njit(cache=True, inline="always")
def maximum(a, b):
    """numpy's float32 ``maximum``: NaN if either is NaN."""
    if a != a or b != b:
        return np.float32(np.nan)
    return a if a >= b else b


@njit(cache=True)
def select(logp, beam, blank, merge_done, forced, use_threshold, threshold, use_max, multiplier, modulus,
           score, done, node, last, length, hsh, prev_hash, node_parent, node_label, base,
           parents, labels, alive_out, emitted_out):
    """A transducer step's selection (``transducer_cpu.select``), the lane state updated in place."""
    num_lanes, vocab = logp.shape
    num_utts = num_lanes // beam
    width = beam * vocab
    alive = np.empty(beam, np.bool_)
    active = np.empty(beam, np.bool_)
    stay = np.empty(beam, np.float32)
    before = np.empty(beam, np.float32)
    stay_node = np.empty(beam, np.int64)
    stay_new = np.empty(beam, np.bool_)
    stay_node_parent = np.empty(beam, np.int64)
    ranks = np.empty(width, np.float32)
    order = np.empty(beam, np.int64)
    order_rank = np.empty(beam, np.float32)
    old_score = np.empty(beam, np.float32)
    old_node = np.empty(beam, np.int64)
    old_last = np.empty(beam, np.int64)
    old_length = np.empty(beam, np.int64)
    old_hash = np.empty(beam, np.int64)
    old_prev = np.empty(beam, np.int64)
    for u in range(num_utts):
        first = u * beam
        for i in range(beam):
            lane = first + i
            old_score[i], old_node[i], old_last[i] = score[lane], node[lane], last[lane]
            old_length[i], old_hash[i], old_prev[i] = length[lane], hsh[lane], prev_hash[lane]
            alive[i] = old_score[i] > NEG_INF
            active[i] = alive[i] and not done[lane]
            stay[i] = np.float32(old_score[i] + logp[lane, blank]) if active[i] else old_score[i]
            stay_node[i] = old_node[i]
            stay_new[i] = False
            stay_node_parent[i] = 0
        # candidates: emissions of active lanes, lane-major then label
        for i in range(beam):
            row = i * vocab
            for v in range(vocab):
                if active[i] and v != blank:
                    ranks[row + v] = np.float32(old_score[i] + logp[first + i, v])
                else:
                    ranks[row + v] = NEG_INF
        if merge_done:  # a done lane and an active lane may spell the same sequence: merge their stays
            for i in range(beam):
                before[i] = stay[i]
            absorbed = np.zeros(beam, np.bool_)
            for i in range(beam):
                partner = -1
                for j in range(i + 1, beam):
                    if (old_hash[i] == old_hash[j] and old_length[i] == old_length[j] and alive[i]
                            and alive[j] and paths_equal(old_node[i], old_node[j], node_label, node_parent)):
                        absorbed[j] = True
                        if partner < 0:
                            partner = j
                if partner >= 0:
                    if before[partner] > before[i]:
                        stay_node[i] = old_node[partner]
                    if use_max:
                        stay[i] = maximum(before[i], before[partner])
                    else:
                        stay[i] = logaddexp(before[i], before[partner])
            for i in range(beam):
                if absorbed[i]:
                    stay[i] = NEG_INF
        if forced:  # an extension that spells an existing lane's sequence joins that lane's stay
            for j in range(beam):
                before[j] = stay[j]
            for j in range(beam):
                match, matched = 0, False
                for i in range(beam):
                    if (old_hash[i] == old_prev[j] and old_length[i] + 1 == old_length[j] and active[i]
                            and before[j] > NEG_INF
                            and paths_equal(old_node[i], node_parent[old_node[j]], node_label, node_parent)):
                        match, matched = i, True
                        break
                v = max(old_last[j], 0)
                merged = np.float32(old_score[match] + logp[first + match, v]) \
                    if (v != blank and active[match]) else NEG_INF
                stay_new[j] = matched and merged > before[j]
                stay_node_parent[j] = old_node[match]
                if matched:
                    if use_max:
                        stay[j] = maximum(before[j], merged)
                    else:
                        stay[j] = logaddexp(before[j], merged)
                    ranks[match * vocab + v] = NEG_INF
        for i in range(beam):
            ranks[i * vocab + blank] = stay[i]
        if use_threshold:
            drop_below_threshold(ranks, width, threshold)
        best_columns(ranks, width, beam, order, order_rank)
        # the new lanes
        for b in range(beam):
            column = order[b]
            alive_new = order_rank[b] > NEG_INF
            p = column // vocab
            label = column % vocab
            is_stay = label == blank or not alive_new
            fresh = (not is_stay) or (alive_new and stay_new[p])
            lane = first + b
            node_parent[base + lane] = stay_node_parent[p] if is_stay else old_node[p]
            node_label[base + lane] = max(old_last[p], 0) if is_stay else label
            node[lane] = base + lane if fresh else stay_node[p]
            if is_stay:
                score[lane] = stay[p] if alive_new else NEG_INF
                prev_hash[lane] = old_prev[p]
                hsh[lane] = old_hash[p]
                last[lane] = old_last[p]
                length[lane] = old_length[p]
            else:
                score[lane] = ranks[column]
                prev_hash[lane] = old_hash[p]
                hsh[lane] = (old_hash[p] * multiplier + label + 1) % modulus
                last[lane] = label
                length[lane] = old_length[p] + 1
            done[lane] = is_stay or forced
            parents[lane] = first + p
            labels[lane] = label
            alive_out[lane] = alive_new
            emitted_out[lane] = not is_stay
