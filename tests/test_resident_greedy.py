"""Greedy steps whose states stay in the bucketed step's own inputs (``ResidentRows``): GenAI's
export (GroupQueryAttention, left-aligned histories) decoded with one beam gives GenAI's own greedy
sequences and token scores (the peer's output, committed with the export), with resident steps on
and off, through bucket changes, continuous batching (the rows go back into the pool at each
admission) and the model's context limit. On the CPU the bucketed steps are padded plain runs
(``PaddedRuns``) and the new steps are copied with numpy; on CUDA the graphs are captured and the
copy is one launch of ``copy_steps`` (``kernels/state_copy.cu``), which the kernel emulator also
checks against the numpy copy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.session import SessionOptions
from gpudecode.session.discovery import ModelError
from gpudecode.session.graphs import GraphOptions
from gpudecode.spec import StateVariable
from gpudecode.states import StateManagerOptions, create_state_manager
from tests.hf_generate import prompt_batch
from tests.test_ctc_prefix_kernel import assert_none_in_emulation, needs_gxx
from tests.test_split_positions import emulator_device

ROOT = Path(__file__).resolve().parents[1]
#: GenAI's exports and its own decodes of them: the CPU (float32) one, and its CUDA (float16) one
FIXTURES = {"cpu": ROOT / "tests" / "fixtures" / "peers" / "genai",
            "cuda": ROOT / "tests" / "fixtures" / "peers" / "genai-cuda"}
DOCUMENTS = {device: json.loads((folder / "expected.json").read_text()) for device, folder in FIXTURES.items()}
DOCUMENT = DOCUMENTS["cpu"]
PROMPTS, EOS, MAX_LENGTH = DOCUMENT["prompts"], DOCUMENT["eos"], DOCUMENT["max_length"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOLERANCES = {"cpu": 1e-4, "cuda": 2e-2}  # float16 on CUDA


def scorer(device: str, resident: bool, time_step: int = 4) -> PrefixLmScorer:
    return PrefixLmScorer(model=str(FIXTURES[device]), vocab_size=128, scores_kind="logits",
                          state_manager=StateManagerOptions(type=f"transformer-{device}"),
                          session_options=SessionOptions(device=device),
                          graphs=GraphOptions(enabled=True, time_step=time_step, resident_greedy=resident))


def greedy(lm, device: str, continuous: int | None = None, **options):
    xp = np
    if device == "cuda":
        import cupy as xp
    document = DOCUMENTS[device]
    prompts = document["prompts"]
    batch = prompt_batch(prompts, document["max_length"] - np.array([len(p) for p in prompts]))
    search = LabelSyncOptions(beam_size=1, sentence_end=document["eos"], max_labels_per_input=1.0, **options)
    return label_sync_search([("genai", lm, 1.0)], batch, search, xp=xp, max_active_utterances=continuous)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("finished", ["in-beam", "separate"])
@pytest.mark.parametrize("continuous", [None, 2], ids=["one-batch", "continuous"])
def test_resident_greedy_steps_give_genais_greedy_decodes(device, finished, continuous):
    document = DOCUMENTS[device]
    expected = document["greedy"]
    results, peaks = {}, {}
    for resident in (True, False):
        lm = scorer(device, resident)
        try:
            results[resident] = greedy(lm, device, continuous, finished=finished)
            runs = lm.runner.resident_runs
            assert (runs > 0) == resident, runs  # the resident path ran (and only where asked)
            statistics = lm.states.statistics()
            assert statistics.live_slots == 0
            peaks[resident] = statistics.peak_live_slots
        finally:
            lm.close()
    if continuous is None:  # the pool held the prompts alone (not split back at the end), the pool path everything
        assert peaks[True] <= sum(map(len, document["prompts"])) < peaks[False]
    for resident, nbest in results.items():
        for prompt, hyps, sequence, log_probs in zip(document["prompts"], nbest, expected["sequences"],
                                                     expected["token_log_probs"]):
            hyp = hyps[0]
            assert [*prompt, *hyp.labels] == sequence, resident  # GenAI leaves out the final EOS
            assert hyp.score == pytest.approx(sum(log_probs), abs=TOLERANCES[device])
    assert {len(s) < document["max_length"] for s in expected["sequences"]} == {True, False}  # EOS and the limit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("time_step", [1, 2, 32])
def test_every_bucket_change_keeps_the_histories(time_step, device):
    """Buckets of 1, 2, 4, ... positions (a change every step or two) and one large bucket; on CUDA
    the presents share their pasts' buffers (the bucket change copies them out of the way first)."""
    lm = scorer(device, True, time_step)
    try:
        nbest = greedy(lm, device)
        assert [[*p, *h[0].labels] for p, h in zip(DOCUMENTS[device]["prompts"], nbest)] == \
            DOCUMENTS[device]["greedy"]["sequences"]
        assert lm.runner.resident_runs > 0
        assert lm.runner.shares_presents == (device == "cuda")
    finally:
        lm.close()


def test_past_the_context_the_resident_step_fails_as_the_pool_step_does():
    """A model declared to hold fewer positions than the prompts and labels need: both forms stop
    with the same error, where the longest history passes it."""
    messages = []
    for resident in (True, False):
        lm = scorer("cpu", resident)
        lm.runner.spec = dataclasses.replace(lm.runner.spec, max_time=13)  # this scorer's own runner
        try:
            with pytest.raises(ModelError, match="exceeds the model's context of 14 positions") as raised:
                greedy(lm, "cpu")
            messages.append(str(raised.value))
            assert (lm.runner.resident_runs > 0) == resident  # resident steps ran up to the limit
        finally:
            lm.close()
    assert messages[0] == messages[1]


def _resident_and_pool(tmp_path, search) -> list:
    """``search(lm)``'s n-best with an LM in GenAI's convention, resident steps on and off: the
    resident steps ran (only where on) and gave the pool's n-best. Returns the resident n-best as
    (labels, score) lists."""
    from gpudecode.scorers.onnx_decoder import RecurrentLmScorer
    from gpudecode.testing import build_genai_lm

    path = build_genai_lm(3, vocab_size=VOCAB).save(tmp_path / "lm.onnx")
    results, runs = {}, {}
    for resident in (True, False):
        lm = RecurrentLmScorer(model=str(path), vocab_size=VOCAB, start_labels=[1], scores_kind="logits",
                               state_manager=StateManagerOptions(type="transformer-cpu"),
                               graphs=GraphOptions(enabled=True, time_step=2, resident_greedy=resident))
        results[resident] = [[(h.labels, h.score) for h in hyps] for hyps in search(lm)]
        runs[resident] = lm.runner.resident_runs
        lm.close()
    assert runs[True] > 0 and runs[False] == 0
    assert [[labels for labels, _ in u] for u in results[True]] == [[labels for labels, _ in u] for u in results[False]]
    np.testing.assert_allclose([s for u in results[True] for _, s in u], [s for u in results[False] for _, s in u],
                               atol=1e-4)
    return results[True]


VOCAB = 16  # the LM of the searches with scorers


def test_a_ctc_prefix_search_fuses_a_resident_lm_at_beam_one(tmp_path):
    """The CTC prefix search with one beam extends its LM's lanes frame by frame (a lane that emits
    nothing carries its state): resident steps give the pool's n-best."""
    from gpudecode.search import CtcPrefixOptions, ctc_prefix_search

    rng = np.random.default_rng(0)
    log_probs = (rng.standard_normal((3, 30, VOCAB)) * 3).astype(np.float32)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    nbest = _resident_and_pool(tmp_path, lambda lm: ctc_prefix_search(
        log_probs, np.array([30, 22, 9]), CtcPrefixOptions(beam_size=1, blank=0), [("lm", lm, 0.5)]))
    assert all(len(u[0][0]) > 3 for u in nbest)  # the LM ran over many emissions


@pytest.mark.parametrize("max_symbols", [1, 3])
def test_a_transducer_search_fuses_a_resident_lm_at_beam_one(tmp_path, max_symbols):
    """The transducer search with one beam scores its LM once per symbol step (several per frame with
    ``max_symbols_per_frame`` 3): resident steps give the pool's n-best."""
    from gpudecode.search.transducer import TransducerOptions, transducer_search
    from tests.test_transducer_search import make_models, random_encoder_states

    models = make_models(5, VOCAB)
    encoder_states, lengths = random_encoder_states(5, 3, 12), np.array([12, 9, 5])
    _resident_and_pool(tmp_path, lambda lm: transducer_search(
        encoder_states, lengths, models.prediction(), models.joint(),
        TransducerOptions(beam_size=1, max_symbols_per_frame=max_symbols), [("lm", lm, 0.5)]))


def test_an_older_resident_context_is_refused_not_read():
    """Resident rows live in buffers the next step overwrites: scoring (or splitting into the pool) a
    context older than the latest one raises instead of reading another step's states."""
    from gpudecode.scorers.base import LaneLayout

    lm = scorer("cpu", True)
    try:
        batch = prompt_batch(PROMPTS, 6)
        lm.begin(LaneLayout(num_groups=len(PROMPTS), beam_size=1, xp=np))
        lm.admit(batch, np.arange(len(PROMPTS)))
        ctx = lm.initial_context(np.arange(len(PROMPTS)))
        contexts = []
        for _ in range(3):
            scores = lm.score(ctx)
            ctx = lm.extend(ctx, np.arange(len(PROMPTS)), scores.argmax(axis=1))
            contexts.append(ctx)
        assert contexts[-1].resident is not None and contexts[-2].resident is not None
        with pytest.raises(AssertionError, match="used after a newer one"):
            lm.score(contexts[-2])
        with pytest.raises(AssertionError, match="used after a newer one"):
            lm.initial_context(np.arange(1), contexts[-2])
        lm.score(contexts[-1])  # the latest one still runs
        lm.release(np.arange(len(PROMPTS)))
        assert lm.states.statistics().live_slots == 0
    finally:
        lm.close()


# --- the copy ------------------------------------------------------------------------------------------
def _variables(dtype) -> list[StateVariable]:
    """Keys [N, 2, T, 4] and values [N, T, 6] (heads folded: another span layout), and one with a
    layer axis before the rows (batch axis 1)."""
    return [StateVariable(input_name="past_k", output_name="present_k", dtype=np.dtype(dtype),
                          shape=(None, 2, None, 4), batch_axis=0, time_axis=2),
            StateVariable(input_name="past_v", output_name="present_v", dtype=np.dtype(dtype),
                          shape=(None, None, 6), batch_axis=0, time_axis=1),
            StateVariable(input_name="past_l", output_name="present_l", dtype=np.dtype(dtype),
                          shape=(3, None, None, 2), batch_axis=1, time_axis=2)]


def copy_mismatches(cupy) -> list[str]:
    """The CUDA manager's ``copy_steps`` (one launch) against the host manager's numpy copy, over
    dtypes, positions inside and outside both time axes and rows past ``num_rows``."""
    emulator_device(cupy)
    bad = []
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float16):
        variables = _variables(dtype)
        managers = {device: create_state_manager(StateManagerOptions(type=f"transformer-{device}"), variables,
                                                 execution_provider=device) for device in ("cpu", "cuda")}
        rows, num_rows, source_time, target_time = 6, 5, 7, 5
        positions = np.array([0, 4, 5, 6, -1, 2], np.int32)  # 5, 6: past the target; -1; row 5 not copied
        sources = {v.input_name: rng.standard_normal(_shape(v, rows, source_time)).astype(dtype) for v in variables}
        targets = {v.input_name: rng.standard_normal(_shape(v, rows, target_time)).astype(dtype) for v in variables}
        expected = {k: v.copy() for k, v in targets.items()}
        managers["cpu"].copy_steps(sources, expected, positions, num_rows=num_rows)
        on_device = {k: cupy.asarray(v) for k, v in targets.items()}
        managers["cuda"].copy_steps({k: cupy.asarray(v) for k, v in sources.items()}, on_device,
                                    cupy.asarray(positions), num_rows=num_rows)
        for v in variables:
            got = cupy.asnumpy(on_device[v.input_name])
            if got.tobytes() != expected[v.input_name].tobytes():
                bad.append(f"{np.dtype(dtype).name} {v.input_name}")
            if np.array_equal(expected[v.input_name], targets[v.input_name]):
                bad.append(f"{v.input_name}: the oracle copied nothing")
        for manager in managers.values():
            manager.close()
    return bad


def _shape(variable: StateVariable, rows: int, time: int) -> tuple[int, ...]:
    shape = list(variable.shape)
    shape[variable.batch_axis], shape[variable.time_axis] = rows, time
    return tuple(shape)


def test_the_host_copy_writes_each_rows_step_at_its_position():
    variables = _variables(np.float32)
    manager = create_state_manager(StateManagerOptions(type="transformer-cpu"), variables, execution_provider="cpu")
    rng = np.random.default_rng(0)
    sources = {v.input_name: rng.standard_normal(_shape(v, 3, 4)).astype(np.float32) for v in variables}
    targets = {v.input_name: np.zeros(_shape(v, 3, 3), np.float32) for v in variables}
    manager.copy_steps(sources, targets, np.array([2, 3, 0], np.int32), num_rows=2)  # row 1: past the target
    key, source = targets["past_k"], sources["past_k"]
    np.testing.assert_array_equal(key[0, :, 2], source[0, :, 2])
    assert not key[1].any() and not key[2].any()  # row 1 out of range, row 2 beyond num_rows
    assert np.count_nonzero(key) == np.count_nonzero(source[0, :, 2])
    layered = targets["past_l"]
    np.testing.assert_array_equal(layered[:, 0, 2], sources["past_l"][:, 0, 2])


@needs_gxx
def test_the_copy_kernel_equals_the_host_copy_in_emulation():
    assert_none_in_emulation("tests.test_resident_greedy", "copy_mismatches")


@pytest.mark.gpu
def test_the_copy_kernel_equals_the_host_copy_on_cuda():
    cupy = pytest.importorskip("cupy")
    assert copy_mismatches(cupy) == []
