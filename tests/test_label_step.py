"""``kernels/label_step.cu`` (one launch per label-synchronous step) selects exactly what the array
version ``beam.select`` selects: the same parents, labels, scores, per-scorer scores,
lengths and ended flags, on inputs with exact ties, -inf scores, terminated and dead lanes, label
limits, length normalisation and a score threshold."""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.scorers.base import LaneLayout
from gpudecode.scorers.combine import combine_scores
from gpudecode.search import label_step
from gpudecode.search.beam import Beam, LabelSyncOptions, candidate_normaliser, select

FIELDS = ("scores", "scorer_scores", "lengths", "ended")


def test_the_kernel_is_used_only_where_it_applies():
    assert not label_step.use_kernel(np, 8, 2)  # numpy: the array version
    cupy_like = object()
    assert label_step.use_kernel(cupy_like, 32, 4)
    assert not label_step.use_kernel(cupy_like, 33, 1)  # LABEL_MAX_BEAM
    assert not label_step.use_kernel(cupy_like, 8, 5)  # logp0 .. logp3


def random_step(seed: int, num_groups: int, beam: int, vocab: int, num_scorers: int, half_scorers: int = 0,
                row_scorers: int = 0):
    """A step's inputs with the awkward cases: exact ties (scores on a coarse grid), -inf log-probs,
    terminated lanes, dead lanes (-inf), an utterance with fewer candidates than lanes (its new
    dead lanes continue its first lane), and lanes at their label limit. The first ``half_scorers``
    scorers' log-probs are float16 (a float16 decoder's), with subnormals among them; the last
    ``row_scorers`` scorers give every lane the same row (a broadcast view, as a length reward)."""
    rng = np.random.default_rng(seed)
    n = num_groups * beam
    log_probs = [np.round(rng.normal(-3, 2, (n, vocab)), 1).astype(np.float32) for _ in range(num_scorers)]
    for logp in log_probs:
        logp[rng.random((n, vocab)) < 0.05] = -np.inf
    terms = [(lp, float(scale)) for lp, scale in zip(log_probs, rng.choice([0.5, 1.0, 0.25, 0.0], num_scorers))]
    scores = np.round(rng.normal(-5, 2, n), 1).astype(np.float32)
    ended = rng.random(n) < 0.3
    dead = rng.random(n) < 0.15
    scores[dead], ended[dead] = -np.inf, True
    scores[::beam][:2] = scores[1::beam][:2]  # equal lanes: ties broken by lane, then label
    ended[-beam:], scores[-beam] = True, -np.inf  # the last utterance: fewer candidates than lanes
    if vocab > label_step.SEGMENT:  # a lane of utterance 1 scores only labels at segment edges, and the last one
        edges = np.array([label_step.SEGMENT - 1, label_step.SEGMENT, vocab - 1])
        for logp in log_probs:
            logp[beam] = -np.inf
            logp[beam, edges] = 1.0
        scores[beam], ended[beam] = 5.0, False
    for s in range(half_scorers):
        log_probs[s] = log_probs[s].astype(np.float16)
        log_probs[s][rng.random((n, vocab)) < 0.02] = np.float16(6e-8) * rng.integers(-40, 40)  # subnormal
        terms[s] = (log_probs[s], terms[s][1])
    for s in range(num_scorers - row_scorers, num_scorers):
        log_probs[s] = np.broadcast_to(log_probs[s][beam + 1], log_probs[s].shape)  # stride 0 over the lanes
        terms[s] = (log_probs[s], terms[s][1])
    beam_state = Beam(scores=scores, scorer_scores=np.round(rng.normal(-4, 2, (num_scorers, n)), 1).astype(np.float32),
                       lengths=rng.integers(0, 9, n).astype(np.int64), ended=ended)
    deadline = rng.integers(3, 8, num_groups).repeat(beam).astype(np.int64)
    return beam_state, terms, log_probs, deadline


def both_selections(cupy, seed: int, beam: int, vocab: int, num_scorers: int, options, num_groups: int = 6,
                    step: int = 5, half_scorers: int = 0, row_scorers: int = 0) -> tuple[dict, dict]:
    """The selection of one :func:`random_step` by the array version on numpy and by the kernel on
    ``cupy``: each as host arrays by name (parents, labels and the new lanes' fields)."""
    state, terms, log_probs, deadline = random_step(seed, num_groups, beam, vocab, num_scorers, half_scorers,
                                                    row_scorers)

    def on_device(array):  # a broadcast row stays one: stride 0 over the lanes
        if array.strides[0] == 0:
            return cupy.broadcast_to(cupy.asarray(np.ascontiguousarray(array[0])), array.shape)
        return cupy.asarray(array)

    norm = candidate_normaliser(state, options, np)  # both get the same normalisers (powf may differ in the last ulp)
    combined = combine_scores([t for t, _ in terms], [scale for _, scale in terms])
    expected, parents, labels = select(state, combined, log_probs, norm, deadline <= step,
                                        LaneLayout(num_groups=num_groups, beam_size=beam), options)
    fields, got_parents, got_labels = label_step.select_kernel(
        Beam(*(cupy.asarray(getattr(state, f)) for f in FIELDS)), [(on_device(t), s) for t, s in terms],
        [on_device(lp) for lp in log_probs], None if norm is None else cupy.asarray(norm),
        cupy.asarray(deadline), step, LaneLayout(num_groups=num_groups, beam_size=beam, xp=cupy), options)
    want = {"parents": parents, "labels": labels, **{f: getattr(expected, f) for f in FIELDS}}
    got = {"parents": got_parents, "labels": got_labels, **fields}
    return want, {name: cupy.asnumpy(value) for name, value in got.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("beam, vocab, num_scorers, half_scorers, row_scorers", [
    (1, 50, 1, 0, 0), (3, 17, 2, 0, 0), (8, 1000, 4, 0, 0), (12, 300, 3, 0, 0), (32, 40, 2, 0, 0), (4, 2500, 2, 0, 0),
    (16, 4500, 1, 0, 0), (1, 50, 1, 1, 0), (8, 1000, 4, 2, 0), (4, 2500, 2, 1, 0),  # float16 log-probs of the first
    (8, 1000, 2, 1, 1), (4, 2500, 3, 0, 2)])  # the last scorers one row for every lane (a broadcast view)
@pytest.mark.parametrize("length_norm_scale, threshold, min_length", [
    (0.0, None, 0), (0.7, None, 0), (0.0, 4.0, 0), (1.0, 2.5, 0), (0.0, None, 5), (0.7, 4.0, 4)])
def test_kernel_selection_equals_the_array_version(beam, vocab, num_scorers, half_scorers, row_scorers,
                                                   length_norm_scale, threshold, min_length):
    """(``min_length``: sentence-end masked for the open lanes of fewer labels; lengths are 0 to 8.)"""
    import cupy

    options = LabelSyncOptions(beam_size=beam, sentence_end=2, length_norm_scale=length_norm_scale,
                               score_threshold=threshold, min_length=min_length)
    want, got = both_selections(cupy, beam * 100 + vocab, beam, vocab, num_scorers, options,
                                half_scorers=half_scorers, row_scorers=row_scorers)
    for name, expected in want.items():
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
    labels = want["labels"]
    assert (labels >= 0).any() and (labels == -1).any()  # both emitting and carried lanes were selected
