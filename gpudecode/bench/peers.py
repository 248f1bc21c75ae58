"""``gpudecode bench peers``: the toolkit against Hugging Face ``generate`` and ONNX Runtime GenAI on
the same random-initialised weights and the same prompts, in one run.

Models: a GPT-2 and a Llama of each shape (layers × width; heads of 64, the Llama's key-value heads
half its heads), built from a config with a fixed seed (no downloads), ``initializer_range``
``INIT_SCALE / √width`` (peaked distributions: beam decisions do not hinge on float rounding).
Each is exported with ``torch.onnx`` in the Hugging Face decoder-with-past convention (step +
prefill: ``tools/peer-fixtures/gpt2.py``'s ``export``); the Llama also by GenAI's model builder
(``tools/peer-fixtures/genai.py``'s ``export``) where ``onnxruntime_genai`` imports.

Cells: every model × beam × prompt count (GenAI's export at ``genai_prompts`` ≤ 32, the most its
search takes; on CUDA only in float16, as its float32 CUDA export does not load). Every side decodes the same prompts (``prompt_length`` random tokens, no sentence-end)
for exactly ``new_tokens`` labels (sentence-end masked by ``min_length`` / ``min_new_tokens`` on every
side), length penalty 0, one best sequence. Sides: ``hf_generate`` (torch, the cell's float type,
``attn_implementation="sdpa"``, its default cache), ``hf_generate_compiled`` (static cache and
``torch.compile``; with ``compile``), ``gpudecode`` (the Python API: ``PrefixLmScorer`` +
``label_sync_search``: beams in the ``finished="separate"`` mode, one beam in ``"in-beam"`` — greedy
search, a lane ending at its sentence end; CUDA graphs on CUDA), ``gpudecode_prepared``
(the same on ``gpudecode.prepare``'s rewrite of the step export, where that package provides
``prepare_model``), ``genai`` (GenAI's own greedy / beam search). Per side: seconds (fastest of
``repeats`` after a warm-up), ms per step (÷ ``new_tokens``), tokens/s, throughput ÷ ``hf_generate``'s,
and parity against ``hf_generate``: prompts whose best token sequences are equal, and the largest
|score difference| of the best hypotheses — the toolkit's own score of its best against the torch
model's float64 log-softmax score of ``generate``'s best (GenAI's and ``generate``'s sequences are scored
by the torch model; ``own_score_max_diff``: the toolkit's own score against the torch model's score of
the same sequence). With ``dtype`` float16 the unprepared side runs a float16 export of the same weights
and the prepared side ``prepare``'s float16 form of the float32 export.
"""

from __future__ import annotations

import importlib.util
import json
import math
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from gpudecode.bench.common import pyplot, save_figure, synchronize, write_results

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_SCRIPTS = ROOT / "tools" / "peer-fixtures"
#: the most prompts GenAI's search takes in one generator
GENAI_MAX_PROMPTS = 32
#: why a float32 run on CUDA has no GenAI cells (seen with onnxruntime-genai 0.18's builder)
GENAI_NO_FLOAT32_CUDA = ("no GenAI cells at float32 on CUDA: GenAI's builder writes a float32 CUDA export that "
                         "neither ONNX Runtime nor GenAI loads (graph output present.0.key does not exist); "
                         "the float16 run (--dtype float16) has them")
#: initializer_range = INIT_SCALE / sqrt(width) (0.3 at width 64, the peer fixtures' value)
INIT_SCALE = 2.4
#: sentence-end (masked on every side) and the padding label
EOS, PAD = 2, 0
FAMILIES = ("gpt2", "llama")
#: the sides of a cell, in table order; the first is the reference of ratios and parity
SIDES = ("hf_generate", "hf_generate_compiled", "gpudecode", "gpudecode_prepared", "genai")


def parse_shapes(text: str) -> tuple[tuple[int, ...], ...]:
    """``"6x512,12x768x50000"`` -> ((6, 512), (12, 768, 50000)): layers × width (a multiple of 64)
    [× vocabulary, else the bench's ``vocab``]."""
    shapes = []
    for item in (part.strip() for part in text.split(",")):
        parts = item.lower().split("x")
        if len(parts) not in (2, 3) or not all(part.isdigit() for part in parts):
            raise ValueError(f"shapes: expected LAYERSxWIDTH[xVOCAB] items such as 6x512, got {item!r}")
        shape = tuple(int(part) for part in parts)
        if shape[0] < 1 or shape[1] < 64 or shape[1] % 64 or (len(shape) == 3 and shape[2] <= EOS + 1):
            raise ValueError(f"shapes: {item!r}: layers >= 1, a width that is a multiple of 64 (heads of 64), "
                             f"a vocabulary > {EOS + 1}")
        shapes.append(shape)
    return tuple(shapes)


@dataclass(frozen=True)
class PeerBenchOptions:
    """What ``gpudecode bench peers`` measures (see the module docstring)."""

    device: str = "cpu"
    shapes: tuple[tuple[int, ...], ...] = ((6, 512), (12, 768, 50000))
    vocab: int = 10000
    beams: tuple[int, ...] = (1, 8)
    prompts: tuple[int, ...] = (64, 256)
    genai_prompts: int = GENAI_MAX_PROMPTS
    new_tokens: int = 48
    prompt_length: int = 8
    dtype: str = "float32"
    families: tuple[str, ...] = FAMILIES
    compile: bool = False
    graphs: bool = True
    repeats: int = 1
    seed: int = 0
    #: threads of every side (torch, the toolkit's and GenAI's ONNX Runtime sessions); 0: each library's default
    threads: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: expected cpu or cuda, got {self.device!r}")
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"dtype: expected float32 or float16, got {self.dtype!r}")
        if set(self.families) - set(FAMILIES) or not self.families:
            raise ValueError(f"families: expected some of {', '.join(FAMILIES)}, got {list(self.families)}")
        if not 1 <= self.genai_prompts <= GENAI_MAX_PROMPTS:
            raise ValueError(f"genai_prompts: GenAI's search takes 1 to {GENAI_MAX_PROMPTS} prompts, "
                             f"got {self.genai_prompts}")
        for name in ("beams", "prompts"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name}: expected integers >= 1, got {list(getattr(self, name))}")
        if self.threads < 0:
            raise ValueError(f"threads: must be >= 0, got {self.threads}")
        for name in ("new_tokens", "prompt_length", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.vocab <= EOS + 1:
            raise ValueError(f"vocab: must be > {EOS + 1}, got {self.vocab}")
        if not self.shapes or any(len(shape) not in (2, 3) for shape in self.shapes):
            raise ValueError(f"shapes: expected (layers, width[, vocab]) tuples, got {list(self.shapes)}")

    @property
    def smallest_vocab(self) -> int:
        return min(shape[2] if len(shape) == 3 else self.vocab for shape in self.shapes)

    @property
    def positions(self) -> int:
        return self.prompt_length + self.new_tokens


def options_from_text(*, shapes: str, beams: str, prompts: str, families: str, **values) -> PeerBenchOptions:
    """The options from the command line's text: ``shapes`` (:func:`parse_shapes`), ``beams`` and
    ``prompts`` (comma-separated integers), ``families`` (comma-separated); the rest as given."""
    def integers(name: str, text: str) -> tuple[int, ...]:
        try:
            return tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None

    return PeerBenchOptions(shapes=parse_shapes(shapes), beams=integers("beams", beams),
                            prompts=integers("prompts", prompts),
                            families=tuple(f.strip() for f in families.split(",") if f.strip()), **values)


def output_name(options: PeerBenchOptions) -> str:
    """``peers`` (CUDA, float32), ``peers-cpu``, ``peers-float16``, ``peers-cpu-float16``."""
    return "peers" + ("-cpu" if options.device == "cpu" else "") + ("-float16" if options.dtype == "float16" else "")


# --- assembling results (no torch) ---------------------------------------------------------------
def side_result(seconds: float, *, new_tokens: int, num_prompts: int, reference_seconds: float | None,
                sequences: list[list[int]] | None = None, reference_sequences: list[list[int]] | None = None,
                scores=None, reference_scores=None) -> dict:
    """One side of a cell: its time as ms per step and tokens/s, its throughput ÷ the reference's
    (None without one) and, given both sides' best sequences and their rescored scores, how many are
    equal and the largest |score difference|."""
    result = {"s": seconds, "ms_per_step": 1e3 * seconds / new_tokens,
              "tokens_per_s": num_prompts * new_tokens / seconds,
              "ratio_to_hf": None if reference_seconds is None else reference_seconds / seconds}
    if sequences is not None and reference_sequences is not None:
        result["equal"] = sum(list(a) == list(b) for a, b in zip(sequences, reference_sequences, strict=True))
    if scores is not None and reference_scores is not None:
        result["max_score_diff"] = float(np.max(np.abs(np.asarray(scores, np.float64)
                                                       - np.asarray(reference_scores, np.float64))))
    return result


def _number(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def format_table(results: dict) -> str:
    """The cells as one markdown table, a row per side; then the notes."""
    lines = ["| model | export | dtype | prompts × beam | side | ms/step | tokens/s | ÷ HF generate | "
             "equal best | max abs score diff |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for cell in results.get("cells", []):
        model = f"{cell['family']} {cell['layers']}×{cell['width']}, V {cell['vocab']}"
        for side in SIDES:
            if side not in cell["sides"]:
                continue
            r = cell["sides"][side]
            if "s" not in r:
                lines.append(f"| {model} | {cell['export']} | {cell['dtype']} | {cell['prompts']} × {cell['beam']} | "
                             f"{side} | — | — | — | — | — |")
                continue
            equal = "—" if "equal" not in r else f"{r['equal']} / {cell['prompts']}"
            lines.append(f"| {model} | {cell['export']} | {cell['dtype']} | {cell['prompts']} × {cell['beam']} | "
                         f"{side} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | "
                         f"{_number(r.get('ratio_to_hf'), '.2f')} | {equal} | "
                         f"{_number(r.get('max_score_diff'), '.1e')} |")
    notes = [f"{cell['family']} {cell['layers']}×{cell['width']} {cell['export']} {cell['prompts']} × {cell['beam']} "
             f"{side}: {r['note']}"
             for cell in results.get("cells", []) for side, r in cell["sides"].items() if r.get("note")]
    notes += results.get("notes", [])
    for m in results.get("models", []):
        check = m.get("export_max_abs_logit_diff")
        loads = "".join(f"; {key[:-len('_load')]} did not load: {value}" for key, value in m.items()
                        if key.endswith("_load"))
        notes.append(f"{m['family']} {m['layers']}×{m['width']} {m['export']}: "
                     + (f"export max abs logit diff to torch {check:.1e}; " if check is not None else
                        f"export check {m['export_check']}; " if "export_check" in m else "")
                     + (f"float16: {m['float16_export']}; " if "float16_export" in m else "")
                     + f"prepared: {m.get('prepared_form', '—')}{loads}")
    return "\n".join(lines + ([""] + notes if notes else []))


def plot_peers(results: dict, path) -> str | None:
    """Throughput ÷ HF generate per cell and side (1 = as fast), log scale."""
    plt = pyplot()
    if plt is None:
        return None
    cells = results.get("cells", [])
    sides = [s for s in SIDES[1:] if any(s in c["sides"] and c["sides"][s].get("ratio_to_hf") for c in cells)]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cells) + 2), 4))
    width = 0.8 / max(1, len(sides))
    for k, side in enumerate(sides):
        xs = [i + k * width for i, c in enumerate(cells) if c["sides"].get(side, {}).get("ratio_to_hf")]
        ys = [c["sides"][side]["ratio_to_hf"] for c in cells if c["sides"].get(side, {}).get("ratio_to_hf")]
        ax.bar(xs, ys, width, label=side)
    ax.axhline(1.0, color="k", linestyle="--")
    ax.set_yscale("log")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))],
                  [f"{c['family']} {c['layers']}×{c['width']} {c['export']}\n{c['prompts']}×b{c['beam']} {c['dtype']}"
                   for c in cells], rotation=45, ha="right", fontsize=6)
    ax.set_ylabel("throughput ÷ HF generate")
    ax.set_title(f"peers on {results.get('config', {}).get('device', '?')}")
    if sides:
        ax.legend(fontsize=7)
    return save_figure(plt, fig, path)


# --- the peers (imported when the bench runs) ---------------------------------------------------
def fixture_script(name: str):
    """``tools/peer-fixtures/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"{name}_fixture", FIXTURE_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(family: str, layers: int, width: int, options: PeerBenchOptions):
    """The random-initialised torch model (float32, CPU) of ``family``; the same weights every call."""
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    heads = width // 64
    init = INIT_SCALE / math.sqrt(width)
    if family == "gpt2":
        config = GPT2Config(vocab_size=options.vocab, n_positions=options.positions, n_embd=width, n_layer=layers,
                            n_head=heads, n_inner=4 * width, initializer_range=init, bos_token_id=1,
                            eos_token_id=EOS, pad_token_id=PAD)
    else:
        inner = 8 * (width * 8 // 3 // 8)
        if inner == options.vocab:  # GenAI's builder takes any Linear of the vocabulary size for the LM head
            inner += 8
        config = LlamaConfig(vocab_size=options.vocab, hidden_size=width, intermediate_size=inner,
                             num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=max(1, heads // 2), max_position_embeddings=options.positions,
                             initializer_range=init, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD,
                             tie_word_embeddings=False)
    torch.manual_seed(options.seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def make_prompts(options: PeerBenchOptions) -> np.ndarray:
    """[max prompt count, prompt_length] random labels without sentence-end and padding, in every
    shape's vocabulary (a cell takes the first rows)."""
    count = max(*options.prompts, options.genai_prompts)
    rng = np.random.default_rng(options.seed)
    return rng.integers(EOS + 1, options.smallest_vocab, (count, options.prompt_length)).astype(np.int64)


def _timed(run, repeats: int, sync) -> tuple[float, object]:
    run()  # warm-up
    best, result = float("inf"), None
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = run()
        sync()
        best = min(best, time.perf_counter() - start)
    return best, result


class _Torch:
    """The torch side: generate and rescoring on one model."""

    def __init__(self, model, options: PeerBenchOptions) -> None:
        import torch

        self.torch = torch
        self.options = options
        self.device = torch.device(options.device)
        dtype = torch.float16 if options.dtype == "float16" else torch.float32
        self.model = model.to(self.device, dtype)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def generate(self, prompts: np.ndarray, beam: int, *, compiled: bool = False) -> list[list[int]]:
        torch, o = self.torch, self.options
        ids = torch.as_tensor(prompts, device=self.device)
        extra = {}
        if compiled:
            from transformers import CompileConfig

            config = CompileConfig()
            config._compile_all_devices = True
            extra = {"cache_implementation": "static", "compile_config": config}
        if beam > 1:  # (greedy search takes neither)
            extra.update(early_stopping=False, length_penalty=0.0)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=o.new_tokens,
                                      min_new_tokens=o.new_tokens, eos_token_id=EOS, pad_token_id=PAD,
                                      do_sample=False, num_beams=beam, num_return_sequences=1, **extra)
        return out[:, prompts.shape[1]:].tolist()

    def rescore(self, prompts: np.ndarray, sequences: list[list[int]], rows: int = 64) -> np.ndarray:
        """Σ log-softmax (float64) of each sequence's labels after its prompt: the model's score of it."""
        torch = self.torch
        scores = []
        with torch.no_grad():
            for start in range(0, len(sequences), rows):
                ids = torch.as_tensor(np.concatenate([prompts[start:start + rows],
                                                      np.asarray(sequences[start:start + rows], np.int64)], 1),
                                      device=self.device)
                logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.double()
                p = prompts.shape[1]
                log_probs = torch.log_softmax(logits[:, p - 1:-1], -1)
                scores.append(log_probs.gather(-1, ids[:, p:, None])[..., 0].sum(-1).cpu().numpy())
        return np.concatenate(scores)


def _toolkit_scorer(step: Path, prefill: Path | None, options: PeerBenchOptions):
    from gpudecode.scorers.prefix_lm import PrefixLmScorer
    from gpudecode.session import SessionOptions
    from gpudecode.session.graphs import GraphOptions
    from gpudecode.states.options import StateManagerOptions

    extra = {} if prefill is None else {"prefill_model": str(prefill),
                                        "state_manager": StateManagerOptions(type=f"transformer-{options.device}")}
    return PrefixLmScorer(model=str(step), vocab_size=options.vocab, scores_kind="logits",
                          session_options=SessionOptions(device=options.device, intra_op_threads=options.threads),
                          graphs=GraphOptions(enabled=options.device == "cuda" and options.graphs), **extra)


def _scorers(models: dict, prefill: Path | None, options: PeerBenchOptions, info: dict) -> dict:
    """side -> the toolkit's scorer of that side's model (None: no such side); one that does not load
    is left out, with why in ``info``."""
    scorers = {}
    for side, model in models.items():
        if model is None:
            continue
        try:
            scorers[side] = _toolkit_scorer(model, prefill, options)
        except Exception as exc:  # reported per model; the other sides still run
            info[f"{side}_load"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return scorers


def _toolkit_decode(lm, prompts: np.ndarray, beam: int, options: PeerBenchOptions) -> tuple[list, np.ndarray]:
    from gpudecode.scorers import UtteranceBatch
    from gpudecode.search import LabelSyncOptions, label_sync_search

    xp = np
    if options.device == "cuda":
        import cupy as xp
    n = len(prompts)
    batch = UtteranceBatch(ids=[f"p{u}" for u in range(n)], input_lengths=np.full(n, options.new_tokens),
                           inputs={"prompt": prompts}, sizes={"prompt": np.full(n, prompts.shape[1])})
    # greedy (one beam) as generate's and GenAI's greedy search: a lane ends at its sentence end; beams
    # as their beam searches: finished hypotheses kept apart
    search = LabelSyncOptions(beam_size=beam, sentence_end=EOS, max_labels_per_input=1.0, max_labels=options.new_tokens,
                              finished="separate" if beam > 1 else "in-beam", early_stopping=False,
                              length_norm_scale=0.0, nbest=1, min_length=options.new_tokens)
    nbest = label_sync_search([("lm", lm, 1.0)], batch, search, xp=xp)
    return [h[0].labels for h in nbest], np.array([h[0].score for h in nbest])


def _prepare(step: Path, out: Path, options: PeerBenchOptions, info: dict) -> tuple[Path | None, str | None]:
    """``gpudecode.prepare``'s rewrite of ``step`` (a float32 export; float16 with ``dtype`` float16) into
    ``out`` and None, or None and why not; the form written goes into ``info``."""
    try:
        from gpudecode.prepare.api import prepare_model
    except ImportError as exc:
        return None, f"prepare not available ({exc})"
    try:
        report = prepare_model(step, out, float16=options.dtype == "float16")
    except Exception as exc:  # the bench reports a model prepare refuses; it does not stop
        return None, f"prepare failed: {type(exc).__name__}: {exc}"
    info["prepared_form"] = report.form if report.reason is None else f"{report.form}: {report.reason}"
    info["prepared_fused_ops"] = dict(report.fused_ops)
    return out, None


def _genai_search(folder: Path, prompts: np.ndarray, beam: int, options: PeerBenchOptions):
    import onnxruntime_genai as og

    if options.threads:
        config = json.loads((folder / "genai_config.json").read_text())
        config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = options.threads
        (folder / "genai_config.json").write_text(json.dumps(config, indent=4))
    model = og.Model(str(folder))
    total = prompts.shape[1] + options.new_tokens

    def run():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False, num_beams=beam,
                                  num_return_sequences=1, batch_size=len(prompts), length_penalty=0.0,
                                  early_stopping=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompts.astype(np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        return [[int(t) for t in generator.get_sequence(i)][prompts.shape[1]:] for i in range(len(prompts))]

    return run


def _cell(family, layers, width, export, prompts, beam, options) -> dict:
    return {"family": family, "layers": layers, "width": width, "vocab": options.vocab, "export": export,
            "dtype": options.dtype, "prompts": len(prompts), "beam": beam, "new_tokens": options.new_tokens,
            "sides": {}}


def _measure(cell: dict, side: str, run, sync, torch_side: _Torch, prompts: np.ndarray, reference: dict | None,
             options: PeerBenchOptions) -> dict | None:
    """Times ``run`` (-> sequences, or (sequences, own scores)), rescoring its sequences; stores the side."""
    try:
        seconds, out = _timed(run, options.repeats, sync)
    except Exception as exc:  # a peer that cannot run this cell is reported, not fatal
        cell["sides"][side] = {"note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        return None
    sequences = out[0] if isinstance(out, tuple) else out
    lengths = sorted({len(seq) for seq in sequences})
    if lengths != [options.new_tokens]:  # parity needs every side to decode the same number of labels
        cell["sides"][side] = {**side_result(seconds, new_tokens=options.new_tokens, num_prompts=len(prompts),
                                             reference_seconds=None if reference is None else reference["s"]),
                               "note": f"decoded {lengths} labels, not {options.new_tokens}: no parity"}
        return None
    rescored = torch_side.rescore(prompts, sequences)
    scores = out[1] if isinstance(out, tuple) else rescored  # a side's own scores where it reports them
    ref_s = None if reference is None else reference["s"]
    result = side_result(seconds, new_tokens=options.new_tokens, num_prompts=len(prompts), reference_seconds=ref_s,
                         sequences=sequences, reference_sequences=None if reference is None else reference["sequences"],
                         scores=scores, reference_scores=None if reference is None else reference["scores"])
    if isinstance(out, tuple):  # the side's own score against the torch model's rescoring of its sequence
        result["own_score_max_diff"] = float(np.max(np.abs(out[1] - rescored)))
    cell["sides"][side] = result
    return {"s": seconds, "sequences": sequences, "scores": rescored}


def _note_graphs(cell: dict, side: str, lm) -> None:
    """The CUDA graphs the toolkit's scorer captured so far, next to its side's figures (0: plain runs)."""
    if side in cell["sides"]:
        cell["sides"][side]["captured_graphs"] = int(lm.captured_graphs)


def _check_export(torch_side: _Torch, step: Path, prefill: Path, prompts: np.ndarray) -> float:
    """max |Δ| of the first generated position's logits: prefill + one step of the export against torch."""
    import onnxruntime as ort

    torch = torch_side.torch
    ids = prompts[:4]
    with torch.no_grad():
        logits = torch_side.model(input_ids=torch.as_tensor(ids, device=torch_side.device)).logits
    want = logits[:, -1].float().cpu().numpy()
    pre = ort.InferenceSession(str(prefill), providers=["CPUExecutionProvider"])
    p = ids.shape[1] - 1
    out = pre.run(None, {"input_ids": ids[:, :p], "attention_mask": np.ones((len(ids), p), np.int64),
                         "position_ids": np.tile(np.arange(p), (len(ids), 1))})
    names = [o.name for o in pre.get_outputs()]
    feeds = {k.replace("present.", "past_key_values."): v for k, v in zip(names[1:], out[1:])}
    feeds.update({"input_ids": ids[:, p:], "attention_mask": np.ones((len(ids), p + 1), np.int64),
                  "position_ids": np.full((len(ids), 1), p)})
    got = ort.InferenceSession(str(step), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0][:, -1]
    return float(np.abs(got.astype(np.float32) - want).max())


def _run_model(family: str, layers: int, width: int, options: PeerBenchOptions, all_prompts: np.ndarray,
               tmp: Path, results: dict) -> None:
    import torch

    gpt2 = fixture_script("gpt2")
    # the standard export in float32 (what prepare takes; with --dtype float16 it writes float16 itself),
    # and with --dtype float16 the same weights exported in float16 for the unprepared side
    name = f"{family}-{layers}x{width}x{options.vocab}"
    folders = {"float32": tmp / name}
    if options.dtype == "float16":
        folders["float16"] = tmp / f"{name}-float16"
    model_info = {"family": family, "layers": layers, "width": width, "export": "torch.onnx"}
    for dtype, folder in folders.items():
        folder.mkdir()
        exported = build_model(family, layers, width, options)
        with torch.no_grad(), warnings.catch_warnings():  # (the tracer's warnings about transformers' code)
            warnings.simplefilter("ignore")
            # the export leaves its module altered: generate runs on a fresh one
            gpt2.export(exported if dtype == "float32" else exported.half(), folder)
        if dtype == "float16":
            model_info["float16_export"] = _valid_float16(folders["float32"], folder)
    hf = _Torch(build_model(family, layers, width, options), options)
    folder = folders[options.dtype]
    step, prefill = folder / "decoder_with_past_model.onnx", folder / "decoder_model.onnx"
    try:
        model_info["export_max_abs_logit_diff"] = _check_export(hf, step, prefill, all_prompts)
    except Exception as exc:  # (float16 exports where ONNX Runtime's CPU provider lacks a kernel)
        model_info["export_check"] = f"not run: {type(exc).__name__}: {str(exc)[:200]}"
    results["models"].append(model_info)
    prepared, why = _prepare(folders["float32"] / "decoder_with_past_model.onnx",
                             folder / "decoder_with_past_model.prepared.onnx", options, model_info)
    if why:
        model_info["prepared_form"] = why
    toolkit = _scorers({"gpudecode": step, "gpudecode_prepared": prepared}, prefill, options, model_info)
    compiled = _Torch(build_model(family, layers, width, options), options) if options.compile else None
    for count in options.prompts:
        prompts = all_prompts[:count]
        for beam in options.beams:
            cell = _cell(family, layers, width, "torch.onnx", prompts, beam, options)
            ref = _measure(cell, "hf_generate", lambda: hf.generate(prompts, beam), hf.sync, hf, prompts, None, options)
            if compiled is not None:
                _measure(cell, "hf_generate_compiled", lambda: compiled.generate(prompts, beam, compiled=True),
                         compiled.sync, hf, prompts, ref, options)
            for side, lm in toolkit.items():
                _measure(cell, side, lambda lm=lm: _toolkit_decode(lm, prompts, beam, options),
                         lambda: synchronize(_array_module(options)), hf, prompts, ref, options)
                _note_graphs(cell, side, lm)
            if why and "gpudecode_prepared" not in cell["sides"]:
                cell["sides"]["gpudecode_prepared"] = {"note": why}
            results["cells"].append(cell)
    for lm in toolkit.values():
        lm.close()
    if family == "llama":
        _run_genai(layers, width, options, all_prompts, hf, tmp, results)


def _valid_float16(float32: Path, float16: Path) -> str:
    """How the float16 pair in ``float16`` was made: torch.onnx of the float16 model where its graphs
    type-check, else (torch.onnx writes GPT-2's LayerNormalization with mixed types) the float32
    export converted by ONNX Runtime's float16 converter."""
    import onnx

    names = ("decoder_with_past_model.onnx", "decoder_model.onnx")
    try:
        for name in names:
            onnx.shape_inference.infer_shapes(onnx.load(str(float16 / name)), check_type=True, strict_mode=True)
        return "torch.onnx of the float16 model"
    except Exception as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    from onnxruntime.transformers.float16 import convert_float_to_float16

    for name in names:
        onnx.save(convert_float_to_float16(onnx.load(str(float32 / name))), str(float16 / name))
    return f"the float32 export through ONNX Runtime's float16 converter (torch.onnx's float16 graph: {why})"


def _array_module(options: PeerBenchOptions):
    if options.device == "cuda":
        import cupy

        return cupy
    return np


def _run_genai(layers: int, width: int, options: PeerBenchOptions, all_prompts: np.ndarray, hf: _Torch, tmp: Path,
               results: dict) -> None:
    """GenAI's builder export of the same Llama weights: GenAI's own search, the toolkit on that export
    (and on its prepared form), HF generate; ``genai_prompts`` prompts."""
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        results["notes"].append("onnxruntime_genai is not installed: no GenAI cells")
        return
    if options.device == "cuda" and options.dtype == "float32":
        results["notes"].append(GENAI_NO_FLOAT32_CUDA)
        return
    genai = fixture_script("genai")
    name = f"llama-{layers}x{width}x{options.vocab}"
    hf_dir, folder = tmp / f"{name}-hf", tmp / f"{name}-genai"
    build_model("llama", layers, width, options).save_pretrained(hf_dir)
    genai.save_tokenizer(hf_dir, options.vocab, bos=1, eos=EOS, pad=PAD)
    precision = "fp16" if options.dtype == "float16" else "fp32"
    try:
        genai.export(hf_dir, folder, precision, options.device)
    except Exception as exc:
        results["notes"].append(f"GenAI's builder failed ({precision}, {options.device}): {exc}")
        return
    prompts = all_prompts[:options.genai_prompts]
    model_info = {"family": "llama", "layers": layers, "width": width, "export": f"GenAI builder ({precision})"}
    results["models"].append(model_info)
    toolkit = {"gpudecode": folder}
    # the builder's export is written in the cell's float type already: prepared as it is
    prepared, why = _prepare(folder / "model.onnx", tmp / f"{name}-prepared" / "model.onnx",
                             replace(options, dtype="float32"), model_info)
    if prepared is not None:
        toolkit["gpudecode_prepared"] = prepared.parent
    else:
        model_info["prepared_form"] = why
    scorers = _scorers(toolkit, None, options, model_info)
    for beam in options.beams:
        cell = _cell("llama", layers, width, "GenAI builder", prompts, beam, options)
        ref = _measure(cell, "hf_generate", lambda: hf.generate(prompts, beam), hf.sync, hf, prompts, None, options)
        for side, lm in scorers.items():
            _measure(cell, side, lambda lm=lm: _toolkit_decode(lm, prompts, beam, options),
                     lambda: synchronize(_array_module(options)), hf, prompts, ref, options)
            _note_graphs(cell, side, lm)
        if why:
            cell["sides"]["gpudecode_prepared"] = {"note": why}
        try:
            run = _genai_search(folder, prompts, beam, options)
        except Exception as exc:
            cell["sides"]["genai"] = {"note": f"GenAI did not load its export: {type(exc).__name__}: {exc}"}
        else:
            _measure(cell, "genai", run, lambda: None, hf, prompts, ref, options)
        results["cells"].append(cell)
    for lm in scorers.values():
        lm.close()


def _machine(device: str) -> str:
    """The CPU's model name and core count (and the GPU's name on CUDA)."""
    import os

    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    machine = f"{cpu}, {os.cpu_count()} cores"
    return f"{torch.cuda.get_device_name(0)}; {machine}" if device == "cuda" else machine


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": sys.version.split()[0]}
    for package in ("torch", "transformers", "onnxruntime", "onnxruntime-gpu", "onnxruntime-genai",
                    "onnxruntime-genai-cuda", "cupy-cuda12x", "cupy-cuda13x"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


def run_peers_bench(options: PeerBenchOptions = PeerBenchOptions(), output_dir=None, name: str = "peers") -> dict:
    """Runs every cell (see the module docstring); returns the results and writes ``<name>.json`` and
    ``<name>.png`` into ``output_dir`` when given."""
    import torch

    if options.threads:
        torch.set_num_threads(options.threads)
    if options.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    results = {"benchmark": "peers",
               "config": {**asdict(options), "timing": f"fastest of {options.repeats} after a warm-up",
                          "init_range": f"{INIT_SCALE} / sqrt(width)", "eos": EOS,
                          "machine": _machine(options.device),
                          "torch_threads": torch.get_num_threads(), "tf32": False, "versions": _versions()},
               "models": [], "cells": [], "notes": []}
    prompts = make_prompts(options)
    with tempfile.TemporaryDirectory() as tmp:
        for layers, width, *vocab in options.shapes:
            for family in options.families:
                _run_model(family, layers, width, replace(options, vocab=vocab[0] if vocab else options.vocab),
                           prompts, Path(tmp), results)
    return write_results(results, output_dir, name, plot_peers)
