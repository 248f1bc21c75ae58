"""Transducer model pieces as the transducer search sees them: prediction networks (stateful,
through a state manager, or stateless with a fixed label context) and the joint network, each
batched over all lanes of a search."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from gpudecode.backend import array_module, to_host
from gpudecode.scorers.base import LaneLayout, UtteranceBatch
from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer
from gpudecode.session import OnnxSession, SessionOptions
from gpudecode.session.graphs import FixedShapeGraphs, GraphOptions
from gpudecode.states.options import StateManagerOptions


def _on_xp(xp, array):
    """``array`` on the run's array module (uploaded or downloaded when a model ran elsewhere)."""
    return to_host(array) if xp is np else xp.asarray(array)


class PredictionNetwork:
    """The prediction network of a transducer, batched over the N lanes of a search.

    Call order: ``begin(layout)``, ``admit(utterances, groups)``, ``ctx = initial_context(groups)``,
    then ``output(ctx)`` [N, P] float32 (on ``layout.xp``) and ``extend(ctx, parents, labels)``
    (lane i continues lane ``parents[i]``; ``labels[i] == -1`` carries the context unchanged), and
    ``release(groups)``. ``extend`` is only called on a context whose ``output`` was taken.
    """

    layout: LaneLayout | None = None

    def begin(self, layout: LaneLayout) -> None:
        self.layout = layout

    def admit(self, utterances: UtteranceBatch, groups) -> None:
        """Per-utterance inputs (none for the usual prediction networks)."""

    def initial_context(self, groups):
        raise NotImplementedError

    def output(self, ctx):
        raise NotImplementedError

    def extend(self, ctx, parents, labels):
        raise NotImplementedError

    def release(self, groups) -> None:
        """The utterances in ``groups`` leave: free their states."""

    def close(self) -> None:
        """Returns held memory."""


class StatefulPredictionNetwork(PredictionNetwork):
    """A stateful ONNX step model (RASR convention: ``token`` [N,1] + state variables declared by
    ``STATE_`` metadata or patterns) whose output ``prediction`` [N,1,P] or [N,P] is the
    prediction vector; states live in a state manager (``lstm``, ``lstm-cpu``, ``lstm-cuda``).

    Driven by an :class:`~gpudecode.scorers.onnx_decoder.OnnxDecoderScorer` (the output read
    as-is), so merge/split, slot reference counting and ``max_batch_size`` chunks are the LM's.
    ``start_label`` (default: ``blank``) is fed first; ``graphs``: the decoder's CUDA graphs (with
    ``auto``, its dense steps captured).
    """

    def __init__(self, *, model, blank: int = 0, start_label: int | None = None,
                 state_manager: StateManagerOptions = StateManagerOptions(type="lstm"),
                 session_options: SessionOptions = SessionOptions(), io_map: Mapping[str, str] | None = None,
                 max_batch_size: int | None = None, state_patterns: Sequence[tuple[str, str]] = (),
                 graphs: GraphOptions = GraphOptions()) -> None:
        io_map = {"scores": "prediction", **dict(io_map or {})}
        if graphs.enabled:
            session_options = replace(session_options, cuda_graphs=True)
        session = model if isinstance(model, OnnxSession) else OnnxSession(model, session_options)
        output = session.tensors.output(io_map["scores"])
        if output is None:
            raise ValueError(f"{session.source}: the prediction network has no output '{io_map['scores']}'; "
                             f"its outputs are {session.output_names} (map it with io_map={{'scores': ...}})")
        size = output.shape[-1]
        self.output_size = size if isinstance(size, int) else None
        self.decoder = OnnxDecoderScorer(
            model=session, vocab_size=self.output_size or 0, start_labels=[blank if start_label is None else start_label],
            state_manager=state_manager, io_map=io_map, scores_kind="log-probs", max_batch_size=max_batch_size,
            state_patterns=state_patterns, graphs=graphs)

    @property
    def states(self):
        """The state manager (for statistics)."""
        return self.decoder.states

    def begin(self, layout: LaneLayout) -> None:
        super().begin(layout)
        self.decoder.begin(layout)

    def admit(self, utterances: UtteranceBatch, groups) -> None:
        self.decoder.admit(utterances, groups)

    def initial_context(self, groups):
        return self.decoder.initial_context(groups)

    def output(self, ctx):
        return self.decoder.score(ctx)

    def extend(self, ctx, parents, labels):
        return self.decoder.extend(ctx, parents, labels)

    def release(self, groups) -> None:
        self.decoder.release(groups)

    def close(self) -> None:
        self.decoder.close()


class StatelessPredictionNetwork(PredictionNetwork):
    """A prediction network on a fixed label context: input ``labels`` [N, k] int (the last k
    labels, oldest first, padded with ``blank``) -> ``prediction`` [N, P] (or [N, 1, P]).

    The context is one int array [N, k] on the run's array module; no states.
    """

    def __init__(self, *, model, blank: int = 0, context_size: int | None = None,
                 session_options: SessionOptions = SessionOptions(),
                 io_map: Mapping[str, str] | None = None) -> None:
        io_map = dict(io_map or {})
        self.session = model if isinstance(model, OnnxSession) else OnnxSession(model, session_options)
        self.input_name = io_map.get("labels", "labels")
        self.output_name = io_map.get("prediction", "prediction")
        info = self.session.tensors.input(self.input_name)
        if info is None or info.rank != 2:
            raise ValueError(f"{self.session.source}: expected an input '{self.input_name}' [N, k] of label "
                             f"indices; the model's inputs are {self.session.input_names}")
        if self.session.tensors.output(self.output_name) is None:
            raise ValueError(f"{self.session.source}: no output '{self.output_name}'; the model's outputs are "
                             f"{self.session.output_names}")
        declared = info.shape[1]
        if context_size is None:
            if not isinstance(declared, int):
                raise ValueError(f"{self.session.source}: input '{self.input_name}' has a dynamic context axis; "
                                 "give context_size")
            context_size = declared
        elif isinstance(declared, int) and declared != context_size:
            raise ValueError(f"{self.session.source}: input '{self.input_name}' takes {declared} labels, "
                             f"context_size is {context_size}")
        if context_size < 1:
            raise ValueError(f"context_size: expected an int >= 1, got {context_size}")
        self.context_size = int(context_size)
        self.blank = int(blank)
        self._dtype = info.dtype

    def initial_context(self, groups):
        xp = self.layout.xp
        return xp.full((self.layout.num_lanes, self.context_size), self.blank, dtype=np.int64)

    def output(self, ctx):
        xp = self.layout.xp
        result = self.session.run({self.input_name: ctx.astype(self._dtype)}, [self.output_name])
        out = _on_xp(xp, result[self.output_name])
        return out.reshape(out.shape[0], -1, out.shape[-1])[:, -1, :].astype(np.float32, copy=False)

    def extend(self, ctx, parents, labels):
        xp = self.layout.xp
        parents, labels = xp.asarray(parents), xp.asarray(labels)
        carried = ctx[parents]
        shifted = xp.concatenate([carried[:, 1:], xp.maximum(labels, 0)[:, None].astype(np.int64)], axis=1)
        return xp.where((labels >= 0)[:, None], shifted, carried)


class JointNetwork:
    """The joint network: ``encoder-frame`` [N, E] + ``prediction`` [N, P] -> ``log-probs`` [N, V]
    (``scores_kind``: log-probabilities, or ``logits`` that get a log-softmax). One session call."""

    def __init__(self, *, model, session_options: SessionOptions = SessionOptions(),
                 io_map: Mapping[str, str] | None = None, scores_kind: str = "log-probs",
                 graphs: GraphOptions = GraphOptions()) -> None:
        if scores_kind not in ("log-probs", "logits"):
            raise ValueError(f"scores_kind: expected 'log-probs' or 'logits', got {scores_kind!r}")
        io_map = dict(io_map or {})
        if graphs.enabled:
            session_options = replace(session_options, cuda_graphs=True)
        self.session = model if isinstance(model, OnnxSession) else OnnxSession(model, session_options)
        #: with graphs: each lane count's run captured (the inputs copied into bound buffers; the
        #: scores a view of a shared buffer, valid until the next call)
        self.graphs = FixedShapeGraphs(self.session) if graphs.enabled else None
        self.names = {k: io_map.get(k, k) for k in ("encoder-frame", "prediction", "log-probs")}
        for kind, key in (("input", "encoder-frame"), ("input", "prediction"), ("output", "log-probs")):
            found = (self.session.tensors.input if kind == "input" else self.session.tensors.output)(self.names[key])
            if found is None:
                raise ValueError(f"{self.session.source}: the joint network has no {kind} '{self.names[key]}' "
                                 f"(logical '{key}'; map it with io_map)")
        self.scores_kind = scores_kind
        self._dtypes = {k: self.session.tensors.input(self.names[k]).dtype for k in ("encoder-frame", "prediction")}
        last = self.session.tensors.output(self.names["log-probs"]).shape[-1]
        self.vocab_size = last if isinstance(last, int) else None

    def __call__(self, encoder_frames, prediction):
        names = self.names
        feeds = {names["encoder-frame"]: encoder_frames.astype(self._dtypes["encoder-frame"], copy=False),
                 names["prediction"]: prediction.astype(self._dtypes["prediction"], copy=False)}
        run = self.session.run if self.graphs is None else self.graphs.run
        result = run(feeds, [names["log-probs"]])[names["log-probs"]]
        if self.scores_kind == "logits":
            xp = array_module(self.session.provider)
            scores = xp.asarray(result).astype(np.float32)
            shifted = scores - scores.max(axis=-1, keepdims=True)
            return shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
        return result

    def close(self) -> None:
        """Returns the graphs' buffers."""
        if self.graphs is not None:
            self.graphs.close()


