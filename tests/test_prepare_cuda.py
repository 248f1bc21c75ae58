"""``gpudecode prepare``'s float16 form on CUDA (``GroupQueryAttention`` runs float16 only there): the
committed GPT-2 export (``tests/fixtures/peers/gpt2``) prepared with ``--float16`` decodes with the
same n-best lists with CUDA graphs on (its presents sharing their pasts' buffers, or not) and off
(scores within 1e-3: a graph's bucket pads the history), is captured, and gives the float32 original's best
sequence on at least 95 % of the prompts (float16 rounding may decide a near-tie) with scores within
float16's error; its float32 prompt model feeds the float16 step (the prefill's states converted).
The float32 prepared form is refused on CUDA with the reason. The CPU tests are ``test_prepare.py``."""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.prepare.api import FORM_GQA, prepare_model
from gpudecode.scorers.prefix_lm import PrefixLmScorer, in_state_dtypes
from gpudecode.session import SessionOptions
from gpudecode.session.graphs import GraphOptions
from gpudecode.states.options import StateManagerOptions
from tests.hf_generate import decode_like_generate
from tests.test_prepare import GPT2, GPT2_STEP, document

PREFILL = GPT2 / "decoder_model.onnx"
CASES = ("greedy", "beam4-late", "beam8-late")


def _lm(model, device: str, graphs: bool, shared_presents: bool = True) -> PrefixLmScorer:
    return PrefixLmScorer(model=str(model), prefill_model=str(PREFILL), vocab_size=100, scores_kind="logits",
                          state_manager=StateManagerOptions(type=f"transformer-{device}"),
                          session_options=SessionOptions(device=device, use_tf32=False),
                          graphs=GraphOptions(enabled=graphs, shared_presents=shared_presents))


def _prompts(doc: dict) -> list[list[int]]:
    """The fixture's prompts and 28 more random ones (lengths 1 to 9, no EOS)."""
    rng = np.random.default_rng(0)
    extra = [[int(t) for t in rng.integers(3, 100, int(n))] for n in rng.integers(1, 10, 28)]
    return [*doc["prompts"], *extra]


def test_a_float32_prefill_is_converted_to_the_float16_step_states():
    from gpudecode.spec import StateVariable
    from gpudecode.states.layout import VariableLayout

    layout = VariableLayout.of(StateVariable(input_name="past", output_name="present", dtype=np.float16,
                                             shape=(None, 2, None, 4), time_axis=2), np.float16)
    states = {"present": np.full((1, 2, 3, 4), 1 / 3, np.float32), "other": np.ones(2, np.int64)}
    converted = in_state_dtypes(states, [layout])
    assert converted["present"].dtype == np.float16 and converted["present"][0, 0, 0, 0] == np.float16(1 / 3)
    assert converted["other"] is states["other"]  # not a state: left as it is


@pytest.fixture(scope="module")
def prepared16(tmp_path_factory):
    report = prepare_model(GPT2_STEP, tmp_path_factory.mktemp("gpt2-half") / "fast16.onnx", float16=True)
    assert report.form == FORM_GQA
    return report.output


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_the_float16_form_on_cuda_graphs_on_and_off_and_against_the_float32_original(prepared16, case):
    doc = document(GPT2)
    prompts, settings = _prompts(doc), doc["cases"][case]
    results = {}
    for name, model, graphs, shared in (("graphs", prepared16, True, True), ("unshared", prepared16, True, False),
                                        ("plain", prepared16, False, True), ("original", GPT2_STEP, False, True)):
        lm = _lm(model, "cuda", graphs, shared)
        results[name] = decode_like_generate(lm, prompts, settings, eos=doc["eos"], max_new=doc["max_new_tokens"],
                                             device="cuda")
        if graphs:
            assert lm.captured_graphs > 0  # the prepared form is captured
        # the graphs' calls append to the pasts' own buffers (GroupQueryAttention in place)
        assert lm.runner.shares_presents == (name == "graphs")
        lm.close()
    for other in ("unshared", "plain"):  # the same n-best
        for graphs, plain in zip(results["graphs"], results[other], strict=True):
            assert [h["tokens"] for h in graphs] == [h["tokens"] for h in plain]
            np.testing.assert_allclose([h["score"] for h in graphs], [h["score"] for h in plain], atol=1e-3)
    best = [(r[0]["tokens"], o[0]["tokens"]) for r, o in zip(results["graphs"], results["original"])]
    same = [a == b for a, b in best]
    assert sum(same) >= 0.95 * len(prompts), f"{sum(same)} of {len(prompts)} best sequences equal"
    scores = [(r[0]["score"], o[0]["score"]) for r, o, s in zip(results["graphs"], results["original"], same) if s]
    np.testing.assert_allclose([a for a, _ in scores], [b for _, b in scores], atol=2e-2 * doc["max_new_tokens"])


@pytest.mark.gpu
def test_the_float32_form_is_refused_on_cuda_with_the_reason(tmp_path):
    from gpudecode.session.runner import SessionError

    report = prepare_model(GPT2_STEP, tmp_path / "fast32.onnx")
    with pytest.raises(SessionError, match="placed on the CPU"):
        _lm(report.output, "cuda", False)
