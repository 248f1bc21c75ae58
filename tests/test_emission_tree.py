"""Tracing lanes through an emission tree: the array version (host) and the kernel (GPU) against
a node-by-node walk."""

import numpy as np
import pytest

from gpudecode.search.emission_tree import trace_paths


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
