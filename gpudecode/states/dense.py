"""Recurrent states kept per lane as dense arrays on the GPU, without the slot pool.

A recurrent model (an LSTM LM, a transducer's stateful prediction network) holds one fixed-size
state per hypothesis. Where such a model runs on CUDA with its states there, the scorer can keep
each state variable as one array in the model's own layout — ``[.., N, ..]``, N lanes along the
model's batch axis — and feed it as it is. A step is then one model run, and the next step's
lanes gather their parents' rows: the new state where the lane was fed a label, the parent's own
where the context is carried. The pool path's merge, split, reference counts and sweeps are left
out; the numbers are the same, as the same rows go through the same model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gpudecode.kernels import kernel_function
from gpudecode.states.layout import VariableLayout

#: The per-row inputs of a recurrent step model besides the label and its states (RASR convention).
_ROW_INPUTS = frozenset({"token", "token-length"})


def dense_states_apply(states, spec, *, graphs: bool, max_batch_size: int | None) -> bool:
    """Whether a step model's states are kept dense (:class:`DenseRecurrentStates`): an ``lstm``
    state manager on CUDA (or anywhere with ``dense_recurrent`` True; never with False) storing the
    model's dtype, a RASR model fed only the label (and its length) besides its states, no
    per-utterance inputs, no CUDA graphs, no ``max_batch_size`` chunks."""
    setting = states.options.dense_recurrent
    on_device = states.device == "cuda" if setting is None else setting
    return (states.family == "lstm" and on_device and not graphs and max_batch_size is None
            and spec.convention == "rasr" and not spec.utterance_inputs and not spec.in_place_outputs
            and set(spec.hypothesis_inputs) <= _ROW_INPUTS
            and all(layout.storage_dtype == layout.model_dtype for layout in states.layouts))


class DenseRecurrentStates:
    """The state variables of ``layouts`` as dense arrays over N lanes, on CuPy ``xp``; a state set
    is a dict input name -> array in the model's input shape with N along the batch axis."""

    def __init__(self, layouts: Sequence[VariableLayout], xp) -> None:
        self.layouts = tuple(layouts)
        self.xp = xp

    def zeros(self, num_lanes: int) -> dict:
        """The start state of ``num_lanes`` lanes (zero, as an empty pool history feeds)."""
        return {layout.name: self.xp.zeros(layout.tensor_shape(num_lanes), dtype=layout.model_dtype)
                for layout in self.layouts}

    def reset(self, states: Mapping, lanes) -> dict:
        """A copy of ``states`` with the lanes ``lanes`` ([R] int64 on ``xp``) back at the start."""
        reset = {}
        for layout in self.layouts:
            array = states[layout.name].copy()
            index = [slice(None)] * array.ndim
            index[layout.variable.batch_axis] = lanes
            array[tuple(index)] = 0
            reset[layout.name] = array
        return reset

    def children(self, states: Mapping, new_states: Mapping, parents, labels, next_labels, *,
                 out: Mapping | None = None, next_out=None) -> tuple[dict, object]:
        """(The child lanes' states, the labels they feed next): lane i's state is its parent
        ``parents[i]``'s new state where it was fed a label (``labels[i] >= 0``), else the parent's
        own; its next label is ``labels[i]`` where fed, else the parent's ``next_labels``
        (``parents``, ``labels``, ``next_labels`` [N] int64 on ``xp``). On CuPy one launch per
        state variable (``kernels/dense_states.cu``) writes into ``out`` / ``next_out`` where given
        (buffers that alias none of the inputs), else into new arrays."""
        xp = self.xp
        if xp is np:
            return self._children_on_host(states, new_states, parents, labels, next_labels, out, next_out)
        children = {}
        if next_out is None:
            next_out = xp.empty_like(next_labels)
        for index, layout in enumerate(self.layouts):
            old, new = states[layout.name], new_states[layout.name]
            target = xp.empty_like(old) if out is None else out[layout.name]
            launch_children(xp, parents, labels, old, new, target, layout.variable.batch_axis,
                            next_labels if index == 0 else None, next_out if index == 0 else None)
            children[layout.name] = target
        if not self.layouts:
            next_out[...] = xp.where(labels >= 0, labels, next_labels[parents])
        return children, next_out

    def _children_on_host(self, states, new_states, parents, labels, next_labels, out, next_out):
        """:meth:`children` in numpy (the oracle of the kernel)."""
        append = labels >= 0
        children = {}
        for layout in self.layouts:
            axis = layout.variable.batch_axis
            old, new = states[layout.name], new_states[layout.name]
            shape = [1] * old.ndim
            shape[axis] = -1
            child = np.where(append.reshape(shape), np.take(new, parents, axis=axis), np.take(old, parents, axis=axis))
            if out is not None:
                out[layout.name][...] = child
                child = out[layout.name]
            children[layout.name] = child
        following = np.where(append, labels, next_labels[parents])
        if next_out is not None:
            next_out[...] = following
            following = next_out
        return children, following


_THREADS = 256  # threads per block of the children launches
_UNITS = (16, 8, 4, 2, 1)  # copy unit bytes of kernels/dense_states.cu, widest first


def launch_children(cupy, parents, labels, old, new, out, batch_axis: int, next_in=None, next_out=None) -> None:
    """One ``dense_children_<unit>`` launch (``kernels/dense_states.cu``): ``out`` [.., N, ..]
    from ``old`` / ``new`` of the same shape and dtype (C-contiguous); with ``next_out`` also the
    child lanes' next labels from ``next_in``."""
    if not (old.shape == new.shape == out.shape and old.dtype == new.dtype == out.dtype):
        raise ValueError(f"dense children: states {old.shape} {old.dtype}, new states {new.shape} {new.dtype} "
                         f"and output {out.shape} {out.dtype} differ")
    if not (old.flags.c_contiguous and new.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("dense children: the state arrays must be C-contiguous")
    if out.data.ptr in (old.data.ptr, new.data.ptr) or (next_out is not None and next_out.data.ptr == next_in.data.ptr):
        raise ValueError("dense children: the output aliases an input (the lanes would read rows already written)")
    num_lanes = int(old.shape[batch_axis])
    pre = int(np.prod(old.shape[:batch_axis], dtype=np.int64))
    row_bytes = int(np.prod(old.shape[batch_axis + 1:], dtype=np.int64)) * old.dtype.itemsize
    addresses = (old.data.ptr, new.data.ptr, out.data.ptr)
    unit = next(u for u in _UNITS if row_bytes % u == 0 and all(a % u == 0 for a in addresses))
    total = pre * num_lanes * (row_bytes // unit)
    blocks = max(1, min(-(-max(total, num_lanes) // _THREADS), 65_535))
    null = np.uint64(0)
    kernel_function("dense_states", f"dense_children_{unit}", old.device.id)((blocks,), (_THREADS,), (
        parents, labels, old, new, out, np.int64(pre), np.int64(num_lanes), np.int64(row_bytes // unit),
        null if next_out is None else next_in, null if next_out is None else next_out))
