"""Which caches a bucketed call may append to in place: ``gqa_present_pairs`` finds the presents that
ONNX Runtime's ``GroupQueryAttention`` writes straight into graph outputs from graph-input pasts (the
op appends in place when both are one buffer), and the step runner shares them only on CUDA with
graphs, for every state or none. Decoding with them shared is checked against GenAI's own CUDA
decodes in ``tests/test_peer_genai_cuda.py`` and against the unshared form in
``tests/test_prepare_cuda.py`` and ``tests/test_resident_greedy.py`` (``gpu``)."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.session import SessionOptions
from gpudecode.session.genai import gqa_present_pairs
from gpudecode.session.graphs import GraphOptions
from gpudecode.states.options import StateManagerOptions

PEERS = Path(__file__).resolve().parent / "fixtures" / "peers"
GENAI = PEERS / "genai" / "model.onnx"


def _genai_graph() -> onnx.ModelProto:
    return onnx.load(str(GENAI), load_external_data=False)


def test_every_present_of_genais_export_is_its_pasts_attention_output():
    model = _genai_graph()
    pasts = sorted(i.name for i in model.graph.input if i.name.startswith("past_key_values."))
    pairs = gqa_present_pairs(model)
    assert len(pasts) >= 4 and sorted(pairs.values()) == pasts
    for present, past in pairs.items():
        assert present == past.replace("past_key_values.", "present.")


def test_a_present_that_passes_through_another_node_is_not_shared():
    model = _genai_graph()
    node = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    present = node.output[1]
    node.output[1] = present + "_raw"  # the graph output now comes from an Identity
    model.graph.node.append(helper.make_node("Identity", [present + "_raw"], [present]))
    pairs = gqa_present_pairs(model)
    assert present not in pairs and node.output[1] not in pairs and node.output[2] in pairs


def test_a_past_computed_in_the_graph_is_not_shared():
    model = _genai_graph()
    node = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    past = node.input[3]
    node.input[3] = past + "_copy"
    model.graph.node.insert(0, helper.make_node("Identity", [past], [past + "_copy"]))
    assert node.output[1] not in gqa_present_pairs(model)


def test_a_plain_attention_export_has_nothing_to_share():
    model = onnx.load(str(PEERS / "gpt2" / "decoder_with_past_model.onnx"), load_external_data=False)
    assert any(i.name.startswith("past_key_values.") for i in model.graph.input)
    assert gqa_present_pairs(model) == {}


def test_the_cpu_provider_shares_nothing():
    lm = PrefixLmScorer(model=str(GENAI.parent), vocab_size=128, scores_kind="logits",
                        state_manager=StateManagerOptions(type="transformer-cpu"),
                        session_options=SessionOptions(device="cpu"), graphs=GraphOptions(enabled=True))
    try:
        assert lm.runner.graphs is not None and not lm.runner.shares_presents
        assert lm.runner.session.gqa_present_pairs == {}  # looked for on CUDA only
    finally:
        lm.close()
