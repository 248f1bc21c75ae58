"""Equivalence of a prepared step model with its original: single steps on random histories, and
a short beam search with both through the toolkit's own scorer and search.

Each model is fed as the toolkit feeds it: the original with right-aligned histories (padding
first), a prepared (left-aligned, ``GroupQueryAttention``) one with each row's history first; the
same histories, labels and positions go to both. Compared: the logits of the new step and its
new key/value states, and the n-best lists (tokens equal, scores within the tolerance).
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from gpudecode.prepare.detect import FAST_ATTENTION_OPS
from gpudecode.prepare.fuse import to_float16
from gpudecode.session.hf import hf_attention_inputs, new_step_states

#: max |Δ| of the logits and new states: float32 forms, float16 forms
TOLERANCE_FLOAT32, TOLERANCE_FLOAT16 = 1e-4, 2e-2
#: float16 forms: the share of prompts whose best hypothesis must be the original's
SAME_BEST_FLOAT16 = 0.95
_ORT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


@dataclass(frozen=True)
class CheckOptions:
    """How hard ``--check`` looks: step trials (rows each, histories up to ``max_history``), and the
    decode (prompts, beam, new labels)."""

    trials: int = 3
    rows: int = 4
    max_history: int = 6
    prompts: int = 4
    beam: int = 4
    max_new: int = 6
    seed: int = 0


@dataclass(frozen=True)
class CheckReport:
    """The prepared model against the original (None: not measured; ``skipped`` says why)."""

    tolerance: float
    max_logit_difference: float | None = None
    max_state_difference: float | None = None
    decode_prompts: int = 0
    same_nbest: int = 0
    same_best: int = 0
    max_score_difference: float | None = None
    float16: bool = False
    skipped: str | None = None
    #: a model checked by its outputs on random inputs alone (an encoder, a cross-attention
    #: decoder): the largest |Δ| of any output over that output's largest magnitude (at least 1)
    max_output_difference: float | None = None

    @property
    def passed(self) -> bool:
        """Steps within the tolerance and the decode's n-best equal (float16: the same best
        hypothesis on at least :data:`SAME_BEST_FLOAT16` of the prompts), or the outputs within the
        tolerance; a skipped check passes nothing."""
        if self.skipped is None and self.max_output_difference is not None:
            return self.max_output_difference <= self.tolerance
        if self.skipped is not None or self.max_logit_difference is None:
            return False
        steps = max(self.max_logit_difference, self.max_state_difference or 0.0) <= self.tolerance
        if self.float16:
            return steps and self.same_best >= SAME_BEST_FLOAT16 * self.decode_prompts
        return steps and self.same_nbest == self.decode_prompts and (self.max_score_difference or 0.0) <= self.tolerance

    def rows(self) -> list[tuple[str, str]]:
        """(what, figure) lines for the report's table."""
        def figure(value):
            return "-" if value is None else f"{value:.3g}"
        if self.skipped is not None:
            return [("check", f"skipped: {self.skipped}")]
        if self.max_output_difference is not None:
            return [("max |Δ| outputs", f"{figure(self.max_output_difference)} of the largest value, random inputs "
                                        f"(tolerance {self.tolerance:g})"),
                    ("check", "passed" if self.passed else "FAILED")]
        return [("max |Δ| logits", f"{figure(self.max_logit_difference)} (tolerance {self.tolerance:g})"),
                ("max |Δ| new key/value states", figure(self.max_state_difference)),
                ("decode: same n-best", f"{self.same_nbest} of {self.decode_prompts} prompts"),
                ("decode: same best", f"{self.same_best} of {self.decode_prompts} prompts"),
                ("decode: max |Δ| scores", figure(self.max_score_difference)),
                ("check", "passed" if self.passed else "FAILED")]


def alignment_of(model: onnx.ModelProto) -> str:
    """``left`` for a graph with fused attention over a left-aligned cache, else ``right``."""
    return "left" if any(n.op_type in FAST_ATTENTION_OPS for n in model.graph.node) else "right"


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _state_dims(model: onnx.ModelProto, state_shape=(None, None)) -> dict[str, tuple[int, int]]:
    """Past input -> (heads, head size): static dims, else those GroupQueryAttention's attributes
    give, else ``state_shape`` (key-value heads, head size; e.g. a ``genai_config.json``'s)."""
    from gpudecode.session.genai import graph_state_dims

    resolved = graph_state_dims(model)
    dims = {}
    for value in model.graph.input:
        if value.name.startswith("past_key_values."):
            shape = [d.dim_value or resolved.get(d.dim_param) for d in value.type.tensor_type.shape.dim]
            dims[value.name] = (shape[1] or state_shape[0], shape[3] or state_shape[1])
    return dims


def compare_steps(original: onnx.ModelProto, prepared: onnx.ModelProto, options: CheckOptions = CheckOptions(),
                  *, state_shape: tuple[int | None, int | None] = (None, None)):
    """(max |Δ| logits, max |Δ| new states) over ``options.trials`` steps of random histories;
    ``state_shape``: (key-value heads, head size) where neither graph says them."""
    sessions = [_session(original), _session(prepared)]
    alignments = [alignment_of(original), alignment_of(prepared)]
    dims = _state_dims(original, state_shape)
    if any(None in d for d in dims.values()):
        dims = _state_dims(prepared, state_shape)
    if any(None in d for d in dims.values()):
        raise ValueError(f"the past states' heads or head size are not known: {dims}")
    vocab = _vocab(original)
    rng = np.random.default_rng(options.seed)
    worst_logits = worst_states = 0.0
    for _ in range(options.trials):
        prefix = rng.integers(0, options.max_history + 1, options.rows)
        time = int(prefix.max())
        labels = rng.integers(0, vocab, (options.rows, 1))
        histories = {name: [rng.standard_normal((h, int(p), d)).astype(np.float32) for p in prefix]
                     for name, (h, d) in dims.items()}
        outputs = []
        for session, alignment in zip(sessions, alignments):
            feeds = _feeds(session, histories, prefix, time, labels, alignment, rng)
            names = [o.name for o in session.get_outputs()]
            values = dict(zip(names, session.run(names, feeds)))
            logits = values["logits"][:, -1].astype(np.float64)
            states = {name: new_step_states(values[name.replace("past_key_values", "present")], prefix, 2, alignment)
                      for name in dims}
            outputs.append((logits, states))
        (logits_a, states_a), (logits_b, states_b) = outputs
        worst_logits = max(worst_logits, float(np.abs(logits_a - logits_b).max()))
        for name in dims:
            diff = np.abs(states_a[name].astype(np.float64) - states_b[name].astype(np.float64)).max()
            worst_states = max(worst_states, float(diff))
    return worst_logits, worst_states


def _vocab(model: onnx.ModelProto, missing: int | None = None) -> int:
    """The size of the ``logits`` output's last axis (2 where symbolic); ``missing`` for a model
    without logits (None: an error)."""
    for value in model.graph.output:
        if value.name == "logits":
            return int(value.type.tensor_type.shape.dim[-1].dim_value or 2)
    if missing is not None:
        return missing
    raise ValueError("the model has no 'logits' output")


def _feeds(session, histories: dict, prefix: np.ndarray, time: int, labels, alignment: str, rng) -> dict:
    """One step's inputs in ``alignment``: each row's history placed at its end (right) or start
    (left) of ``time`` positions, noise in the padding."""
    mask, positions = hf_attention_inputs(prefix, time, 1, alignment)
    declared = {i.name: _ORT_TYPES.get(i.type, np.float32) for i in session.get_inputs()}
    feeds = {"input_ids": labels, "attention_mask": mask, "position_ids": positions,
             "use_cache_branch": np.array([True])}
    for name, rows in histories.items():
        heads, _, size = rows[0].shape
        past = (rng.standard_normal((len(rows), heads, time, size)) * 3).astype(np.float32)
        for r, history in enumerate(rows):
            length = history.shape[1]
            if length:
                past[r, :, (time - length if alignment == "right" else 0):][:, :length] = history
        feeds[name] = past
    return {name: np.asarray(value).astype(declared[name]) for name, value in feeds.items() if name in declared}


def compare_decodes(original: str, prepared: str, *, prefill: str | None, prepared_prefill: str | None = None,
                    options: CheckOptions = CheckOptions()):
    """(prompts, same n-best, same best, max |Δ| scores): both models decode the same random
    prompts with a beam search (the toolkit's ``PrefixLmScorer`` and ``label_sync_search``), each
    with its prompt model (``prefill``, ``prepared_prefill``; None: the step model itself)."""
    from gpudecode.scorers import UtteranceBatch
    from gpudecode.scorers.prefix_lm import PrefixLmScorer
    from gpudecode.search import LabelSyncOptions, label_sync_search
    from gpudecode.session import SessionOptions
    from gpudecode.states.options import StateManagerOptions

    vocab = _vocab(onnx.load(original, load_external_data=False))
    rng = np.random.default_rng(options.seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(1, 5))).tolist() for _ in range(options.prompts)]
    table = np.zeros((len(prompts), max(map(len, prompts))), np.int64)
    for u, prompt in enumerate(prompts):
        table[u, :len(prompt)] = prompt
    batch = UtteranceBatch(ids=[f"p{u}" for u in range(len(prompts))],
                           input_lengths=np.full(len(prompts), options.max_new), inputs={"prompt": table},
                           sizes={"prompt": np.array([len(p) for p in prompts])})
    search = LabelSyncOptions(beam_size=options.beam, sentence_end=vocab - 1, max_labels_per_input=1.0,
                              max_labels=options.max_new, finished="separate", nbest=options.beam)
    results = []
    for model, prompt_model in ((original, prefill), (prepared, prepared_prefill or prefill)):
        with warnings.catch_warnings():  # (the original's "not in the fast form" note: being prepared)
            warnings.filterwarnings("ignore", message=".*not in the fast form")
            scorer = PrefixLmScorer(model=model, prefill_model=prompt_model, vocab_size=vocab, scores_kind="logits",
                                    state_manager=StateManagerOptions(type="transformer-cpu"),
                                    session_options=SessionOptions(device="cpu"))
        results.append(label_sync_search([("lm", scorer, 1.0)], batch, search))
    same_nbest = same_best = 0
    worst = 0.0
    for mine, theirs in zip(*results):
        tokens = [[h.labels for h in hyps] for hyps in (mine, theirs)]
        same_nbest += tokens[0] == tokens[1]
        same_best += tokens[0][:1] == tokens[1][:1]
        if tokens[0] == tokens[1]:
            worst = max(worst, max((abs(a.score - b.score) for a, b in zip(mine, theirs)), default=0.0))
    return len(prompts), same_nbest, same_best, worst


def check_prepared(original_path: str, prepared_path: str, *, prefill: str | None, float16: bool,
                   options: CheckOptions = CheckOptions()) -> CheckReport:
    """Both comparisons; a prepared model the CPU provider cannot run (float16 kernels it lacks)
    gives a report that says so rather than a figure."""
    from gpudecode.session.genai import find_genai_config, read_genai_config

    tolerance = TOLERANCE_FLOAT16 if float16 else TOLERANCE_FLOAT32
    original, prepared = onnx.load(original_path), onnx.load(prepared_path)
    config = find_genai_config(original_path)
    genai = read_genai_config(config) if config is not None else None
    state_shape = (genai.num_key_value_heads, genai.head_size) if genai is not None else (None, None)
    try:
        logits, states = compare_steps(original, prepared, options, state_shape=state_shape)
    except Exception as exc:  # noqa: BLE001 - a kernel the CPU provider lacks is a skip, not a figure
        if float16:
            return CheckReport(tolerance, float16=True, skipped="the CPU provider cannot run this float16 model "
                               f"({str(exc).splitlines()[0][:160]}); check it on CUDA")
        raise
    with tempfile.TemporaryDirectory() as folder:
        prepared_prefill = prefill
        if float16 and prefill is not None:  # the prompt model's states in the step model's dtype
            prepared_prefill = str(Path(folder) / "prefill-float16.onnx")
            onnx.save(to_float16(onnx.load(prefill), ["logits"]), prepared_prefill)
        prompts, same_nbest, same_best, worst = compare_decodes(original_path, prepared_path, prefill=prefill,
                                                                prepared_prefill=prepared_prefill, options=options)
    return CheckReport(tolerance, logits, states, prompts, same_nbest, same_best, worst, float16=float16)


#: sizes of a graph's symbolic dims in the outputs check, by name: the batch, the new tokens, the rest
_BATCH_SIZE, _NEW_TOKENS, _OTHER_SIZE = 2, 1, 8


def _dim_size(name: str) -> int:
    if "batch" in name:
        return _BATCH_SIZE
    if name in ("decoder_sequence_length", "sequence_length"):
        return _NEW_TOKENS
    return _OTHER_SIZE


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict:
    """Inputs for every declared input of ``model``: symbolic dims sized by name (the same name the
    same size), labels below the vocabulary, masks of ones, positions counting up, cache branches
    on, other integers (lengths) the symbolic size, floats normal."""
    rng = np.random.default_rng(seed)
    vocab = _vocab(model, missing=2)
    feeds = {}
    for value in model.graph.input:
        tensor = value.type.tensor_type
        shape = [d.dim_value or _dim_size(d.dim_param) for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        if value.name == "input_ids":
            array = rng.integers(0, vocab, shape)
        elif value.name == "position_ids":
            array = np.broadcast_to(np.arange(shape[-1]), shape) if shape else np.zeros(())
        elif dtype.kind == "f":
            array = rng.standard_normal(shape)
        elif dtype.kind == "b" or value.name == "attention_mask":
            array = np.ones(shape)
        else:
            array = np.full(shape, _OTHER_SIZE)
        feeds[value.name] = np.asarray(array).astype(dtype)
    return feeds


def compare_outputs(original: onnx.ModelProto, prepared: onnx.ModelProto, options: CheckOptions = CheckOptions()) -> float:
    """The largest |Δ| of the two models' float outputs of the same name over ``options.trials``
    random inputs (:func:`random_inputs`), each over its output's largest magnitude (at least 1)."""
    sessions = [_session(original), _session(prepared)]
    names = sorted({o.name for o in sessions[0].get_outputs()} & {o.name for o in sessions[1].get_outputs()})
    worst = 0.0
    for trial in range(options.trials):
        feeds = random_inputs(original, options.seed + trial)
        runs = []
        for session in sessions:
            declared = {i.name: _ORT_TYPES.get(i.type, np.float32) for i in session.get_inputs()}
            runs.append(dict(zip(names, session.run(names, {k: v.astype(declared[k]) for k, v in feeds.items()
                                                             if k in declared}))))
        for name in names:
            a, b = (np.asarray(run[name]) for run in runs)
            if a.dtype.kind != "f" or a.size == 0:
                continue
            a, b = a.astype(np.float64), b.astype(np.float64)
            finite = np.isfinite(a)
            scale = max(1.0, float(np.abs(a[finite]).max(initial=0.0)))
            if not np.array_equal(finite, np.isfinite(b)):
                return float("inf")
            worst = max(worst, float(np.abs(a[finite] - b[finite]).max(initial=0.0)) / scale)
    return worst


def check_outputs(original_path: str, prepared_path: str, *, float16: bool,
                  options: CheckOptions = CheckOptions()) -> CheckReport:
    """:func:`compare_outputs` as a report (an encoder, a cross-attention decoder); a float16 model
    the CPU provider cannot run gives a report that says so."""
    tolerance = TOLERANCE_FLOAT16 if float16 else TOLERANCE_FLOAT32
    try:
        worst = compare_outputs(onnx.load(original_path), onnx.load(prepared_path), options)
    except Exception as exc:  # noqa: BLE001 - a kernel the CPU provider lacks is a skip, not a figure
        if float16:
            return CheckReport(tolerance, float16=True, skipped="the CPU provider cannot run this float16 model "
                               f"({str(exc).splitlines()[0][:160]}); check it on CUDA")
        raise
    return CheckReport(tolerance, float16=float16, max_output_difference=worst)
