"""A step model's convention at load: discovery with the model's own hints, then a parity probe.

Hints: a ``genai_config.json`` next to the model (ONNX Runtime GenAI) gives names, the symbolic
head size and key-value heads; a GroupQueryAttention graph gives them too. Then, for a Hugging Face
decoder with a time axis, the **parity probe** proves that the toolkit feeds the model correctly:
a history padded (with noise in the padding) next to a longer unpadded history in one batch must
give each the scores and new token states it gives alone, unpadded. It tries the right-aligned convention
(padding first, the default) and the left-aligned one (each row's history first, the mask's ones
over its first prefix+1 positions, the new step read at the row's own length: GroupQueryAttention
fed from ``attention_mask``, as GenAI's exports), and keeps the first that agrees; a model for
which neither agrees is refused with a :class:`ModelError` that says what was tried and by how much
the results differed.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from gpudecode.backend import array_module, to_host
from gpudecode.prepare.detect import prepare_hint
from gpudecode.session.discovery import HISTORY_ALIGNMENT_KEY, HF_LENGTH_INPUTS, ModelError, ModelSpec, discover_step_model
from gpudecode.session.genai import (
    GenAiConfig, find_genai_config, genai_state_dims, graph_state_dims, read_genai_config,
)
from gpudecode.session.hf import new_step_states
from gpudecode.session.step_model import hf_step_feeds

#: probe tolerance on the max absolute difference, relative to the largest reference value
PROBE_TOLERANCE = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-8}
PROBE_TOLERANCE_HALF = 2e-2
PROBE_HISTORY, PROBE_PADDING = 3, 2


@dataclass(frozen=True)
class ProbeResult:
    """One convention tried by the probe: the largest score / state difference, or why it failed."""

    alignment: str
    difference: float | None
    tolerance: float
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.difference is not None and self.difference <= self.tolerance

    def describe(self) -> str:
        kind = {"right": "right-aligned histories (padding first)",
                "left": "left-aligned histories (each row's history first, new step at the row's length)"}[self.alignment]
        if self.error is not None:
            return f"{kind}: the model failed to run ({self.error})"
        return f"{kind}: max difference {self.difference:.3g} (tolerance {self.tolerance:.3g})"


def model_hints(source) -> GenAiConfig | None:
    """The GenAI config of a model file, folder or ``genai_config.json`` (None without one)."""
    path = find_genai_config(source)
    return read_genai_config(path) if path is not None else None


def resolve_model_path(model):
    """A model given as a GenAI folder or ``genai_config.json`` -> its decoder file; else ``model``."""
    if isinstance(model, (str, Path)) and (Path(model).is_dir() or Path(model).name.endswith(".json")):
        hints = model_hints(model)
        if hints is None:
            raise FileNotFoundError(f"{model}: no genai_config.json there")
        return str(hints.model_file)
    return model


def discover_with_hints(
    tensors, *, io_map: Mapping[str, str] | None = None, state_patterns: Sequence[tuple[str, str]] = (),
    utterance_patterns: Sequence[str] = (), vocab_size: int | None = None, hints: GenAiConfig | None = None,
    fixed_frames: bool = False,
) -> ModelSpec:
    """``discover_step_model`` with the GenAI config's names and state dims; symbolic state dims
    it does not resolve are read from the graph's GroupQueryAttention nodes (a model file)."""
    io_map = {**(hints.io_map if hints else {}), **dict(io_map or {})}
    patterns = [*state_patterns, *(hints.state_patterns if hints else ())]
    shapes = {t.name: t.shape for t in tensors.inputs}
    dims = genai_state_dims(hints, shapes) if hints else {}

    def discover(state_dims):
        return discover_step_model(tensors, io_map=io_map, state_patterns=patterns,
                                   utterance_patterns=utterance_patterns, vocab_size=vocab_size,
                                   state_dims=state_dims, fixed_frames=fixed_frames)
    try:
        spec = discover(dims)
    except ModelError as first:
        if "is symbolic" not in str(first) or not Path(tensors.source).is_file():
            raise
        import onnx

        graph_dims = graph_state_dims(onnx.load(tensors.source, load_external_data=False))
        if not graph_dims:
            raise
        spec = discover({**graph_dims, **dims})
    if hints is not None and hints.context_length:  # GenAI: positions of the rotary tables
        spec = replace(spec, max_time=int(hints.context_length) - 1)
    return spec


def load_step_model_spec(session, *, io_map=None, state_patterns=(), utterance_patterns=(), vocab_size=None,
                         probe: bool = True, seed: int = 0, fixed_frames: bool = False) -> ModelSpec:
    """The spec of ``session``'s step model: discovered with its hints, the history alignment of a
    Hugging Face decoder chosen and proven by :func:`probe_alignment` (``probe``)."""
    hints = model_hints(session.source)
    spec = discover_with_hints(session.tensors, io_map=io_map, state_patterns=state_patterns,
                               utterance_patterns=utterance_patterns, vocab_size=vocab_size, hints=hints,
                               fixed_frames=fixed_frames)
    if not probe or not _probeable(spec):
        return spec
    fixed = HISTORY_ALIGNMENT_KEY in spec.tensors.metadata or any(n in spec.hypothesis_inputs for n in HF_LENGTH_INPUTS)
    alignments = [spec.history_alignment] if fixed else ["right", "left"]
    results = []
    for alignment in alignments:
        result = probe_alignment(session, replace(spec, history_alignment=alignment), seed=seed)
        results.append(result)
        if result.passed:
            chosen = replace(spec, history_alignment=alignment)
            hint = prepare_hint(chosen, genai=hints is not None)
            if hint is not None:  # (shown once per model: the warning filter's default)
                warnings.warn(hint, stacklevel=2)
            return chosen
    raise ModelError(
        f"{spec.source}: refused: the toolkit cannot prove it feeds this model's attention correctly. A history "
        f"of {PROBE_HISTORY} steps padded with {PROBE_PADDING} positions (noise), in one batch with an unpadded "
        f"history of {PROBE_HISTORY + PROBE_PADDING}, gives other scores or new token states than each alone "
        "under every convention tried: "
        + "; ".join(r.describe() for r in results)
        + ". The model's attention must ignore masked (attention_mask = 0) past positions.")


def _probeable(spec: ModelSpec) -> bool:
    """A Hugging Face decoder whose states all have a time axis, batch first, no in-place outputs,
    fed lengths (one without ``attention_mask`` / ``seqlens_k`` never gets a padded history: the
    step runner calls it once per history length)."""
    variables = spec.state_variables
    masked = any(n in spec.hypothesis_inputs for n in ("attention_mask", "seqlens_k"))
    return (spec.convention == "huggingface" and bool(variables) and not spec.in_place_outputs and masked
            and all(v.time_axis is not None and v.batch_axis == 0 for v in variables))


def _utterance_feeds(spec: ModelSpec, rng: np.random.Generator) -> dict:
    """One row of made-up per-utterance inputs (two encoder frames, all valid)."""
    feeds = {}
    for u in spec.utterance_inputs:
        info = spec.tensors.input(u.name)
        shape = tuple(1 if axis == 0 else (d if isinstance(d, int) else 2) for axis, d in enumerate(info.shape))
        if info.dtype.kind == "f":
            feeds[u.name] = rng.standard_normal(shape).astype(info.dtype)
        elif info.dtype == np.bool_ or "mask" in u.name:
            feeds[u.name] = np.ones(shape, dtype=info.dtype)
        else:  # sizes
            feeds[u.name] = np.full(shape, 2, dtype=info.dtype)
    return feeds


def probe_alignment(session, spec: ModelSpec, *, seed: int = 0) -> ProbeResult:
    """Runs histories unpadded and padded through the model in ``spec.history_alignment``; the
    largest difference of their scores and new token states (see the module's docstring). One
    batch holds the padded history next to a longer unpadded one, each compared with its run alone."""
    rng = np.random.default_rng(seed)
    xp = array_module(session.provider)
    variables = spec.state_variables
    dtype = variables[0].dtype
    tolerance = PROBE_TOLERANCE.get(np.dtype(dtype), PROBE_TOLERANCE_HALF)
    vocab = spec.vocab_size or 2
    label_name = spec.hypothesis_inputs["input_ids"]
    label_dtype = spec.tensors.input(label_name).dtype
    utterances = _utterance_feeds(spec, rng)
    wanted = [spec.scores_output, *(v.output_name for v in variables)]

    def empty(v, time):
        shape = [d for d in v.shape]
        shape[0], shape[v.time_axis] = 1, time
        return np.zeros(shape, dtype=v.dtype)

    def step(states: dict, prefixes: list[int], labels: list[int]):
        rows = len(prefixes)
        time = states[variables[0].input_name].shape[variables[0].time_axis]
        prefix_lengths = xp.asarray(np.array(prefixes, np.int32))
        per_row = spec.utterance_rows != "utterance"
        feeds = {k: xp.asarray(v) for k, v in states.items()}
        feeds.update({k: xp.asarray(np.repeat(v, rows, axis=0) if per_row else v) for k, v in utterances.items()})
        feeds[label_name] = xp.asarray(np.array(labels, dtype=label_dtype)[:, None])
        feeds.update(hf_step_feeds(spec, spec.tensors, prefix_lengths, time))
        out = session.run(feeds, wanted)
        scores = to_host(out[spec.scores_output]).astype(np.float64)
        scores = scores.reshape(rows, -1, scores.shape[-1])[:, -1]
        new = {v.input_name: to_host(new_step_states(out[v.output_name], prefix_lengths, v.time_axis,
                                                     spec.history_alignment)).astype(np.float64)
               for v in variables}
        return scores, new

    short, long = PROBE_HISTORY, PROBE_HISTORY + PROBE_PADDING
    labels = [int(x) for x in rng.integers(0, vocab, long + 2)]
    try:
        histories = [{v.input_name: empty(v, 0) for v in variables}]
        for t in range(long):  # the histories, one unpadded step at a time
            _, new = step(histories[-1], [t], [labels[t]])
            histories.append({v.input_name: np.concatenate([histories[-1][v.input_name],
                                                            new[v.input_name].astype(v.dtype)], axis=v.time_axis)
                              for v in variables})
        alone = [step(histories[short], [short], [labels[long]]), step(histories[long], [long], [labels[long + 1]])]
        batch = {}
        for v in variables:
            past = histories[short][v.input_name]
            scale = max(1.0, float(np.abs(past.astype(np.float64)).max()))
            noise = (rng.standard_normal(empty(v, PROBE_PADDING).shape) * 3 * scale).astype(v.dtype)
            padded = np.concatenate([noise, past] if spec.history_alignment == "right" else [past, noise],
                                    axis=v.time_axis)
            batch[v.input_name] = np.concatenate([padded, histories[long][v.input_name]], axis=0)
        together = step(batch, [short, long], [labels[long], labels[long + 1]])
    except Exception as exc:  # noqa: BLE001 - the model refusing our feeds is a probe result
        return ProbeResult(spec.history_alignment, None, tolerance, error=str(exc).splitlines()[0][:300])

    def difference(a, b) -> float:
        return float(np.abs(a - b).max() / max(1.0, np.abs(a).max())) if a.shape == b.shape else np.inf

    differences = []
    for row, (scores, new) in enumerate(alone):
        differences.append(difference(scores[0], together[0][row]))
        differences += [difference(new[v.input_name][0], together[1][v.input_name][row]) for v in variables]
    return ProbeResult(spec.history_alignment, max(differences), tolerance)
