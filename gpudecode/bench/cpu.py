"""``gpudecode bench cpu``: the CPU path against the CPU decoders people use, same inputs, one thread.

Measured in one run (each peer part only where the peer imports; otherwise a note in the JSON):
- CTC prefix beam search (no LM) against pyctcdecode's ``decode_beams`` (its default pruning,
  ``beam_prune_logp`` and ``token_min_logp``): peaky random log-probs (``random_log_probs``), frames/s
  of the toolkit with all utterances in one call and one utterance per call, of pyctcdecode one
  utterance per call (its batched ``decode_beams_batch`` needs a process pool); the toolkit unpruned
  (its default) and with pyctcdecode's default pruning as its options (:data:`CTC_PRUNING`); best
  transcripts equal on how many utterances, and where they differ, which has the higher exact CTC
  log-likelihood (:func:`ctc_log_likelihood`, the forward algorithm);
- LM decoding of ONNX Runtime GenAI's own export (``tests/fixtures/peers/genai``) against GenAI's
  CPU greedy and beam search, one generator per prompt (its left-padded batch gives other tokens):
  sequences that end at sentence-end (most end early), and greedy sequences that all run to the
  context (sentence-end masked by ``min_length`` on both sides);
- GPT-2 (``tests/fixtures/peers/gpt2``) against ``transformers`` ``generate`` on torch CPU, one prompt
  per call.

One thread on both sides: ``OMP_NUM_THREADS=1`` is set before the peers load, ONNX Runtime's
``intra_op_num_threads`` = 1 (the toolkit's ``SessionOptions.intra_op_threads``; GenAI's config's
session options), ``torch.set_num_threads(1)``. On a machine of more than one core the CTC cells run
a second time on all cores on both sides: the toolkit's compiled loop with ``cpu_threads`` = cores
(all utterances in one call) against pyctcdecode's ``decode_beams_batch`` with a process pool of as
many processes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import string
import tempfile
import time
from pathlib import Path

import numpy as np

from gpudecode.bench.common import pyplot, save_figure, write_results

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "tests" / "fixtures" / "peers"
#: pyctcdecode's labels: the blank ("", index 0, the toolkit's blank) and single characters (no space:
#: one word per transcript, no "_", which it would take for a blank)
CHARACTERS = string.ascii_letters + string.digits + "!#$%&()*+,-./:;<=>?@[]^{|}~"


def ctc_log_likelihood(log_probs: np.ndarray, labels, blank: int = 0) -> float:
    """The exact CTC log-likelihood log p(labels | log_probs) of one utterance ([T, V] frame
    log-probs), by the forward algorithm over the blank-extended label sequence (float64)."""
    log_probs = np.asarray(log_probs, dtype=np.float64)
    extended = [blank]
    for label in labels:
        extended += [int(label), blank]
    size = len(extended)
    ext = np.array(extended)
    # a state may be entered from two back when it is a label differing from the label two back
    skip = np.zeros(size, bool)
    skip[2:] = (ext[2:] != blank) & (ext[2:] != ext[:-2])
    alpha = np.full(size, -np.inf)
    if log_probs.shape[0] == 0:
        return 0.0 if not len(labels) else -np.inf
    alpha[0] = log_probs[0, blank]
    if size > 1:
        alpha[1] = log_probs[0, ext[1]]
    for t in range(1, log_probs.shape[0]):
        one, two = np.full(size, -np.inf), np.full(size, -np.inf)
        one[1:] = alpha[:-1]
        two[2:] = np.where(skip[2:], alpha[:-2], -np.inf)
        alpha = np.logaddexp(np.logaddexp(alpha, one), two) + log_probs[t, ext]
    return float(np.logaddexp(alpha[-1], alpha[-2]) if size > 1 else alpha[-1])


def peaky_log_probs(num_utts: int, num_frames: int, vocab_size: int, *, seed: int = 0, blank_share: float = 0.6,
                    peak: float = 8.0, noise: float = 1.5) -> np.ndarray:
    """[U, T, V] float32 log-softmax shaped like a trained CTC model's output: runs of 1–3 frames
    each dominated by one class (the blank with probability ``blank_share``, else a random label),
    that class's logit raised by ``peak`` over Gaussian noise (scale ``noise``): the dominant class
    holds about 0.9 of each frame, and the runner-up labels sit near pyctcdecode's
    ``token_min_logp`` (-5)."""
    rng = np.random.default_rng(seed)
    dominant = np.empty((num_utts, num_frames), np.int64)
    for u in range(num_utts):
        runs = rng.integers(1, 4, num_frames)
        classes = np.where(rng.random(num_frames) < blank_share, 0, rng.integers(1, vocab_size, num_frames))
        dominant[u] = np.repeat(classes, runs)[:num_frames]
    logits = rng.standard_normal((num_utts, num_frames, vocab_size)).astype(np.float32) * np.float32(noise)
    np.put_along_axis(logits, dominant[..., None],
                      np.take_along_axis(logits, dominant[..., None], axis=2) + np.float32(peak), axis=2)
    logits -= logits.max(axis=2, keepdims=True)
    logits -= np.log(np.exp(logits).sum(axis=2, keepdims=True))
    return logits


def _version(package: str) -> str | None:
    """The installed version of ``package`` (None: not installed): numba decides whether the CTC
    search runs its compiled loop (``SearchTuning.compiled_cpu_loops``)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fastest_wall(run, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


#: The CTC inputs: "peaky" (:func:`peaky_log_probs`, like a trained model's output) and "flat"
#: (``gpudecode.bench.ctc.random_log_probs``: blank-biased random logits, the top class often near 0.5)
CTC_INPUTS = {"peaky": "gpudecode.bench.cpu.peaky_log_probs (seed 0)",
              "flat": "gpudecode.bench.ctc.random_log_probs (seed 0, sharpness 4, blank bias 8)"}


#: The toolkit's pruning rows: none (its default), and pyctcdecode's default pruning as its options
#: (``token_min_logp`` -5; ``beam_prune_logp`` -10 as ``score_threshold`` 10)
CTC_PRUNING = {"none": {}, "pyctcdecode": {"token_min_logp": -5.0, "score_threshold": 10.0}}


def _compare_best(ours, theirs, log_probs) -> dict:
    """Best transcripts equal on how many utterances; where they differ, whose exact CTC
    log-likelihood is higher."""
    differ = []
    for u, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            mine, peer_ll = ctc_log_likelihood(log_probs[u], a), ctc_log_likelihood(log_probs[u], b)
            differ.append({"utterance": u, "gpudecode_log_likelihood": mine, "pyctcdecode_log_likelihood": peer_ll,
                           "higher": "gpudecode" if mine > peer_ll else ("pyctcdecode" if peer_ll > mine else "equal")})
    return {"best_equal": len(ours) - len(differ), "differing": differ}


def _ctc_part(*, num_utts: int, num_frames: int, vocab_size: int, beams, repeats: int, inputs,
              cores: int = 1) -> dict:
    """Per (inputs, beam) one cell: the toolkit unpruned (its default) against pyctcdecode, and in
    ``cell["pruned"]`` the toolkit with pyctcdecode's default pruning (:data:`CTC_PRUNING`) against
    the same pyctcdecode run."""
    from gpudecode.bench.ctc import random_log_probs
    from gpudecode.search import CtcPrefixOptions, ctc_prefix_search
    from gpudecode.search.tuning import SearchTuning

    lengths = np.full(num_utts, num_frames, dtype=np.int64)
    total = num_utts * num_frames
    part = {"utterances": num_utts, "frames": num_frames, "classes": vocab_size,
            "inputs": {name: CTC_INPUTS[name] for name in inputs}, "gpudecode_pruning": CTC_PRUNING, "cells": []}
    try:
        import pyctcdecode  # noqa: F401

        pyctc_version = importlib.metadata.version("pyctcdecode")
    except ImportError:
        pyctc_version = None
    decoder = None
    if pyctc_version is not None:
        import logging

        from pyctcdecode import build_ctcdecoder
        from pyctcdecode.constants import DEFAULT_MIN_TOKEN_LOGP, DEFAULT_PRUNE_LOGP

        logging.getLogger("pyctcdecode").setLevel(logging.ERROR)
        if vocab_size - 1 > len(CHARACTERS):
            raise ValueError(f"bench cpu: at most {len(CHARACTERS) + 1} classes for pyctcdecode")
        labels = [""] + list(CHARACTERS[:vocab_size - 1])
        decoder = build_ctcdecoder(labels)
        index = {c: i for i, c in enumerate(labels)}
        part["pyctcdecode"] = {"version": pyctc_version, "beam_prune_logp": DEFAULT_PRUNE_LOGP,
                               "token_min_logp": DEFAULT_MIN_TOKEN_LOGP, "lm": None,
                               "call": "decode_beams, one utterance per call"}
    else:
        part["pyctcdecode"] = None
        part["note"] = "pyctcdecode is not installed: the toolkit alone"
    pool = None
    if cores > 1:  # all cores on both sides: the toolkit's threads, pyctcdecode's process pool
        part["all_cores"] = {"cores": cores, "gpudecode": f"all utterances in one call, cpu_threads={cores}"}
        if decoder is not None:
            import multiprocessing

            pool = multiprocessing.get_context("fork").Pool(cores)  # before any thread starts
            part["all_cores"]["pyctcdecode"] = f"decode_beams_batch with a pool of {cores} processes"
    threaded = SearchTuning(cpu_threads=cores)

    def toolkit(log_probs, options) -> dict:
        """The toolkit's figures of one cell (and its best transcripts under "best")."""
        for tuning in (SearchTuning(), threaded):  # warm-up (and the compiled loops' first compilation)
            ctc_prefix_search(log_probs[:, :8], np.full(num_utts, 8), options, tuning=tuning)
        batched_s, nbest = _fastest_wall(lambda: ctc_prefix_search(log_probs, lengths, options), repeats)
        single_s, _ = _fastest_wall(lambda: [ctc_prefix_search(log_probs[u:u + 1], lengths[u:u + 1], options)
                                             for u in range(num_utts)], repeats)
        row = {"gpudecode_batched_s": batched_s, "gpudecode_batched_frames_per_s": total / batched_s,
               "gpudecode_per_utterance_s": single_s, "gpudecode_per_utterance_frames_per_s": total / single_s,
               "best": [hyps[0].labels for hyps in nbest]}
        if cores > 1:
            threaded_s, _ = _fastest_wall(lambda: ctc_prefix_search(log_probs, lengths, options, tuning=threaded),
                                          repeats)
            row.update({"gpudecode_threaded_s": threaded_s, "gpudecode_threaded_frames_per_s": total / threaded_s})
        return row

    cases = [(name, beam) for name in inputs for beam in beams]
    for name, beam in cases:
        log_probs = peaky_log_probs(num_utts, num_frames, vocab_size) if name == "peaky" else \
            random_log_probs(np, num_utts, num_frames, vocab_size)
        rows = {pruning: toolkit(log_probs, CtcPrefixOptions(beam_size=beam, sentence_end=None, nbest=1, **settings))
                for pruning, settings in CTC_PRUNING.items()}
        peer_row = {}
        if decoder is not None:
            def peer():
                return [decoder.decode_beams(log_probs[u], beam_width=beam)[0][0] for u in range(num_utts)]

            peer_s, texts = _fastest_wall(peer, repeats)
            theirs = [[index[c] for c in text] for text in texts]
            peer_row = {"pyctcdecode_s": peer_s, "pyctcdecode_frames_per_s": total / peer_s}
            if pool is not None:
                pool_s, _ = _fastest_wall(lambda: decoder.decode_beams_batch(pool, list(log_probs), beam_width=beam),
                                          repeats)
                peer_row.update({"pyctcdecode_pool_s": pool_s, "pyctcdecode_pool_frames_per_s": total / pool_s})
            for row in rows.values():
                row.update(peer_row, batched_over_pyctcdecode=peer_s / row["gpudecode_batched_s"],
                           per_utterance_over_pyctcdecode=peer_s / row["gpudecode_per_utterance_s"],
                           **_compare_best(row["best"], theirs, log_probs))
                if pool is not None:
                    row["threaded_over_pyctcdecode_pool"] = pool_s / row["gpudecode_threaded_s"]
        for row in rows.values():
            del row["best"]
        cell = {"inputs": name, "beam": beam, **rows["none"],
                "pruned": {"gpudecode_pruning": "pyctcdecode", **rows["pyctcdecode"]}}
        part["cells"].append(cell)
    if pool is not None:
        pool.close()
        pool.join()
    return part


def _prompts(base: list[list[int]], count: int, vocab: int, avoid: int) -> list[list[int]]:
    """``count`` prompts: the fixture's, then each extended by deterministic tokens (never ``avoid``)."""
    prompts = []
    for i in range(count):
        extra = [(13 * i + 7 * j + 2) % vocab for j in range(i // len(base))]
        prompts.append(list(base[i % len(base)]) + [t if t != avoid else (t + 1) % vocab for t in extra])
    return prompts


def _lm_batch(prompts: list[list[int]], new_tokens: list[int]):
    from gpudecode.scorers import UtteranceBatch

    sizes = np.array([len(p) for p in prompts])
    table = np.zeros((len(prompts), sizes.max()), np.int64)
    for u, prompt in enumerate(prompts):
        table[u, :len(prompt)] = prompt
    return UtteranceBatch(ids=[f"p{u}" for u in range(len(prompts))], input_lengths=np.array(new_tokens),
                          inputs={"prompt": table}, sizes={"prompt": sizes})


def _genai_part(*, num_prompts: int, beams, repeats: int, max_length_beams=(1,)) -> dict:
    from gpudecode.scorers.prefix_lm import PrefixLmScorer
    from gpudecode.search import LabelSyncOptions, label_sync_search
    from gpudecode.session import SessionOptions

    fixture = PEERS / "genai"
    document = json.loads((fixture / "expected.json").read_text())
    config = json.loads((fixture / "genai_config.json").read_text())
    eos, context = document["eos"], config["model"]["context_length"]
    vocab = config["model"]["vocab_size"]
    prompts = _prompts(document["prompts"], num_prompts, vocab, eos)
    new_tokens = [min(64, context - len(p)) for p in prompts]
    part = {"export": "tests/fixtures/peers/genai (GenAI model builder, fp32 CPU Llama with GroupQueryAttention)",
            "prompts": len(prompts), "max_length": context, "new_tokens": "min(64, context - prompt)",
            "ends": {"eos": "each sequence ends at sentence-end (most end early) or the context",
                     "max-length": "sentence-end masked (min_length = context on both sides): every sequence "
                                   "runs to the context (greedy only)"},
            "cells": []}
    try:
        import onnxruntime_genai as og
    except ImportError:
        og = None
        part["note"] = "onnxruntime_genai is not installed: the toolkit alone"
    lm = PrefixLmScorer(model=str(fixture), vocab_size=vocab, scores_kind="logits",
                        session_options=SessionOptions(device="cpu", intra_op_threads=1))
    with tempfile.TemporaryDirectory() as tmp:
        model = None
        if og is not None:
            part["onnxruntime_genai"] = getattr(og, "__version__", "unknown")
            folder = Path(tmp)
            shutil.copy(fixture / "model.onnx", folder / "model.onnx")
            config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 1
            (folder / "genai_config.json").write_text(json.dumps(config))
            model = og.Model(str(folder))
        cells = [("eos", beam) for beam in beams] + [("max-length", beam) for beam in beams if beam in max_length_beams]
        for ends, beam in cells:
            # "max-length": sentence-end masked on both sides (min_length: the toolkit's counts labels,
            # GenAI's the prompt too), so every prompt runs to the context
            min_length = context if ends == "max-length" else 0
            options = LabelSyncOptions(beam_size=1, sentence_end=eos, max_labels_per_input=1.0,
                                       min_length=min_length) if beam == 1 else \
                LabelSyncOptions(beam_size=beam, sentence_end=eos, max_labels_per_input=1.0, max_labels=context,
                                 finished="separate-genai", early_stopping=True, length_norm_scale=1.0,
                                 length_counts="prompt-and-labels", nbest=1, min_length=min_length)
            batch = _lm_batch(prompts, new_tokens)
            label_sync_search([("genai", lm, 1.0)], batch, options, xp=np)  # warm-up
            ours_s, nbest = _fastest_wall(lambda: label_sync_search([("genai", lm, 1.0)], batch, options, xp=np),
                                          repeats)
            ours = [[*p, *hyps[0].labels] for p, hyps in zip(prompts, nbest)]
            generated = sum(len(h[0].labels) for h in nbest)
            cell = {"ends": ends, "beam": beam, "gpudecode_s": ours_s, "gpudecode_tokens": generated,
                    "gpudecode_tokens_per_s": generated / ours_s, "gpudecode_call": "all prompts in one call"}
            if model is not None:
                def peer():
                    sequences = []
                    for prompt in prompts:
                        params = og.GeneratorParams(model)
                        params.set_search_options(max_length=context, do_sample=False, num_beams=beam,
                                                  num_return_sequences=1, batch_size=1, min_length=min_length)
                        generator = og.Generator(model, params)
                        generator.append_tokens(np.array([prompt], np.int32))
                        while not generator.is_done():
                            generator.generate_next_token()
                        sequences.append([int(t) for t in generator.get_sequence(0)])
                    return sequences

                peer()  # warm-up
                peer_s, theirs = _fastest_wall(peer, repeats)
                peer_tokens = sum(len(s) - len(p) for s, p in zip(theirs, prompts))
                cell.update({"genai_s": peer_s, "genai_tokens": peer_tokens, "genai_tokens_per_s": peer_tokens / peer_s,
                             "genai_call": "one generator per prompt",
                             "speed_over_genai": (generated / ours_s) / (peer_tokens / peer_s),
                             "best_equal": sum(a == b for a, b in zip(ours, theirs))})
            part["cells"].append(cell)
        model = None
    lm.close()
    return part


def _gpt2_part(*, num_prompts: int, beams, repeats: int) -> dict:
    from gpudecode.scorers.prefix_lm import PrefixLmScorer
    from gpudecode.search import LabelSyncOptions, label_sync_search
    from gpudecode.session import SessionOptions
    from gpudecode.states.options import StateManagerOptions

    fixture = PEERS / "gpt2"
    document = json.loads((fixture / "expected.json").read_text())
    eos, vocab = document["eos"], document["vocab_size"]
    spec = importlib.util.spec_from_file_location("gpt2_fixture", ROOT / "tools" / "peer-fixtures" / "gpt2.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    positions = script.POSITIONS
    prompts = _prompts(document["prompts"], num_prompts, vocab, eos)
    new_tokens = [min(64, positions - len(p)) for p in prompts]
    part = {"export": "tests/fixtures/peers/gpt2 (torch.onnx, Hugging Face decoder-with-past convention)",
            "prompts": len(prompts), "positions": positions, "new_tokens": "min(64, positions - prompt)",
            "cells": []}
    try:
        import torch
        import transformers
    except ImportError:
        torch = None
        part["note"] = "torch / transformers are not installed: the toolkit alone"
    reference = None
    if torch is not None:
        torch.set_num_threads(1)
        part["transformers"], part["torch"] = transformers.__version__, torch.__version__
        part["torch_threads"] = torch.get_num_threads()
        reference = script.model()
    threads = SessionOptions(device="cpu", intra_op_threads=1)
    lm = PrefixLmScorer(model=str(fixture / "decoder_with_past_model.onnx"),
                        prefill_model=str(fixture / "decoder_model.onnx"), vocab_size=vocab, scores_kind="logits",
                        state_manager=StateManagerOptions(type="transformer-cpu"), session_options=threads)
    for beam in beams:
        options = LabelSyncOptions(beam_size=beam, sentence_end=eos, max_labels_per_input=1.0, max_labels=64,
                                   finished="separate", early_stopping=False,
                                   length_norm_scale=0.0 if beam == 1 else 1.0, nbest=1)
        batch = _lm_batch(prompts, new_tokens)
        label_sync_search([("lm", lm, 1.0)], batch, options, xp=np)  # warm-up
        ours_s, nbest = _fastest_wall(lambda: label_sync_search([("lm", lm, 1.0)], batch, options, xp=np), repeats)
        ours = [h[0].labels + [eos] * (h[0].length - len(h[0].labels)) for h in nbest]
        generated = sum(map(len, ours))
        cell = {"beam": beam, "gpudecode_s": ours_s, "gpudecode_tokens": generated,
                "gpudecode_tokens_per_s": generated / ours_s, "gpudecode_call": "all prompts in one call"}
        if reference is not None:
            def peer():
                out = []
                with torch.no_grad():
                    for prompt, new in zip(prompts, new_tokens):
                        ids = torch.tensor([prompt])
                        sequence = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                                      eos_token_id=eos, pad_token_id=eos, do_sample=False,
                                                      num_beams=beam, early_stopping=False, length_penalty=1.0)
                        tokens = sequence[0, len(prompt):].tolist()
                        out.append(tokens[:tokens.index(eos) + 1] if eos in tokens else tokens)
                return out

            peer()  # warm-up
            peer_s, theirs = _fastest_wall(peer, repeats)
            peer_tokens = sum(map(len, theirs))
            cell.update({"transformers_s": peer_s, "transformers_tokens": peer_tokens,
                         "transformers_tokens_per_s": peer_tokens / peer_s,
                         "transformers_call": "generate, one prompt per call",
                         "speed_over_transformers": (generated / ours_s) / (peer_tokens / peer_s),
                         "best_equal": sum(a == b for a, b in zip(ours, theirs))})
        part["cells"].append(cell)
    lm.close()
    return part


def run_cpu_bench(*, num_utts: int = 64, num_frames: int = 500, vocab_size: int = 80, beams=(8, 25),
                  ctc_inputs=("peaky", "flat"),
                  lm_prompts: int = 16, genai_beams=(1, 4), gpt2_beams=(1, 8), parts=("ctc", "genai", "gpt2"),
                  repeats: int = 1, cores: int | None = None, output_dir=None) -> dict:
    """Runs every comparison in one process, one thread each side; returns (and writes ``cpu.json``).
    ``cores`` (None: all the machine's): the CTC cells also run on that many cores on both sides
    (the toolkit's threads against pyctcdecode's process pool) where it is more than one."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    if set(ctc_inputs) - set(CTC_INPUTS):
        raise ValueError(f"run_cpu_bench: ctc_inputs must be among {sorted(CTC_INPUTS)}, got {list(ctc_inputs)}")
    unknown = set(parts) - {"ctc", "genai", "gpt2"}
    if unknown:
        raise ValueError(f"run_cpu_bench: unknown parts {sorted(unknown)}; expected ctc, genai, gpt2")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {"benchmark": "cpu", "config": {
        "threads": 1, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "timing": f"fastest of {repeats}",
        "parts": list(parts), "numba": _version("numba"), "cores": cores}}
    if "ctc" in parts:
        results["ctc"] = _ctc_part(num_utts=num_utts, num_frames=num_frames, vocab_size=vocab_size,
                                   beams=beams, repeats=repeats, inputs=ctc_inputs, cores=cores)
    if "genai" in parts:
        results["genai"] = _genai_part(num_prompts=lm_prompts, beams=genai_beams, repeats=repeats)
    if "gpt2" in parts:
        results["gpt2"] = _gpt2_part(num_prompts=lm_prompts, beams=gpt2_beams, repeats=repeats)
    return write_results(results, output_dir, "cpu", plot_cpu)


def plot_cpu(results: dict, path) -> str | None:
    """Toolkit ÷ peer speed per comparison (1 = as fast)."""
    plt = pyplot()
    if plt is None:
        return None
    names, ratios = [], []
    for cell in results.get("ctc", {}).get("cells", []):
        if "batched_over_pyctcdecode" in cell:
            names += [f"CTC {cell['inputs']} b{cell['beam']} batched", f"CTC {cell['inputs']} b{cell['beam']} 1/call"]
            ratios += [cell["batched_over_pyctcdecode"], cell["per_utterance_over_pyctcdecode"]]
    for part, key, label in (("genai", "speed_over_genai", "GenAI"), ("gpt2", "speed_over_transformers", "GPT-2")):
        for cell in results.get(part, {}).get("cells", []):
            if key in cell:
                names.append(f"{label} b{cell['beam']}" + (" max-len" if cell.get("ends") == "max-length" else ""))
                ratios.append(cell[key])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(ratios)), ratios)
    ax.axhline(1.0, color="k", linestyle="--")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("gpudecode ÷ peer speed")
    ax.set_title("CPU, one thread each side")
    return save_figure(plt, fig, path)


def format_table(results: dict) -> str:
    lines = []
    ctc = results.get("ctc")
    if ctc:
        def ctc_rows(c):  # the unpruned row, then (where measured) the one with pyctcdecode's pruning
            return [("none", c)] + ([("pyctcdecode", c["pruned"])] if "pruned" in c else [])

        lines += ["| CTC inputs | beam | gpudecode pruning | gpudecode batched frames/s | gpudecode 1/call frames/s | "
                  "pyctcdecode frames/s | batched ÷ pyctcdecode | 1/call ÷ pyctcdecode | best equal | "
                  "differing: higher likelihood |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
        for c in ctc["cells"]:
            for pruning, r in ctc_rows(c):
                if "pyctcdecode_frames_per_s" in r:
                    counts = {who: sum(d["higher"] == who for d in r["differing"])
                              for who in ("gpudecode", "pyctcdecode", "equal")}
                    higher = ", ".join(f"{who} {n}" for who, n in counts.items() if n) or "—"
                    peer = (f"{r['pyctcdecode_frames_per_s']:,.0f} | {r['batched_over_pyctcdecode']:.2f} | "
                            f"{r['per_utterance_over_pyctcdecode']:.2f} | {r['best_equal']} / {ctc['utterances']} | "
                            f"{higher}")
                else:
                    peer = "— | — | — | — | —"
                lines.append(f"| {c['inputs']} | {c['beam']} | {pruning} | {r['gpudecode_batched_frames_per_s']:,.0f} | "
                             f"{r['gpudecode_per_utterance_frames_per_s']:,.0f} | {peer} |")
        lines.append("")
        if ctc.get("all_cores"):
            cores = ctc["all_cores"]["cores"]
            lines += [f"| CTC inputs | beam | gpudecode pruning | gpudecode {cores} threads frames/s | "
                      f"pyctcdecode pool of {cores} frames/s | gpudecode ÷ pyctcdecode |", "|---|---:|---|---:|---:|---:|"]
            for c in ctc["cells"]:
                for pruning, r in ctc_rows(c):
                    pool = (f"{r['pyctcdecode_pool_frames_per_s']:,.0f} | {r['threaded_over_pyctcdecode_pool']:.2f}"
                            if "pyctcdecode_pool_s" in r else "— | —")
                    lines.append(f"| {c['inputs']} | {c['beam']} | {pruning} | "
                                 f"{r['gpudecode_threaded_frames_per_s']:,.0f} | {pool} |")
            lines.append("")
    for part, peer, key in (("genai", "GenAI", "genai"), ("gpt2", "transformers", "transformers")):
        section = results.get(part)
        if not section:
            continue
        lines += [f"| {part} sequences end | beam | tokens | gpudecode tokens/s | {peer} tokens/s | "
                  f"gpudecode ÷ {peer} | best equal |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for c in section["cells"]:
            if f"{key}_tokens_per_s" in c:
                ratio = c["speed_over_genai" if part == "genai" else "speed_over_transformers"]
                rest = f"{c[f'{key}_tokens_per_s']:,.0f} | {ratio:.2f} | {c['best_equal']} / {section['prompts']}"
            else:
                rest = "— | — | —"
            lines.append(f"| {c.get('ends', 'eos')} | {c['beam']} | {c['gpudecode_tokens']} | "
                         f"{c['gpudecode_tokens_per_s']:,.0f} | {rest} |")
        lines.append("")
    for part in ("ctc", "genai", "gpt2"):
        if results.get(part, {}).get("note"):
            lines.append(f"{part}: {results[part]['note']}")
    return "\n".join(lines)
