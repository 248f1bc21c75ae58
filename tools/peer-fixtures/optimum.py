"""Builds the Optimum fixture: a tiny decoder-only model exported by Optimum itself in each form it
writes, and transformers' own ``generate`` outputs on it.

Run in the peers environment with transformers 4.57 (optimum-onnx 0.1.0 needs transformers < 4.58),
from the repository root::

    PYTHONPATH=.peers-tf4:. .venv-peers/bin/python tools/peer-fixtures/optimum.py

A random-initialised ``LlamaForCausalLM`` (fixed seed; 2 layers, hidden 32, 4 heads, 2 key-value
heads, MLP 64, vocabulary 100, 64 positions; ``initializer_range`` 0.3 so that its distributions
are peaked enough for beam decisions not to hinge on float rounding) is saved with
``save_pretrained`` and exported with Optimum into ``tests/fixtures/peers/optimum/``:

- ``model.onnx``: the default export, what
  ``optimum-cli export onnx --model MODEL_DIR --task text-generation-with-past OUT/`` writes
  (``optimum.exporters.onnx.main_export``, the function behind the command): one decoder with past
  inputs (``input_ids``, ``attention_mask``, ``position_ids``, ``past_key_values.{i}.key|value``
  -> ``logits``, ``present.{i}.key|value``), run with empty pasts on the prompt;
- ``decoder_model.onnx`` + ``decoder_with_past_model.onnx``: the separate pair (Optimum's legacy
  layout: the model's ``LlamaOnnxConfig`` with ``use_past_in_inputs`` False and True, exported by
  ``optimum.exporters.onnx.export_models``);
- ``decoder_model_merged.onnx``: the two merged by Optimum's post-processing of that pair
  (``TextDecoderOnnxConfig.post_process_exported_models`` -> ``optimum.onnx.merge_decoders``): one
  model with a ``use_cache_branch`` [1] bool input choosing the branch (False: ``decoder_model``,
  the pasts ignored; True: ``decoder_with_past_model``);

each checked by Optimum's own validation (``validate_models_outputs``) and against the model's
logits (``check_exports``). With optimum-onnx 0.1.0 ``model.onnx`` is byte for byte
``decoder_with_past_model.onnx`` (git stores it once); a re-run reproduces every file but the merged
model's names of its shared weights (Optimum's merge numbers them in a varying order). A vocabulary
``vocab.txt`` (labels ``t0`` ... ``t99``) is written next to them.

Then transformers' ``generate`` decodes the GPT-2 fixture's ``PROMPTS`` (one prompt per call: no
padding) in every case of its ``CASES`` (``tools/peer-fixtures/gpt2.py``: greedy, beam 4 and 8,
early_stopping True / False / "never", length_penalty 0 and 1, several returned sequences, minimum
lengths, EOS never reached), and ``expected.json`` records, per case and prompt, the generated
tokens (the prompt cut off, EOS kept), ``sequences_scores`` (beam search) or the sum of the chosen
tokens' log-softmax (greedy), and the peer versions.

Made with: torch 2.13.0+cpu, transformers 4.57.3, optimum-onnx 0.1.0, optimum 2.3.0, onnxruntime
1.32.0, onnx 1.23.2 (also in ``versions`` of expected.json).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "peers" / "optimum"
SEED = 0
VOCAB, LAYERS, HEADS, KV_HEADS, HIDDEN, INNER, POSITIONS = 100, 2, 4, 2, 32, 64, 64
INIT_RANGE = 0.3
MAX_NEW_TOKENS = 10
#: EOS: a token the greedy decodes reach at different steps (min_new_tokens=MAX_NEW_TOKENS: never)
EOS = 48
#: the exported files (Optimum's names)
DEFAULT, PREFILL, STEP, MERGED = "model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx", \
    "decoder_model_merged.onnx"


@functools.cache
def _gpt2_fixture():
    spec = importlib.util.spec_from_file_location("gpt2_fixture", Path(__file__).with_name("gpt2.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROMPTS = _gpt2_fixture().PROMPTS
CASES = _gpt2_fixture().CASES


def model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INNER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=POSITIONS,
                         initializer_range=INIT_RANGE, bos_token_id=0, eos_token_id=EOS, pad_token_id=EOS)
    return LlamaForCausalLM(config).eval()


def export(model_dir: Path, out: Path) -> None:
    """Optimum's exports of the model saved in ``model_dir``, into ``out`` (see the docstring)."""
    from optimum.exporters.onnx import export_models, main_export, validate_models_outputs
    from optimum.exporters.onnx.model_configs import LlamaOnnxConfig
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        # the default: optimum-cli export onnx --model model_dir --task text-generation-with-past
        main_export(str(model_dir), tmp, task="text-generation-with-past")
        shutil.copy(Path(tmp) / "model.onnx", out / DEFAULT)
    lm = LlamaForCausalLM.from_pretrained(model_dir).eval()
    configs = {
        "decoder_model": (lm, LlamaOnnxConfig(lm.config, task="text-generation", use_past=True,
                                              use_past_in_inputs=False)),
        "decoder_with_past_model": (lm, LlamaOnnxConfig(lm.config, task="text-generation", use_past=True,
                                                        use_past_in_inputs=True)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        config = configs["decoder_model"][1]
        files = [PREFILL, STEP]
        _, outputs = export_models(configs, output_dir=Path(tmp), opset=config.DEFAULT_ONNX_OPSET, output_names=files)
        validate_models_outputs(configs, outputs, Path(tmp), atol=1e-4, onnx_files_subpaths=files,
                                use_subprocess=False)
        for name in files:
            shutil.copy(Path(tmp) / name, out / name)
        # Optimum's post-processing of a decoder exported without / with past: the merged model
        configs, merged = config.post_process_exported_models(Path(tmp), configs, files)
        assert merged == [MERGED, MERGED], merged
        validate_models_outputs(configs, outputs, Path(tmp), atol=1e-4, onnx_files_subpaths=merged,
                                use_subprocess=False)
        shutil.copy(Path(tmp) / MERGED, out / MERGED)


def _feeds(tokens, past: dict | None, start: int):
    import numpy as np

    feeds = {"input_ids": tokens, "attention_mask": np.ones((1, start + tokens.shape[1]), np.int64),
             "position_ids": np.arange(start, start + tokens.shape[1])[None]}
    if past is not None:
        feeds.update({k.replace("present.", "past_key_values."): v for k, v in past.items()})
    return feeds


def check_exports(reference, directory: Path) -> None:
    """Each export reproduces ``reference`` (the logits of ``CHECK_SEQUENCE`` by the model) within
    1e-4: a prompt of 3 tokens, then one step per token; the default export and the merged one
    (``use_cache_branch`` False on the prompt, True after) on their own, the pair as prefill + step."""
    import numpy as np
    import onnxruntime as ort

    head = HIDDEN // HEADS
    empty = {f"present.{i}.{kv}": np.zeros((1, KV_HEADS, 0, head), np.float32)
             for i in range(LAYERS) for kv in ("key", "value")}
    sessions = {name: ort.InferenceSession(str(directory / name)) for name in (DEFAULT, PREFILL, STEP, MERGED)}
    forms = {"default": (DEFAULT, DEFAULT), "pair": (PREFILL, STEP), "merged": (MERGED, MERGED)}
    tokens = np.asarray([CHECK_SEQUENCE], np.int64)
    for form, (first, then) in forms.items():
        def run(name, feeds, branch):
            session = sessions[name]
            if name == MERGED:
                feeds["use_cache_branch"] = np.array([branch])
            names = [o.name for o in session.get_outputs()]
            out = session.run(None, {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}})
            return out[0][0], dict(zip(names[1:], out[1:]))

        logits, past = run(first, _feeds(tokens[:, :3], None if first == PREFILL else empty, 0), False)
        rows = [logits]
        for p in range(3, tokens.shape[1]):
            logits, past = run(then, _feeds(tokens[:, p:p + 1], past, p), True)
            rows.append(logits)
        error = float(np.abs(np.concatenate(rows) - reference).max())
        if error > 1e-4:
            raise AssertionError(f"the {form} export differs from the model by {error}")


#: a sequence whose logits the exports must reproduce (check_exports)
CHECK_SEQUENCE = [5, 17, 33, 61, 7, 44, 90, 3]


def generate(lm, prompt: list[int], options: dict) -> list[dict]:
    """transformers' ``generate`` of one prompt, as the GPT-2 fixture records it, with this
    fixture's EOS and number of new tokens."""
    return _gpt2_fixture().generate(lm, prompt, options, eos=EOS, max_new_tokens=MAX_NEW_TOKENS)


def expected(lm) -> dict:
    return {case: [generate(lm, prompt, options) for prompt in PROMPTS] for case, options in CASES.items()}


def versions() -> dict:
    from importlib.metadata import version

    import onnx
    import onnxruntime
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "optimum-onnx": version("optimum-onnx"), "optimum": version("optimum"),
            "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__, "python": sys.version.split()[0]}


def main() -> None:
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    OUT.mkdir(parents=True, exist_ok=True)
    lm = model()
    outputs = expected(lm)
    with torch.no_grad():
        reference = lm(torch.tensor([CHECK_SEQUENCE])).logits[0].numpy()
    with tempfile.TemporaryDirectory() as tmp:
        lm.save_pretrained(tmp)
        export(Path(tmp), OUT)
    check_exports(reference, OUT)
    (OUT / "vocab.txt").write_text("".join(f"t{i}\n" for i in range(VOCAB)))
    document = {"versions": versions(), "vocab_size": VOCAB, "eos": EOS, "max_new_tokens": MAX_NEW_TOKENS,
                "files": {"default": DEFAULT, "prefill": PREFILL, "step": STEP, "merged": MERGED},
                "prompts": PROMPTS, "cases": {k: {**v} for k, v in CASES.items()}, "expected": outputs}
    (OUT / "expected.json").write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    # this file's folder first on the path would make ``import optimum`` import this script
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    main()
