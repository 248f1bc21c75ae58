"""The selection of a transducer symbol step without label scorers as one compiled CPU call (numba).

:meth:`gpudecode.search.transducer._TransducerSearch._select` runs a step's selection — stays and
emissions, the merge of lanes that spell the same sequence, the best ``beam`` per utterance and the
new lane state — as ~50 numpy operations. Without label scorers the utterances never interact, so
here one compiled function does it utterance by utterance and lane by lane, as
``kernels/transducer_step.cu`` does on CUDA and ``gpudecode.testing.search_reference.select_reference``
in Python (label paths walked to the end; equal ranks to the lower lane, then the lower label; NaN
ranks as -inf), in the array version's float32 arithmetic, so the n-best lists are the same (the
tests compare them). The prediction and joint networks still run between the steps.

numba is optional (the ``cpu-jit`` extra); without it the search runs its array version.
"""

from __future__ import annotations

import numpy as np

from gpudecode.search.ctc_cpu import available
from gpudecode.search.emission_tree import HASH_MULTIPLIER

#: The lane state taken and returned, in this order (``transducer_step.LANE_STATE``).
LANE_STATE = ("score", "done", "node", "last", "length", "hash", "prev_hash")


def use_loop(xp, num_scorers: int, tuning) -> bool:
    """Whether a transducer step's selection runs compiled: numpy, no scorers, numba importable
    and ``SearchTuning.compiled_cpu_loops`` on."""
    return xp is np and num_scorers == 0 and tuning.compiled_cpu_loops and available()


def _compiled():
    from gpudecode.search import transducer_cpu_jit

    return transducer_cpu_jit.select


def select(logp, state: tuple, node_parent, node_label, base: int, unresolved, options, beam_size: int,
           *, symbol: int, forced: bool) -> tuple[tuple, object, tuple]:
    """A transducer step's selection, compiled (``transducer_step.select_kernel``'s contract on
    numpy arrays): ``logp`` [N, V] the joint's log-probs, ``state`` the lane arrays in
    :data:`LANE_STATE` order, the step's nodes written into ``node_parent`` / ``node_label`` from
    ``base`` on. Returns (the new lane state, ``unresolved`` unchanged (pairs are compared to the
    end), (parents, labels, alive, emitted) [N])."""
    run = _compiled()
    logp = np.ascontiguousarray(logp, dtype=np.float32)
    num_lanes = int(logp.shape[0])
    state = [np.ascontiguousarray(array).copy() for array in state]
    state[1] = state[1].astype(np.bool_, copy=False)
    score, done, node, last, length, hsh, prev_hash = state
    parents = np.empty(num_lanes, dtype=np.int64)
    labels = np.empty(num_lanes, dtype=np.int64)
    alive = np.empty(num_lanes, dtype=bool)
    emitted = np.empty(num_lanes, dtype=bool)
    threshold = options.score_threshold
    run(logp, int(beam_size), int(options.blank), symbol > 0, bool(forced), threshold is not None,
        np.float32(threshold or 0), options.recombination == "max", np.int64(HASH_MULTIPLIER),
        np.int64(options.hash_modulus), score, done, node, last, length, hsh, prev_hash, node_parent, node_label,
        int(base), parents, labels, alive, emitted)
    return tuple(state), unresolved, (parents, labels, alive, emitted)
