"""Decoding prompts as transformers' ``generate`` reports them: the shared part of the parity tests
against ``generate`` (``test_peer_transformers``, ``test_peer_optimum``).

A fixture document (``expected.json`` of a peer fixture) gives the prompts, EOS, the number of new
tokens and the ``generate`` settings of each case; these helpers turn a case into the toolkit's
search options, decode the prompts in the ``finished="separate"`` mode and compare n-best lists.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from gpudecode.scorers import UtteranceBatch
from gpudecode.search import LabelSyncOptions, label_sync_search

ROOT = Path(__file__).resolve().parents[1]
#: tokens equal, scores within this
TOL = 1e-4


def array_module(device: str):
    if device == "cuda":
        import cupy

        return cupy
    return np


def prompt_batch(prompts: list[list[int]], max_new) -> UtteranceBatch:
    """``prompts`` (different lengths) as one batch of token prompts, ``max_new`` labels each (an
    int, or one per prompt)."""
    table = np.zeros((len(prompts), max(map(len, prompts))), np.int64)
    for u, prompt in enumerate(prompts):
        table[u, :len(prompt)] = prompt
    return UtteranceBatch(ids=[f"p{u}" for u in range(len(prompts))], input_lengths=np.full(len(prompts), max_new),
                          inputs={"prompt": table}, sizes={"prompt": np.array([len(p) for p in prompts])})


def generate_options(generate: dict, *, eos: int, max_new: int, prompt_length: int = 0) -> LabelSyncOptions:
    """The search options of ``generate``'s (num_beams, early_stopping, length_penalty,
    num_return_sequences, min_new_tokens, min_length — which counts the prompt)."""
    greedy = generate["num_beams"] == 1
    min_length = generate.get("min_new_tokens", 0)
    if "min_length" in generate:
        min_length = max(0, generate["min_length"] - prompt_length)
    return LabelSyncOptions(
        beam_size=generate["num_beams"], sentence_end=eos, max_labels_per_input=1.0, max_labels=max_new,
        finished="separate", early_stopping=generate.get("early_stopping", False),
        length_norm_scale=0.0 if greedy else generate.get("length_penalty", 1.0),
        nbest=generate.get("num_return_sequences", 1), min_length=min_length)


def decode_like_generate(lm, prompts: list[list[int]], generate: dict, *, eos: int, max_new: int,
                         device: str = "cpu", **search) -> list[list[dict]]:
    """The toolkit's n-best lists of ``prompts`` with the label scorer ``lm``, as ``generate``
    reports them: tokens (EOS kept) and the length-normalised score. A prompt-counting
    ``min_length`` differs per prompt, so each prompt is then decoded alone."""
    groups = [[u] for u in range(len(prompts))] if "min_length" in generate else [list(range(len(prompts)))]
    results: list = [None] * len(prompts)
    for group in groups:
        opts = generate_options(generate, eos=eos, max_new=max_new, prompt_length=len(prompts[group[0]]))
        nbest = label_sync_search([("lm", lm, 1.0)], prompt_batch([prompts[u] for u in group], max_new), opts,
                                  xp=array_module(device), **search)
        for u, hyps in zip(group, nbest):
            results[u] = [{"tokens": h.labels + [eos] * (h.length - len(h.labels)),
                           "score": h.score / h.length ** opts.length_norm_scale} for h in hyps]
    return results


def assert_same(got: list[list[dict]], expected: list[list[dict]]) -> None:
    """Equal token sequences, scores within :data:`TOL`, prompt by prompt."""
    for u, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert [h["tokens"] for h in mine] == [h["tokens"] for h in theirs], f"prompt {u}"
        np.testing.assert_allclose([h["score"] for h in mine], [h["score"] for h in theirs], atol=TOL,
                                   err_msg=f"prompt {u}")


def fixture_script(name: str):
    """``tools/peer-fixtures/<name>.py`` as a module (the peer's side of a fixture; imports the peer
    when its functions run)."""
    spec = importlib.util.spec_from_file_location(f"{name}_fixture", ROOT / "tools" / "peer-fixtures" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LiveGenerate:
    """``generate``'s outputs, run now (the peers environment) on a fixture script's weights; the
    model is built once."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.module = None
        self.model = None

    def load(self):
        if self.model is None:
            self.module = fixture_script(self.script)
            self.model = self.module.model()
        return self.module, self.model

    def expected(self, case: str) -> list[list[dict]]:
        module, model = self.load()
        return [module.generate(model, prompt, module.CASES[case]) for prompt in module.PROMPTS]
