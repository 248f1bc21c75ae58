"""The selection of a transducer symbol step in one kernel launch (``kernels/transducer_step.cu``).

:meth:`gpudecode.search.transducer._TransducerSearch._select` runs the selection of a step —
stays and emissions, the merge of lanes that spell the same sequence, the best ``beam`` per
utterance and the new lane state — as ~50 array operations. Utterances never interact, so one
thread block per utterance does it in one launch, label scorers' cached terms added to the ranks;
the prediction network and the scorers run between the steps. ``gpudecode.testing.search_reference.select_reference`` is the
selection written utterance by utterance and lane by lane in Python (what each thread block
does), the oracle of the kernel's structure; the tests check it against the array version.
"""

from __future__ import annotations

import numpy as np

from gpudecode.search.emission_tree import HASH_MULTIPLIER


# -- the kernel ------------------------------------------------------------------------------------
MAX_BEAM = 32  # TRANSDUCER_MAX_BEAM of kernels/transducer_step.cu
_THREADS = 256  # TRANSDUCER_THREADS
#: The lane state the kernel takes and returns, in this order (``transducer._TransducerSearch``'s arrays).
LANE_STATE = ("score", "done", "node", "last", "length", "hash", "prev_hash")

def use_kernel(xp, beam_size: int) -> bool:
    """Whether a transducer step's selection can run as ``transducer_select_<K>`` (CuPy, beam <= 32;
    ``SearchTuning.fused_transducer_step`` decides whether it does)."""
    return xp is not np and beam_size <= MAX_BEAM


def select_kernel(logp, state: tuple, node_parent, node_label, base: int, unresolved, options, beam_size: int,
                  *, symbol: int, forced: bool, lm_term=None, lm_total=None) -> tuple[tuple, object, tuple]:
    """A transducer step's selection (``_TransducerSearch._select``) as one launch of
    ``transducer_select_<K>``: a thread block per utterance, on the current stream, no host
    synchronisation.

    ``logp`` [N, V]: the joint's log-probs; ``state``: the lane arrays in :data:`LANE_STATE`
    order; ``node_parent`` and ``node_label`` get the step's nodes from ``base`` on (written in
    place); ``unresolved``: the search's device bool; ``options``: the ``TransducerOptions``;
    ``symbol``: the symbol step within the frame; ``forced``: labels leave the frame; ``lm_term``
    [N, V] and ``lm_total`` [N] (float32, or None without scorers): Σ scale · scorer score of each
    label after each lane / of each lane's sequence, added to the candidates' ranks. Returns
    (the new lane state in :data:`LANE_STATE` order, ``unresolved`` (hash-equal pairs are
    compared to the end, so the kernel never sets it), (parents, labels, alive, emitted) [N])."""
    from gpudecode.backend import get_array_module
    from gpudecode.kernels import kernel_function

    cupy = get_array_module(logp)
    num_lanes = int(logp.shape[0])
    num_utts = num_lanes // beam_size
    logp = cupy.ascontiguousarray(logp, dtype=np.float32)
    vocab_size = int(logp.shape[1])
    state = [cupy.ascontiguousarray(array) for array in state]
    state[1] = state[1].astype(bool, copy=False)
    parents = cupy.empty(num_lanes, dtype=np.int64)
    labels = cupy.empty(num_lanes, dtype=np.int64)
    alive = cupy.empty(num_lanes, dtype=bool)
    emitted = cupy.empty(num_lanes, dtype=bool)
    if unresolved.ndim != 0 or unresolved.dtype != bool:
        unresolved = cupy.asarray(unresolved, dtype=bool).reshape(())
    steps = -1  # the kernel walks hash-equal pairs to the end: it never leaves one undecided
    threshold = options.score_threshold
    kept = next(k for k in (8, 16, 32) if k >= beam_size)  # the kernel's per-thread list
    kernel = kernel_function("transducer_step", f"transducer_select_{kept}", logp.device.id)
    kernel((num_utts,), (_THREADS,), (
        logp, np.int32(vocab_size), np.int32(options.blank), np.int32(beam_size),
        state[0], state[1].view(np.uint8), *state[2:], node_parent, node_label, np.int64(base),
        np.int32(symbol > 0), np.int32(bool(forced)), np.int32(steps), np.int32(threshold is not None),
        np.float32(threshold or 0), np.int32(options.recombination == "max"), np.int64(HASH_MULTIPLIER),
        np.int64(options.hash_modulus), parents, labels, alive.view(np.uint8), emitted.view(np.uint8),
        unresolved.view(np.uint8),
        np.uint64(0) if lm_term is None else cupy.ascontiguousarray(lm_term, dtype=np.float32),
        np.uint64(0) if lm_total is None else cupy.ascontiguousarray(lm_total, dtype=np.float32),
    ))
    return tuple(state), unresolved, (parents, labels, alive, emitted)
