"""``kernels/ctc_prefix_score.cu``: the ctc-prefix scorer's CuPy path (one launch per
``score_candidates`` and per ``extend``) equals its numpy array version — forward variables
r_label / r_blank [T+1, N, K], ψ [N, K], the increments and every field of the extended contexts
over several steps — on random frames with varied utterance sizes (0 and the full length
included), -inf log-probs, candidates that repeat the lane's last label, blank and sentence_end
among the candidates, carried lanes and labels that were not scored; and a joint label-sync
search (a bigram table scorer + ctc-prefix) gives the same n-best on both.

On the CPU the real kernels run in the kernel emulator (``tools/kernel-emulator``: the CUDA source
compiled as C++ behind a stand-in ``cupy``; host glibc expf/log1pf as numpy's logaddexp uses, so
bit for bit); on the H200 (``gpu``) with CuPy, where CUDA's expf/log1pf differ in the last ulps
(within 1e-5 there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpudecode.scorers import LaneLayout, UtteranceBatch
from gpudecode.scorers.base import LabelScorer
from gpudecode.scorers.ctc_prefix import CtcPrefixScorer
from gpudecode.search import LabelSyncOptions, label_sync_search

ROOT = Path(__file__).resolve().parent.parent
EMULATOR = ROOT / "tools" / "kernel-emulator"
#: (seed, utterance sizes, beam, V, blank, sentence_end, candidates per lane K (None: score() of all V))
CASES = [(0, (6, 0, 4), 3, 7, 0, 6, 3), (1, (9, 9), 2, 11, 5, 1, 1), (2, (1, 13, 5, 0), 4, 9, 8, 0, 5),
         (3, (16, 3), 3, 6, 2, 3, None), (4, (7,), 5, 20, 0, 19, 8)]
STEPS = 4


def _host(array) -> np.ndarray:
    return np.asarray(array.get() if hasattr(array, "get") else array)


def _log_probs(rng, num_utts, num_frames, vocab, blank):
    """[U, T, V] log-softmax frames with -inf entries: a label impossible on some frames, a whole
    frame's blank impossible, one label never possible."""
    logits = rng.normal(size=(num_utts, num_frames, vocab)).astype(np.float32) * 2
    logits[:, :, blank] += 1.0
    log_probs = (logits - np.log(np.exp(logits).sum(axis=2, keepdims=True))).astype(np.float32)
    log_probs[rng.random(log_probs.shape) < 0.08] = -np.inf
    log_probs[:, 1::5, blank] = -np.inf
    log_probs[:, :, (blank + 1) % vocab] = -np.inf
    return log_probs


def _scorer(xp, log_probs, sizes, beam, vocab, blank, sentence_end):
    scorer = CtcPrefixScorer(vocab_size=vocab, blank=blank, sentence_end=sentence_end)
    layout = LaneLayout(num_groups=len(sizes), beam_size=beam, xp=xp)
    scorer.begin(layout)
    batch = UtteranceBatch(ids=[str(u) for u in range(len(sizes))], input_lengths=np.array(sizes),
                           inputs={"log-probs": xp.asarray(log_probs)}, sizes={"log-probs": np.array(sizes)})
    scorer.admit(batch, np.arange(len(sizes)))
    return scorer, layout


def _candidates(rng, last, num_lanes, vocab, k, blank, sentence_end):
    """[N, K] distinct labels per lane: random, with the lane's last label, blank and sentence_end
    put in on some lanes."""
    rows = np.stack([rng.permutation(vocab)[:k] for _ in range(num_lanes)])
    for lane in range(num_lanes):
        forced = [label for label, p in ((last[lane], 0.6), (blank, 0.3), (sentence_end, 0.3))
                  if label >= 0 and rng.random() < p and label not in rows[lane]][:k]
        if forced:
            rows[lane, k - len(forced):] = forced
    return rows


def _differences(name, want, got, exact):
    want, got = _host(want), _host(got)
    if want.shape != got.shape or want.dtype != got.dtype:
        return [f"{name}: shape/dtype {want.shape} {want.dtype} != {got.shape} {got.dtype}"]
    same = np.array_equal(want, got, equal_nan=True) if exact else (
        np.array_equal(np.isfinite(want), np.isfinite(got)) and np.array_equal(want[~np.isfinite(want)],
                                                                                got[~np.isfinite(got)])
        and np.allclose(want[np.isfinite(want)], got[np.isfinite(got)], rtol=0, atol=1e-5))
    if same:
        return []
    at = np.argwhere(~((want == got) | (np.isnan(want) & np.isnan(got))))[:3].tolist()
    return [f"{name}: differ at {at}: {[want[tuple(i)] for i in at]} != {[got[tuple(i)] for i in at]}"]


def mismatches(cupy, exact: bool = True) -> list[str]:
    """Every case's differences between the numpy scorer and the ``cupy`` one, step by step."""
    bad = []
    for seed, sizes, beam, vocab, blank, sentence_end, k in CASES:
        rng = np.random.default_rng(seed)
        log_probs = _log_probs(rng, len(sizes), max(sizes), vocab, blank)
        cpu, layout = _scorer(np, log_probs, sizes, beam, vocab, blank, sentence_end)
        gpu, _ = _scorer(cupy, log_probs, sizes, beam, vocab, blank, sentence_end)
        groups = np.arange(len(sizes))
        contexts = [cpu.initial_context(groups), gpu.initial_context(groups)]
        num_lanes = layout.num_lanes
        for step in range(STEPS):
            case = f"case {seed} step {step}"
            if k is None:
                candidates = np.broadcast_to(np.arange(vocab), (num_lanes, vocab))
                scores = [cpu.score(contexts[0]), gpu.score(contexts[1])]
            else:
                candidates = _candidates(rng, _host(contexts[0].last), num_lanes, vocab, k, blank, sentence_end)
                scores = [cpu.score_candidates(contexts[0], candidates),
                          gpu.score_candidates(contexts[1], cupy.asarray(candidates))]
            bad += _differences(f"{case} increments", *scores, exact)
            for name, want, got in zip(("labels", "r_label", "r_blank", "ψ"), contexts[0].scored, contexts[1].scored):
                bad += _differences(f"{case} {name}", want, got, exact)
            # parents within each lane group; labels: a candidate, carried (-1) or not scored
            parents = (np.arange(num_lanes) // beam) * beam + rng.integers(0, beam, num_lanes)
            labels = candidates[parents, rng.integers(0, candidates.shape[1], num_lanes)].copy()
            labels[rng.random(num_lanes) < 0.2] = -1
            unscored = rng.random(num_lanes) < 0.2
            labels[unscored] = rng.integers(0, vocab, int(unscored.sum()))
            if step == 1:  # extend gathers the scored forward variables (not recomputes them): shift them
                for ctx in contexts:
                    ctx.scored = (ctx.scored[0], *(a + np.float32(0.5) for a in ctx.scored[1:]))
            if step == STEPS - 1:  # nothing scored: every label runs the recursion
                contexts = [ctx.__class__(ctx.r_label, ctx.r_blank, ctx.prefix_logp, ctx.last) for ctx in contexts]
            contexts = [cpu.extend(contexts[0], parents, labels),
                        gpu.extend(contexts[1], cupy.asarray(parents), cupy.asarray(labels))]
            for name in ("r_label", "r_blank", "prefix_logp", "last"):
                bad += _differences(f"{case} extend {name}", getattr(contexts[0], name),
                                    getattr(contexts[1], name), exact)
    return bad


def test_the_cases_hold_what_the_kernels_must_get_right():
    """The oracle's inputs cover sizes 0 and T, -inf log-probs, repeats, blank and sentence_end
    candidates, carried lanes and unscored labels (which run the recursion in extend)."""
    assert any(0 in sizes for _, sizes, *_ in CASES) and any(len(set(sizes)) < len(sizes) for _, sizes, *_ in CASES)
    rng = np.random.default_rng(0)
    log_probs = _log_probs(rng, 2, 5, 7, 0)
    assert np.isneginf(log_probs).any() and np.isfinite(log_probs).any()
    candidates = _candidates(rng, np.array([3, 3, 3, 3, -1, -1]), 6, 7, 3, 0, 6)
    assert (candidates == 3).any() and (candidates == 0).any() and (candidates == 6).any()
    assert all(len(set(row)) == 3 for row in candidates.tolist())
    scorer, layout = _scorer(np, log_probs, (5, 0), 3, 7, 0, 6)
    ctx = scorer.initial_context(np.arange(2))
    scores = scorer.score_candidates(ctx, np.tile([0, 2, 6], (layout.num_lanes, 1)))
    assert np.isneginf(scores[:, 0]).all() and np.isfinite(scores[:3, 1]).all()  # blank: -inf
    assert np.isneginf(scores[:3, 2]).all()  # an impossible blank frame: the empty sequence is impossible
    assert np.isneginf(scores[3:, 1]).all() and (scores[3:, 2] == 0).all()  # no frames: only the empty one


class BigramScorer(LabelScorer):
    """A full scorer for the search test: log-probs from a fixed [V + 1, V] table by the lane's last
    label (row V: no label yet)."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.vocab_size = table.shape[1]

    def begin(self, layout: LaneLayout) -> None:
        super().begin(layout)
        self._table = layout.xp.asarray(self.table)

    def initial_context(self, groups, ctx=None):
        return self.layout.xp.full(self.layout.num_lanes, self.vocab_size, dtype=np.int64)

    def score(self, ctx):
        return self._table[ctx]

    def extend(self, ctx, parents, labels):
        xp = self.layout.xp
        parents, labels = xp.asarray(parents), xp.asarray(labels)
        return xp.where(labels < 0, ctx[parents], labels)


def search_nbest(xp, seed: int = 0):
    """(labels, score, ctc score) of every n-best entry of a joint bigram + ctc-prefix search."""
    rng = np.random.default_rng(seed)
    vocab, blank, end, sizes = 9, 0, 8, (11, 0, 7, 14)
    log_probs = _log_probs(rng, len(sizes), max(sizes), vocab, blank)
    table = np.log(rng.dirichlet(np.ones(vocab), vocab + 1)).astype(np.float32)
    batch = UtteranceBatch(ids=[str(u) for u in range(len(sizes))], input_lengths=np.array(sizes),
                           inputs={"log-probs": xp.asarray(log_probs)}, sizes={"log-probs": np.array(sizes)})
    scorers = [("lm", BigramScorer(table), 0.6), ("ctc", CtcPrefixScorer(vocab_size=vocab, blank=blank,
                                                                          sentence_end=end), 0.4)]
    options = LabelSyncOptions(beam_size=4, sentence_end=end, max_labels=12, pre_beam_size=5, nbest=4)
    nbest = label_sync_search(scorers, batch, options, xp=xp)
    return [[(tuple(h.labels), h.length, float(h.score), float(h.scores["ctc"])) for h in hyps] for hyps in nbest]


def search_mismatch(cupy) -> str:
    """'' where the n-best lists have the same labels and scores (within 1e-4) on numpy and ``cupy``."""
    want, got = search_nbest(np), search_nbest(cupy)
    same = [len(w) == len(g) and all(a[:2] == b[:2] and np.allclose(a[2:], b[2:], rtol=0, atol=1e-4)
                                     for a, b in zip(w, g)) for w, g in zip(want, got)]
    return "" if len(want) == len(got) and all(same) else f"numpy {want} != cupy {got}"


def _emulate(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(EMULATOR / "fakecupy"), str(EMULATOR / "emu"), str(ROOT)]), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=EMULATOR, capture_output=True, text=True,
                          timeout=600)


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel emulator compiles with g++")


def assert_none_in_emulation(module: str, function: str) -> None:
    """``module.function(cupy)`` run with the kernel emulator's CuPy returns its problems (a list or
    a string); they must be none."""
    run = _emulate(f"import cupy; from {module} import {function}; bad = {function}(cupy); "
                   "print(bad if isinstance(bad, str) else (len(bad), bad[:10])); raise SystemExit(1 if bad else 0)")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@needs_gxx
def test_the_kernels_equal_the_array_version_bit_for_bit_in_emulation():
    assert_none_in_emulation("tests.test_ctc_prefix_kernel", "mismatches")


@needs_gxx
def test_a_joint_search_gives_the_numpy_nbest_in_emulation():
    assert_none_in_emulation("tests.test_ctc_prefix_kernel", "search_mismatch")


@pytest.mark.gpu
def test_the_kernels_equal_the_array_version_on_cuda():
    cupy = pytest.importorskip("cupy")
    assert mismatches(cupy, exact=False) == []


@pytest.mark.gpu
def test_a_joint_search_gives_the_numpy_nbest_on_cuda():
    cupy = pytest.importorskip("cupy")
    assert search_mismatch(cupy) == ""
