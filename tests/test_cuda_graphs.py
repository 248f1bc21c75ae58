"""CUDA graphs of the decoder step: buckets, padding, shared buffers, fallback.

On the CPU the bucketed step runs as padded plain runs (``PaddedRuns``): the same inputs a
captured graph would get, so padding exactness is tested without a GPU. Expected scores come
from the reference models' numpy oracles; graphs-on results are also compared with graphs off.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from gpudecode import defaults
from gpudecode.config import ConfigError, validate_config
from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.onnx_decoder import OnnxDecoderScorer, RecurrentLmScorer
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session import OnnxSession, SessionOptions
from gpudecode.sizes import next_power_of_two
from gpudecode.session.graphs import (
    GraphBuckets,
    GraphBuffers,
    GraphOptions,
    PaddedRuns,
    bucket_rows,
    bucket_time,
    capture_blocker,
    host_copy_blocker,
    time_buckets,
)
from gpudecode.states.options import StateManagerOptions
from gpudecode.testing import build_lstm_lm, build_prefix_lm, build_transformer_lm
from tests.test_onnx_decoder_search import BOS, EOS, Setup, terminated, xp_of

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = 1e-4


# --- buckets ---------------------------------------------------------------------------------------
def test_row_buckets_are_powers_of_two_with_a_floor():
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 8, 9, 1000)] == [1, 2, 4, 8, 8, 16, 1024]
    assert [bucket_rows(n, min_rows=8) for n in (1, 7, 8, 9)] == [8, 8, 8, 16]
    assert bucket_rows(3, min_rows=5) == 8  # the floor is a bucket itself
    with pytest.raises(ValueError, match="rows"):
        bucket_rows(0)


def test_time_buckets_are_powers_of_two_then_multiples_of_the_step():
    assert [bucket_time(t, 32) for t in (0, 1, 2, 3, 17, 32, 33, 64, 65, 100)] == [1, 1, 2, 4, 32, 32, 64, 64, 96, 128]
    assert [bucket_time(t, 6) for t in (3, 5, 6, 7, 13)] == [4, 6, 6, 12, 18]  # never above the step below it
    assert time_buckets(20, 8) == [1, 2, 4, 8, 16, 24]
    for t in range(200):  # every bucket holds its time and is the smallest of its set that does
        b = bucket_time(t, 16)
        assert b >= max(t, 1)
        assert all(c < max(t, 1) for c in time_buckets(200, 16) if c < b)
    with pytest.raises(ValueError, match="time"):
        bucket_time(-1, 8)


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]


def test_graph_buckets_hold_whole_groups_and_take_their_steps_from_the_defaults():
    options = GraphOptions(enabled=True, time_step=4, min_rows=4)
    buckets = GraphBuckets(OnnxSession(Setup(3).decoder.serialized(), SessionOptions()), options)
    assert isinstance(buckets.runs, PaddedRuns) and not buckets.num_graphs and not buckets.captures
    assert [buckets.rows(n) for n in (1, 5, 9)] == [bucket_rows(n, 4) for n in (1, 5, 9)]
    assert [buckets.rows(n, group_size=3) for n in (3, 9, 13)] == [6, 12, 24]  # groups: floor 2, then 4 and 8
    assert [buckets.time(t) for t in (0, 3, 5)] == [bucket_time(t, 4) for t in (0, 3, 5)]
    assert (GraphOptions().time_step, GraphOptions().min_rows) == (defaults.GRAPH_TIME_STEP, defaults.GRAPH_MIN_ROWS)


def test_graph_options_are_checked():
    with pytest.raises(ValueError, match="time_step"):
        GraphOptions(time_step=0)
    with pytest.raises(ValueError, match="min_rows"):
        GraphOptions(min_rows=0)
    with pytest.raises(ValueError, match="warm_up_time"):
        GraphOptions(warm_up_time=-1)


# --- buffers -------------------------------------------------------------------------------------------
def test_shared_buffers_hold_the_largest_bucket_and_per_bucket_buffers_the_sum():
    shared, separate = GraphBuffers("cpu", shared=True), GraphBuffers("cpu", shared=False)
    shapes = [(8, 2, 4, 16), (8, 2, 16, 16), (8, 2, 8, 16)]
    for buffers in (shared, separate):
        views = [buffers.view("past", np.float32, shape, bucket=shape) for shape in shapes]
        for view, shape in zip(views, shapes):
            assert view.shape == shape and view.dtype == np.float32
    assert shared.nbytes == max(int(np.prod(s)) for s in shapes) * 4
    assert separate.nbytes == sum(int(np.prod(s)) for s in shapes) * 4
    a = shared.view("past", np.float32, shapes[0])
    b = shared.view("past", np.float32, shapes[2])
    assert np.shares_memory(a, b)  # every bucket is a view of one buffer
    assert shared.generation == 1  # replaced once, when the 16-step bucket came
    shared.view("other", np.int32, (4,))
    assert shared.generation == 1  # a new name is not a replacement


# --- fallback ----------------------------------------------------------------------------------
def if_model() -> onnx.ModelProto:
    """y = x + 1 if flag else x - 1, with an If node."""
    one = helper.make_tensor("one", onnx.TensorProto.FLOAT, [], [1.0])
    branch = lambda op, name: helper.make_graph(  # noqa: E731
        [helper.make_node("Constant", [], [f"{name}_c"], value=one), helper.make_node(op, ["x", f"{name}_c"], [f"{name}_y"])],
        name, [], [helper.make_tensor_value_info(f"{name}_y", onnx.TensorProto.FLOAT, ["n"])])
    graph = helper.make_graph(
        [helper.make_node("If", ["flag"], ["y"], name="choose", then_branch=branch("Add", "then"),
                          else_branch=branch("Sub", "else"))],
        "if-model",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n"])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_control_flow_and_host_copies_block_capture():
    assert "If 'choose'" in capture_blocker(if_model())
    assert capture_blocker(onnx.load_from_string(Setup(0).decoder.serialized())) is None
    copy = helper.make_graph([helper.make_node("MemcpyFromHost", ["shape"], ["on_device"], name="copy1")], "g", [], [])
    assert "'shape'" in host_copy_blocker(helper.make_model(copy)) and "copy1" in host_copy_blocker(helper.make_model(copy))
    assert host_copy_blocker(helper.make_model(helper.make_graph([], "g", [], []))) is None


def test_cpu_sessions_never_capture_and_the_scorer_runs_padded():
    setup = Setup(3)
    scorer = graph_scorer(setup, "cpu", GraphOptions(enabled=True))
    assert not scorer.session.cuda_graphs
    assert isinstance(scorer.runner.graphs.runs, PaddedRuns)


# --- exactness ---------------------------------------------------------------------------------------
def graph_scorer(setup: Setup, device: str, graphs: GraphOptions, **kwargs):
    sm = "transformer-cuda" if device == "cuda" else "transformer-cpu"
    return OnnxDecoderScorer(
        model=setup.decoder.serialized(), vocab_size=setup.decoder.vocab_size, start_labels=[BOS],
        state_manager=StateManagerOptions(type=sm), session_options=SessionOptions(device=device),
        graphs=graphs, **kwargs,
    )


def lm_scorer(reference, device, graphs, kind="log-probs"):
    family = "lstm" if "lstm" in reference.model.graph.name else "transformer"
    sm = f"{family}-{'cuda' if device == 'cuda' else 'cpu'}"
    return RecurrentLmScorer(model=reference.serialized(), vocab_size=reference.vocab_size, start_labels=[BOS],
                             scores_kind=kind, state_manager=StateManagerOptions(type=sm),
                             session_options=SessionOptions(device=device), graphs=graphs)


def search(scorers, batch, xp, **options):
    options = {"beam_size": 4, "sentence_end": EOS, "max_labels_per_input": 1.0, **options}
    continuous = options.pop("max_active_utterances", None)
    return label_sync_search(scorers, batch, LabelSyncOptions(**options), xp=xp, max_active_utterances=continuous)


def assert_same(a, b):
    assert len(a) == len(b)
    for u, (x, y) in enumerate(zip(a, b)):
        assert [h.labels for h in x] == [h.labels for h in y], f"utterance {u}"
        np.testing.assert_allclose([h.score for h in x], [h.score for h in y], atol=TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_layout, export", [("bhtd", ("full", False)), ("btd", ("full", False)),
                                               ("bhtd", ("new", True)), ("bhtd", ("new", True, "ragged"))])
def test_bucketed_decoder_equals_the_oracle_and_the_unbucketed_run(device, kv_layout, export):
    """(export: state outputs of the whole history or of the new step alone.)"""
    xp = xp_of(device)
    setup = Setup(5, device=device, kv_layout=kv_layout, num_utts=3, frames=(40, 30, 36), export=export)
    graphs = GraphOptions(enabled=True, time_step=2, min_rows=8)  # 12 lanes -> 16 rows; times 1, 2, 4, 6, ...
    scorer = graph_scorer(setup, device, graphs)
    nbest = search([("decoder", scorer, 1.0)], setup.batch(xp=xp), xp)
    plain = search([("decoder", graph_scorer(setup, device, GraphOptions()), 1.0)], setup.batch(xp=xp), xp)
    assert_same(plain, nbest)
    for u, hyps in enumerate(nbest):
        for hyp in hyps:
            expected = setup.oracle_score(setup.decoder, u, hyp.labels, terminated(hyp))
            assert hyp.score == pytest.approx(expected, abs=TOL)
    assert scorer.runner.graphs.num_graphs + scorer.captured_graphs >= 3  # several history buckets (3 steps pad to 4)
    if device == "cuda":
        assert scorer.session.cuda_graphs and scorer.runner.graphs.captures >= 3
    assert scorer.states.statistics().live_slots == 0


@pytest.mark.parametrize("device", DEVICES)
def test_chunks_padded_to_buckets_and_continuous_batching_stay_exact(device):
    """max_batch_size 5 over 2 active utterances x beam 3 = 6 lanes: chunks of 5 and 1 rows, the
    first padded to 8 (it reads lane rows beyond the lanes); utterances admitted mid-search
    change the batch composition."""
    xp = xp_of(device)
    setup = Setup(8, device=device, num_utts=4)
    graphs = GraphOptions(enabled=True, time_step=4, min_rows=1)
    plain = search([("decoder", graph_scorer(setup, device, GraphOptions()), 1.0)], setup.batch(xp=xp), xp, beam_size=3)
    scorer = graph_scorer(setup, device, graphs, max_batch_size=5)
    chunked = search([("decoder", scorer, 1.0)], setup.batch(xp=xp), xp, beam_size=3, max_active_utterances=2)
    assert_same(plain, chunked)
    assert scorer.lanes.rows == 8  # chunks at 0 and 5 with buckets 8 and 1
    assert scorer.states.statistics().live_slots == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lstm", "rasr", "huggingface"])
def test_bucketed_lms_equal_their_oracles(device, kind):
    xp = xp_of(device)
    if kind == "lstm":
        reference, scores_kind = build_lstm_lm(6, vocab_size=12), "log-probs"
    else:
        reference = build_transformer_lm(9, convention=kind)
        scores_kind = "logits" if kind == "huggingface" else "log-probs"
    batch = UtteranceBatch(ids=["a", "b", "c"], input_lengths=np.array([7, 5, 9]))
    scorer = lm_scorer(reference, device, GraphOptions(enabled=True, time_step=2), scores_kind)
    nbest = search([("lm", scorer, 1.0)], batch, xp, beam_size=3)
    plain = search([("lm", lm_scorer(reference, device, GraphOptions(), scores_kind), 1.0)], batch, xp, beam_size=3)
    assert_same(plain, nbest)
    rasr = reference if kind != "huggingface" else build_transformer_lm(9, convention="rasr")
    for hyps in nbest:
        for hyp in hyps:
            rows = rasr.sequence_log_probs([BOS, *hyp.labels])
            targets = [*hyp.labels, EOS] if terminated(hyp) else hyp.labels
            assert hyp.score == pytest.approx(float(sum(rows[p, t] for p, t in enumerate(targets))), abs=TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_bucketed_prefix_lm_equals_the_unbucketed_run(device):
    xp = xp_of(device)
    pair = build_prefix_lm(4)
    rng = np.random.default_rng(4)
    sizes = np.array([5, 8, 3], np.int32)
    states = rng.standard_normal((3, 8, 32)).astype(np.float32)
    batch = UtteranceBatch(ids=["a", "b", "c"], input_lengths=sizes,
                           inputs={"encoder-states": xp.asarray(states)})
    sm = "transformer-cuda" if device == "cuda" else "transformer-cpu"

    def scorer(graphs):
        return PrefixLmScorer(model=pair.step.serialized(), prefill_model=pair.prefill.serialized(),
                              vocab_size=pair.step.vocab_size, initial_prompt_labels=[2, 3],
                              suffix_prompt_labels=[BOS], state_manager=StateManagerOptions(type=sm),
                              session_options=SessionOptions(device=device), graphs=graphs)

    plain = search([("lm", scorer(GraphOptions()), 1.0)], batch, xp, beam_size=3)
    bucketed = scorer(GraphOptions(enabled=True, time_step=4, warm_up_time=16))
    assert_same(plain, search([("lm", bucketed, 1.0)], batch, xp, beam_size=3))
    assert max(bucketed.runner.graphs.num_graphs, bucketed.captured_graphs) >= len(time_buckets(16, 4))  # warmed up


# --- configuration -----------------------------------------------------------------------------------
BASE = {"models": {"vocabulary": {"path": "examples/models/vocab.txt"}}}


def test_config_takes_a_switch_or_a_section_and_checks_the_device(tmp_path):
    on = validate_config({**BASE, "runtime": {"device": "cuda", "cuda_graphs": True}}, ".")
    assert on.runtime.cuda_graphs.enabled and on.runtime.cuda_graphs.time_step == 32
    section = {"enabled": True, "time_step": 16, "min_rows": 4, "shared_buffers": False, "warm_up_time": 64}
    options = validate_config({**BASE, "runtime": {"device": "cuda", "cuda_graphs": section}}, ".").runtime.cuda_graphs
    assert options.to_options() == GraphOptions(**section)
    assert options.to_options(enabled=False).enabled is False  # a scorer's own switch wins
    with pytest.raises(ConfigError, match=r"runtime\.cuda_graphs\.enabled: CUDA graphs need runtime\.device cuda"):
        validate_config({**BASE, "runtime": {"cuda_graphs": True}}, ".")
    with pytest.raises(ConfigError, match=r"runtime\.cuda_graphs\.time_step"):
        validate_config({**BASE, "runtime": {"device": "cuda", "cuda_graphs": {"time_step": 0}}}, ".")
    with pytest.raises(ConfigError, match=r"runtime\.cuda_graphs\.bucket"):
        validate_config({**BASE, "runtime": {"device": "cuda", "cuda_graphs": {"bucket": 3}}}, ".")
    scorer = {"type": "recurrent-lm", "model": "examples/models/lstm-lm.onnx", "cuda_graphs": True}
    with pytest.raises(ConfigError, match=r"scorers\[0\]\.cuda_graphs: CUDA graphs need runtime\.device cuda"):
        validate_config({**BASE, "scorers": [scorer]}, ".")


# --- GPU only: capture, replay, memory, fallback ------------------------------------------------------
@pytest.mark.gpu
def test_a_model_with_an_if_node_falls_back_with_one_warning(caplog):
    import cupy

    with caplog.at_level(logging.WARNING, logger="gpudecode.session.runner"):
        session = OnnxSession(if_model().SerializeToString(), SessionOptions(device="cuda", cuda_graphs=True))
    warnings = [r.getMessage() for r in caplog.records if "CUDA graphs are off" in r.getMessage()]
    assert len(warnings) == 1 and "If 'choose'" in warnings[0]
    assert not session.cuda_graphs
    x = cupy.arange(4, dtype=cupy.float32)
    for flag in (True, False, True):  # plain runs follow the data, as no graph would
        y = session.run({"x": x, "flag": np.array(flag)})["y"]
        np.testing.assert_array_equal(cupy.asnumpy(y), cupy.asnumpy(x) + (1 if flag else -1))


@pytest.mark.gpu
def test_replay_follows_new_inputs_and_bucket_switches():
    """The same graph replays on new data (composition changes), and switching between buckets
    back and forth replays each bucket's own graph."""
    import cupy

    setup = Setup(11, device="cuda", num_utts=4)
    graphs = GraphOptions(enabled=True, time_step=2, min_rows=1)
    for beam in (2, 3):
        scorer = graph_scorer(setup, "cuda", graphs)
        on = search([("decoder", scorer, 1.0)], setup.batch(xp=cupy), cupy, beam_size=beam, max_active_utterances=3)
        off = search([("decoder", graph_scorer(setup, "cuda", GraphOptions()), 1.0)], setup.batch(xp=cupy), cupy,
                     beam_size=beam)
        assert_same(off, on)
        assert scorer.runner.graphs.captures >= 3


@pytest.mark.gpu
def test_graphs_need_the_state_manager_where_the_model_runs():
    with pytest.raises(ValueError, match="state manager where the model runs"):
        graph_scorer_with(Setup(3, device="cuda"), "transformer-cpu")


def graph_scorer_with(setup, state_manager_type):
    return OnnxDecoderScorer(model=setup.decoder.serialized(), vocab_size=12, start_labels=[BOS],
                             state_manager=StateManagerOptions(type=state_manager_type),
                             session_options=SessionOptions(device="cuda"), graphs=GraphOptions(enabled=True))


@pytest.mark.gpu
def test_shared_buffers_save_the_non_largest_buckets_in_device_memory():
    """cudaMemGetInfo around capturing every bucket up to 128 history steps (64 lanes, ONNX
    Runtime's arena growing by exactly what is requested): the per-bucket variant holds more by
    what its extra buffers hold."""
    import cupy

    from gpudecode.scorers.base import LaneLayout

    reference = build_transformer_lm(1, model_dim=256, num_heads=4, ffn_dim=256)
    batch = UtteranceBatch(ids=list("abcdefgh"), input_lengths=np.full(8, 60))
    held = {}
    for shared in (None, True, False):  # the first run only loads what any first run loads
        scorer = RecurrentLmScorer(
            model=reference.serialized(), vocab_size=reference.vocab_size, start_labels=[BOS],
            state_manager=StateManagerOptions(type="transformer-cuda"),
            session_options=SessionOptions(device="cuda", arena_extend_strategy="kSameAsRequested"),
            graphs=GraphOptions(enabled=True, time_step=32, shared_buffers=shared is not False))
        scorer.begin(LaneLayout(num_groups=8, beam_size=8, xp=cupy))
        scorer.admit(batch, np.arange(8))
        cupy.cuda.runtime.deviceSynchronize()
        free_before = cupy.cuda.runtime.memGetInfo()[0]
        scorer.warm_up(128)
        cupy.cuda.runtime.deviceSynchronize()
        held[shared] = (free_before - cupy.cuda.runtime.memGetInfo()[0], scorer.runner.graphs.buffers.nbytes)
        assert scorer.runner.graphs.captures == len(time_buckets(128, 32))
        scorer.close()
        del scorer
    predicted = held[False][1] - held[True][1]  # what the non-largest buckets' tensors hold
    measured = held[False][0] - held[True][0]
    print(f"graph memory (device bytes, buffer bytes): shared {held[True]}, per bucket {held[False]}; "
          f"saved {measured} (predicted {predicted})")
    assert predicted > 64 << 20
    assert measured == pytest.approx(predicted, rel=0.3)


@pytest.mark.gpu
def test_scorers_sharing_a_session_never_replay_each_others_graphs():
    """Graph ids come from the session: a second scorer on the same session captures its own
    graphs (replaying the first scorer's would write through its freed buffers)."""
    import cupy

    setup = Setup(12, device="cuda", num_utts=3)
    session = OnnxSession(setup.decoder.serialized(), SessionOptions(device="cuda", cuda_graphs=True))
    plain = search([("decoder", graph_scorer(setup, "cuda", GraphOptions()), 1.0)], setup.batch(xp=cupy), cupy)
    for _ in range(2):
        scorer = OnnxDecoderScorer(model=session, vocab_size=12, start_labels=[BOS],
                                   state_manager=StateManagerOptions(type="transformer-cuda"),
                                   graphs=GraphOptions(enabled=True, time_step=2, min_rows=1))
        assert_same(plain, search([("decoder", scorer, 1.0)], setup.batch(xp=cupy), cupy))
        scorer.close()
