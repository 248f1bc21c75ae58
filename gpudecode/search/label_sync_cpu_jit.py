"""The numba-compiled body of :mod:`gpudecode.search.label_sync_cpu` (imported only where numba is):
one step of the label-synchronous search (separate finished lists, or in the beam), utterance by
utterance; the top-k lists and the threshold are :mod:`gpudecode.search.ctc_cpu_jit`'s."""

from __future__ import annotations

import numpy as np
from numba import njit

from gpudecode.search.ctc_cpu_jit import NEG_INF, best_columns, drop_below_threshold, insert_best, top_key


@njit(cache=True, inline="always")
def _candidate(scores, combined, n, v, is_open, short, sentence_end):
    """Lane ``n``'s candidate of label ``v`` (``beam._candidates``): an open lane's score plus the
    combined score (sentence-end -inf where the lane is ``short`` of ``min_length``), a terminated
    lane itself in column 0, -inf elsewhere."""
    if not is_open:
        return scores[n] if v == 0 else NEG_INF
    if short and v == sentence_end:
        return NEG_INF
    return np.float32(scores[n] + combined[n, v])


@njit(cache=True, inline="always")
def _is_short(ended, lengths, n, min_length):
    """Whether lane ``n`` is open with fewer than ``min_length`` labels (its sentence-end is masked)."""
    return not ended[n] and min_length > 0 and lengths[n] < min_length


@njit(cache=True, inline="always")
def _rank(score, length, norm, use_norm):
    """``score / normaliser(length)`` (``norm``: the normalisers by counted length), or the score."""
    if use_norm:
        return np.float32(score / norm[length])
    return score


@njit(cache=True)
def select_separate(scores, ended, lengths, scorer_scores, combined, log_probs, deadline, step,
                    fin_ranks, fin_scores, fin_scorer, fin_lengths, fin_steps, fin_lanes, fin_labels,
                    prompts, hopeful, done, beam_size, sentence_end, min_length, genai, prompt_counts,
                    norm, use_norm, early_stopping, never_norm,
                    out_scores, out_scorer, out_lengths, out_ended, parents, labels,
                    new_ranks, new_scores, new_scorer, new_lengths, new_steps, new_lanes, new_labels,
                    new_hopeful, new_done, picked, cand_lanes, cand_labels):
    """``beam.select_separate`` on numpy arrays, group by group, writing the ``out_*`` (the new
    beam), ``parents``/``labels`` and the ``new_*`` (the new finished lists). ``early_stopping``:
    0 False, 1 True, 2 "never"; ``never_norm``: "never" with a length penalty."""
    num_scorers, num_lanes, vocab = log_probs.shape
    num_groups = num_lanes // beam_size
    width = beam_size * vocab
    size = min(2 * beam_size, width)
    extra = 2 * beam_size if genai else beam_size  # the step's candidates for the lists
    keys = np.empty(size, np.float32)
    chosen = np.empty(size, np.int64)
    score = np.empty(size, np.float32)
    parent = np.empty(size, np.int64)
    label = np.empty(size, np.int64)
    ending = np.empty(size, np.bool_)
    open_score = np.empty(size, np.float32)
    kept = np.empty(beam_size, np.int64)
    raw = np.empty(beam_size, np.float32)  # the open lanes' scores before -inf for the dead
    open_labels = np.empty(beam_size, np.int64)
    alive = np.empty(beam_size, np.bool_)
    merged = np.empty(beam_size + extra, np.float32)
    best = np.empty(beam_size, np.int64)
    m_scores = np.empty(beam_size + extra, np.float32)
    m_scorer = np.empty((num_scorers, beam_size + extra), np.float32)
    m_lengths = np.empty(beam_size + extra, np.int64)
    m_steps = np.empty(beam_size + extra, np.int64)
    m_lanes = np.empty(beam_size + extra, np.int64)
    m_labels = np.empty(beam_size + extra, np.int64)
    for g in range(num_groups):
        first = g * beam_size
        # the best 2B candidates by score (lane-major, then label; NaN as -inf)
        count = 0
        for b in range(beam_size):
            n = first + b
            is_open, short = not ended[n], _is_short(ended, lengths, n, min_length)
            for v in range(vocab):
                key = top_key(_candidate(scores, combined, n, v, is_open, short, sentence_end))
                count = insert_best(keys, chosen, count, size, key, b * vocab + v)
        for k in range(size):
            b, v = chosen[k] // vocab, chosen[k] % vocab
            n = first + b
            x = _candidate(scores, combined, n, v, not ended[n], _is_short(ended, lengths, n, min_length), sentence_end)
            score[k], parent[k], label[k] = x, n, v
            ends = v == sentence_end or (not genai and deadline[n] <= step)
            ending[k] = x > NEG_INF and not ended[n] and ends
            open_score[k] = NEG_INF if ending[k] else x
        # the open lanes: the best B candidates that do not end
        best_columns(open_score, size, beam_size, kept, keys)
        for j in range(beam_size):
            n = first + j
            s = open_score[kept[j]]
            p = parent[kept[j]]
            raw[j] = s
            alive[j] = s > NEG_INF
            open_labels[j] = label[kept[j]]
            lab = open_labels[j] if alive[j] and not ended[p] else -1
            parents[n], labels[n] = p, lab
            emitted = lab >= 0
            for i in range(num_scorers):
                add = log_probs[i, p, lab] if emitted else np.float32(0)
                out_scorer[i, n] = np.float32(scorer_scores[i, p] + add)
            out_lengths[n] = lengths[p] + (1 if emitted else 0)
            out_scores[n] = s if alive[j] else NEG_INF
        # the old entries, then the ending candidates among the best B, then (GenAI) the open lanes
        for c in range(beam_size):
            e = first + c
            merged[c] = fin_ranks[e]
            m_scores[c], m_lengths[c], m_steps[c] = fin_scores[e], fin_lengths[e], fin_steps[e]
            m_lanes[c], m_labels[c] = fin_lanes[e], fin_labels[e]
            for i in range(num_scorers):
                m_scorer[i, c] = fin_scorer[i, e]
        listed = hopeful[g] and not done[g]
        for k in range(beam_size):
            c = beam_size + k
            p, lab = parent[k], label[k]
            length = lengths[p] + 1
            counted = prompts[g] + length - (1 if lab == sentence_end else 0) if prompt_counts else length
            r = _rank(score[k], counted, norm, use_norm)
            merged[c] = r if ending[k] and listed else NEG_INF
            m_scores[c], m_lengths[c], m_steps[c], m_lanes[c], m_labels[c] = score[k], length, step, p, lab
            safe = lab if lab > 0 else 0
            for i in range(num_scorers):
                m_scorer[i, c] = np.float32(scorer_scores[i, p] + log_probs[i, p, safe])
        at_limit = deadline[first] <= step
        hope, finish = hopeful[g], done[g]
        if genai:  # the stop test before the open lanes join at the limit
            best_columns(merged, 2 * beam_size, beam_size, best, keys)
            full = True
            low = merged[best[0]]
            for j in range(beam_size):
                value = merged[best[j]]
                full = full and value > NEG_INF
                low = value if value < low else low
            length = lengths[parent[0]]
            before = prompts[g] + length if prompt_counts else length
            improvable = low < _rank(score[0], before, norm, use_norm)
            stops = full and (not improvable if early_stopping == 0 else True) and not done[g]
            finish = done[g] or stops or at_limit
            joins = at_limit and not done[g] and not stops
            for j in range(beam_size):
                n, c = first + j, 2 * beam_size + j
                counted = prompts[g] + out_lengths[n] if prompt_counts else out_lengths[n]
                r = _rank(raw[j], counted, norm, use_norm)
                merged[c] = r if alive[j] and joins else NEG_INF
                m_scores[c], m_lengths[c], m_steps[c] = raw[j], out_lengths[n], step
                m_lanes[c], m_labels[c] = parents[n], open_labels[j]
                for i in range(num_scorers):
                    m_scorer[i, c] = out_scorer[i, n]
        best_columns(merged, beam_size + extra, beam_size, best, keys)
        for j in range(beam_size):
            e, c = first + j, best[j]
            picked[g, j] = c
            new_ranks[e], new_scores[e], new_lengths[e] = merged[c], m_scores[c], m_lengths[c]
            new_steps[e], new_lanes[e], new_labels[e] = m_steps[c], m_lanes[c], m_labels[c]
            for i in range(num_scorers):
                new_scorer[i, e] = m_scorer[i, c]
        for c in range(extra):
            cand_lanes[g * extra + c] = m_lanes[beam_size + c]
            cand_labels[g * extra + c] = m_labels[beam_size + c]
        if not genai:  # the stop test after the step, on the best open lane
            full = True
            low = new_ranks[first]
            for j in range(beam_size):
                value = new_ranks[first + j]
                full = full and value > NEG_INF
                low = value if value < low else low
            length = out_lengths[first]
            if never_norm:
                length = length + deadline[first] - step
            counted = prompts[g] + length if prompt_counts else length
            best_open = _rank(raw[0], counted, norm, use_norm)
            hope = hopeful[g] and (not full or best_open > low)
            finish = done[g] or not hope or at_limit
            if early_stopping == 1:
                finish = finish or full
        new_hopeful[g], new_done[g] = hope, finish
        for j in range(beam_size):
            out_ended[first + j] = finish or not alive[j]


@njit(cache=True)
def select_in_beam(scores, ended, lengths, scorer_scores, combined, log_probs, deadline, step, beam_size,
                   sentence_end, min_length, norm, use_norm, has_threshold, threshold,
                   out_scores, out_scorer, out_lengths, out_ended, parents, labels):
    """``beam.select`` (``finished="in-beam"``) on numpy arrays, group by group: candidates ranked by
    ``score / norm[length + open]``, the threshold below the group's best (a NaN rank drops all), the
    best ``beam_size`` (equal ranks to the lower lane, then label; NaN as -inf), the new lanes."""
    num_scorers, num_lanes, vocab = log_probs.shape
    num_groups = num_lanes // beam_size
    width = beam_size * vocab
    ranks = np.empty(width, np.float32)
    keys = np.empty(beam_size, np.float32)
    chosen = np.empty(beam_size, np.int64)
    for g in range(num_groups):
        first = g * beam_size
        for b in range(beam_size):
            n = first + b
            is_open, short = not ended[n], _is_short(ended, lengths, n, min_length)
            divisor = norm[lengths[n] + (1 if is_open else 0)]
            for v in range(vocab):
                x = _candidate(scores, combined, n, v, is_open, short, sentence_end)
                ranks[b * vocab + v] = np.float32(x / divisor) if use_norm else x
        if has_threshold:
            drop_below_threshold(ranks, width, threshold)
        best_columns(ranks, width, beam_size, chosen, keys)
        for j in range(beam_size):
            n = first + j
            column = chosen[j]
            p, v = first + column // vocab, column % vocab
            alive = ranks[column] > NEG_INF
            lab = v if alive and not ended[p] else -1
            parents[n], labels[n] = p, lab
            emitted = lab >= 0
            out_scores[n] = (_candidate(scores, combined, p, v, not ended[p], _is_short(ended, lengths, p, min_length),
                                        sentence_end) if alive else NEG_INF)
            for i in range(num_scorers):
                add = log_probs[i, p, lab] if emitted else np.float32(0)
                out_scorer[i, n] = np.float32(scorer_scores[i, p] + add)
            out_lengths[n] = lengths[p] + (1 if emitted else 0)
            out_ended[n] = ended[p] or not alive or lab == sentence_end or deadline[n] <= step
