"""Builds the GPT-2 fixture: a tiny ``torch.onnx`` export in the Hugging Face decoder-with-past
convention and transformers' own ``generate`` outputs on it.

Run in the peers environment (torch, transformers, onnxruntime), from the repository root::

    PYTHONPATH=. .venv-peers/bin/python tools/peer-fixtures/gpt2.py

A random-initialised ``GPT2LMHeadModel`` (fixed seed; 2 layers, n_embd 64, 4 heads, MLP 128, vocabulary
100, n_positions 32; ``initializer_range`` 0.3 so that its distributions are peaked enough for
beam decisions not to hinge on float rounding) is exported with ``torch.onnx.export`` twice,
from the same weights, into ``tests/fixtures/peers/gpt2/`` with Optimum's names:

- ``decoder_with_past_model.onnx``, the step model: inputs ``input_ids`` [N, 1],
  ``attention_mask`` [N, T + 1], ``position_ids`` [N, 1], ``past_key_values.{i}.key|value``
  [N, 4, T, 16]; outputs ``logits`` [N, 1, 100] and ``present.{i}.key|value`` [N, 4, T + 1, 16];
- ``decoder_model.onnx``, the prefill: inputs ``input_ids``, ``attention_mask``, ``position_ids``
  [U, P]; outputs ``logits`` [U, P, 100] and ``present.{i}.key|value`` [U, 4, P, 16].

A vocabulary file ``vocab.txt`` (labels ``t0`` … ``t99``, so that a config can name sentence-end)
is written next to them.

Then transformers' ``generate`` decodes ``PROMPTS`` (one prompt per call: no padding) in every case
of ``CASES`` and ``expected.json`` records, per case and prompt, the generated tokens (the prompt
cut off, EOS kept), ``sequences_scores`` (beam search) or the sum of the chosen tokens'
log-softmax (greedy), and the peer versions.

The search's length conventions, as transformers 5.24's ``_beam_search`` has them: a finished
hypothesis is ranked by ``sum_logprobs / generated_length ** length_penalty`` (generated tokens
including EOS, the prompt not counted); ``min_length`` counts the prompt (``MinLengthLogitsProcessor``:
EOS masked while ``input_ids.shape[-1] < min_length``), ``min_new_tokens`` does not.

Made with: torch 2.13.0+cpu, transformers 5.24.0, onnxruntime 1.32.0, onnx 1.23.2 (also in
``versions`` of expected.json).

``--family llama`` makes ``tests/fixtures/peers/llama-torch/`` instead: a random-initialised
``LlamaForCausalLM`` (fixed seed; 1 layer, hidden 32, 4 heads, 2 key-value heads: grouped query
attention; MLP 40, vocabulary 48, 24 positions; ``attn_implementation="sdpa"``) through the same
``export`` (step + prefill; checked against the model's own logits of ``LLAMA_CHECK_SEQUENCE``). Its
attention is what ``torch.onnx`` makes of ``scaled_dot_product_attention(..., enable_gqa=True)``:
the query heads reshaped to [N, key-value heads, groups·S, head size] against the unrepeated keys,
the context reshaped back (no ``expected.json``: ``gpudecode prepare``'s tests check its rewrite
against this export itself). Made with the same versions as above.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "peers" / "gpt2"
SEED = 0
VOCAB, LAYERS, HEADS, EMBD, INNER, POSITIONS = 100, 2, 4, 64, 128, 32
INIT_RANGE = 0.3
MAX_NEW_TOKENS = 10
#: EOS: a token the greedy decodes reach at different steps (min_new_tokens=MAX_NEW_TOKENS: never)
EOS = 4
PROMPTS = [
    [5, 17, 33, 61, 7],
    [44],
    [90, 3, 12],
    [9, 9, 20, 58, 31, 64, 22],
    [71, 2],
]
#: name -> generate options (every case: max_new_tokens=MAX_NEW_TOKENS, eos_token_id=EOS)
CASES = {
    "greedy": dict(num_beams=1),
    "beam4-early": dict(num_beams=4, early_stopping=True, length_penalty=1.0),
    "beam4-late": dict(num_beams=4, early_stopping=False, length_penalty=1.0),
    "beam4-late-lp0": dict(num_beams=4, early_stopping=False, length_penalty=0.0),
    "beam4-never": dict(num_beams=4, early_stopping="never", length_penalty=1.0),
    "beam8-late": dict(num_beams=8, early_stopping=False, length_penalty=1.0, num_return_sequences=3),
    "beam8-early-lp0": dict(num_beams=8, early_stopping=True, length_penalty=0.0),
    "beam4-min-new-tokens": dict(num_beams=4, early_stopping=False, length_penalty=1.0, min_new_tokens=6),
    "beam4-min-length": dict(num_beams=4, early_stopping=False, length_penalty=1.0, min_length=9),
    "beam4-no-eos": dict(num_beams=4, early_stopping=False, length_penalty=1.0, min_new_tokens=MAX_NEW_TOKENS),
}


def model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=EMBD, n_layer=LAYERS, n_head=HEADS, n_inner=INNER,
                        initializer_range=INIT_RANGE, bos_token_id=0, eos_token_id=EOS, pad_token_id=EOS)
    return GPT2LMHeadModel(config).eval()


def _cache(past):
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(len(past) // 2):
        cache.update(past[2 * layer], past[2 * layer + 1], layer)
    return cache


def _presents(cache):
    out = []
    for layer in cache.layers:
        out += [layer.keys, layer.values]
    return out


def cache_shape(config) -> tuple[int, int, int]:
    """(layers, key-value heads, head size) of a GPT-2 or Llama config: the pasts' shape."""
    layers = getattr(config, "n_layer", None) or config.num_hidden_layers
    heads = getattr(config, "n_head", None) or config.num_attention_heads
    width = getattr(config, "n_embd", None) or config.hidden_size
    return layers, getattr(config, "num_key_value_heads", None) or heads, width // heads


def export(lm, directory: Path) -> None:
    """The step and prefill exports of ``lm`` (any causal LM taking ``past_key_values``: GPT-2, Llama)
    into ``directory``, in the float type of its weights."""
    import torch

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, position_ids, *past):
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=_cache(past), use_cache=True)
            return (out.logits, *_presents(out.past_key_values))

    class Prefill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask, position_ids):
            out = self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True)
            return (out.logits, *_presents(out.past_key_values))

    layers, kv_heads, head = cache_shape(lm.config)
    dtype = next(lm.parameters()).dtype
    past_names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present_names = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    n, t = 3, 4
    past = [torch.randn(n, kv_heads, t, head, dtype=dtype, device=lm.device) for _ in past_names]
    step_inputs = (torch.tensor([[5], [6], [7]]), torch.ones(n, t + 1, dtype=torch.int64),
                   torch.tensor([[4], [4], [4]]), *past)
    dynamic = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total"},
               "position_ids": {0: "batch"}, "logits": {0: "batch"}}
    dynamic.update({name: {0: "batch", 2: "past"} for name in past_names})
    dynamic.update({name: {0: "batch", 2: "total"} for name in present_names})
    torch.onnx.export(Step(), step_inputs, directory / "decoder_with_past_model.onnx", dynamo=False, opset_version=17,
                      input_names=["input_ids", "attention_mask", "position_ids", *past_names],
                      output_names=["logits", *present_names], dynamic_axes=dynamic)
    prefill_inputs = (torch.tensor([[5, 6, 7, 8], [1, 2, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
                      torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]))
    dynamic = {name: {0: "batch", 1: "prompt"} for name in ("input_ids", "attention_mask", "position_ids", "logits")}
    dynamic.update({name: {0: "batch", 2: "prompt"} for name in present_names})
    torch.onnx.export(Prefill(), prefill_inputs, directory / "decoder_model.onnx", dynamo=False, opset_version=17,
                      input_names=["input_ids", "attention_mask", "position_ids"],
                      output_names=["logits", *present_names], dynamic_axes=dynamic)


def generate(lm, prompt: list[int], options: dict, *, eos: int = EOS, max_new_tokens: int = MAX_NEW_TOKENS
             ) -> list[dict]:
    """transformers' ``generate`` of one prompt: per returned sequence its generated tokens and
    score (``sequences_scores``, or for greedy the sum of the chosen tokens' log-softmax)."""
    import torch

    options = dict(options)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          eos_token_id=eos, pad_token_id=eos, do_sample=False, return_dict_in_generate=True,
                          output_logits=True, output_scores=True, **options)
    generated = out.sequences[:, len(prompt):].tolist()
    if options["num_beams"] == 1:
        tokens = generated[0]
        logp = [torch.log_softmax(step[0].double(), -1)[tok].item() for step, tok in zip(out.logits, tokens)]
        return [{"tokens": tokens, "score": sum(logp)}]
    scores = out.sequences_scores.tolist()
    results = []
    for tokens, score in zip(generated, scores):
        if eos in tokens:  # rows are padded with pad_token_id = EOS after the first EOS
            tokens = tokens[:tokens.index(eos) + 1]
        results.append({"tokens": tokens, "score": score})
    return results


def expected(lm) -> dict:
    return {case: [generate(lm, prompt, options) for prompt in PROMPTS] for case, options in CASES.items()}


def versions() -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
            "python": sys.version.split()[0]}


def check_export(reference, directory: Path, sequence: list[int] | None = None) -> None:
    """The exported prefill + step models reproduce ``reference`` (the logits of ``sequence``, by
    default ``CHECK_SEQUENCE``, by the model before its export) within 1e-4: prefill over the first 3
    tokens, then one step per token."""
    import numpy as np
    import onnxruntime as ort

    prefill = ort.InferenceSession(str(directory / "decoder_model.onnx"))
    step = ort.InferenceSession(str(directory / "decoder_with_past_model.onnx"))
    tokens = np.asarray([sequence or CHECK_SEQUENCE], np.int64)
    names = [o.name for o in prefill.get_outputs()]
    out = prefill.run(None, {"input_ids": tokens[:, :3], "attention_mask": np.ones((1, 3), np.int64),
                             "position_ids": np.arange(3)[None]})
    logits, past = [out[0][0]], dict(zip(names[1:], out[1:]))
    for p in range(3, tokens.shape[1]):
        feeds = {"input_ids": tokens[:, p:p + 1], "attention_mask": np.ones((1, p + 1), np.int64),
                 "position_ids": np.array([[p]])}
        feeds.update({k.replace("present.", "past_key_values."): v for k, v in past.items()})
        out = step.run(None, feeds)
        logits.append(out[0][0])
        past = dict(zip(names[1:], out[1:]))
    error = float(np.abs(np.concatenate(logits) - reference).max())
    if error > 1e-4:
        raise AssertionError(f"the ONNX export differs from the model by {error}")


#: a sequence whose logits the export must reproduce (check_export)
CHECK_SEQUENCE = [5, 17, 33, 61, 7, 44, 90, 3]


#: the Llama fixture (``--family llama``): folder, shape, and the sequence its export must reproduce
LLAMA_OUT = OUT.parent / "llama-torch"
LLAMA_VOCAB, LLAMA_LAYERS, LLAMA_HEADS, LLAMA_KV_HEADS = 48, 1, 4, 2
LLAMA_HIDDEN, LLAMA_INNER, LLAMA_POSITIONS = 32, 40, 24
LLAMA_CHECK_SEQUENCE = [5, 17, 33, 41, 7, 44, 30, 3]


def llama_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=LLAMA_HIDDEN, intermediate_size=LLAMA_INNER,
                         num_hidden_layers=LLAMA_LAYERS, num_attention_heads=LLAMA_HEADS,
                         num_key_value_heads=LLAMA_KV_HEADS, max_position_embeddings=LLAMA_POSITIONS,
                         initializer_range=INIT_RANGE, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
                         tie_word_embeddings=False)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa").eval()


def main_llama() -> None:
    import torch

    LLAMA_OUT.mkdir(parents=True, exist_ok=True)
    lm = llama_model()
    with torch.no_grad():
        reference = lm(torch.tensor([LLAMA_CHECK_SEQUENCE])).logits[0].numpy()
    export(lm, LLAMA_OUT)
    check_export(reference, LLAMA_OUT, LLAMA_CHECK_SEQUENCE)
    print(f"wrote {LLAMA_OUT}")


def main() -> None:
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    if parser.parse_args().family == "llama":
        main_llama()
        return
    OUT.mkdir(parents=True, exist_ok=True)
    lm = model()
    # generate and the reference logits first: torch.onnx.export leaves the module computing
    # different logits afterwards (transformers 5.24 / torch 2.13), while the export itself is right
    outputs = expected(lm)
    with torch.no_grad():
        reference = lm(torch.tensor([CHECK_SEQUENCE])).logits[0].numpy()
    export(lm, OUT)
    check_export(reference, OUT)
    (OUT / "vocab.txt").write_text("".join(f"t{i}\n" for i in range(VOCAB)))
    document = {"versions": versions(), "vocab_size": VOCAB, "eos": EOS, "max_new_tokens": MAX_NEW_TOKENS,
                "prompts": PROMPTS, "cases": {k: {**v} for k, v in CASES.items()}, "expected": outputs}
    (OUT / "expected.json").write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
