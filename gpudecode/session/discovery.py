"""Recognises a model's convention, state variables and per-utterance inputs, and validates them.

Logical names (docs/user-guide.md, "Your own models") are mapped to a model's own names by ``io_map`` (logical -> model).
Every problem is a :class:`ModelError` naming the model file, the tensor, expected vs actual.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from gpudecode.session.tensors import ModelTensors, TensorInfo
from gpudecode.spec import StateVariable

STATE_PREFIX = "STATE_"
UTTERANCE_PREFIX = "UTTERANCE_"
#: Metadata key: the per-utterance inputs have one row per ``lane`` (default) or per ``utterance``.
UTTERANCE_ROWS_KEY = "PER_UTTERANCE_ROWS"
HISTORY_ALIGNMENT_KEY = "HISTORY_ALIGNMENT"  # "right" (RASR, the default) or "left"
#: Metadata ``IN_PLACE_<output>`` = ``<state input>``: the model writes that output into the state
#: input's own buffer (ONNX Runtime's GroupQueryAttention with a shared past/present buffer: the
#: new step lands at position prefix-length of the left-aligned past, so T leaves room for it).
IN_PLACE_PREFIX = "IN_PLACE_"
#: Metadata key: the label positions the model has (e.g. learned position embeddings); a search
#: whose labels (prompt included) could need more is refused at load.
MAX_POSITIONS_KEY = "max_positions"
UTTERANCE_ROWS = ("lane", "utterance")

# (input regex, output template): the Hugging Face / Optimum decoder-with-past names.
DEFAULT_STATE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"past_key_values\.(\d+)\.decoder\.(key|value)", r"present.\1.decoder.\2"),
    (r"past_key_values\.(\d+)\.(key|value)", r"present.\1.\2"),
)
DEFAULT_UTTERANCE_PATTERNS: tuple[str, ...] = (
    r"past_key_values\.\d+\.encoder\.(key|value)",
    r"encoder_attention_mask",
    r"encoder_hidden_states",
    r"encoder-states",
    r"encoder-states-size",
)

RASR_INPUTS = ("token", "token-length", "prefix-length")
HF_INPUTS = ("input_ids", "attention_mask", "position_ids", "seqlens_k", "total_sequence_length", "use_cache_branch")
#: explicit GroupQueryAttention lengths: [N] int32 (valid positions - 1) and a scalar int32 (T + 1)
HF_LENGTH_INPUTS = ("seqlens_k", "total_sequence_length")
#: Optimum's merged decoder (``decoder_model_merged``): a [1] bool choosing its branch, False on a
#: prompt run with empty pasts (the ``decoder_model`` graph), True on a step (``decoder_with_past_model``)
HF_BRANCH_INPUT = "use_cache_branch"
SCORE_OUTPUTS = {"rasr": "scores", "huggingface": "logits"}
INT_TYPES = (np.dtype(np.int32), np.dtype(np.int64))
FLOAT_TYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype("V2"))


class ModelError(ValueError):
    """A model does not match what the configuration or the conventions expect."""


@dataclass(frozen=True)
class UtteranceInput:
    """A per-utterance input: written once when an utterance is admitted, constant during search.

    ``source`` names the encoder (or initializer) output it comes from, when the model says so.
    """

    name: str
    dtype: np.dtype
    shape: tuple
    source: str | None
    time_axis: int | None


@dataclass(frozen=True)
class ModelSpec:
    """What a stateful step model takes and gives, in logical terms."""

    source: str
    convention: str  # "rasr" or "huggingface"
    tensors: ModelTensors
    hypothesis_inputs: dict[str, str]  # logical name -> model input name
    state_variables: tuple[StateVariable, ...]
    utterance_inputs: tuple[UtteranceInput, ...]
    scores_output: str
    #: "lane": per-utterance inputs have a row per hypothesis row (repeated over the beam);
    #: "utterance": one row per utterance, and the N hypothesis rows are that many equal groups
    #: of consecutive rows (the model attends each group to its utterance's row).
    utterance_rows: str = "lane"
    #: "right": each row's history ends at the last time position (RASR); "left": it starts at the
    #: first, and the model reads only prefix-length positions (metadata HISTORY_ALIGNMENT).
    history_alignment: str = "right"
    #: output -> state input whose buffer it is written into (metadata ``IN_PLACE_<output>``)
    in_place_outputs: Mapping[str, str] = field(default_factory=dict)
    #: symbolic non-time state dimensions and the sizes they were resolved to (``state_dims``)
    resolved_dims: Mapping[str, int] = field(default_factory=dict)
    #: the most past positions a step may have (the model's context less the new step), if known
    max_time: int | None = None
    #: whether padded frames of the per-utterance inputs are masked (``encoder-states-size`` or
    #: ``encoder_attention_mask``); False only for an encoder that gives every utterance the same
    #: frames (``fixed_frames``): the lane buffers then keep the frames unpadded
    masked_frames: bool = True

    @property
    def vocab_size(self) -> int | None:
        """The static last dimension of the score output, if declared."""
        last = self.tensors.output(self.scores_output).shape[-1]
        return last if isinstance(last, int) else None


@dataclass(frozen=True)
class EncoderLayout:
    """How an encoder takes its features (``models.encoder.layout``).

    ``channels_first``: ``features`` is [U, F, T] (Whisper, NeMo) instead of [U, T, F];
    ``fixed_frames``: every utterance has exactly that many feature frames (Whisper: 3000, its
    front end pads or cuts to 30 s); ``lengths``: ``inputs`` (``features-size`` in,
    ``encoder-states-size`` out) or ``none`` (no lengths: every utterance's encoder states are the
    whole output, all frames attended to, as Whisper's cross-attention does).
    """

    channels_first: bool = False
    fixed_frames: int | None = None
    lengths: str = "inputs"


#: Hugging Face / Optimum encoder names (``encoder_model.onnx``): ``input_features`` [N, F, T] with
#: static F and T, no lengths, output ``last_hidden_state`` — Whisper's layout, recognised by name.
HF_ENCODER_NAMES = {"features": "input_features", "encoder-states": "last_hidden_state"}


@dataclass(frozen=True)
class EncoderSpec:
    """An encoder: ``features`` [U,T,F] + ``features-size`` [U] -> ``encoder-states`` + sizes; or
    another :class:`EncoderLayout` (channels first, fixed length, no lengths)."""

    source: str
    tensors: ModelTensors
    names: dict[str, str]  # logical -> model name
    extra_outputs: tuple[str, ...]  # e.g. precomputed cross-attention keys/values
    layout: EncoderLayout = EncoderLayout()

    @property
    def num_features(self) -> int | None:
        shape = self.tensors.input(self.names["features"]).shape
        size = shape[1] if self.layout.channels_first else shape[-1]
        return size if isinstance(size, int) else None

    @property
    def has_lengths(self) -> bool:
        return self.layout.lengths != "none"


def _fail(tensors: ModelTensors, message: str) -> ModelError:
    return ModelError(f"{tensors.source}: {message}")


def _names(items: Sequence[TensorInfo]) -> str:
    return ", ".join(f"'{t.name}' {t.describe()}" for t in items)


def _require(tensors: ModelTensors, kind: str, name: str, logical: str) -> TensorInfo:
    found = tensors.input(name) if kind == "input" else tensors.output(name)
    if found is None:
        declared = tensors.inputs if kind == "input" else tensors.outputs
        mapped = "" if name == logical else f" (io_map: {logical} -> {name})"
        raise _fail(tensors, f"no {kind} '{name}'{mapped}; the model's {kind}s are {_names(declared)}")
    return found


def _check(tensors: ModelTensors, info: TensorInfo, *, dtypes, ranks, what: str) -> None:
    if info.dtype not in dtypes:
        expected = " or ".join(d.name if d.kind != "V" else "bfloat16" for d in dtypes)
        raise _fail(tensors, f"{what} '{info.name}': expected dtype {expected}, got {info.dtype.name}")
    if info.rank not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise _fail(
            tensors, f"{what} '{info.name}': expected rank {expected}, got rank {info.rank} {info.describe()}"
        )


def _state_pairs(
    tensors: ModelTensors, patterns: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    pairs = [
        (key[len(STATE_PREFIX):], value)
        for key, value in tensors.metadata.items()
        if key.startswith(STATE_PREFIX)
    ]
    claimed = {i for i, _ in pairs}
    for info in tensors.inputs:
        if info.name in claimed:
            continue
        for regex, template in patterns:
            match = re.fullmatch(regex, info.name)
            if match:
                pairs.append((info.name, match.expand(template)))
                claimed.add(info.name)
                break
    return pairs


def _batch_symbol(label_input: TensorInfo) -> object:
    return label_input.shape[0] if label_input.rank else None


def _state_variable(
    tensors: ModelTensors, input_name: str, output_name: str, batch_symbol: object,
    state_dims: Mapping[str, int] | None = None, resolved: dict | None = None,
) -> StateVariable:
    info = tensors.input(input_name)
    if info is None:
        raise _fail(tensors, f"state variable '{input_name}' -> '{output_name}' names no input of the model")
    out = tensors.output(output_name)
    if out is None:
        raise _fail(
            tensors,
            f"state input '{input_name}' has no output '{output_name}'; "
            f"the model's outputs are {_names(tensors.outputs)}",
        )
    if out.dtype != info.dtype:
        raise _fail(
            tensors,
            f"state output '{output_name}': expected dtype {info.dtype.name} (as input '{input_name}'), "
            f"got {out.dtype.name}",
        )
    if out.rank != info.rank:
        raise _fail(
            tensors,
            f"state output '{output_name}': expected rank {info.rank} (as input '{input_name}'), "
            f"got rank {out.rank} {out.describe()}",
        )
    if info.dtype not in FLOAT_TYPES + (np.dtype(np.int16), np.dtype(np.int8)):
        raise _fail(tensors, f"state input '{input_name}': expected a float or int16/int8 dtype, got {info.dtype.name}")
    batch_axis = info.shape.index(batch_symbol) if batch_symbol in info.shape and isinstance(batch_symbol, str) else 0
    shape = list(info.shape)
    state_dims = dict(state_dims or {})
    for axis, d in enumerate(shape):  # symbolic non-time dims resolved (head size, key-value heads)
        if axis != batch_axis and isinstance(d, str) and d in state_dims:
            shape[axis] = int(state_dims[d])
            if resolved is not None:
                resolved[d] = int(state_dims[d])
    dynamic = [a for a, d in enumerate(shape) if a != batch_axis and not isinstance(d, int)]
    if len(dynamic) > 1:
        # the time axis is the one whose size differs between past and present (past_sequence_length
        # -> total_sequence_length); the others must be resolved
        growing = [a for a in dynamic if a < out.rank and out.shape[a] != info.shape[a]]
        unresolved = [a for a in dynamic if a not in growing] if len(growing) == 1 else dynamic
        named = ", ".join(f"'{info.shape[a]}' (axis {a})" for a in unresolved)
        raise _fail(
            tensors,
            f"state input '{input_name}' {info.describe()}: expected at most one dynamic axis besides "
            f"the batch axis {batch_axis} (the time axis), got axes {dynamic}"
            + (f"; the time axis is {growing[0]} (it grows from input to output '{output_name}'), and "
               f"{named} is symbolic: resolve it with a genai_config.json next to the model (head_size, "
               "num_key_value_heads), from a GroupQueryAttention graph, or with state_dims"
               if len(growing) == 1 else ""),
        )
    return StateVariable(
        input_name=input_name,
        output_name=output_name,
        dtype=info.dtype,
        shape=tuple(d if isinstance(d, int) else None for d in shape),
        batch_axis=batch_axis,
        time_axis=dynamic[0] if dynamic else None,
    )


def _utterance_input(tensors: ModelTensors, info: TensorInfo, source: str | None, batch_symbol) -> UtteranceInput:
    batch_axis = info.shape.index(batch_symbol) if isinstance(batch_symbol, str) and batch_symbol in info.shape else 0
    dynamic = [a for a, d in enumerate(info.shape) if a != batch_axis and not isinstance(d, int)]
    return UtteranceInput(info.name, info.dtype, info.shape, source, dynamic[0] if dynamic else None)


def discover_step_model(
    tensors: ModelTensors,
    *,
    io_map: Mapping[str, str] | None = None,
    state_patterns: Sequence[tuple[str, str]] = (),
    utterance_patterns: Sequence[str] = (),
    vocab_size: int | None = None,
    state_dims: Mapping[str, int] | None = None,
    history_alignment: str | None = None,
    fixed_frames: bool = False,
) -> ModelSpec:
    """Recognise and validate a stateful step model (RASR or Hugging Face convention).

    ``state_patterns`` (input regex, output template) and ``utterance_patterns`` (input regex)
    add to the metadata (``STATE_*``, ``UTTERANCE_*``) and the Hugging Face defaults.
    ``state_dims`` (symbol -> size) resolves symbolic non-time state dimensions, e.g. GenAI's
    ``kv_cache_dim``. ``history_alignment`` (``right`` or ``left``) overrides the metadata's
    (``HISTORY_ALIGNMENT``); a model with ``seqlens_k`` / ``total_sequence_length`` inputs is left-aligned.
    ``fixed_frames``: the encoder gives every utterance the same number of frames (no lengths, as
    Whisper's), so per-utterance inputs without a mask are accepted (never padded).
    """
    io_map = dict(io_map or {})
    name = lambda logical: io_map.get(logical, logical)  # noqa: E731
    if tensors.input(name("token")) is not None:
        convention, logical_inputs = "rasr", RASR_INPUTS
    elif tensors.input(name("input_ids")) is not None:
        convention, logical_inputs = "huggingface", HF_INPUTS
    else:
        raise _fail(
            tensors,
            f"no label input: expected '{name('token')}' (RASR convention) or '{name('input_ids')}' "
            f"(Hugging Face convention); the model's inputs are {_names(tensors.inputs)}; "
            "map yours with io_map",
        )
    label_input = tensors.input(name(logical_inputs[0]))
    _check(tensors, label_input, dtypes=INT_TYPES, ranks=(2,), what="label input")
    hypothesis_inputs = {logical_inputs[0]: label_input.name}
    for logical in logical_inputs[1:]:
        info = tensors.input(name(logical))
        if info is None:
            continue  # checked below once the state variables are known
        rank = {"attention_mask": (2,), "position_ids": (2,), "total_sequence_length": (0, 1),
                HF_BRANCH_INPUT: (0, 1)}.get(logical, (1,))
        dtypes = ((np.dtype(np.int32),) if logical in HF_LENGTH_INPUTS
                  else (np.dtype(np.bool_),) if logical == HF_BRANCH_INPUT else INT_TYPES)
        _check(tensors, info, dtypes=dtypes, ranks=rank, what="input")
        hypothesis_inputs[logical] = info.name

    scores = _require(tensors, "output", name(SCORE_OUTPUTS[convention]), SCORE_OUTPUTS[convention])
    _check(tensors, scores, dtypes=FLOAT_TYPES, ranks=(2, 3), what="score output")

    batch_symbol = _batch_symbol(label_input)
    pairs = _state_pairs(tensors, list(state_patterns) + list(DEFAULT_STATE_PATTERNS))
    resolved: dict[str, int] = {}
    state_variables = tuple(_state_variable(tensors, i, o, batch_symbol, state_dims, resolved) for i, o in pairs)

    if convention == "rasr" and "prefix-length" not in hypothesis_inputs and any(
        v.time_axis is not None for v in state_variables
    ):
        _require(tensors, "input", name("prefix-length"), "prefix-length")  # raises

    sources = {
        key[len(UTTERANCE_PREFIX):]: value
        for key, value in tensors.metadata.items()
        if key.startswith(UTTERANCE_PREFIX)
    }
    patterns = list(utterance_patterns) + list(DEFAULT_UTTERANCE_PATTERNS) + [
        re.escape(name("encoder-states")), re.escape(name("encoder-states-size"))
    ]
    taken = set(hypothesis_inputs.values()) | {v.input_name for v in state_variables}
    utterance_inputs = []
    for info in tensors.inputs:
        if info.name in taken:
            continue
        if info.name in sources or any(re.fullmatch(p, info.name) for p in patterns):
            utterance_inputs.append(_utterance_input(tensors, info, sources.get(info.name), batch_symbol))
            continue
        raise _fail(
            tensors,
            f"input '{info.name}' {info.describe()} is provided by nothing: it is not a "
            f"{convention} input ({', '.join(logical_inputs)}), not a state variable (no "
            f"{STATE_PREFIX}{info.name} metadata or state name pattern) and not a per-utterance "
            f"input ({UTTERANCE_PREFIX}{info.name} metadata or pattern); map it with io_map or the patterns",
        )
    utterance_names = {u.name for u in utterance_inputs}
    masked = any(n in utterance_names for n in (name("encoder-states-size"), "encoder_attention_mask"))
    if utterance_inputs and not masked and not fixed_frames:
        raise _fail(
            tensors,
            f"per-utterance inputs {sorted(utterance_names)} come without '{name('encoder-states-size')}' "
            "(or 'encoder_attention_mask'), so padded encoder frames could not be masked",
        )

    utterance_rows = tensors.metadata.get(UTTERANCE_ROWS_KEY, "lane")
    if utterance_rows not in UTTERANCE_ROWS:
        raise _fail(
            tensors,
            f"metadata {UTTERANCE_ROWS_KEY}={utterance_rows!r}: expected one of {', '.join(UTTERANCE_ROWS)}",
        )
    explicit_lengths = [n for n in HF_LENGTH_INPUTS if n in hypothesis_inputs]
    if history_alignment is None:
        history_alignment = tensors.metadata.get(HISTORY_ALIGNMENT_KEY, "left" if explicit_lengths else "right")
    if history_alignment not in ("right", "left"):
        raise _fail(tensors, f"history alignment {history_alignment!r} (metadata {HISTORY_ALIGNMENT_KEY}): "
                             "expected 'right' or 'left'")
    if explicit_lengths and history_alignment != "left":
        raise _fail(tensors, f"inputs {explicit_lengths} (GroupQueryAttention's lengths: each row's history "
                             "starts at position 0) need left-aligned histories, not right-aligned ones")
    in_place = _in_place_outputs(tensors, state_variables, history_alignment)
    spec = ModelSpec(
        source=tensors.source,
        utterance_rows=utterance_rows,
        history_alignment=history_alignment,
        in_place_outputs=in_place,
        resolved_dims=resolved,
        masked_frames=masked or not utterance_inputs,
        convention=convention,
        tensors=tensors,
        hypothesis_inputs=hypothesis_inputs,
        state_variables=state_variables,
        utterance_inputs=tuple(utterance_inputs),
        scores_output=scores.name,
        max_time=_declared_max_time(tensors),
    )
    if vocab_size is not None and spec.vocab_size is not None and spec.vocab_size != vocab_size:
        raise _fail(
            tensors,
            f"score output '{scores.name}' {scores.describe()}: expected vocabulary size {vocab_size} "
            f"(from the vocabulary), got {spec.vocab_size}",
        )
    return spec


def _declared_max_time(tensors: ModelTensors) -> int | None:
    """The most past positions of a step from the ``max_positions`` metadata (positions - 1), or None."""
    value = tensors.metadata.get(MAX_POSITIONS_KEY)
    if value is None:
        return None
    try:
        positions = int(value)
    except ValueError:
        positions = 0
    if positions < 1:
        raise _fail(tensors, f"metadata {MAX_POSITIONS_KEY}={value!r}: expected a number of positions >= 1")
    return positions - 1


def _in_place_outputs(tensors: ModelTensors, state_variables, history_alignment: str) -> dict[str, str]:
    """The ``IN_PLACE_<output>`` metadata, checked: each names an output of the state input's dtype
    and rank, written into that input's buffer (which needs the left-aligned history)."""
    pairs = {k[len(IN_PLACE_PREFIX):]: v for k, v in tensors.metadata.items() if k.startswith(IN_PLACE_PREFIX)}
    state_inputs = {v.input_name for v in state_variables}
    for output, state_input in pairs.items():
        out, inp = tensors.output(output), tensors.input(state_input)
        if out is None:
            raise _fail(tensors, f"metadata {IN_PLACE_PREFIX}{output}: the model has no output '{output}'")
        if state_input not in state_inputs:
            raise _fail(tensors, f"metadata {IN_PLACE_PREFIX}{output}={state_input!r}: not a state input "
                                 f"({', '.join(sorted(state_inputs))})")
        if out.dtype != inp.dtype or len(out.shape) != len(inp.shape):
            raise _fail(tensors, f"metadata {IN_PLACE_PREFIX}{output}: output {out.describe()} cannot share the "
                                 f"buffer of input '{state_input}' {inp.describe()}")
        if history_alignment != "left":
            raise _fail(tensors, f"metadata {IN_PLACE_PREFIX}{output} needs {HISTORY_ALIGNMENT_KEY}=left (the "
                                 "new step is written after each row's history)")
    return pairs


def discover_encoder(tensors: ModelTensors, *, io_map: Mapping[str, str] | None = None,
                     layout: EncoderLayout | None = None) -> EncoderSpec:
    """Recognise and validate an encoder model. ``layout`` None: the default layout, or Whisper's
    (channels first, fixed frames, no lengths) for a model with Hugging Face's ``input_features``
    and no ``features-size`` input."""
    io_map = dict(io_map or {})
    names = {k: io_map.get(k, k) for k in ("features", "features-size", "encoder-states", "encoder-states-size")}
    hf = tensors.input(HF_ENCODER_NAMES["features"])
    if "features" not in io_map and tensors.input(names["features"]) is None and hf is not None:
        names.update({k: io_map.get(k, v) for k, v in HF_ENCODER_NAMES.items()})  # Optimum's names
        if layout is None and tensors.input(names["features-size"]) is None and hf.rank == 3 \
                and isinstance(hf.shape[2], int):
            layout = EncoderLayout(channels_first=True, fixed_frames=hf.shape[2], lengths="none")
    layout = layout or EncoderLayout()
    if layout.lengths not in ("inputs", "none"):
        raise _fail(tensors, f"encoder layout lengths {layout.lengths!r}: expected 'inputs' or 'none'")
    features = _require(tensors, "input", names["features"], "features")
    _check(tensors, features, dtypes=FLOAT_TYPES, ranks=(3,), what="input")
    time_axis = 2 if layout.channels_first else 1
    declared = features.shape[time_axis]
    if layout.fixed_frames is not None and isinstance(declared, int) and declared != layout.fixed_frames:
        raise _fail(tensors, f"input '{features.name}' {features.describe()}: the layout's fixed_frames is "
                             f"{layout.fixed_frames}, the model's time axis {time_axis} is {declared}")
    if layout.lengths == "none" and layout.fixed_frames is None:
        raise _fail(tensors, "an encoder without lengths (layout lengths: none) needs fixed_frames: features "
                             "of different lengths padded in one batch could not be told apart from speech")
    _check(tensors, _require(tensors, "output", names["encoder-states"], "encoder-states"),
           dtypes=FLOAT_TYPES, ranks=(3,), what="output")
    if layout.lengths == "inputs":
        _check(tensors, _require(tensors, "input", names["features-size"], "features-size"),
               dtypes=INT_TYPES, ranks=(1,), what="input")
        _check(tensors, _require(tensors, "output", names["encoder-states-size"], "encoder-states-size"),
               dtypes=INT_TYPES, ranks=(1,), what="output")
    else:
        names = {k: v for k, v in names.items() if k in ("features", "encoder-states")}
    known = set(names.values())
    extra_inputs = [t for t in tensors.inputs if t.name not in known]
    if extra_inputs:
        raise _fail(tensors, f"encoder input(s) {_names(extra_inputs)} are provided by nothing")
    return EncoderSpec(
        source=tensors.source,
        tensors=tensors,
        names=names,
        extra_outputs=tuple(t.name for t in tensors.outputs if t.name not in known),
        layout=layout,
    )
