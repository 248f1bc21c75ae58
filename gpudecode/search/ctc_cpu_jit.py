"""The numba-compiled bodies of :mod:`gpudecode.search.ctc_cpu` (imported only where numba is),
and the helpers the transducer's compiled selection shares: numpy's float32 ``logaddexp`` and the
label-path comparison of the emission tree."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

LOG2 = np.float32(math.log(2.0))
NEG_INF = np.float32(-np.inf)


@njit(cache=True, inline="always")
def logaddexp(x, y):
    """numpy's float32 ``logaddexp`` (``npy_logaddexpf``), operation for operation."""
    if x == y:
        return np.float32(x + LOG2)
    tmp = np.float32(x - y)
    if tmp > 0:
        return np.float32(x + np.float32(math.log1p(np.float32(math.exp(-tmp)))))
    if tmp <= 0:
        return np.float32(y + np.float32(math.log1p(np.float32(math.exp(tmp)))))
    return tmp  # NaN


@njit(cache=True)
def paths_equal(a, b, node_label, node_parent):
    """Whether emission nodes ``a`` and ``b`` (of equal depth) spell the same labels: both paths
    walked back until they meet (``emission_tree.same_label_paths`` to the end)."""
    if a == b:
        return True
    while True:
        if node_label[a] != node_label[b]:
            return False
        a, b = node_parent[a], node_parent[b]
        if a == b:
            return True


@njit(cache=True, inline="always")
def drop_below_threshold(ranks, width, threshold):
    """Sets ``ranks[:width]`` more than ``threshold`` below the best to -inf, as the array version
    does (a NaN among them drops every candidate)."""
    best, nan = NEG_INF, False
    for c in range(width):
        if ranks[c] != ranks[c]:
            nan = True
        elif ranks[c] > best:
            best = ranks[c]
    floor = np.float32(best - threshold)
    for c in range(width):
        if nan or not ranks[c] >= floor:
            ranks[c] = NEG_INF


@njit(cache=True, inline="always")
def top_key(x):
    """The key a top-k list ranks ``x`` by: NaN as -inf (-0.0 equals +0.0 as compared)."""
    return NEG_INF if x != x else x


@njit(cache=True, inline="always")
def insert_best(keys, columns, count, k, key, column):
    """Adds (``key``, ``column``) to the list ``keys``/``columns`` of ``count`` entries kept best
    first (equal keys in arrival order: columns arrive ascending), at most ``k``; returns the count."""
    if count == k:
        if not key > keys[k - 1]:
            return count
        position = k - 1
    else:
        position = count
        count += 1
    while position > 0 and key > keys[position - 1]:
        keys[position] = keys[position - 1]
        columns[position] = columns[position - 1]
        position -= 1
    keys[position] = key
    columns[position] = column
    return count


@njit(cache=True, inline="always")
def best_columns(ranks, width, beam, order, order_rank):
    """The ``beam`` best columns of ``ranks[:width]`` into ``order`` (their ranks into
    ``order_rank``): larger rank first, equal ranks (and NaN, as -inf) by column."""
    filled = 0
    for c in range(width):
        filled = insert_best(order_rank, order, filled, beam, top_key(ranks[c]), c)


@njit(cache=True)
def _utterance(u, log_probs, lengths, skip, has_skip, kinds, beam, blank, use_threshold, threshold, use_token_min,
               token_min, multiplier, modulus, blank_logp, label_logp, last, length, hsh, prev_hash, node, node_parent,
               node_label, frame_begin, frame_end, k_begin, scored, lm_term, lm_total, new_parent, new_label,
               new_transition):
    """Frames [``frame_begin``, ``frame_end``) (-1: to the end) of utterance ``u``: its lanes' state
    and its lanes' emission nodes (node ``1 + k · N + lane`` of the k-th full frame, from
    ``k_begin``), updated in place; no other utterance's. ``scored``: ranked with the scorers'
    terms (``lm_term`` [N, V], ``lm_total`` [N], as ``kernels/ctc_frame.cu``'s scored frames), the
    full frame's moves written to ``new_parent``, ``new_label`` (-1: none), ``new_transition``."""
    num_utts, num_frames, vocab = log_probs.shape
    num_lanes = num_utts * beam
    width = beam * vocab
    x = np.empty(vocab, np.float32)
    total = np.empty(beam, np.float32)
    stay_blank = np.empty(beam, np.float32)
    stay_label = np.empty(beam, np.float32)
    match = np.empty(beam, np.int64)
    matched = np.empty(beam, np.bool_)
    merged = np.empty(beam, np.float32)
    retime = np.empty(beam, np.bool_)
    ranks = np.empty(width, np.float32)
    order = np.empty(beam, np.int64)
    order_rank = np.empty(beam, np.float32)
    old_b = np.empty(beam, np.float32)
    old_l = np.empty(beam, np.float32)
    old_last = np.empty(beam, np.int64)
    old_length = np.empty(beam, np.int64)
    old_hash = np.empty(beam, np.int64)
    old_prev = np.empty(beam, np.int64)
    old_node = np.empty(beam, np.int64)
    first = u * beam
    k = k_begin
    end = num_frames if frame_end < 0 else frame_end
    for t in range(frame_begin, end):
        kind = kinds[t]
        if kind == 0:
            continue
        if kind == 1:  # every utterance that has the frame skips it: the blank transition only
            value = log_probs[u, t, blank] if t < lengths[u] else np.float32(0)
            for i in range(first, first + beam):
                blank_logp[i] = np.float32(logaddexp(blank_logp[i], label_logp[i]) + value)
                label_logp[i] = NEG_INF
            continue
        base = 1 + k * num_lanes
        k += 1
        active = t < lengths[u]
        keep = active and not (has_skip and skip[u, t])
        top = -1  # label pruning: the frame's best label (numpy's argmax: the first NaN, else the first maximum)
        if active and use_token_min:
            top = 0
            for v in range(1, vocab):
                best = log_probs[u, t, top]
                if best == best and (log_probs[u, t, v] > best or log_probs[u, t, v] != log_probs[u, t, v]):
                    top = v
        for v in range(vocab):
            value = log_probs[u, t, v]
            if top >= 0 and v != top and not value >= token_min:
                value = NEG_INF
            if keep:
                x[v] = value
            elif v == blank:
                x[v] = value if active else np.float32(0)
            else:
                x[v] = NEG_INF
        for i in range(beam):
            lane = first + i
            old_b[i], old_l[i], old_last[i] = blank_logp[lane], label_logp[lane], last[lane]
            old_length[i], old_hash[i], old_prev[i], old_node[i] = length[lane], hsh[lane], \
                prev_hash[lane], node[lane]
            total[i] = logaddexp(old_b[i], old_l[i])
            stay_blank[i] = np.float32(total[i] + x[blank])
            stay_label[i] = np.float32(old_l[i] + x[old_last[i]]) if old_last[i] >= 0 else NEG_INF
        # recombination: lane j's prefix = lane i's prefix + j's last label
        for j in range(beam):
            match[j], matched[j] = 0, False
            for i in range(beam):
                if matched[j]:
                    break
                if (old_hash[i] == old_prev[j] and old_length[i] + 1 == old_length[j]
                        and total[i] > NEG_INF and total[j] > NEG_INF
                        and paths_equal(old_node[i], node_parent[old_node[j]], node_label, node_parent)):
                    match[j], matched[j] = i, True
            v = max(old_last[j], 0)
            i = match[j]
            if v == blank:
                merged[j] = NEG_INF
            elif old_last[i] >= 0 and v == old_last[i]:
                merged[j] = np.float32(old_b[i] + x[v])
            else:
                merged[j] = np.float32(total[i] + x[v])
        # candidates, lane-major then label; the stay candidate in the blank column
        for i in range(beam):
            row = i * vocab
            for v in range(vocab):
                ranks[row + v] = np.float32(total[i] + x[v])
            if old_last[i] >= 0:
                ranks[row + old_last[i]] = np.float32(old_b[i] + x[old_last[i]])
        for j in range(beam):
            retime[j] = matched[j] and merged[j] > logaddexp(stay_blank[j], stay_label[j])
            if matched[j]:
                stay_label[j] = logaddexp(stay_label[j], merged[j])
                ranks[match[j] * vocab + max(old_last[j], 0)] = NEG_INF
        for i in range(beam):
            ranks[i * vocab + blank] = logaddexp(stay_blank[i], stay_label[i])
        if scored:  # (extension + lm_total) + lm_term, stay + lm_total: the array version's order
            for i in range(beam):
                lane = first + i
                row = i * vocab
                for v in range(vocab):
                    if v == blank:
                        ranks[row + v] = np.float32(ranks[row + v] + lm_total[lane])
                    else:
                        ranks[row + v] = np.float32(np.float32(ranks[row + v] + lm_total[lane]) + lm_term[lane, v])
        if use_threshold:
            drop_below_threshold(ranks, width, threshold)
        best_columns(ranks, width, beam, order, order_rank)
        # the new lanes
        for b in range(beam):
            column = order[b]
            alive = order_rank[b] > NEG_INF
            p = column // vocab
            label = column % vocab
            stay = label == blank or not alive
            retimed = stay and alive and retime[p]
            lane = first + b
            parent_node = old_node[p]
            node_parent[base + lane] = node_parent[parent_node] if retimed else parent_node
            node_label[base + lane] = old_last[p] if retimed else label
            if stay:
                blank_logp[lane] = stay_blank[p] if alive else NEG_INF
                label_logp[lane] = stay_label[p] if alive else NEG_INF
                node[lane] = base + lane if retimed else parent_node
                prev_hash[lane] = old_prev[p]
                hsh[lane] = old_hash[p]
                last[lane] = old_last[p]
                length[lane] = old_length[p]
            else:
                blank_logp[lane] = NEG_INF
                if old_last[p] >= 0 and label == old_last[p]:
                    label_logp[lane] = np.float32(old_b[p] + x[label])
                else:  # the extension's own path score (a scored rank holds the scorers' terms)
                    label_logp[lane] = np.float32(total[p] + x[label]) if scored else ranks[column]
                node[lane] = base + lane
                prev_hash[lane] = old_hash[p]
                hsh[lane] = (old_hash[p] * multiplier + label + 1) % modulus
                last[lane] = label
                length[lane] = old_length[p] + 1
            if scored:
                new_parent[lane] = first + p
                new_label[lane] = -1 if stay else label
                new_transition[lane] = 0 if not stay else (2 if stay_label[p] > stay_blank[p] else 1)


@njit(cache=True)
def frames(log_probs, lengths, skip, has_skip, kinds, beam, blank, use_threshold, threshold, use_token_min, token_min,
           multiplier, modulus, blank_logp, label_logp, last, length, hsh, prev_hash, node, node_parent, node_label):
    """Every frame of the prefix search (``ctc_cpu.search_frames``), utterance after utterance, the
    lane state updated in place."""
    terms, totals, moves, kinds_out = _no_terms()
    for u in range(log_probs.shape[0]):
        _utterance(u, log_probs, lengths, skip, has_skip, kinds, beam, blank, use_threshold, threshold, use_token_min,
                   token_min, multiplier, modulus, blank_logp, label_logp, last, length, hsh, prev_hash, node,
                   node_parent, node_label, 0, -1, 0, False, terms, totals, moves, moves, kinds_out)


@njit(cache=True, parallel=True)
def frames_threaded(log_probs, lengths, skip, has_skip, kinds, beam, blank, use_threshold, threshold, use_token_min,
                    token_min, multiplier, modulus, blank_logp, label_logp, last, length, hsh, prev_hash, node,
                    node_parent, node_label):
    """:func:`frames` with the utterances spread over numba's threads (they share no lane and no node)."""
    terms, totals, moves, kinds_out = _no_terms()
    for u in prange(log_probs.shape[0]):
        _utterance(u, log_probs, lengths, skip, has_skip, kinds, beam, blank, use_threshold, threshold, use_token_min,
                   token_min, multiplier, modulus, blank_logp, label_logp, last, length, hsh, prev_hash, node,
                   node_parent, node_label, 0, -1, 0, False, terms, totals, moves, moves, kinds_out)


@njit(cache=True)
def _no_terms():
    """Placeholders of the scored arguments for a search without scorers (never read or written)."""
    return (np.zeros((1, 1), np.float32), np.zeros(1, np.float32), np.zeros(1, np.int64), np.zeros(1, np.int8))


@njit(cache=True)
def scored_frames(log_probs, lengths, skip, has_skip, kinds, beam, blank, use_threshold, threshold, use_token_min,
                  token_min, multiplier, modulus, blank_logp, label_logp, last, length, hsh, prev_hash, node,
                  node_parent, node_label, frame_begin, frame_end, k_begin, lm_term, lm_total, new_parent, new_label,
                  new_transition):
    """Frames [``frame_begin``, ``frame_end``) of every utterance, ranked with the scorers' terms
    (``_utterance``'s ``scored``), utterance after utterance."""
    for u in range(log_probs.shape[0]):
        _utterance(u, log_probs, lengths, skip, has_skip, kinds, beam, blank, use_threshold, threshold, use_token_min,
                   token_min, multiplier, modulus, blank_logp, label_logp, last, length, hsh, prev_hash, node,
                   node_parent, node_label, frame_begin, frame_end, k_begin, True, lm_term, lm_total, new_parent,
                   new_label, new_transition)


@njit(cache=True, parallel=True)
def scored_frames_threaded(log_probs, lengths, skip, has_skip, kinds, beam, blank, use_threshold, threshold,
                           use_token_min, token_min, multiplier, modulus, blank_logp, label_logp, last, length, hsh,
                           prev_hash, node, node_parent, node_label, frame_begin, frame_end, k_begin, lm_term,
                           lm_total, new_parent, new_label, new_transition):
    """:func:`scored_frames` with the utterances spread over numba's threads."""
    for u in prange(log_probs.shape[0]):
        _utterance(u, log_probs, lengths, skip, has_skip, kinds, beam, blank, use_threshold, threshold, use_token_min,
                   token_min, multiplier, modulus, blank_logp, label_logp, last, length, hsh, prev_hash, node,
                   node_parent, node_label, frame_begin, frame_end, k_begin, True, lm_term, lm_total, new_parent,
                   new_label, new_transition)
