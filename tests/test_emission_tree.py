"""Tracing lanes through an emission tree: the array version (host) and the kernel (GPU) against
a node-by-node walk."""

import numpy as np
import pytest

from gpudecode.search.emission_tree import emission_tree_nbest, trace_paths
from gpudecode.search.results import Hypothesis


def random_tree(seed: int, num_lanes: int = 6, steps: int = 9):
    """A tree as the searches build it: at each step every lane gets node 1 + k * N + lane whose
    parent is a node of an earlier step (or the root) and whose label is >= 0."""
    rng = np.random.default_rng(seed)
    size = 1 + steps * num_lanes
    node_parent = np.zeros(size, np.int64)
    node_label = np.full(size, -1, np.int64)
    for k in range(steps):
        for lane in range(num_lanes):
            n = 1 + k * num_lanes + lane
            node_parent[n] = 0 if k == 0 or rng.random() < 0.15 else rng.integers(1, 1 + k * num_lanes)
            node_label[n] = rng.integers(0, 7)
    node = rng.integers(0, size, num_lanes).astype(np.int64)
    node[0] = 0  # an empty sequence
    node_frames = sorted(rng.choice(4 * steps, steps, replace=False).tolist())
    return node, node_parent, node_label, node_frames


def grouped_tree(seed: int, num_groups: int, group_size: int, steps: int):
    """A tree whose nodes' parents stay in their lane's group (an utterance's beam), as the
    searches make them."""
    rng = np.random.default_rng(seed)
    num_lanes = num_groups * group_size
    size = 1 + steps * num_lanes
    node_parent = np.zeros(size, np.int64)
    node_label = rng.integers(0, 50, size).astype(np.int64)
    node_label[0] = -1
    for k in range(1, steps):
        for lane in range(num_lanes):
            if rng.random() < min(0.002, 0.5 / steps):
                continue  # a path that starts at step k (rarely: paths span several chunks of steps)
            group = lane // group_size
            parent_step = rng.integers(max(0, k - 2), k)
            node_parent[1 + k * num_lanes + lane] = 1 + parent_step * num_lanes + group * group_size + rng.integers(
                group_size)
    newest = np.where(rng.random(num_lanes) < 0.5, steps - 1, rng.integers(0, max(steps, 1), num_lanes))
    first = 1 + newest * num_lanes + np.arange(num_lanes)
    node = np.where((rng.random(num_lanes) < 0.1) | (steps == 0), 0, first).astype(np.int64)
    node_frames = sorted(rng.choice(3 * steps, steps, replace=False).tolist())
    return node, node_parent, node_label, node_frames


def walk(n, node_parent, node_label, node_frames, num_lanes):
    labels, frames = [], []
    while n != 0:
        labels.append(int(node_label[n]))
        frames.append(node_frames[(n - 1) // num_lanes])
        n = node_parent[n]
    return labels[::-1], frames[::-1]


@pytest.mark.parametrize("seed", range(4))
def test_host_trace_equals_a_node_by_node_walk(seed):
    node, node_parent, node_label, node_frames = random_tree(seed)
    lanes = np.array([3, 0, 5, 3, 1], np.int64)
    labels, frames, lengths = trace_paths(lanes, node, node_parent, node_label, node_frames, 6)
    assert labels.shape == frames.shape == (5, len(node_frames))
    for row, lane in enumerate(lanes):
        want_labels, want_frames = walk(node[lane], node_parent, node_label, node_frames, 6)
        n = lengths[row]
        assert n == len(want_labels)
        assert labels[row, :n].tolist() == want_labels and frames[row, :n].tolist() == want_frames
        assert (labels[row, n:] == -1).all() and (frames[row, n:] == -1).all()


def test_trace_of_an_empty_tree():
    labels, frames, lengths = trace_paths(np.array([0, 1]), np.zeros(2, np.int64), np.zeros(1, np.int64),
                                          np.full(1, -1, np.int64), [], 2)
    assert labels.shape == (2, 0) and lengths.tolist() == [0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_kernel_trace_equals_the_host_trace(seed):
    import cupy

    node, node_parent, node_label, node_frames = random_tree(seed, num_lanes=40, steps=60)
    lanes = np.random.default_rng(seed).integers(0, 40, 100)
    expected = trace_paths(lanes, node, node_parent, node_label, node_frames, 40)
    got = trace_paths(cupy.asarray(lanes), cupy.asarray(node), cupy.asarray(node_parent),
                      cupy.asarray(node_label), node_frames, 40)
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b.get())


@pytest.mark.gpu
@pytest.mark.parametrize("num_groups, group_size, rows_per_group, steps",
                         [(3, 4, 2, 50), (5, 8, 1, 300), (2, 8, 8, 700), (4, 3, 3, 1), (1, 1, 1, 5000), (2, 16, 5, 0)])
def test_group_kernel_trace_equals_the_host_trace(num_groups, group_size, rows_per_group, steps):
    """trace_emission_groups (paths walked in shared memory, one or more chunks of steps) equals
    the host trace; rows trace lanes of their own group in any order, repeats included."""
    import cupy

    node, node_parent, node_label, node_frames = grouped_tree(steps, num_groups, group_size, steps)
    rng = np.random.default_rng(1)
    lanes = (np.arange(num_groups)[:, None] * group_size
             + rng.integers(0, group_size, (num_groups, rows_per_group))).reshape(-1)
    expected = trace_paths(lanes, node, node_parent, node_label, node_frames, num_groups * group_size)
    got = trace_paths(cupy.asarray(lanes), cupy.asarray(node), cupy.asarray(node_parent), cupy.asarray(node_label),
                      node_frames, num_groups * group_size, group_size=group_size)
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b.get())
    chunk = 2048 // group_size
    if steps > chunk:  # some path spans chunks of steps (staged newest first, 2,048 nodes each)
        step_of = np.searchsorted(node_frames, expected[1])  # each label's tree step
        chunk_of = (steps - 1 - step_of) // chunk
        assert any(chunk_of[r, 0] != chunk_of[r, n - 1] for r, n in enumerate(expected[2]) if n > 0)


@pytest.mark.gpu
def test_group_kernel_flags_paths_that_leave_their_group():
    import cupy

    node, node_parent, node_label, node_frames = grouped_tree(0, 2, 4, 20)
    lanes = np.array([1, 2, 4, 7])
    crossing = 1 + 19 * 8 + 5  # a node of lane 5 (group 1) of the last step, on no other path, ...
    node_parent[crossing] = 1 + 9 * 8 + 0  # ... whose parent is of lane 0 (group 0)
    node[7] = crossing
    node[2] = 1 + 19 * 8 + 6  # lane 2 of group 0 ends in a node of lane 6 (group 1)
    got = trace_paths(cupy.asarray(lanes), cupy.asarray(node), cupy.asarray(node_parent), cupy.asarray(node_label),
                      node_frames, 8, group_size=4)
    expected = trace_paths(lanes, node, node_parent, node_label, node_frames, 8)
    lengths = got[2].get()
    assert lengths.tolist()[1::2] == [-1, -1]
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a[0::2], b.get()[0::2])
    assert (got[0].get()[1::2] == -1).all()


@pytest.mark.parametrize("seed", range(3))
def test_nbest_lists_equal_a_lane_by_lane_build(seed):
    """emission_tree_nbest's lists, made by numpy and ``map``, against one Hypothesis built per
    traced lane in a loop: labels and frames cut to the path, the rank as the score, each score
    by name, and each utterance's list ending at its first -inf rank."""
    num_utts, beam, num_best = 3, 4, 3
    node, node_parent, node_label, node_frames = random_tree(seed, num_lanes=num_utts * beam)
    rng = np.random.default_rng(seed)
    ranks = rng.standard_normal(num_utts * beam).astype(np.float32)
    ranks[beam + 1:2 * beam] = -np.inf  # utterance 1 has one live lane: its list ends after it
    order = np.argsort(-ranks.reshape(num_utts, beam), axis=1, kind="stable")
    own = {"ctc": rng.standard_normal(num_utts * beam).astype(np.float32)}
    lm = rng.standard_normal((1, num_utts * beam)).astype(np.float32)

    class Entry:
        name = "lm"

    got = emission_tree_nbest(order, ranks, own, lm, [Entry()], node, node_parent, node_label, node_frames,
                              num_best, transfer=lambda *arrays: arrays)
    lanes = (np.arange(num_utts)[:, None] * beam + order[:, :num_best]).reshape(-1)
    labels, frames, lengths = trace_paths(lanes, node, node_parent, node_label, node_frames, num_utts * beam)
    for u in range(num_utts):
        expected = []
        for row in range(u * num_best, (u + 1) * num_best):
            lane, n = lanes[row], lengths[row]
            if not np.isfinite(ranks[lane]):
                break
            expected.append(Hypothesis(labels=[int(x) for x in labels[row, :n]], score=float(ranks[lane]),
                                       scores={"ctc": float(own["ctc"][lane]), "lm": float(lm[0, lane])},
                                       length=int(n), frames=[int(x) for x in frames[row, :n]]))
        assert got[u] == expected
    assert [len(nbest) for nbest in got] == [3, 1, 3]
