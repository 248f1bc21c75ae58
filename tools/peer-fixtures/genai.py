"""Builds the ONNX Runtime GenAI fixture: a tiny builder export and GenAI's own decodes of it.

Run in the peers environment (torch, transformers, onnxruntime-genai), from the repository root::

    .venv-peers/bin/python tools/peer-fixtures/genai.py

A random-initialised Llama (fixed seed; 2 layers, hidden 64, 4 heads, 2 key-value heads: grouped
query attention; MLP width 96, since the builder takes any Linear of the vocabulary size for the LM
head; vocabulary 128) is saved with ``save_pretrained`` next to a word-level tokenizer (the builder
loads one; the fixture does not need it) and exported with GenAI's model builder::

    python -m onnxruntime_genai.models.builder -i <hf dir> -o <out> -p fp32 -e cpu

``model.onnx`` (its external weights moved inside: one file) and ``genai_config.json`` are copied
to ``tests/fixtures/peers/genai/``, with ``vocab.txt`` (the tokenizer's labels ``t0`` … ``t127``).
Then GenAI's own ``Generator`` decodes ``PROMPTS`` (token ids of different lengths), one prompt
per generator, greedily and with beam search, and ``expected.json`` records its outputs (prompt +
generated tokens, as ``get_sequence`` returns them; greedy rows also with the log-probability of
each generated token from the step's logits), transformers' greedy decodes of the same prompts
(equal to GenAI's, which leave out the final EOS) and the peer versions. GenAI's own batch of these
prompts, left-padded, differs from its single-prompt runs on the padded rows; it is recorded as
``genai_batch_left_padded`` but is no oracle.

Made with: torch 2.13.0+cpu, transformers 5.24.0, onnxruntime 1.32.0, onnxruntime-genai 0.18.0,
tokenizers 0.23.3 (also in ``versions`` of expected.json).

``--target cuda`` makes ``tests/fixtures/peers/genai-cuda/``: the same weights exported by the builder
for CUDA in float16 (``-p fp16 -e cuda``: GroupQueryAttention in float16, past and present sharing one
buffer, as GenAI runs on a GPU), and GenAI's own CUDA decodes of it. The export needs no GPU; GenAI's
decodes do, so the two steps run apart::

    .venv-peers/bin/python tools/peer-fixtures/genai.py --target cuda --step export     # here
    python3 tools/peer-fixtures/genai.py --target cuda --step expected  # on the GPU machine, with
                                                                        # onnxruntime-genai-cuda 0.18.0

The CUDA fixture's expected.json holds no transformers decodes (its ``versions`` are those of the GPU
machine's run).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "peers"
#: target -> (fixture folder, the builder's precision and execution provider)
TARGETS = {"cpu": (FIXTURES / "genai", "fp32", "cpu"), "cuda": (FIXTURES / "genai-cuda", "fp16", "cuda")}
SEED = 0
VOCAB = 128
#: EOS is a label the greedy decodes reach at different steps (the weights do not depend on it)
BOS, EOS, PAD = 1, 79, 0
MAX_LENGTH = 20  # prompt + generated tokens, GenAI's max_length
NUM_BEAMS = 4
#: the beam search's max_length, the model's whole context (max_position_embeddings); the beam search
#: is also recorded at MAX_LENGTH (``beam_at_max_length_20``), where lists fill up at the limit (GenAI,
#: as Hugging Face's former BeamSearchScorer, then adds the open beams only to an utterance not done)
BEAM_MAX_LENGTH = 64
#: token prompts of different lengths (no PAD inside a prompt: GenAI masks pad ids)
PROMPTS = [
    [BOS, 17, 33, 5, 90, 61, 7],
    [BOS, 44],
    [BOS, 100, 3, 12, 77],
    [BOS, 9, 9, 120, 58, 31, 64, 22, 101, 15, 6],
    [BOS],
]


def build_hf(directory: Path) -> list[list[int]]:
    """Saves the model and tokenizer; returns transformers' greedy decodes of ``PROMPTS``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
        initializer_range=0.2,  # peaked distributions: fewer near-ties between tokens
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    greedy = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_length=MAX_LENGTH, do_sample=False, num_beams=1,
                                 eos_token_id=EOS, pad_token_id=PAD)
            greedy.append([int(t) for t in out[0]])
    save_tokenizer(directory, VOCAB, bos=BOS, eos=EOS, pad=PAD)
    return greedy


def save_tokenizer(directory: Path, vocab_size: int, *, bos: int, eos: int, pad: int) -> None:
    """A word-level tokenizer of labels ``t0`` … (the builder loads one) saved into ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=f"t{bos}", eos_token=f"t{eos}", pad_token=f"t{pad}",
                            unk_token="t3").save_pretrained(directory)


def export(hf_dir: Path, out_dir: Path, precision: str = "fp32", provider: str = "cpu") -> None:
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
                    "-o", str(out_dir), "-p", precision, "-e", provider], check=True)


def padded(prompts):
    width = max(len(p) for p in prompts)
    return np.array([[PAD] * (width - len(p)) + p for p in prompts], dtype=np.int32)


def generate(model_dir: Path, prompts, num_beams: int, with_scores: bool, max_length: int = MAX_LENGTH):
    """GenAI's sequences (and, greedy, the log-probability of each generated token). Search options
    not given here are the genai_config.json's: early_stopping true, length_penalty 1."""
    import onnxruntime_genai as og

    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False, num_beams=num_beams,
                              num_return_sequences=num_beams, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(padded(prompts))
    scores = [[] for _ in prompts]
    while not generator.is_done():
        if with_scores:
            logits = np.asarray(generator.get_logits(), dtype=np.float64).reshape(len(prompts), -1)
        generator.generate_next_token()
        if with_scores:
            chosen = np.asarray(generator.get_next_tokens()).reshape(-1)
            shifted = logits - logits.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            for row, label in enumerate(chosen):
                scores[row].append(float(log_probs[row, label]))
    sequences = [[int(t) for t in generator.get_sequence(i)] for i in range(len(prompts) * num_beams)]
    return sequences, scores


def write_export(out: Path, precision: str, provider: str) -> list[list[int]]:
    """Builds the model, exports it into ``out`` (weights inside model.onnx); transformers' greedy decodes."""
    import onnx
    import onnxruntime_genai

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, out_dir = Path(tmp) / "hf", Path(tmp) / "onnx"
        hf_greedy = build_hf(hf_dir)
        export(hf_dir, out_dir, precision, provider)
        # the builder writes the weights as external data: the fixture keeps them inside model.onnx
        model = onnx.load(str(out_dir / "model.onnx"), load_external_data=True)
        model.producer_version = onnxruntime_genai.__version__  # the builder appends the cwd's git commit
        onnx.save(model, str(out / "model.onnx"), save_as_external_data=False)
        shutil.copy(out_dir / "genai_config.json", out / "genai_config.json")
    # the tokenizer's labels, one per line (a vocabulary for configs/genai-generate.yaml)
    (out / "vocab.txt").write_text("".join(f"t{i}\n" for i in range(VOCAB)))
    return hf_greedy


def write_expected(out: Path, hf_greedy: list[list[int]] | None) -> dict:
    """GenAI's own decodes of the export in ``out`` -> ``out/expected.json``."""
    import onnx
    import onnxruntime
    import onnxruntime_genai

    greedy = [generate(out, [p], 1, with_scores=True) for p in PROMPTS]
    beams = [generate(out, [p], NUM_BEAMS, with_scores=False, max_length=BEAM_MAX_LENGTH)[0] for p in PROMPTS]
    beams_short = [generate(out, [p], NUM_BEAMS, with_scores=False)[0] for p in PROMPTS]
    batched, _ = generate(out, PROMPTS, 1, with_scores=False)
    versions = {"onnxruntime": onnxruntime.__version__, "onnxruntime-genai": onnxruntime_genai.__version__,
                "onnx": onnx.__version__}
    expected = {
        "prompts": PROMPTS,
        "bos": BOS, "eos": EOS, "pad": PAD, "max_length": MAX_LENGTH,
        "greedy": {"sequences": [g[0][0] for g in greedy], "token_log_probs": [g[1][0] for g in greedy]},
        "beam": {"num_beams": NUM_BEAMS, "max_length": BEAM_MAX_LENGTH, "early_stopping": True,
                 "length_penalty": 1.0, "sequences": beams},
        "beam_at_max_length_20": {"num_beams": NUM_BEAMS, "max_length": MAX_LENGTH, "early_stopping": True,
                                  "length_penalty": 1.0, "sequences": beams_short},
        # GenAI's own batch of the same prompts, left-padded with PAD: its rows with padding differ
        # from the single-prompt runs above (and from transformers); kept as a record, not an oracle
        "genai_batch_left_padded": batched,
        "versions": versions,
    }
    if hf_greedy is not None:
        import tokenizers
        import torch
        import transformers

        expected["transformers_greedy"] = hf_greedy
        versions.update({"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": tokenizers.__version__})
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    for name in ("greedy", "beam"):
        print(name, json.dumps(expected[name]["sequences"]))
    if hf_greedy is not None:
        without_eos = [s[:-1] if s[-1] == EOS else s for s in hf_greedy]  # GenAI's sequences end before EOS
        print("GenAI greedy == transformers greedy:", expected["greedy"]["sequences"] == without_eos)
    return expected


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="cpu")
    parser.add_argument("--step", choices=["all", "export", "expected"], default="all")
    parser.add_argument("--out", type=Path, help="the fixture folder (default: the target's)")
    args = parser.parse_args()
    default_out, precision, provider = TARGETS[args.target]
    out = args.out or default_out
    hf_greedy = write_export(out, precision, provider) if args.step in ("all", "export") else None
    if args.step in ("all", "expected"):
        write_expected(out, hf_greedy)


if __name__ == "__main__":
    main()
