"""Why `top[num_top - 2]` -> `top[num_top - 3]` (the prefilter's tie check) cannot be caught by
comparing outputs: in the numpy reference of the prefilter (testing.search_reference.full_frame_reference), the
tie check is replaced by (a) the mutant and (b) no check at all, on many tie-heavy inputs; the
n-best is compared with the full numpy search. Usage: PYTHONPATH=REPO python equivalent_mutant.py"""
import inspect, itertools
import numpy as np
from gpudecode.bench.ctc import random_log_probs
from gpudecode.search import CtcPrefixOptions, ctc_prefix_search
from gpudecode.search import ctc as ctc_module
from gpudecode.testing import search_reference

src = inspect.getsource(search_reference.full_frame_reference)
check = "np.float32(total[i] + x(top[-2])) == np.float32(total[i] + x(top[-1]))"
assert check in src
variants = {}
for name, expr in [("reference", check), ("mutant top[-3]", check.replace("top[-2]", "top[-3]")), ("no tie check", "False")]:
    ns = dict(vars(search_reference))
    exec(src.replace(check, expr).replace("def full_frame_reference", "def variant"), ns)
    variants[name] = ns["variant"]

def nbest(r):
    return [[(h.labels, h.frames) for h in n] for n in r]

def with_reference(fn, num_top, *args):
    original = ctc_module._PrefixSearch._full_frame
    ctc_module._PrefixSearch._full_frame = lambda s, t, e: fn(s, t, e, num_top=num_top)
    try:
        return nbest(ctc_prefix_search(*args))
    finally:
        ctc_module._PrefixSearch._full_frame = original

def tie_inputs(seed, levels, spacing, blank, V=12):
    lp = random_log_probs(np, 5, 14, V, seed=seed, sharpness=2.0, blank_bias=1.0)
    rng = np.random.default_rng(seed + 1)
    near = np.round(lp.max(axis=2, keepdims=True), 0) - np.float32(1.0)
    labels = np.arange(V) != blank
    lp[:, :, labels] = near + rng.integers(0, levels, (5, 14, V))[:, :, labels] * np.float32(spacing)
    return lp

lengths = np.array([14, 9, 1, 12, 0])
for list_len, label in ((lambda b: 9, "kernel list (9 labels, beam <= 4)"), (lambda b: b + 2, "tight list (beam + 2 labels)")):
    differ = dict.fromkeys(variants, 0)
    n = 0
    for seed, levels, spacing, beam, blank in itertools.product(range(4), (2, 3, 5), (1e-7, 2e-7), (2, 3, 4), (0, 3)):
        opt = CtcPrefixOptions(beam_size=beam, blank=blank)
        lp = tie_inputs(seed, levels, spacing, blank)
        full = nbest(ctc_prefix_search(lp, lengths, opt))
        n += 1
        for name, fn in variants.items():
            differ[name] += with_reference(fn, list_len(beam), lp, lengths, opt) != full
    print(f"{label}: of {n} tie inputs, the n-best differs from the full search in " +
          ", ".join(f"{v} with {k}" for k, v in differ.items()), flush=True)
