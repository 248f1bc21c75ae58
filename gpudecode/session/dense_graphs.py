"""``DenseStepGraphs``: a dense recurrent step (``gpudecode.states.dense``) captured in CUDA graphs.

A dense step always runs the same N lanes, so its inputs and outputs can live at fixed addresses
and the step can be replayed as a CUDA graph (ONNX Runtime's ``gpu_graph_id``) instead of bound
and launched node by node. The states alternate between two sets of input buffers (ping-pong):
a step reads set p and its children (``DenseRecurrentStates.children``) are written straight into
set 1 - p, the next step's inputs, so no state is copied into a graph's buffers. The outputs (the
scores and the new states) are one set shared by both graphs. A graph per (N, set).

A context that lives in a set is valid until that set is written again: every write bumps the
set's serial, and a step fed a context whose serial is old raises (never a silently wrong state).
On the CPU (tests) the same buffers run through plain runs (:class:`PaddedRuns`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gpudecode.session.graphs import CapturedRuns
from gpudecode.states.layout import VariableLayout


class StaleDenseStates(RuntimeError):
    """A dense context whose buffers were written since it was made (a search bug)."""


class DenseStepGraphs(CapturedRuns):
    """The captured dense steps of one recurrent step model.

    ``run(states, labels, version)`` places the states (a copy only when they are not already one
    of the two input sets) and labels, replays the graph of their set and returns (raw scores, new
    states by state input name, the version of the placed states); ``targets(version)`` gives the
    other set's state buffers and label column for the children, and the version they get.
    """

    def __init__(self, session, spec, layouts: Sequence[VariableLayout], xp, label_name: str, label_dtype):
        super().__init__(session)
        self.session, self.spec, self.xp = session, spec, xp
        self.layouts = tuple(layouts)
        self.label_name, self.label_dtype = label_name, np.dtype(label_dtype)
        self._lanes = -1
        self._sets: list[dict] = []  # per set: state input name -> buffer, plus the label column
        self._label_views: list = [None, None]
        self._serials = [0, 0]
        names = spec.hypothesis_inputs
        self._length_name = names.get("token-length")
        self._output_names = [spec.scores_output, *(v.output_name for v in spec.state_variables)]

    def _prepare(self, num_lanes: int) -> None:
        """The two input sets (and the token-length ones) for ``num_lanes`` lanes."""
        if num_lanes == self._lanes and self._generation == self.buffers.generation:
            return
        sets = []
        for index in range(2):
            feeds = {layout.name: self.buffers.view(f"in{index}:{layout.name}", layout.model_dtype,
                                                   layout.tensor_shape(num_lanes)) for layout in self.layouts}
            feeds[self.label_name] = self.buffers.view(f"in{index}:{self.label_name}", self.label_dtype,
                                                       (num_lanes, 1))
            sets.append(feeds)
        if self._length_name is not None:
            info = self.session.tensors.input(self._length_name)
            ones = self.buffers.view(f"in:{self._length_name}", info.dtype, (num_lanes,))
            ones[...] = 1
            for feeds in sets:
                feeds[self._length_name] = ones
        self._sets, self._lanes, self._serials = sets, num_lanes, [self._serials[0] + 1, self._serials[1] + 1]
        # [N] int64 views of the label columns, which the children write (None: another dtype)
        self._label_views = [feeds[self.label_name].reshape(-1) if self.label_dtype == np.int64 else None
                             for feeds in sets]
        self._generation = self.buffers.generation

    _generation = -1

    def _set_of(self, states: Mapping) -> int | None:
        """The input set ``states`` are (the same arrays), or None."""
        first = self.layouts[0].name if self.layouts else None
        for index, feeds in enumerate(self._sets):
            if first is not None and states.get(first) is feeds[first]:
                return index
        return None

    def run(self, states: Mapping, labels, version):
        """One captured step of the lanes' ``states`` fed ``labels`` ([N] int64): (raw scores, new
        states by state input name, the placed states' version, the placed states)."""
        num_lanes = int(labels.shape[0])
        self._prepare(num_lanes)
        index = self._set_of(states)
        if index is None:  # states made elsewhere (the start, a reset): copied into a set
            index = 0 if version is None else 1 - version[0]
            self._serials[index] += 1
            for layout in self.layouts:
                self._sets[index][layout.name][...] = states[layout.name]
        elif version != (index, self._serials[index]):
            raise StaleDenseStates(f"{self.spec.source}: a dense context was fed after its state buffers "
                                   f"were written again (version {version}, set {index} is at "
                                   f"{self._serials[index]})")
        feeds = self._sets[index]
        if labels is not self._label_views[index]:  # else the children wrote them in place
            feeds[self.label_name][:, 0] = labels
        outputs = self.runs.run((num_lanes, index), feeds, self._output_names, self._output_buffer)
        new_states = {v.input_name: outputs[v.output_name] for v in self.spec.state_variables}
        placed = {layout.name: feeds[layout.name] for layout in self.layouts}
        return outputs[self.spec.scores_output], new_states, (index, self._serials[index]), placed

    def targets(self, version) -> tuple[dict, object | None, tuple]:
        """(state buffers, [N] int64 label column or None, version) that the children of the
        states of ``version`` are written into: the other input set."""
        target = 1 - version[0]
        self._serials[target] += 1
        feeds = self._sets[target]
        next_out = self._label_views[target]
        return ({layout.name: feeds[layout.name] for layout in self.layouts}, next_out,
                (target, self._serials[target]))

    def _output_buffer(self, name: str, dtype, shape: tuple[int, ...]):
        return self.buffers.view(f"out:{name}", dtype, shape)

    def close(self) -> None:
        super().close()
        self._sets, self._lanes = [], -1
