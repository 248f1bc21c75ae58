"""The emission tree of the time-synchronous searches (CTC prefix, transducer): which lanes spell
the same label sequence (:func:`same_label_paths`), and the n-best lists.

Every emitted label is a tree node ``1 + k * N + lane`` (k: the tree step, made at input frame
``node_frames[k]``) with its parent node and label; node 0 is the empty sequence. The lanes that
make the lists are traced on the search's device (:func:`trace_paths`; ``kernels/emission_tree.cu``
on CuPy) and come to the host in one transfer with their scores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from gpudecode.backend import get_array_module
from gpudecode.search.nonfinite import check_finite
from gpudecode.search.results import Hypothesis, int_rows, nbest_lists, no_cyclic_gc

#: The rolling hash of label sequences that finds candidate pairs of equal sequences:
#: hash(prefix + c) = (hash(prefix) * HASH_MULTIPLIER + c + 1) % modulus.
HASH_MULTIPLIER = 1_000_003
_THREADS = 128  # trace_emission_paths, and trace_emission_groups' TRACE_THREADS
_GROUP_CHUNK = 2048  # TRACE_CHUNK of kernels/emission_tree.cu


def trace_paths(lanes, node, node_parent, node_label, node_frames: Sequence[int], num_lanes: int,
                group_size: int | None = None):
    """Labels and frames of ``lanes`` [L], oldest first: (labels [L, K], frames [L, K], lengths
    [L]) int32 on the arrays' module, rows padded with -1 (K: the tree's steps).

    ``group_size`` G: lanes come in groups of G (an utterance's beam) whose paths stay in their
    group, and the rows are the groups' rows in order, L / (N / G) each; on CuPy each group's
    nodes are then walked in shared memory. A row that breaks this gets length -1."""
    xp = get_array_module(node)
    max_length = len(node_frames)
    num_traced = int(lanes.shape[0])
    if xp is np:
        return _trace_on_host(lanes, node, node_parent, node_label, node_frames, num_lanes)
    from gpudecode.kernels import load_module

    labels = xp.empty((num_traced, max_length), dtype=np.int32)
    frames = xp.empty((num_traced, max_length), dtype=np.int32)
    lengths = xp.empty(num_traced, dtype=np.int32)
    if not num_traced:
        return labels, frames, lengths
    module = load_module("emission_tree", (), node.device.id)
    frames_dev = xp.asarray(np.asarray(node_frames, dtype=np.int64).reshape(-1))
    lanes = xp.ascontiguousarray(lanes, dtype=np.int64)
    num_groups = num_lanes // group_size if group_size else 0
    rows_per_group = num_traced // num_groups if num_groups else 0
    if (num_groups and num_groups * group_size == num_lanes and rows_per_group * num_groups == num_traced
            and group_size <= _GROUP_CHUNK and rows_per_group <= _THREADS and max_length * group_size < 2**31):
        module.get_function("trace_emission_groups")((num_groups,), (_THREADS,), (
            lanes, np.int32(rows_per_group), np.int32(group_size), xp.ascontiguousarray(node), node_parent,
            node_label, frames_dev, np.int64(num_lanes), np.int32(max_length), labels, frames, lengths))
    else:
        module.get_function("trace_emission_paths")(((num_traced + _THREADS - 1) // _THREADS,), (_THREADS,), (
            lanes, np.int32(num_traced), xp.ascontiguousarray(node), node_parent, node_label, frames_dev,
            np.int64(num_lanes), np.int32(max_length), labels, frames, lengths))
    return labels, frames, lengths


def _trace_on_host(lanes, node, node_parent, node_label, node_frames, num_lanes: int):
    max_length = len(node_frames)
    node_frame = np.concatenate([[-1], np.repeat(np.asarray(node_frames, np.int64), num_lanes)])
    traced = []  # newest first; node 0 (the root) once a path has ended
    current = node[lanes]
    while (current != 0).any():
        traced.append(current)
        current = node_parent[current]
    labels = np.full((len(lanes), max_length), -1, dtype=np.int32)
    frames = np.full((len(lanes), max_length), -1, dtype=np.int32)
    if not traced:
        return labels, frames, np.zeros(len(lanes), dtype=np.int32)
    newest_first = np.stack(traced, axis=1)  # [L, D], each row's path then zeros
    lengths = (newest_first != 0).sum(axis=1)
    columns = lengths[:, None] - 1 - np.arange(newest_first.shape[1])[None, :]  # oldest first
    valid = columns >= 0
    nodes = np.take_along_axis(newest_first, np.maximum(columns, 0), axis=1)
    depth = newest_first.shape[1]
    labels[:, :depth] = np.where(valid, node_label[nodes], -1)
    frames[:, :depth] = np.where(valid, node_frame[nodes], -1)
    return labels, frames, lengths.astype(np.int32)


def emission_tree_nbest(order, ranks, own_scores: dict, lm_scores, entries, node, node_parent, node_label,
                        node_frames: Sequence[int], num_best: int, transfer: Callable, unresolved=None, *,
                        truncated=None, maxima=None, ids: Sequence[str] = ()):
    """Per utterance the n-best, best first: ``order`` [U, B] each utterance's lanes best first,
    ``ranks`` [N] (a lane ranked -inf ends its list), ``own_scores`` name -> [N] (the search's own
    score), ``lm_scores`` [S, N] of ``entries``, ``truncated`` [N] bool (None: no lane is). Arrays
    may live on the device; ``transfer`` brings them to the host (one call). None when the device
    bool ``unresolved`` is set.

    ``maxima`` [1 + S, U]: the largest score of the search's own score (first) and of each scorer
    per utterance (:mod:`gpudecode.search.nonfinite`); with it, utterances (``ids``) whose scores
    were non-finite, or whose best rank is, raise :class:`~gpudecode.search.nonfinite.NonFiniteScores`."""
    xp = get_array_module(node)
    num_utts, beam = order.shape
    num_lanes = num_utts * beam
    num_best = min(num_best, beam)
    lanes = (xp.arange(num_utts, dtype=np.int64)[:, None] * beam + order[:, :num_best]).reshape(-1)
    labels, frames, lengths = trace_paths(lanes, node, node_parent, node_label, node_frames, num_lanes,
                                          group_size=beam)
    names = list(own_scores) + [e.name for e in entries]
    scores = [own_scores[name][lanes] for name in own_scores] + [lm_scores[s][lanes] for s in range(len(entries))]
    flag = xp.zeros((), dtype=bool) if unresolved is None else unresolved
    extra = [a for a in (None if truncated is None else truncated[lanes], maxima) if a is not None]
    (flag, ranks, labels, frames, lengths, *scores) = transfer(flag, ranks[lanes], labels, frames, lengths, *scores,
                                                               *extra)
    if bool(flag):
        return None
    if maxima is not None:
        maxima = scores.pop()
        check_finite(ids, names, maxima, ranks.reshape(num_utts, num_best)[:, 0])
    if truncated is not None:
        truncated = scores.pop()
    if (lengths < 0).any():
        raise RuntimeError("emission tree: a traced path leaves its utterance's lanes (a search bug)")
    with no_cyclic_gc():
        return _hypotheses(num_utts, num_best, ranks, labels, frames, lengths, names, scores, truncated)


def _hypotheses(num_utts, num_best, ranks, labels, frames, lengths, names, scores,
                truncated=None) -> list[list[Hypothesis]]:
    """Per utterance its n-best list (:func:`nbest_lists`) from the traced rows [U·num_best] (host),
    each hypothesis scored by its rank."""
    scorer_scores = np.stack(scores) if scores else np.empty((0, len(ranks)), np.float32)
    return nbest_lists(ranks.reshape(num_utts, num_best), int_rows(labels, lengths), ranks, names, scorer_scores,
                       lengths, int_rows(frames, lengths), truncated)


def same_label_paths(candidate, node_a, node_b, node_label, node_parent, steps: int | None, read):
    """Which ``candidate`` pairs (equal hash and length) spell the same label sequence: both
    paths of the label tree (``node_label``, ``node_parent``) walked back until they meet.

    ``steps``: walk at most that many steps and return, as the second value, a device bool
    "some pair is still undecided"; None: walk to the end (one host check per step), second
    value None. Returns (equal pairs, undecided flag or None). ``read``: the search's
    device→host read (:func:`gpudecode.search.stats.read_back` bound to its tuning and stats).
    """
    equal = candidate & (node_a == node_b)
    pending = candidate & (node_a != node_b)
    step = 0
    while True:
        if steps is None:
            (more,) = read(pending.any())
            if not more:
                return equal, None
        elif step >= steps:
            return equal, pending.any()
        pending = pending & (node_label[node_a] == node_label[node_b])
        node_a, node_b = node_parent[node_a], node_parent[node_b]
        met = pending & (node_a == node_b)
        equal = equal | met
        pending = pending & ~met
        step += 1
