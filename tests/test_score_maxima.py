"""``kernels/score_maxima.cu``: the non-finite check's per-step maxima in one launch equal the array
version (``max`` over each group's live lanes, NaN propagating, folded into the maxima so far), for
float32 and float16 scores, NaN, +inf and -inf, with lanes given live, dead or all.

On the CPU the real kernel runs in the kernel emulator (``tools/kernel-emulator``: the CUDA source
compiled as C++ behind a stand-in ``cupy``); on the H200 (``gpu``) with CuPy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpudecode.search.nonfinite import folded_group_maxima, group_maxima

ROOT = Path(__file__).resolve().parent.parent
EMULATOR = ROOT / "tools" / "kernel-emulator"
#: (groups, lanes per group, V, scorers, float16 bits): one lane per group (the transducer's per-lane
#: maxima), a V not a multiple of the block, four scorers (the kernel's most)
CASES = [(3, 4, 37, 2, 0), (5, 1, 300, 1, 1), (2, 8, 513, 3, 2), (4, 2, 20, 4, 0b1010)]


def mismatches(cupy) -> list[str]:
    """The cases where the kernel (through ``folded_group_maxima`` on ``cupy``) differs from the
    array version on numpy."""
    rng = np.random.default_rng(0)
    bad = []
    for groups, size, vocab, num_scorers, half in CASES:
        lanes = groups * size
        arrays = [rng.standard_normal((lanes, vocab)).astype(np.float16 if half >> s & 1 else np.float32)
                  for s in range(num_scorers)]
        arrays[0][1, 3] = np.nan  # a NaN in group 0 (live or not, depending on the draw below)
        arrays[-1][lanes - 1, vocab - 1] = np.inf
        arrays[-1][0, :] = -np.inf
        dead = rng.random(lanes) < 0.3
        previous = rng.standard_normal((num_scorers, groups)).astype(np.float32)
        previous[0, -1] = np.nan  # a NaN seen before stays
        previous[-1, 0] = -np.inf
        for lanes_given in ({"dead": dead}, {"live": ~dead}, {}):
            live = ~dead if lanes_given else None
            want = np.maximum(previous, group_maxima([a.astype(np.float32) for a in arrays], live, groups, np))
            got = folded_group_maxima(cupy.asarray(previous), [cupy.asarray(a) for a in arrays], groups, cupy,
                                      **{k: cupy.asarray(v) for k, v in lanes_given.items()})
            got = np.asarray(got.get() if hasattr(got, "get") else got)
            if not np.array_equal(want, got, equal_nan=True):
                bad.append(f"{(groups, size, vocab, num_scorers, half)} {sorted(lanes_given)}: {want} != {got}")
    return bad


def test_the_cases_hold_nan_inf_and_dead_lanes():
    """The oracle sees what the kernel must get right: NaN, +inf and -inf maxima, dead lanes."""
    rng = np.random.default_rng(0)
    groups, size, vocab, num_scorers, _ = CASES[0]
    arrays = [rng.standard_normal((groups * size, vocab)).astype(np.float32) for _ in range(num_scorers)]
    arrays[0][1, 3] = np.nan
    assert np.isnan(group_maxima(arrays, None, groups, np)[0, 0])
    dead = np.zeros(groups * size, bool)
    dead[1] = True
    assert not np.isnan(folded_group_maxima(np.full((num_scorers, groups), -np.inf, np.float32), arrays, groups,
                                            np, dead=dead)[0, 0])


@pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel emulator compiles with g++")
def test_the_kernel_folds_like_the_array_version_in_emulation():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(EMULATOR / "fakecupy"), str(EMULATOR / "emu"), str(ROOT)]), "PYTHONDONTWRITEBYTECODE": "1"}
    code = "import cupy; from tests.test_score_maxima import mismatches; bad = mismatches(cupy); print(bad); " \
           "raise SystemExit(1 if bad else 0)"
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=EMULATOR, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.gpu
def test_the_kernel_folds_like_the_array_version_on_cuda():
    cupy = pytest.importorskip("cupy")
    assert mismatches(cupy) == []
