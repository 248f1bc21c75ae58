"""The fused CTC prefix-search kernels (kernels/ctc_frame.cu) and the n-best trace
(kernels/emission_tree.cu) on the CPU emulation, against the numpy search; the label-synchronous
selection step (kernels/label_step.cu) against its array version.

Run through run.sh (PYTHONPATH: the fake cupy, then the checkout). The CuPy path of
ctc_prefix_search runs unchanged: gpudecode.search.ctc_frame.search_kernel launches
ctc_top_labels_<P> / ctc_prefix_frames_<K>, topk launches top_k_rows_<K>, emission_tree.trace_paths
launches trace_emission_groups; each launch is emulated (emu/emulator.py) with its arguments checked
against the kernel's C signature.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import time
import traceback

import numpy as np

import cupy  # the fake (fakecupy/cupy)
import emulator
import gpudecode
from gpudecode.bench.ctc import random_log_probs
from gpudecode.kernels import kernel_source
from gpudecode.search import CtcPrefixOptions, ctc_prefix_search
from gpudecode.search import ctc as ctc_module
from gpudecode.search import ctc_frame
from gpudecode.testing import search_reference
from gpudecode.search.tuning import SearchTuning
from tests.test_ctc_frame import PREFILTER_CASES

TOL = 1e-4
SMALL_LENGTHS = np.array([14, 9, 1, 12, 0])


def small_inputs(seed, blank_bias, blank=0):
    return random_log_probs(np, 5, 14, 12, seed=seed, sharpness=2.0, blank_bias=blank_bias), SMALL_LENGTHS


def large_inputs(seed, blank_bias=1.5):
    lengths = np.random.default_rng(seed).integers(1, 41, 8)
    return random_log_probs(np, 8, 40, 200, seed=seed, sharpness=2.0, blank_bias=blank_bias), lengths


def wide_inputs(seed):
    return (random_log_probs(np, 4, 30, 1000, seed=seed, sharpness=2.0, blank_bias=1.5),
            np.random.default_rng(seed).integers(1, 31, 4))


def huge_vocab_inputs(seed):
    return (random_log_probs(np, 3, 20, 12_000, seed=seed, sharpness=2.0, blank_bias=1.5),
            np.array([20, 13, 7]))


def tie_inputs(options, spec):
    """Log-probs where every label but blank lies within a few ulps, so that sums round to ties.
    ("test",): tests/test_ctc_frame.py's `levels` inputs (U=5, T=14, V=12, seed 7, 3 levels);
    ("gen", seed, levels, spacing, V): the same construction with other parameters."""
    if spec[0] == "test":
        seed, noise_seed, levels, spacing, vocab_size = 7, 1, 3, 2e-7, 12
    else:
        _, seed, levels, spacing, vocab_size = spec
        noise_seed = seed + 1
    log_probs = random_log_probs(np, 5, 14, vocab_size, seed=seed, sharpness=2.0, blank_bias=1.0)
    rng = np.random.default_rng(noise_seed)
    near = np.round(log_probs.max(axis=2, keepdims=True), 0) - np.float32(1.0)
    labels = np.arange(vocab_size) != options.blank
    log_probs[:, :, labels] = (near + rng.integers(0, levels, (5, 14, vocab_size))[:, :, labels]
                               * np.float32(spacing))
    return log_probs, SMALL_LENGTHS


SMALL = [
    dict(beam_size=1),
    dict(beam_size=3),
    dict(beam_size=4),
    dict(beam_size=4, score_threshold=2.0),
    dict(beam_size=4, hash_modulus=5),
    dict(beam_size=2, blank_skip_threshold_logp=-0.05),
    dict(beam_size=4, blank=3),
    dict(beam_size=6),  # V = 12: too few labels for the prefilter, the full scan
]
SMALL_INPUTS = [(7, 1.0), (0, 1.5), (1, 1.5), (2, 1.0)]  # (seed, blank_bias)
LARGE = [
    dict(beam_size=4),
    dict(beam_size=8),
    dict(beam_size=13),
    dict(beam_size=8, score_threshold=4.0),
]
LARGE_SEEDS = [3, 4, 5, 6]
EXTRA = [  # not in the brief: the other kernel paths and list lengths
    ("large", dict(beam_size=5), 3),                          # 17-label list, KEPT 8
    ("large", dict(beam_size=9, score_threshold=5.0), 3),     # 33-label list, KEPT 16
    ("large", dict(beam_size=16), 4),                         # 33-label list at its largest beam
    ("large", dict(beam_size=8, blank_skip_threshold_logp=-0.05), 5, 10.0),  # 84 skipped, 4 blank-only frames
    ("small", dict(beam_size=2, blank_skip_threshold_logp=-0.05), 3, 6.0),    # 14 skipped, 1 blank-only frame
    ("small", dict(beam_size=4, blank_skip_threshold_logp=-0.05), 3, 6.0),
    ("small", dict(beam_size=6, blank_skip_threshold_logp=-0.01), 3, 8.0),    # full scan, 2 blank-only frames
    ("large", dict(beam_size=8, hash_modulus=7), 6),          # hash collisions with the prefilter
    ("large", dict(beam_size=13, hash_modulus=3), 4),
    ("small", dict(beam_size=6, hash_modulus=3), 0, 1.5),
    ("small", dict(beam_size=6, hash_modulus=3), 7, 1.0),
    ("small", dict(beam_size=4, hash_modulus=2), 1, 1.5),
    ("wide", dict(beam_size=1), 5, 1.5, False),               # full scans where every warp holds labels
    ("wide", dict(beam_size=4), 5, 1.5, False),
    ("wide", dict(beam_size=8, score_threshold=4.0), 6, 1.5, False),
    ("wide", dict(beam_size=8), 6),                           # the same input with the prefilter
    ("huge", dict(beam_size=2), 4, 1.5, False),
    ("large", dict(beam_size=20, score_threshold=6.0), 3),   # beam > 16: no prefilter, KEPT 32, row in shared
    ("huge", dict(beam_size=6, score_threshold=6.0), 4),     # V = 12,000 with the prefilter
    ("huge", dict(beam_size=17), 4),                         # V = 12,000, full scan: row read from global memory
    # label pruning (token_min_logp: the CuPy path searches the pruned log-probs, -inf for most labels)
    ("large", dict(beam_size=8, token_min_logp=-5.0, score_threshold=10.0), 3),  # pyctcdecode's defaults, prefilter
    ("small", dict(beam_size=4, token_min_logp=-1.5), 0, 1.5),                   # pruned blanks, prefilter
    ("small", dict(beam_size=6, token_min_logp=-1.0, blank_skip_threshold_logp=-2.0), 3, 6.0),  # full scan, skips
    ("wide", dict(beam_size=8, token_min_logp=-5.0), 6),                         # V = 1000, lists of few labels
]
TIES = [  # (options, inputs): the kernel with the prefilter must equal the kernel without it bit for bit
    *[(case, ("test",)) for case in PREFILTER_CASES],
    # more tie inputs (in the numpy reference most of these give another n-best without the fallback)
    *[(dict(beam_size=beam, blank=blank), ("gen", seed, levels, spacing, 12))
      for beam in (2, 3, 4) for blank in (0, 3) for seed in (0, 1) for levels, spacing in ((2, 1e-7), (3, 2e-7))],
    *[(dict(beam_size=beam, blank=blank), ("gen", 0, levels, spacing, vocab_size))
      for beam, vocab_size in ((6, 24), (8, 40), (13, 64), (16, 64)) for blank in (0, 3)
      for levels, spacing in ((2, 1e-7), (3, 2e-7))],
]


TOP_LABELS_CAP = 64  # TOP_LABELS_CAP of kernels/ctc_frame.cu
TOP_LABELS = [  # (P, V, blank, kind, the kernel paths the rows must take): ctc_top_labels_<P> alone
    *[(p, 1000, 0, "random", "fast") for p in (9, 17, 33)],
    (17, 1000, 999, "random", "fast"), (9, 200, 77, "random", "fast"), (33, 12_000, 5, "random", "fast"),
    (17, 45, 3, "random", "fast"), (33, 40, 39, "random", "fast"),             # V not a multiple of 32
    *[(p, v, b, "random", "fast") for p in (9, 17, 33) for v, b in ((p + 1, p), (p + 2, 1))],  # P labels
    *[(p, p, 0, "random", "fallback") for p in (9, 17, 33)],                   # fewer labels than P: -1
    (9, 1, 0, "random", "fallback"), (33, 20, 4, "random", "fallback"),
    (17, 1000, 2, "blank-max", "fast"), (33, 300, 0, "blank-max", "fast"),
    (17, 1000, 0, "levels-400", "fast"), (9, 1000, 6, "levels-3", "fallback"),  # ties: lower label first
    (33, 1000, 1, "levels-16", "both"), (9, 1000, 1, "levels-16", "both"),
    *[(p, 1000, 0, "equal", "fallback") for p in (9, 17, 33)], (17, 60, 0, "equal", "fast"),
    (17, 1000, 0, "one-lane", "fast"), (17, 5000, 0, "one-lane", "fallback"),  # a lane full of large values
    (33, 5000, 7, "one-lane", "fallback"),
    (17, 1000, 0, "few-finite", "fallback"), (33, 1000, 3, "few-finite", "fallback"),  # -inf rows
    (17, 1000, 0, "nan", "both"), (9, 100, 0, "nan", "both"), (33, 1000, 9, "nan", "both"),
    (17, 1000, 4, "zeros", "fallback"), (17, 1000, 4, "inf", "fast"),         # -0.0 / +0.0, +inf
]


def top_labels_rows(vocab_size, blank, kind, seed, num_rows=13):
    """num_rows rows of log-probs [num_rows, V] float32 of one kind (13 rows: the last block part empty)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((num_rows, vocab_size)) * 2 - 5).astype(np.float32)
    if kind == "blank-max":
        x[:, blank] = 50.0
    elif kind.startswith("levels-"):
        x = (rng.integers(0, int(kind[7:]), x.shape) * 0.25 - 3).astype(np.float32)
    elif kind == "equal":
        x[:] = -1.5
    elif kind == "one-lane":  # lane 5's columns above everything, a third of them equal
        x[:, 5::32] = (10 + rng.integers(0, 3, x[:, 5::32].shape)).astype(np.float32)
    elif kind == "few-finite":  # P - 1 or fewer finite labels, the rest -inf (and some NaN)
        x[:] = -np.inf
        x[:, rng.integers(0, vocab_size, 8)] = rng.standard_normal(8).astype(np.float32)
        x[1::2, rng.integers(0, vocab_size, 40)] = np.nan
    elif kind == "nan":  # rows from all NaN to NaN-free
        for r in range(num_rows):
            x[r, rng.random(vocab_size) < r / (num_rows - 1)] = np.nan
        x[-1, 3] = 0.0
    elif kind == "zeros":
        x = np.where(rng.random(x.shape) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        x[:, ::7] = -1
    elif kind == "inf":
        x[:, rng.integers(0, vocab_size, 12)] = np.inf
    return x


def top_labels_path(row, blank, num_top):
    """Which path ctc_top_labels_<P> takes on `row` ("fast" or "fallback"), by the kernel's rule."""
    x = np.where(np.isnan(row), -np.inf, row).astype(np.float32)
    x[blank] = -np.inf
    kept_per_lane = (num_top + 31) // 32  # M
    padding = max(-len(x) % 32, 32 * kept_per_lane - len(x))
    lanes = np.concatenate([x, np.full(padding, -np.inf, np.float32)]).reshape(-1, 32)
    kept = -np.sort(-lanes, axis=0)[:kept_per_lane]
    tau = np.sort(kept.ravel())[::-1][num_top - 1]
    count = np.count_nonzero(row >= tau) - (row[blank] >= tau)
    return "fast" if tau > -np.inf and count <= TOP_LABELS_CAP else "fallback"


def run_top_labels(num_top, vocab_size, blank, kind, paths):
    x = top_labels_rows(vocab_size, blank, kind, seed=num_top * vocab_size + blank)
    name = f"top labels P={num_top} V={vocab_size} blank={blank} {kind}"
    labels, values = (np.asarray(a) for a in ctc_frame.top_labels_kernel(cupy.asarray(x), blank, num_top))
    problems = []
    for r, row in enumerate(x):
        want = search_reference.top_labels_reference(row, blank, num_top)
        want = np.array(want + [-1] * (num_top - len(want)), dtype=np.int32)
        want_values = np.where(want >= 0, row[np.maximum(want, 0)], np.float32(-np.inf)).astype(np.float32)
        if not np.array_equal(labels[r], want):
            problems.append(f"row {r}: labels {labels[r].tolist()} expected {want.tolist()}")
        elif not np.array_equal(values[r].view(np.uint32), want_values.view(np.uint32)):
            problems.append(f"row {r}: values {values[r].tolist()} expected {want_values.tolist()}")
    taken = [top_labels_path(row, blank, num_top) for row in x]
    counts = {p: taken.count(p) for p in ("fast", "fallback")}
    if any(counts[p] == 0 for p in (("fast", "fallback") if paths == "both" else (paths,))):
        problems.append(f"rows by path {counts}, expected {paths}")
    return name, problems, f"rows: {counts['fast']} fast path, {counts['fallback']} fallback"


LABEL_STEPS = [(beam, vocab, scorers, norm, threshold, 0) for beam, vocab, scorers in
               ((1, 50, 1), (3, 17, 2), (8, 300, 4), (12, 40, 3), (32, 40, 2))
               for norm, threshold in ((0.0, None), (0.7, None), (0.0, 4.0), (1.0, 2.5))]
LABEL_STEPS += [(4, 2500, 2, 0.7, None, 0), (16, 4500, 1, 0.0, 3.0, 0)]  # V > 2,048: more than one segment
LABEL_STEPS += [(1, 50, 1, 0.0, None, 1), (8, 300, 4, 0.7, 4.0, 2), (4, 2500, 2, 1.0, 2.5, 1)]  # float16 log-probs
LABEL_STEPS = [(*case, 0) for case in LABEL_STEPS]
LABEL_STEPS += [(8, 300, 2, 0.7, None, 1, 1), (4, 2500, 3, 0.0, 3.0, 0, 2), (3, 17, 1, 1.0, 2.5, 0, 1)]  # broadcast rows
LABEL_STEPS = [(*case, 0) for case in LABEL_STEPS]
LABEL_STEPS += [(3, 17, 2, 0.0, None, 0, 0, 5), (8, 300, 4, 0.7, 4.0, 2, 0, 4), (4, 2500, 2, 1.0, 2.5, 1, 1, 6)]  # min_length


def run_label_step(beam, vocab, num_scorers, length_norm, threshold, half_scorers, row_scorers, min_length):
    """``label_step.select_kernel`` (kernels/label_step.cu) against ``beam.select``, every
    output bit for bit, on tests/test_label_step.py's inputs (ties, -inf, ended and dead lanes)."""
    from gpudecode.search.label_sync import LabelSyncOptions
    from tests.test_label_step import both_selections

    name = (f"label step beam={beam} V={vocab} scorers={num_scorers} lns={length_norm} thr={threshold}"
            + (f" float16={half_scorers}" if half_scorers else "") + (f" rows={row_scorers}" if row_scorers else "")
            + (f" min_length={min_length}" if min_length else ""))
    options = LabelSyncOptions(beam_size=beam, sentence_end=2, length_norm_scale=length_norm,
                               score_threshold=threshold, min_length=min_length)
    want, got = both_selections(cupy, beam * 100 + vocab, beam, vocab, num_scorers, options, half_scorers=half_scorers,
                                row_scorers=row_scorers)
    problems = [f"{what}: {got[what].ravel()[:12].tolist()} expected {expected.ravel()[:12].tolist()}"
                for what, expected in want.items() if not np.array_equal(got[what], expected)]
    labels = want["labels"]
    return name, problems, f"{int((labels >= 0).sum())} emitting, {int((labels < 0).sum())} carried lanes"


def describe(options: dict) -> str:
    return ",".join(f"{k.replace('_size', '').replace('_threshold', '_thr')}={v}" for k, v in options.items())


def emulated(log_probs, lengths, options, prefilter=True):
    emulator.launch_log.clear()
    got = ctc_prefix_search(cupy.asarray(log_probs), lengths, options, xp=cupy,
                            tuning=SearchTuning(ctc_prefilter=prefilter))
    return got, list(emulator.launch_log)


def check_launches(launches, options, vocab_size, prefilter=True):
    """The kernels the CuPy path must have launched."""
    problems = []
    if not any(n.startswith("ctc_prefix_frames_") for n in launches):
        problems.append("ctc_prefix_frames_* never launched")
    if "trace_emission_groups" not in launches:
        problems.append("trace_emission_groups never launched")
    num_top = ctc_frame.top_label_count(options.beam_size, vocab_size, prefilter)
    tops = [n for n in launches if n.startswith("ctc_top_labels_")]
    if num_top and not tops:
        problems.append(f"expected the label prefilter (ctc_top_labels_*, {num_top} labels), not launched")
    if not num_top and tops:
        problems.append(f"prefilter launched ({tops}) where none was expected")
    return problems


def compare(expected, got):
    """Problems (empty: equal): labels and frames exact, scores within TOL."""
    problems, worst = [], 0.0
    if len(expected) != len(got):
        return [f"{len(got)} utterances, expected {len(expected)}"], worst
    for u, (a, b) in enumerate(zip(expected, got)):
        if len(a) != len(b):
            problems.append(f"utt {u}: {len(b)} hypotheses, expected {len(a)}")
        for r, (x, y) in enumerate(zip(a, b)):
            where = f"utt {u} hyp {r}"
            if x.labels != y.labels:
                problems.append(f"{where}: labels {y.labels} expected {x.labels}")
            elif x.frames != y.frames:
                problems.append(f"{where}: frames {y.frames} expected {x.frames}")
            diffs = [abs(x.score - y.score)] + [abs(x.scores[k] - y.scores.get(k, np.inf)) for k in x.scores]
            if x.scores.keys() != y.scores.keys():
                problems.append(f"{where}: score names {sorted(y.scores)} expected {sorted(x.scores)}")
            d = max(diffs)
            worst = max(worst, d) if np.isfinite(d) else np.inf
            if not d <= TOL:
                problems.append(f"{where}: score {y.score!r} expected {x.score!r} (|diff| {d:.3g})")
    return problems, worst


def exact(results):
    return [[(h.labels, h.frames, h.score, sorted(h.scores.items())) for h in nbest] for nbest in results]


def reference_full_scans(log_probs, lengths, options):
    """How many frames fall back to the full scan in the prefilter's numpy reference (the tie path)."""
    num_top = ctc_frame.top_label_count(options.beam_size, log_probs.shape[2])  # the kernel's list
    searches = []
    original = ctc_module._PrefixSearch._full_frame

    def reference(search, t, exact_):
        searches.append(search)
        search_reference.full_frame_reference(search, t, exact_, num_top=num_top)

    ctc_module._PrefixSearch._full_frame = reference
    try:  # the array version (where numba imports, the compiled loop would run instead)
        ctc_prefix_search(log_probs, lengths, options, tuning=SearchTuning(compiled_cpu_loops=False))
    finally:
        ctc_module._PrefixSearch._full_frame = original
    return max((getattr(s, "full_scans", 0) for s in searches), default=0)


# --- the case runners -------------------------------------------------------------------------------
def run_vs_numpy(kind, case, seed, blank_bias=1.5, prefilter=True):
    options = CtcPrefixOptions(**case)
    if kind == "small":
        log_probs, lengths = small_inputs(seed, blank_bias)
        shape = f"U=5 T=14 V=12 seed={seed} bias={blank_bias}"
    elif kind == "large":
        log_probs, lengths = large_inputs(seed, blank_bias)
        shape = f"U=8 T=40 V=200 seed={seed}" + ("" if blank_bias == 1.5 else f" bias={blank_bias}")
    elif kind == "wide":
        log_probs, lengths = wide_inputs(seed)
        shape = f"U=4 T=30 V=1000 seed={seed}"
    else:
        log_probs, lengths = huge_vocab_inputs(seed)
        shape = f"U=3 T=20 V=12000 seed={seed}"
    name = f"{shape} {describe(case)}" + ("" if prefilter else " prefilter off")
    expected = ctc_prefix_search(log_probs, lengths, options)
    got, launches = emulated(log_probs, lengths, options, prefilter)
    problems, worst = compare(expected, got)
    problems += check_launches(launches, options, log_probs.shape[2], prefilter=prefilter)
    kernels = "+".join(n for n in dict.fromkeys(launches) if n.startswith("ctc_"))
    return name, problems, f"[{kernels}] max|dscore| {worst:.2g}"


def run_ties(case, spec):
    options = CtcPrefixOptions(**case)
    log_probs, lengths = tie_inputs(options, spec)
    vocab_size = log_probs.shape[2]
    inputs = "test inputs" if spec[0] == "test" else f"seed={spec[1]} levels={spec[2]} spacing={spec[3]:g}"
    name = f"ties U=5 T=14 V={vocab_size} {inputs} {describe(case)}: prefilter vs full scan"
    with_prefilter, launches_on = emulated(log_probs, lengths, options)
    full_scan, launches_off = emulated(log_probs, lengths, options, prefilter=False)
    problems = []
    if exact(with_prefilter) != exact(full_scan):
        for u, (a, b) in enumerate(zip(exact(full_scan), exact(with_prefilter))):
            if a != b:
                problems.append(f"utt {u}: prefilter {b} != full scan {a}")
    problems += check_launches(launches_on, options, vocab_size, prefilter=True)
    problems += check_launches(launches_off, options, vocab_size, prefilter=False)
    info = "bit-exact"
    if vocab_size == 12:  # the numpy reference of the prefilter: how many frames need the full scan
        scans = reference_full_scans(log_probs, lengths, options)
        if options.beam_size > 1 and scans == 0:
            problems.append("the inputs give no tie frame (the reference never falls back to the full scan)")
        info += f"; tie frames in the reference: {scans}"
    return name, problems, info


TRACES = [(3, 4, 2, 50), (5, 8, 1, 300), (2, 8, 8, 700), (1, 1, 1, 3000), (2, 16, 5, 0)]


def run_trace(num_groups, group_size, rows_per_group, steps, grouped=True):
    """trace_paths on the device (trace_emission_groups, or trace_emission_paths when not grouped)
    vs the host trace, on tests/test_emission_tree.py's grouped trees (several chunks of steps)."""
    from gpudecode.search.emission_tree import trace_paths
    from tests.test_emission_tree import grouped_tree

    node, node_parent, node_label, node_frames = grouped_tree(steps, num_groups, group_size, steps)
    rng = np.random.default_rng(1)
    lanes = (np.arange(num_groups)[:, None] * group_size
             + rng.integers(0, group_size, (num_groups, rows_per_group))).reshape(-1)
    num_lanes = num_groups * group_size
    expected = trace_paths(lanes, node, node_parent, node_label, node_frames, num_lanes)
    emulator.launch_log.clear()
    got = trace_paths(*(cupy.asarray(a) for a in (lanes, node, node_parent, node_label)), node_frames, num_lanes,
                      group_size=group_size if grouped else None)
    kernel = "trace_emission_groups" if grouped else "trace_emission_paths"
    problems = [] if list(emulator.launch_log) == [kernel] else [f"launched {list(emulator.launch_log)}, not [{kernel}]"]
    for name, a, b in zip(("labels", "frames", "lengths"), expected, got):
        if not np.array_equal(a, np.asarray(b)):
            problems.append(f"{name} differ from the host trace")
    name = f"trace G={group_size} groups={num_groups} rows/group={rows_per_group} K={steps} via {kernel}"
    return name, problems, f"longest path {int(expected[2].max(initial=0))}"


def run_one(job):
    t0 = time.time()
    try:
        name, problems, info = job[0](*job[1:])
    except Exception as exc:  # an emulation error (deadlock, race, bad argument, ...) or a crash
        name = f"{job[0].__name__}{job[1:]}"
        problems = [f"{type(exc).__name__}: {exc}"]
        info = traceback.format_exc(limit=6)
    if len(problems) > 20:
        problems = problems[:20] + [f"... {len(problems) - 20} more"]
    return name, problems, info, time.time() - t0


def run_isolated(all_jobs, workers, timeout):
    """Each job in a forked child (a crash or a hang of an emulated kernel fails that job only);
    yields (name, problems, info, seconds) in job order."""
    pending = list(enumerate(all_jobs))
    running, done, emitted = {}, {}, 0
    timeouts = 0
    while pending or running:
        while pending and timeouts >= 2:  # something hangs: do not wait for every remaining job
            index, job = pending.pop(0)
            done[index] = (f"{job[0].__name__}{job[1:]}", ["not run: earlier jobs timed out"], "", 0.0)
        while pending and len(running) < workers:
            index, job = pending.pop(0)
            out = tempfile.NamedTemporaryFile(prefix="ctcemu_", delete=False)
            err = tempfile.TemporaryFile()
            pid = os.fork()
            if pid == 0:  # the child
                code = 0
                try:
                    os.dup2(err.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                    pickle.dump(run_one(job), out)
                    out.flush()
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            running[pid] = (index, job, out, err, time.time())
        finished = False
        for pid, (index, job, out, err, started) in list(running.items()):
            got, status = os.waitpid(pid, os.WNOHANG)
            timed_out = not got and time.time() - started > timeout
            if not got and not timed_out:
                continue
            if timed_out:
                timeouts += 1
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            err.seek(0)
            log = err.read().decode(errors="replace").strip()
            err.close()
            out.close()
            try:
                with open(out.name, "rb") as f:
                    result = pickle.load(f)
            except Exception:
                result = None
            os.unlink(out.name)
            if result is None:
                name = f"{job[0].__name__}{job[1:]}"
                why = (f"timed out after {timeout} s (an endless loop?)" if timed_out else
                       f"the worker died ({'signal ' + str(os.WTERMSIG(status)) if os.WIFSIGNALED(status) else 'exit ' + str(os.WEXITSTATUS(status))})")
                crash = [line for line in log.splitlines() if "EMULATED KERNEL CRASH" in line]
                result = (name, [why] + crash[:1], log[-2000:], time.time() - started)
            done[index] = result
            del running[pid]
            finished = True
        while emitted in done:
            yield done.pop(emitted)
            emitted += 1
        if not finished:
            time.sleep(0.01)


def compile_job(family):
    t0 = time.time()
    emulator.compile_source(kernel_source(family))
    return f"compile {family}", [], f"{time.time() - t0:.1f} s"


def jobs():
    out = []
    for seed, bias in SMALL_INPUTS:
        for case in SMALL:
            out.append((run_vs_numpy, "small", case, seed, bias))
    for seed in LARGE_SEEDS:
        for case in LARGE:
            out.append((run_vs_numpy, "large", case, seed))
    for kind, case, seed, *bias in EXTRA:
        out.append((run_vs_numpy, kind, case, seed, *bias))
    for case, spec in TIES:
        out.append((run_ties, case, spec))
    for trace in TRACES:
        out.append((run_trace, *trace))
    out.append((run_trace, 3, 4, 2, 50, False))
    for case in TOP_LABELS:
        out.append((run_top_labels, *case))
    for case in LABEL_STEPS:
        out.append((run_label_step, *case))
    return out


def main():
    t0 = time.time()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(gpudecode.__file__)))
    print(f"repo {repo}", flush=True)
    workers = max(1, min(int(os.environ.get("CTCEMU_JOBS", os.cpu_count() or 2)), 8))
    timeout = float(os.environ.get("CTCEMU_TIMEOUT", 60))
    for name, problems, info, seconds in run_isolated(
            [(compile_job, f) for f in ("ctc_frame", "emission_tree", "top_k", "label_step")], workers, timeout):
        if problems:
            print(f"FAIL  {name}: " + "\n        ".join(problems) + ("\n" + info if info else ""))
            return 2
        print(f"{name} for the emulator: {info}", flush=True)
    failures = 0
    all_jobs = jobs()
    for name, problems, info, seconds in run_isolated(all_jobs, workers, timeout):
        if problems:
            failures += 1
            print(f"FAIL  {name} ({seconds:.1f} s)")
            for p in problems:
                print(f"        {p}")
            if "Traceback" in info:
                print("        " + info.strip()[-1500:].replace("\n", "\n        "))
        else:
            print(f"PASS  {name}  {info} ({seconds:.1f} s)", flush=True)
    print(f"{len(all_jobs) - failures}/{len(all_jobs)} cases passed, {failures} failed, {time.time() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
