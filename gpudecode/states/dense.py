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
        return {layout.name: self.xp.zeros(self._shape(layout, num_lanes), dtype=layout.model_dtype)
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

    def children(self, states: Mapping, new_states: Mapping, parents, append) -> dict:
        """Lane i's state: its parent ``parents[i]``'s new state where ``append[i]``, else the
        parent's own (``parents`` [N] int64, ``append`` [N] bool, both on ``xp``)."""
        xp = self.xp
        children = {}
        for layout in self.layouts:
            axis = layout.variable.batch_axis
            old, new = states[layout.name], new_states[layout.name]
            shape = [1] * old.ndim
            shape[axis] = -1
            children[layout.name] = xp.where(append.reshape(shape), xp.take(new, parents, axis=axis),
                                             xp.take(old, parents, axis=axis))
        return children

    @staticmethod
    def _shape(layout: VariableLayout, num_lanes: int) -> tuple[int, ...]:
        variable = layout.variable
        shape = [int(d) if d is not None else 0 for d in variable.shape]
        shape[variable.batch_axis] = num_lanes
        return tuple(shape)

