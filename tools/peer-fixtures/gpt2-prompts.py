"""Builds the prompt-file fixture: a tiny GPT-2 exported with ``torch.onnx`` as Optimum names the two
models of a decoder-only export, and transformers' own greedy ``generate`` on the prompts.

Run in the peers environment (torch, transformers, onnxruntime), from the repository root::

    PYTHONPATH=. .venv-peers/bin/python tools/peer-fixtures/gpt2-prompts.py

A random-initialised ``GPT2LMHeadModel`` (seed 0; 2 layers, n_embd 32, 2 heads, vocabulary 12,
n_positions 64, ``initializer_range`` 0.3) is exported into ``tests/fixtures/peers/gpt2-prompts/``:

- ``decoder_model.onnx`` (the prefill): ``input_ids``, ``attention_mask``, ``position_ids``
  [N, L] -> ``logits`` [N, L, 12], ``present.{i}.key|value`` [N, 2, L, 16];
- ``decoder_with_past_model.onnx`` (the step model): ``input_ids`` [N, 1], ``attention_mask``
  [N, T + 1], ``position_ids`` [N, 1], ``past_key_values.{i}.key|value`` [N, 2, T, 16] ->
  ``logits`` [N, 1, 12], ``present.{i}.key|value`` [N, 2, T + 1, 16];

with ``vocab.txt`` (label 0 ``<s>``, label 7 ``</s>`` = EOS, the others ``w{i}``), ``prompts.txt``
(the prompt file, label indices) and ``expected.json``: per prompt the tokens of transformers'
greedy ``generate`` (``max_new_tokens`` 6, EOS 7; the prompt cut off, EOS kept) and their summed
log-softmax, with the peer versions.

Made with: torch 2.13.0+cpu, transformers 5.24.0, onnxruntime 1.32.0, onnx 1.23.2 (also in
``versions`` of expected.json).
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "peers" / "gpt2-prompts"
SEED, VOCAB, LAYERS, HEADS, EMBD, POSITIONS, INIT_RANGE = 0, 12, 2, 2, 32, 64, 0.3
EOS, MAX_NEW_TOKENS = 7, 6
PROMPTS = {"a": [3, 4, 5], "b": [2], "c": [11, 2], "d": [9, 9, 9, 9, 9], "e": [6, 10, 3, 3]}


def model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=EMBD, n_layer=LAYERS, n_head=HEADS,
                        initializer_range=INIT_RANGE, bos_token_id=0, eos_token_id=EOS, pad_token_id=EOS)
    return GPT2LMHeadModel(config).eval()


def generate(lm, prompt: list[int]) -> dict:
    """transformers' greedy ``generate``: the generated tokens (EOS kept) and their summed log-softmax."""
    import torch

    lm.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                          num_beams=1, eos_token_id=EOS, pad_token_id=EOS, output_scores=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    score = sum(float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.scores, tokens))
    return {"tokens": tokens, "score": score}


def export(lm, directory: Path) -> None:
    """The prefill and step exports of ``lm``: ``tools/peer-fixtures/gpt2.py``'s ``export``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt2_fixture", Path(__file__).with_name("gpt2.py"))
    gpt2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt2)
    gpt2.export(lm, directory)
    lm.eval()  # the export may leave the module in training mode (dropout)


def versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    lm = model()
    export(lm, OUT)
    labels = ["<s>" if i == 0 else "</s>" if i == EOS else f"w{i}" for i in range(VOCAB)]
    (OUT / "vocab.txt").write_text("\n".join(labels) + "\n")
    (OUT / "prompts.txt").write_text("".join(f"{u} {' '.join(map(str, p))}\n" for u, p in PROMPTS.items()))
    expected = {"versions": versions(), "eos": EOS, "max_new_tokens": MAX_NEW_TOKENS, "prompts": PROMPTS,
                "greedy": {u: generate(lm, p) for u, p in PROMPTS.items()}}
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(json.dumps(expected["greedy"]))


if __name__ == "__main__":
    main()
