"""The label-scorer interface: one batched call per search step covers every lane.

A search lays its hypotheses out as **lanes**: utterance group ``g`` owns the
``beam_size`` lanes ``g * beam_size .. (g + 1) * beam_size - 1``, N = ``num_groups * beam_size``
lanes in all. A scorer sees all N lanes in every call — there is no per-hypothesis call and no
per-hypothesis Python object. What a scorer keeps about the lanes (the **scoring context**) is
its own business: usually a few device arrays of shape [N, ...], or slot histories into a state
pool. The search only hands contexts back to the scorer that made them.

Call order in one search::

    scorer.begin(layout)                     # once: lane layout and array module
    scorer.admit(utterances, groups)         # utterances enter lane groups (inputs written once)
    ctx = scorer.initial_context(groups)     # first hypothesis of each group; other lanes dead
    loop:  logp = scorer.score(ctx)          # [N, V] log-probabilities (on numpy:
                                             #   scorer.score_lanes(ctx, open_lanes))
           ctx = scorer.extend(ctx, parents, labels)
    scorer.release(groups)                   # utterances leave

Time-synchronous searches (CTC, transducer) use three more methods whose defaults make every
label-synchronous scorer work there unchanged: :meth:`LabelScorer.at_frames` (frame index; the
default ignores it), :meth:`LabelScorer.extend_transitions` (label / blank / loop transitions;
blank and loop carry the context, as an LM expects) and :meth:`LabelScorer.score_candidates`
(partial scoring of pre-beam candidates; the default gathers from :meth:`LabelScorer.score`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from gpudecode.backend import get_array_module, to_host
from gpudecode.session.discovery import ModelError

class ScorerContractError(ModelError):
    """A scorer that does not keep the :class:`LabelScorer` contract (``vocab_size``, the shape
    and dtype of ``score()``); the message names the scorer and its class."""


def describe_scorer(scorer, name: str | None = None) -> str:
    """``scorer 'NAME' (module.Class)`` for error messages."""
    cls = type(scorer)
    return f"scorer {name!r} ({cls.__module__}.{cls.__qualname__})" if name else \
        f"scorer {cls.__module__}.{cls.__qualname__}"


def check_vocab_size(scorer, name: str | None = None, expected: int | None = None) -> int:
    """``scorer.vocab_size`` after construction: present, a positive int and, when ``expected`` is
    given (the vocabulary's size), equal to it; else :class:`ScorerContractError`."""
    who = describe_scorer(scorer, name)
    value = getattr(scorer, "vocab_size", None)
    if value is None:
        raise ScorerContractError(
            f"{who} has no vocab_size after construction: a LabelScorer sets self.vocab_size, the "
            "number of labels (columns) its score() returns")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ScorerContractError(f"{who}: vocab_size must be a positive int, got {value!r}")
    if expected is not None and int(value) != int(expected):
        raise ScorerContractError(f"{who} has vocab_size {int(value)}, but the vocabulary has {int(expected)} "
                                  "labels: its score() columns must be the vocabulary's labels")
    return int(value)


#: A scoring context: whatever a scorer returns from ``initial_context`` / ``extend`` (device
#: arrays over all N lanes). The search never looks inside.
Context = Any


class Transition(enum.IntEnum):
    """How a time-synchronous search moves a hypothesis from one frame to the next."""

    LABEL = 0  # a new label is emitted
    BLANK = 1  # blank: no label
    LOOP = 2  # the last label is repeated (CTC); no new label


@dataclass(frozen=True)
class LaneLayout:
    """The lane layout of one search: ``num_groups`` groups of ``beam_size`` lanes.

    ``xp`` is the array module of the run (numpy or cupy); scores and contexts live there.
    """

    num_groups: int
    beam_size: int
    xp: ModuleType = np

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.beam_size < 1:
            raise ValueError(f"a lane layout needs num_groups >= 1 and beam_size >= 1, "
                             f"got num_groups={self.num_groups}, beam_size={self.beam_size}")

    @property
    def num_lanes(self) -> int:
        """N = num_groups * beam_size."""
        return self.num_groups * self.beam_size

    def lane_groups(self):
        """[N] int64 on ``xp``: the group of every lane (``lane // beam_size``)."""
        return self.xp.arange(self.num_lanes, dtype=np.int64) // self.beam_size

    def first_lanes(self, groups) -> np.ndarray:
        """[G] int64 host array: the first lane of each of ``groups``."""
        return np.asarray(groups, dtype=np.int64) * self.beam_size

    def lanes_of(self, groups) -> np.ndarray:
        """[G * beam_size] int64 host array: every lane of ``groups``, group-major."""
        first = self.first_lanes(groups)
        return (first[:, None] + np.arange(self.beam_size, dtype=np.int64)).reshape(-1)


#: Per-utterance inputs that hold labels (token prompts): they always come with their own sizes.
LABEL_INPUTS = ("prompt",)


@dataclass(frozen=True)
class UtteranceBatch:
    """Utterances entering a search together.

    - ``ids``: U utterance ids (strings);
    - ``input_lengths``: [U] ints, the encoder length of each utterance (frames after
      subsampling); the label-synchronous search caps hypotheses at
      ``max_labels_per_input × input_lengths``. Kept as a host int64 array;
    - ``inputs``: per-utterance inputs by name, each [U, ...] (numpy or CuPy), e.g.
      ``encoder-states`` [U, T, E] or precomputed cross-attention keys/values;
    - ``sizes``: valid lengths [U] per input name along its time axis (padded positions are
      masked). Token prompts (``prompt`` [U, P] label indices, padded at the end) always bring
      theirs; an input without an entry is an encoder output, sized by ``input_lengths`` (see
      :meth:`size_of`).
    """

    ids: Sequence[str]
    input_lengths: Any
    inputs: Mapping[str, Any] = field(default_factory=dict)
    sizes: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = tuple(str(i) for i in self.ids)
        lengths = np.asarray(to_host(self.input_lengths)).astype(np.int64, copy=False)
        if lengths.shape != (len(ids),):
            raise ValueError(f"input_lengths: expected shape ({len(ids)},) for {len(ids)} "
                             f"utterance ids, got {lengths.shape}")
        if (lengths < 0).any():
            raise ValueError(f"input_lengths: negative length for utterance "
                             f"{ids[int(np.argmax(lengths < 0))]!r}")
        for name, array in self.inputs.items():
            if array.shape[:1] != (len(ids),):
                raise ValueError(f"input {name!r}: expected [U={len(ids)}, ...], got shape "
                                 f"{tuple(array.shape)}")
        for name in LABEL_INPUTS:
            if name in self.inputs and name not in self.sizes:
                raise ValueError(f"input {name!r}: token prompts carry their own sizes "
                                 f"(sizes[{name!r}], [U] prompt lengths)")
        for name, array in self.sizes.items():
            if tuple(array.shape) != (len(ids),):
                raise ValueError(f"sizes of {name!r}: expected shape ({len(ids)},), got "
                                 f"{tuple(array.shape)}")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "input_lengths", lengths)
        object.__setattr__(self, "inputs", dict(self.inputs))
        object.__setattr__(self, "sizes", dict(self.sizes))

    @property
    def num_utterances(self) -> int:
        return len(self.ids)

    def size_of(self, name: str):
        """[U] valid lengths of input ``name`` (``sizes[name]``, else ``input_lengths``)."""
        return self.sizes.get(name, self.input_lengths)

    def select(self, indices) -> UtteranceBatch:
        """The utterances at ``indices`` (host ints), in that order, as a new batch."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        on_device = None  # the indices uploaded once for every device input

        def take(array):
            nonlocal on_device
            xp = get_array_module(array)
            if xp is np:
                return array[indices]
            if on_device is None:
                on_device = xp.asarray(indices)
            return xp.take(array, on_device, axis=0)

        return UtteranceBatch(
            ids=[self.ids[i] for i in indices],
            input_lengths=self.input_lengths[indices],
            inputs={k: take(v) for k, v in self.inputs.items()},
            sizes={k: take(v) for k, v in self.sizes.items()},
        )


class LabelScorer:
    """Base class of every label scorer; batched over all N lanes of a search.

    Subclasses set ``vocab_size`` and implement :meth:`initial_context`, :meth:`score` and
    :meth:`extend`; :meth:`admit` and :meth:`release` default to no-ops (scorers without
    per-utterance inputs or states). Shapes: N lanes, V = ``vocab_size``, G admitted groups.
    Index arrays (``parents``, ``labels``) are int64 on the run's array module.
    """

    vocab_size: int
    layout: LaneLayout | None = None
    #: True for scorers too costly to score every label (e.g. CTC prefix scores): a label-
    #: synchronous search then calls :meth:`score_candidates` on the ``pre_beam_size`` best labels
    #: per lane by the other scorers only.
    partial_scoring: bool = False
    #: True where :meth:`score` and :meth:`extend` only queue device work on the current stream on
    #: buffers that outlive a step (no host reads, no synchronisation), so a search may capture a
    #: whole step in a CUDA graph and replay it (``SearchTuning.captured_ctc_frames``; contexts
    #: that :meth:`score` fills in place are snapshotted by the capture).
    capturable: bool = False
    #: Keyword options that name files: given from a config, their relative paths resolve against
    #: the config file's folder (``scorers[i].base_dir``), as every path of a config does.
    path_options: tuple[str, ...] = ()

    # --- lifecycle -----------------------------------------------------------------------------
    def begin(self, layout: LaneLayout) -> None:
        """A search starts with ``layout`` (called once, before any ``admit``).

        Allocate per-lane buffers here (sized ``layout.num_lanes`` / ``layout.num_groups``).
        Overrides should call ``super().begin(layout)``.
        """
        self.layout = layout

    def admit(self, utterances: UtteranceBatch, groups) -> None:
        """Utterance ``i`` of ``utterances`` enters lane group ``groups[i]`` ([U] host ints).

        Per-utterance inputs (``utterances.inputs`` [U, ...] with ``utterances.size_of(name)``)
        are written into per-group buffers here, once; no step copies them again.
        """

    def initial_context(self, groups, ctx: Context | None = None) -> Context:
        """The context of all N lanes, with every lane of ``groups`` reset to the start.

        In each group of ``groups`` the first lane holds the sentence-begin context (after any
        ``start_labels`` — the scorer handles them, the search passes nothing); the other lanes
        of those groups are dead (never selected; anything valid may be kept there). Lanes of
        other groups are taken from ``ctx`` (a running search admitting into freed groups), or
        are dead when ``ctx`` is None.
        """
        raise NotImplementedError

    def score(self, ctx: Context):
        """[N, V] log-probabilities of every next label for every lane (on ``xp``): float32, or
        float16 where the model computes in float16 (the searches convert what they combine).

        Rows of dead lanes may hold anything finite or -inf; they are never used. The array may be
        a buffer that the scorer's next ``score()`` overwrites (a CUDA graph's output): a search
        that keeps scores across calls copies them.
        """
        raise NotImplementedError

    def score_lanes(self, ctx: Context, lanes):
        """:meth:`score` where only the rows ``lanes`` ([R] int64 host array, ascending) must hold
        scores: on numpy the label-synchronous search asks for its open lanes only (every other lane
        is ended: terminated, dead, or of an utterance whose search is over) and reads no other row.

        A scorer may compute just those rows (the model run on R rows); the other rows may hold
        anything finite or -inf, and the contexts of those lanes must stay as they are (their
        children only carry them, label -1). Default: :meth:`score` (every row).
        """
        return self.score(ctx)

    def extend(self, ctx: Context, parents, labels) -> Context:
        """The contexts of the next step's N lanes.

        Lane ``i`` continues lane ``parents[i]`` ([N] int64) with label ``labels[i]`` ([N]
        int64); ``labels[i] == -1`` means: carry the parent's context unchanged (terminated or
        dead lanes). ``ctx`` may be reused or overwritten: the search drops it afterwards.
        """
        raise NotImplementedError

    def release(self, groups) -> None:
        """The utterances in ``groups`` leave the search: free their states."""

    # --- time-synchronous hooks (defaults keep label-synchronous scorers working there) -------
    def at_frames(self, ctx: Context, frames) -> Context:
        """The context for scoring at encoder frame ``frames[i]`` ([N] int64) per lane.

        Frame-independent scorers (LMs, label-synchronous decoders) return ``ctx`` unchanged.
        """
        return ctx

    def extend_transitions(self, ctx: Context, parents, labels, transitions) -> Context:
        """:meth:`extend` with a transition type per lane ([N] int, :class:`Transition`).

        Default: only ``Transition.LABEL`` appends its label; blank and loop transitions carry
        the parent's context unchanged (label -1), which is what a label-context scorer wants.
        """
        xp = get_array_module(labels)
        emitted = xp.where(transitions == int(Transition.LABEL), labels, -1)
        return self.extend(ctx, parents, emitted)

    def score_candidates(self, ctx: Context, candidate_labels):
        """[N, K] log-probabilities of only the labels ``candidate_labels`` ([N, K] int64).

        For pre-beam candidates; the default gathers from :meth:`score`. Scorers that can score
        a subset more cheaply override it.
        """
        xp = get_array_module(candidate_labels)
        return xp.take_along_axis(self.score(ctx), candidate_labels, axis=1)
