"""``prefix-lm``: a step model whose prompt is run once per utterance by a prefill model.

At admission the **prefill** (initializer) model runs once over the admitted utterances: it takes
the prompt — prompt labels, encoder states, suffix prompt labels, in whatever way the model
combines them — and has no state inputs. It outputs the scores of the first label and one state
output per state variable of the step model (named like the step model's state outputs) over all
prompt positions, packed to the left (row n's positions first, padding after). Its states are
split into one pool slot per prompt position (``token_counts`` per row; host outputs are
uploaded) and become the history of the utterance's lanes, so the prompt length counts into the
history length and the step model's ``prefix-length``. From then on the step model decodes as in
``onnx-decoder``.

The same mechanism runs an Optimum seq2seq export: ``decoder_model`` is the prefill (``input_ids``
= the decoder start labels), its ``present.{i}.encoder.*`` outputs become the step model's
``past_key_values.{i}.encoder.*`` per-utterance inputs, and ``decoder_with_past_model`` is the
step model.

Prefill inputs, by logical name (``prefill_io_map`` maps them to the model's own names):

- ``prompt`` / ``input_ids`` [U, P]: ``initial_prompt_labels`` for every utterance, or the
  utterances' own ``prompt`` input (ragged, with its sizes) when they bring one;
- ``prompt-size`` [U]: prompt lengths; ``suffix`` [U, Q] + ``suffix-size`` [U]:
  ``suffix_prompt_labels``;
- ``encoder-states`` / ``encoder_hidden_states`` [U, S, E] (the utterances' ``encoder-states``),
  ``encoder-states-size`` [U], ``encoder_attention_mask`` [U, S] (built from the sizes);
- anything else: the utterances' input of that name.

**A step model as its own prefill** (``prefill_model`` None: a merged Optimum decoder, an ONNX
Runtime GenAI export — a decoder-only model with past inputs): at admission the prompts go through
the step model itself with empty pasts, right-padded (each row's prompt first: a causal model never
attends to the padding after a position), with ``attention_mask`` / ``position_ids`` (and
``seqlens_k`` / ``total_sequence_length``) from the prompt sizes, and a merged Optimum decoder's
``use_cache_branch`` False (its branch without pasts; True on every step); its present outputs hold
each row's prompt states first. At load a probe requires a short prompt alone and the same prompt padded
in a batch with a longer one to give the same scores and states, else the model is refused.
Optimum's merged Whisper decoder (``decoder_model_merged``: ``use_cache_branch``, no
``attention_mask``) is its own prefill too, without the probe: the prompt run also gets the
utterances' encoder states and empty cross-attention pasts, and outputs the cross-attention pasts
that become the step's per-utterance inputs; its prompts must be of one length (nothing masks padding).

Prefill outputs: ``scores`` (or ``logits``) [U, V], [U, 1, V] or [U, P, V] (then the row's last
prompt position is taken), the step model's state outputs, and optionally ``prefix-length`` [U]
(prompt positions per row; without it a row has as many positions as prompt + suffix labels —
the layout of an encoder–decoder whose encoder states are attended to, not prepended).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpudecode import defaults
from gpudecode.backend import array_module, to_host
from gpudecode.scorers.base import Context, LaneLayout, UtteranceBatch
from gpudecode.scorers.onnx_decoder import DecoderContext, OnnxDecoderScorer, converted_scores
from gpudecode.scorers.registry import register_scorer
from gpudecode.session import ModelError, OnnxSession, SessionOptions, hf_encoder_attention_mask
from gpudecode.session.conventions import resolve_model_path
from gpudecode.session.discovery import HF_BRANCH_INPUT
from gpudecode.session.step_model import hf_prompt_feeds
from gpudecode.session.graphs import GraphOptions
from gpudecode.states.history import StateHistory
from gpudecode.states.options import StateManagerOptions

_LABEL_PROMPTS = ("prompt", "input_ids")
_ENCODER_STATES = ("encoder-states", "encoder_hidden_states")
#: inputs of a decoder-only prefill (Optimum's ``decoder_model``) built from the prompt sizes
_PROMPT_POSITIONS = ("attention_mask", "position_ids")


def _on(xp, array):
    """``array`` on the array module ``xp`` (upload or download)."""
    if xp is np:
        return to_host(array)
    return xp.asarray(array)


def in_state_dtypes(outputs: dict, layouts) -> dict:
    """A prefill's state outputs by name in the step model's state dtypes: a float prefill of another
    float type than the step (the float32 prompt model of a step ``gpudecode prepare --float16``
    rewrote) is converted, once per prompt; anything else is left for the split to check."""
    wanted = {layout.variable.output_name: layout.model_dtype for layout in layouts}
    return {name: array.astype(wanted[name]) if name in wanted and array.dtype != wanted[name]
            and array.dtype.kind == "f" and wanted[name].kind == "f" else array
            for name, array in outputs.items()}


@register_scorer("prefix-lm")
class PrefixLmScorer(OnnxDecoderScorer):
    """A prompted decoder: ``prefill_model`` once per admitted utterance, ``model`` per step.

    ``initial_prompt_labels``: prompt labels before the encoder states (for an Optimum pair: the
    decoder start labels, e.g. ``[decoder_start_token_id]``); ``suffix_prompt_labels``: labels
    after them. ``prefill_session_options`` (default: ``session_options``) may put the prefill on
    another device, e.g. the CPU while the step model runs on the GPU; its outputs are then
    uploaded. ``prefill_scores_kind`` (default: ``scores_kind``) says what the prefill's scores
    are. Other options as :class:`OnnxDecoderScorer`.
    """

    _uses_start_labels = False

    def __init__(
        self,
        *,
        model,
        vocab_size: int,
        prefill_model=None,
        initial_prompt_labels: Sequence[int] = (),
        suffix_prompt_labels: Sequence[int] = (),
        state_manager: StateManagerOptions = StateManagerOptions(),
        session_options: SessionOptions = SessionOptions(),
        prefill_session_options: SessionOptions | None = None,
        io_map: Mapping[str, str] | None = None,
        prefill_io_map: Mapping[str, str] | None = None,
        scores_kind: str = defaults.SCORES_KIND,
        prefill_scores_kind: str | None = None,
        max_batch_size: int | None = None,
        state_patterns: Sequence[tuple[str, str]] = (),
        utterance_patterns: Sequence[str] = (),
        graphs: GraphOptions = GraphOptions(),
        fixed_frames: bool = False,
    ) -> None:
        super().__init__(
            model=model, vocab_size=vocab_size, start_labels=(), state_manager=state_manager,
            session_options=session_options, io_map=io_map, scores_kind=scores_kind,
            max_batch_size=max_batch_size, state_patterns=state_patterns,
            utterance_patterns=utterance_patterns, graphs=graphs, fixed_frames=fixed_frames,
        )
        self.dense = None  # a prompt's prefill writes histories into the pool
        prefill_scores_kind = prefill_scores_kind or scores_kind
        if prefill_scores_kind not in defaults.SCORES_KINDS:
            raise ValueError(f"prefill_scores_kind: expected one of {', '.join(defaults.SCORES_KINDS)}, "
                             f"got {prefill_scores_kind!r}")
        self.prefill_scores_kind = prefill_scores_kind
        self.initial_prompt_labels = [int(label) for label in initial_prompt_labels]
        self.suffix_prompt_labels = [int(label) for label in suffix_prompt_labels]
        #: the step model is its own prefill (empty pasts at admission)
        self.self_prefill = prefill_model is None
        if self.self_prefill:
            self.prefill = self.session
            self._prefill_names = self._check_self_prefill()
        else:
            if isinstance(prefill_model, OnnxSession):
                self.prefill = prefill_model
            else:
                self.prefill = OnnxSession(resolve_model_path(prefill_model),
                                           prefill_session_options or session_options)
            self._prefill_names = self._check_prefill(dict(prefill_io_map or {}))
        outputs = {t.name for t in self.prefill.tensors.outputs}
        #: prefill outputs that become per-utterance inputs of the step model
        self._produced = sorted({self._source_of(u) for u in self.spec.utterance_inputs} & outputs)
        self._pending: list[tuple[np.ndarray, Any, Any]] = []  # (groups, slots [G, W], counts [G])
        self._prefill_scores = None

    # --- the prefill model's contract --------------------------------------------------------------
    def _check_self_prefill(self) -> dict[str, str]:
        """The step model as its prefill: a Hugging Face decoder-only model whose states all have a
        time axis (batch first); proven by :meth:`_probe_self_prefill`."""
        spec, source = self.spec, self.spec.source
        if self.suffix_prompt_labels:
            raise ValueError(f"{source}: suffix_prompt_labels need a prefill model of their own")
        if self._merged_seq2seq:  # Optimum's merged Whisper decoder: never padded, nothing to probe
            return {"scores": spec.scores_output}
        if spec.convention != "huggingface" or spec.utterance_inputs or spec.in_place_outputs or any(
                v.time_axis is None or v.batch_axis != 0 for v in spec.state_variables) or not spec.state_variables:
            raise ValueError(f"{source}: the step model cannot be its own prefill: that needs a Hugging Face "
                             "decoder-only model (input_ids + attention_mask, past_key_values with a time axis, "
                             "no per-utterance inputs); give prefill_model")
        label = self.session.tensors.input(spec.hypothesis_inputs["input_ids"])
        if isinstance(label.shape[1], int):
            raise ValueError(f"{source}: the step model cannot be its own prefill: its input '{label.name}' "
                             f"{label.describe()} takes {label.shape[1]} label(s) per call, not a whole prompt; "
                             "give prefill_model")
        try:
            self._probe_self_prefill()
        except ModelError:
            raise
        except Exception as exc:  # noqa: BLE001 - the model refusing a prompt run is a load error
            raise ModelError(f"{source}: refused as its own prefill: a prompt run with empty pasts fails "
                             f"({str(exc).splitlines()[0][:300]}); give prefill_model") from exc
        return {"scores": spec.scores_output}

    @property
    def _merged_seq2seq(self) -> bool:
        """An Optimum merged sequence-to-sequence decoder (``decoder_model_merged`` of Whisper): the
        step model, with ``use_cache_branch``, no ``attention_mask``, ``encoder_hidden_states`` and
        per-utterance cross-attention pasts that its own prompt run outputs."""
        spec = self.spec
        names = spec.hypothesis_inputs
        outputs = {t.name for t in self.session.tensors.outputs}
        return (spec.convention == "huggingface" and HF_BRANCH_INPUT in names and "attention_mask" not in names
                and bool(spec.state_variables) and not spec.in_place_outputs
                and all(v.time_axis is not None and v.batch_axis == 0 for v in spec.state_variables)
                and any(u.name in _ENCODER_STATES for u in spec.utterance_inputs)
                and all(u.name in _ENCODER_STATES or self._source_of(u) in outputs for u in spec.utterance_inputs))

    def _run_self_prefill(self, prompts: np.ndarray, sizes: np.ndarray, utterances: UtteranceBatch | None = None):
        """The step model over ``prompts`` [U, P] (host labels, right-padded; ``sizes`` [U]) with
        empty pasts: its outputs by name. A merged sequence-to-sequence decoder also gets the
        utterances' encoder states and empty cross-attention pasts, and gives those pasts."""
        spec, xp = self.spec, self._prefill_xp
        names = spec.hypothesis_inputs
        feeds, produced = {}, []
        if spec.utterance_inputs:
            if (sizes != prompts.shape[1]).any():
                raise ValueError(f"{spec.source}: prompts of different lengths {sorted(set(sizes.tolist()))}: the "
                                 "model takes no attention_mask, so its prompt run cannot pad them")
            own = self.io_map.get("encoder-states", "encoder-states")
            if utterances is None or own not in utterances.inputs:
                raise ValueError(f"{spec.source}: the prompt run needs the utterances' '{own}' (an encoder)")
            for u in spec.utterance_inputs:
                info = self.session.tensors.input(u.name)
                if u.name in _ENCODER_STATES:
                    feeds[u.name] = _on(xp, utterances.inputs[own]).astype(info.dtype, copy=False)
                else:  # a cross-attention past the prompt run computes: empty (its branch ignores it)
                    shape = [len(prompts) if a == 0 else (d if isinstance(d, int) else 0)
                             for a, d in enumerate(info.shape)]
                    feeds[u.name] = xp.zeros(shape, dtype=info.dtype)
                    produced.append(self._source_of(u))
        for v in spec.state_variables:
            shape = list(v.shape)
            shape[0], shape[v.time_axis] = len(prompts), 0
            feeds[v.input_name] = xp.zeros(shape, dtype=v.dtype)
        label_dtype = self.session.tensors.input(names["input_ids"]).dtype
        feeds[names["input_ids"]] = xp.asarray(prompts.astype(label_dtype))
        feeds.update(hf_prompt_feeds(spec, self.session.tensors, xp.asarray(sizes.astype(np.int64)), prompts.shape[1]))
        return self.session.run(feeds, [spec.scores_output, *(v.output_name for v in spec.state_variables), *produced])

    def _probe_self_prefill(self) -> None:
        """A prompt of 3 alone and right-padded next to a prompt of 5 must give the same last-position
        scores and prompt states (fp32 1e-4, relative); else ModelError."""
        rng = np.random.default_rng(0)
        short, long = rng.integers(0, self.vocab_size, 3), rng.integers(0, self.vocab_size, 5)
        alone = self._run_self_prefill(short[None, :], np.array([3]))
        batch = np.stack([np.concatenate([short, long[:2]]), long])
        padded = self._run_self_prefill(batch, np.array([3, 5]))
        tolerance = 1e-4 if self.spec.state_variables[0].dtype in (np.float32, np.float64) else 2e-2
        worst = 0.0
        for name in [self.spec.scores_output, *(v.output_name for v in self.spec.state_variables)]:
            a = to_host(alone[name]).astype(np.float64)
            b = to_host(padded[name]).astype(np.float64)
            if name == self.spec.scores_output:
                a, b = a.reshape(1, -1, a.shape[-1])[:, -1], b.reshape(2, -1, b.shape[-1])[:1, 2]
            else:
                axis = next(v.time_axis for v in self.spec.state_variables if v.output_name == name)
                b = np.take(b[:1], np.arange(3), axis=axis)
                if a.shape != b.shape:
                    worst = np.inf
                    continue
            worst = max(worst, float(np.abs(a - b).max() / max(1.0, np.abs(a).max())))
        if not worst <= tolerance:
            raise ModelError(f"{self.spec.source}: refused as its own prefill: a prompt of 3 labels alone and "
                             "the same prompt right-padded in a batch with a prompt of 5 (attention_mask zeros "
                             f"after it) give different scores or states: max difference {worst:.3g} (tolerance "
                             f"{tolerance:.3g}); give a prefill_model")

    def _self_prefill_feeds(self, utterances: UtteranceBatch):
        """The prompts (the utterances' own, else ``initial_prompt_labels``) right-padded, their sizes."""
        num_utts = utterances.num_utterances
        if "prompt" in utterances.inputs:
            prompts = to_host(utterances.inputs["prompt"]).astype(np.int64)
            sizes = to_host(utterances.size_of("prompt")).astype(np.int64)
        else:
            prompts = np.tile(np.asarray(self.initial_prompt_labels, np.int64), (num_utts, 1))
            sizes = np.full(num_utts, len(self.initial_prompt_labels), np.int64)
        if (sizes < 1).any():
            bad = utterances.ids[int(np.argmax(sizes < 1))]
            raise ValueError(f"{self.spec.source}: utterance {bad!r} has an empty prompt (no label to prefill)")
        prompts = prompts[:, :int(sizes.max())].copy()
        prompts[np.arange(prompts.shape[1])[None, :] >= sizes[:, None]] = 0
        return prompts, sizes

    def _check_prefill(self, io_map: dict[str, str]) -> dict[str, str]:
        """Logical name -> prefill tensor name; raises ValueError naming what is missing."""
        tensors, source = self.prefill.tensors, self.prefill.source
        by_model = {io_map.get(k, k): k for k in (
            *_LABEL_PROMPTS, "prompt-size", "suffix", "suffix-size", *_ENCODER_STATES,
            "encoder-states-size", "encoder_attention_mask", "scores", "logits", "prefix-length",
            *_PROMPT_POSITIONS)}
        names = {}
        for info in [*tensors.inputs, *tensors.outputs]:
            if info.name in by_model:
                names[by_model[info.name]] = info.name
        score_output = names.get("scores") or names.get("logits")
        if score_output is None or tensors.output(score_output) is None:
            raise ValueError(f"{source}: the prefill model has no 'scores' (or 'logits') output; its outputs "
                             f"are {[t.name for t in tensors.outputs]}; map yours with prefill_io_map")
        names["scores"] = score_output
        missing = [v.output_name for v in self.spec.state_variables if tensors.output(v.output_name) is None]
        if missing:
            raise ValueError(f"{source}: the prefill model lacks the step model's state outputs {missing} "
                             f"(its outputs are {[t.name for t in tensors.outputs]})")
        if any(tensors.input(v.input_name) is not None for v in self.spec.state_variables):
            raise ValueError(f"{source}: a prefill model takes no state inputs")
        label_prompt = next((names[k] for k in _LABEL_PROMPTS if k in names and tensors.input(names[k])), None)
        if label_prompt is None and self.initial_prompt_labels:
            raise ValueError(f"{source}: initial_prompt_labels are given, but the prefill model has no "
                             f"'prompt' (or 'input_ids') input")
        if self.suffix_prompt_labels and "suffix" not in names:
            raise ValueError(f"{source}: suffix_prompt_labels are given, but the prefill model has no "
                             "'suffix' input")
        return names

    def _prefill_feeds(self, utterances: UtteranceBatch):
        """Feeds of the prefill for ``utterances`` and the host token counts per row (or None)."""
        tensors, names, source = self.prefill.tensors, self._prefill_names, self.prefill.source
        xp, num_utts = self._prefill_xp, utterances.num_utterances
        feeds, counted = {}, np.zeros(num_utts, np.int64)
        taken = set()

        def labels_input(logical: str, size_logical: str, static: list[int], own: str | None):
            name = names[logical]
            info = tensors.input(name)
            if own is not None and own in utterances.inputs:  # the utterances' own prompts
                labels = to_host(utterances.inputs[own]).astype(np.int64)
                sizes = to_host(utterances.size_of(own)).astype(np.int64)
            elif own is not None and not static and size_logical not in names:
                raise ValueError(f"{source}: the prefill input '{name}' gets no labels: the utterances bring "
                                 f"no '{own}' input (token prompts) and initial_prompt_labels is empty")
            else:
                labels = np.tile(np.asarray(static, np.int64), (num_utts, 1))
                sizes = np.full(num_utts, len(static), np.int64)
            if positions and own is not None:  # a decoder-only prefill: its mask carries the sizes
                valid = np.arange(labels.shape[1])[None, :] < sizes[:, None]
                for logical, value in (("attention_mask", valid),
                                       ("position_ids", np.broadcast_to(np.arange(labels.shape[1]), labels.shape))):
                    if logical in positions:
                        feeds[positions[logical]] = xp.asarray(value.astype(tensors.input(positions[logical]).dtype))
                        taken.add(positions[logical])
            elif size_logical not in names and (sizes != labels.shape[1]).any():
                raise ValueError(f"{source}: the prompts of '{name}' differ in length but the model has "
                                 f"no '{size_logical}' input")
            feeds[name] = xp.asarray(labels.astype(info.dtype))
            taken.add(name)
            if size_logical in names:
                size_name = names[size_logical]
                feeds[size_name] = xp.asarray(sizes.astype(tensors.input(size_name).dtype))
                taken.add(size_name)
            return sizes

        label_logical = next((k for k in _LABEL_PROMPTS if k in names and tensors.input(names[k])), None)
        states_logical = next((k for k in _ENCODER_STATES if k in names and tensors.input(names[k])), None)
        positions = {} if states_logical is not None else {
            k: names[k] for k in _PROMPT_POSITIONS
            if k in names and tensors.input(names[k]) is not None and names[k] not in utterances.inputs}
        if label_logical is not None:
            counted += labels_input(label_logical, "prompt-size", self.initial_prompt_labels, "prompt")
        if "suffix" in names:
            counted += labels_input("suffix", "suffix-size", self.suffix_prompt_labels, None)
        sizes = utterances.input_lengths
        if states_logical is not None:
            name = names[states_logical]
            own = self.io_map.get("encoder-states", "encoder-states")
            if own not in utterances.inputs:
                raise ValueError(f"{source}: the prefill input '{name}' needs the utterances' '{own}', but "
                                 f"they bring {sorted(utterances.inputs)}")
            states = utterances.inputs[own]
            sizes = to_host(utterances.size_of(own)).astype(np.int64)
            feeds[name] = _on(xp, states).astype(tensors.input(name).dtype, copy=False)
            taken.add(name)
            for logical in ("encoder-states-size", "encoder_attention_mask"):
                if logical not in names or tensors.input(names[logical]) is None:
                    continue
                target = names[logical]
                if logical == "encoder-states-size":
                    value = sizes
                else:
                    value = hf_encoder_attention_mask(sizes, states.shape[1])
                feeds[target] = xp.asarray(value.astype(tensors.input(target).dtype))
                taken.add(target)
        for info in tensors.inputs:
            if info.name in taken:
                continue
            if info.name not in utterances.inputs:
                raise ValueError(f"{source}: prefill input '{info.name}' {info.describe()} is provided by "
                                 f"nothing (the utterances bring {sorted(utterances.inputs)})")
            feeds[info.name] = _on(xp, utterances.inputs[info.name]).astype(info.dtype, copy=False)
        if "prefix-length" in names and self.prefill.tensors.output(names["prefix-length"]) is not None:
            return feeds, None, sizes
        if (counted < 1).any():
            bad = utterances.ids[int(np.argmax(counted < 1))]
            raise ValueError(f"{source}: utterance {bad!r} has an empty prompt (no label to prefill)")
        return feeds, counted, sizes

    @property
    def takes_prompts(self) -> bool:
        """Whether the prefill reads the utterances' token prompts (its ``prompt``/``input_ids`` input;
        a step model that is its own prefill always does)."""
        return self.self_prefill or any(k in self._prefill_names and self.prefill.tensors.input(self._prefill_names[k]) is not None
                   for k in _LABEL_PROMPTS)

    @property
    def _prefill_xp(self):
        return array_module(self.prefill.provider)

    # --- lifecycle ---------------------------------------------------------------------------------
    def begin(self, layout: LaneLayout) -> None:
        super().begin(layout)
        self._pending = []
        self._prefill_scores = layout.xp.zeros((layout.num_lanes, self.vocab_size), dtype=np.float32)

    def admit(self, utterances: UtteranceBatch, groups) -> None:
        """Runs the prefill over the utterances (in ``max_batch_size`` chunks), splits its states into
        slots (held until :meth:`initial_context`) and writes the step model's per-utterance inputs."""
        self._leave_resident()
        groups = np.asarray(groups, dtype=np.int64).reshape(-1)
        chunk = self.max_batch_size or max(len(groups), 1)
        for start in range(0, len(groups), chunk):
            rows = np.arange(start, min(start + chunk, len(groups)))
            part = utterances if len(rows) == len(groups) else utterances.select(rows)
            self._admit_chunk(part, groups[rows])
        self._maybe_warm_up()

    def _admit_chunk(self, utterances: UtteranceBatch, groups: np.ndarray) -> None:
        names, spec = self._prefill_names, self.spec
        state_outputs = [v.output_name for v in spec.state_variables]
        if self.self_prefill:
            prompts, counts = self._self_prefill_feeds(utterances)
            outputs, sizes = self._run_self_prefill(prompts, counts, utterances), utterances.input_lengths
        else:
            feeds, counts, sizes = self._prefill_feeds(utterances)
            wanted = [names["scores"], *state_outputs, *self._produced]
            if counts is None:
                wanted.append(names["prefix-length"])
            outputs = self.prefill.run(feeds, wanted)
        if counts is None:
            counts = outputs[names["prefix-length"]]
        time_axis = spec.state_variables[0].time_axis
        width = int(outputs[state_outputs[0]].shape[time_axis])
        token_counts = _on(self.states.xp, counts).astype(np.int32)
        slots = self.states.split(in_state_dtypes({k: outputs[k] for k in state_outputs}, self.states.layouts),
                                  num_new_tokens=width, token_counts=token_counts)
        self._pending.append((groups, slots, token_counts))
        # first-label scores: the row's last prompt position
        xp = self.layout.xp
        raw = _on(xp, outputs[names["scores"]]).astype(np.float32)
        raw = raw.reshape(raw.shape[0], -1, raw.shape[-1])
        last = xp.clip(_on(xp, counts).astype(np.int64) - 1, 0, raw.shape[1] - 1) if raw.shape[1] > 1 else None
        raw = raw[:, -1] if last is None else raw[xp.arange(raw.shape[0]), last]
        scores = converted_scores(xp, raw, self.prefill_scores_kind)
        lanes = xp.asarray(self.layout.lanes_of(groups))
        self._prefill_scores[lanes] = xp.repeat(scores, self.layout.beam_size, axis=0)
        produced = {name: outputs[name] for name in self._produced}
        self.lanes.write_utterances(utterances, groups, produced=produced, sizes=sizes, source_of=self._source_of)

    def _source_of(self, u) -> str:
        """Metadata first; ``past_key_values.{i}.encoder.*`` take the prefill's
        ``present.{i}.encoder.*``; else the input's own name."""
        if u.source:
            return u.source
        renamed = re.sub(r"^past_key_values\.", "present.", u.name)
        if self.prefill.tensors.output(renamed) is not None:
            return renamed
        if u.name == "encoder_hidden_states" and self.prefill.tensors.output(u.name) is None:
            return self.io_map.get("encoder-states", "encoder-states")  # Hugging Face's name for them
        return u.name

    def release(self, groups) -> None:
        """Frees the lanes' slots, and the prefill slots of groups not yet started."""
        gone = np.asarray(groups, dtype=np.int64).reshape(-1)
        self._pending = [p for p in self._pending if not np.isin(p[0], gone).any()]
        self._leave_resident(gone)
        ctx, keep = self._ctx, self._pending_histories()
        if ctx is not None:
            xp = self.states.xp
            lengths = ctx.histories.lengths.copy()
            lengths[xp.asarray(self.layout.lanes_of(gone))] = 0
            kept = StateHistory(table=ctx.histories.table, lengths=lengths)
            self._ctx = DecoderContext(kept, ctx.next_labels)
            self._group_bound[gone] = 0
            keep.append(kept)
        if self.layout is not None:
            self.states.retain(*keep)

    def _held_histories(self) -> list[StateHistory]:
        return self._pending_histories()

    def _pending_histories(self) -> list[StateHistory]:
        return [StateHistory(table=self.states.xp.ascontiguousarray(slots), lengths=counts)
                for _, slots, counts in self._pending]

    # --- scoring -----------------------------------------------------------------------------------
    def initial_context(self, groups, ctx: Context | None = None) -> DecoderContext:
        """Lanes of ``groups`` get their prefilled prompt as history (fresh: the first scores come
        from the prefill); the other lanes keep ``ctx``."""
        xp, layout = self.states.xp, self.layout
        num_lanes, beam = layout.num_lanes, layout.beam_size
        ctx = self._pool_context(ctx)
        groups = np.asarray(groups, dtype=np.int64).reshape(-1)
        pending = [p for p in self._pending if np.isin(p[0], groups).all()]
        self._pending = [p for p in self._pending if not np.isin(p[0], groups).all()]
        width = max([ctx.histories.width if ctx is not None else 0] + [s.shape[1] for _, s, _ in pending])
        table = xp.full((num_lanes, width), -1, dtype=np.int32)
        if ctx is None:
            lengths = xp.zeros(num_lanes, dtype=np.int32)
            next_labels = xp.zeros(num_lanes, dtype=np.int64)
            fresh = xp.zeros(num_lanes, dtype=bool)
        else:
            old = ctx.histories
            table[:, :old.width] = old.table
            lengths, next_labels = old.lengths.copy(), ctx.next_labels.copy()
            fresh = (xp.zeros(num_lanes, dtype=bool) if ctx.fresh is None
                     else xp.asarray(self._on_states(ctx.fresh)).copy())
            lanes = xp.asarray(layout.lanes_of(groups))
            table[lanes] = -1
            lengths[lanes] = 0
            next_labels[lanes] = 0
            fresh[lanes] = False
        self._group_bound[groups] = 0
        for pgroups, slots, counts in pending:
            # the fresh step appends nothing, but extend() counts it: one less keeps the bound exact
            self._group_bound[pgroups] = slots.shape[1] - 1
            lanes = xp.asarray(layout.lanes_of(pgroups))
            table[lanes, :slots.shape[1]] = xp.repeat(xp.asarray(slots), beam, axis=0)
            lengths[lanes] = xp.repeat(xp.asarray(counts), beam)
            fresh[lanes] = True
        histories = StateHistory(table=table, lengths=lengths)
        self.states.retain(histories, *self._pending_histories())
        context = DecoderContext(histories, next_labels, fresh=_on(self.layout.xp, fresh),
                                 all_fresh=ctx is None)
        self._ctx = context
        return context

    def score(self, ctx: DecoderContext):
        """[N, V]: the prefill's scores for fresh lanes, the step model's for the others."""
        if ctx.fresh is None:
            return super().score(ctx)
        if ctx.all_fresh:  # first step of every lane: nothing for the step model to do
            ctx.new_slots = self.states.xp.full((self.layout.num_lanes, 1), -1, dtype=np.int32)
            return self._prefill_scores.copy()
        scores = super().score(ctx)
        return self.layout.xp.where(ctx.fresh[:, None], self._prefill_scores, scores)

    def close(self) -> None:
        super().close()
        self._pending = []
