"""Split at per-row time positions (``StateManager.split(positions=...)``): a left-aligned Hugging
Face model's present outputs hold each row's history first and its new step at the row's own
length. The CUDA split (``kernels/state_copy.cu``) reads it there in its one launch; it must store
exactly what ``new_step_states`` followed by a plain split stores. The host managers take the
steps with numpy first."""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode.session.hf import new_step_states
from gpudecode.spec import StateVariable
from gpudecode.states import StateManagerOptions, create_state_manager
from tests.test_ctc_prefix_kernel import assert_none_in_emulation, needs_gxx
from tests.test_state_managers import batched_shape, kv_variables, token_view

SLOTS_PER_CHUNK = 8  # a few chunks per case: slots of several slabs


def aligned_variables(dtype) -> list[StateVariable]:
    """Three [N, 2, T, 8] variables: spans of 16 bytes or more (the split's fast path)."""
    return [StateVariable(input_name=f"past_{n}", output_name=f"present_{n}", dtype=np.dtype(dtype),
                          shape=(None, 2, None, 8), batch_axis=0, time_axis=2) for n in ("key", "value", "extra")]


# (variables, rows split, rows of the output buffers, history positions T, new tokens per row)
CASES = [
    ("heads", np.float32, 5, 5, 6, 1),
    ("heads", np.float16, 7, 9, 4, 1),
    ("aligned", np.float32, 6, 8, 5, 1),
    ("aligned", np.float16, 3, 3, 1, 1),  # an empty history: the present holds the new step only
    ("chunks", np.float16, 9, 12, 7, 1),  # one 16-byte vector per span
    ("flat", np.float32, 4, 6, 3, 1),
    ("layered", np.float16, 5, 7, 4, 1),  # batch axis 1: layers outside the rows
    ("heads", np.float32, 4, 4, 6, 2),
]


def case_variables(name: str, dtype) -> list[StateVariable]:
    return aligned_variables(dtype) if name == "aligned" else kv_variables(1, dtype, name)


def manager(device: str, variables, cupy=None):
    """A transformer state manager on ``device`` (``cuda``: the kernels, on ``cupy``)."""
    return create_state_manager(StateManagerOptions(type=f"transformer-{device}", slots_per_chunk=SLOTS_PER_CHUNK),
                                variables, execution_provider=device)


def first_rows(array, axis: int, count: int):
    """The first ``count`` rows along the batch ``axis`` (as the step model slices its outputs)."""
    index = [slice(None)] * array.ndim
    index[axis] = slice(0, count)
    return array[tuple(index)]


def case_inputs(rng, variables, rows: int, buffer_rows: int, time: int, num_new: int):
    """Present outputs [.., buffer_rows, .., time + num_new, ..] (host) and per-row positions
    [buffer_rows] int32 in [0, time], different across rows; rows past ``rows`` hold nonsense."""
    presents = {v.output_name: rng.standard_normal(batched_shape(v, buffer_rows, time + num_new)).astype(v.dtype)
                for v in variables}
    positions = rng.integers(0, time + 1, buffer_rows).astype(np.int32)
    if rows > 1 and time > 0:
        positions[:2] = (0, time)  # the first and the last position
    positions[rows:] = 10**6
    return presents, positions


def expected_tokens(variable: StateVariable, present: np.ndarray, positions: np.ndarray, rows: int, num_new: int):
    """Row b's new token p: the token state at time ``positions[b] + p`` (clamped as the split does)."""
    tokens = token_view(present, variable)
    time = tokens.shape[1]
    return [[tokens[b, min(max(int(positions[b]), 0), time - num_new) + p] for p in range(num_new)]
            for b in range(rows)]


def pool_tokens(states, slots: np.ndarray, v: int, to_host) -> list:
    """The pool's token states of variable ``v`` at ``slots`` [N, S]."""
    slabs = [to_host(slab) for slab in states.pool.slabs[v]]
    return [[slabs[s // SLOTS_PER_CHUNK][s % SLOTS_PER_CHUNK] for s in row] for row in slots]


def pool_bytes(states, to_host) -> list[bytes]:
    """Every slab of every variable, as raw bytes."""
    return [to_host(slab).tobytes() for slabs in states.pool.slabs for slab in slabs]


def split_at_positions(states, presents: dict, positions, variables, rows: int, num_new: int, **kwargs):
    """``states.split`` of the first ``rows`` of ``presents`` read at ``positions``."""
    outputs = {v.output_name: first_rows(presents[v.output_name], v.batch_axis, rows) for v in variables}
    return states.split(outputs, num_new_tokens=num_new, positions=positions, **kwargs)


def split_new_steps(states, presents: dict, positions, variables, rows: int):
    """The step model's old path: ``new_step_states`` per output, then a plain split."""
    steps = {v.output_name: new_step_states(first_rows(presents[v.output_name], 0, rows), positions[:rows],
                                            v.time_axis, "left") for v in variables}
    return states.split(steps)


def case_problems(xp, to_host, make, case, rng) -> list:
    """The problems of one case: slots and tokens against the numpy expectation and, where
    ``new_step_states`` applies (batch axis 0, one new token), the pool against its path's."""
    name, dtype, rows, buffer_rows, time, num_new = case
    variables = case_variables(name, dtype)
    presents, positions = case_inputs(rng, variables, rows, buffer_rows, time, num_new)
    on_device = {k: xp.asarray(a) for k, a in presents.items()}
    problems = []
    for counted in (False, True):  # fused allocation; slots allocated first (token_counts)
        states = make(variables)
        counts = {"token_counts": xp.asarray(np.full(rows, num_new, np.int32))} if counted else {}
        slots = to_host(split_at_positions(states, on_device, xp.asarray(positions), variables, rows, num_new,
                                           **counts))
        if slots.shape != (rows, num_new) or len(set(slots.ravel().tolist())) != slots.size or (slots < 0).any():
            problems.append((name, str(np.dtype(dtype)), counted, "slots", slots.tolist()))
            continue
        for v, variable in enumerate(variables):
            want = expected_tokens(variable, presents[variable.output_name], positions, rows, num_new)
            got = pool_tokens(states, slots, v, to_host)
            if np.asarray(got).tobytes() != np.asarray(want).tobytes():
                problems.append((name, str(np.dtype(dtype)), counted, variable.output_name))
        if num_new == 1 and all(v.batch_axis == 0 for v in variables) and not counted:
            plain = make(variables)
            plain_slots = to_host(split_new_steps(plain, on_device, xp.asarray(positions), variables, rows))
            if plain_slots.tolist() != slots.tolist() or pool_bytes(plain, to_host) != pool_bytes(states, to_host):
                problems.append((name, str(np.dtype(dtype)), "differs from new_step_states + split"))
    return problems


def emulator_device(cupy) -> None:
    """The kernel emulator's CuPy has no device attributes: a device of 2 SMs (grids of a few
    blocks). Real CuPy is left as it is."""
    if not hasattr(cupy.cuda.Device(0), "attributes"):
        cupy.cuda.Device.attributes = {"MultiProcessorCount": 2}


def split_position_mismatches(cupy) -> list:
    """Every case's problems with the CUDA manager on ``cupy`` (none when the split is right)."""
    emulator_device(cupy)
    rng = np.random.default_rng(17)
    problems = []
    for case in CASES:
        problems += case_problems(cupy, cupy.asnumpy, lambda variables: manager("cuda", variables), case, rng)
    return problems


def step_scores(scorer, device: str, xp, steps: int = 5, rows: int = 5) -> list:
    """Scores of ``steps`` plain steps of ``scorer``'s step model with a ``device`` state manager,
    the histories growing unevenly (some rows keep their history), so the rows' lengths differ."""
    from types import SimpleNamespace

    from gpudecode.session.step_model import StepModelRunner

    states = create_state_manager(StateManagerOptions(type=f"transformer-{device}", history_alignment="left",
                                                      slots_per_chunk=SLOTS_PER_CHUNK),
                                  scorer.spec.state_variables, execution_provider=device)
    runner = StepModelRunner(scorer.session, scorer.spec, states)
    lanes = SimpleNamespace(buffers={}, version=0, group_size=1, xp=xp)
    rng = np.random.default_rng(1)
    histories, scores = states.initial_histories(rows), []
    for _ in range(steps):
        labels = xp.asarray(rng.integers(0, 16, rows).astype(np.int64))
        step, slots = runner.run(histories, labels, slice(0, rows), lanes)
        append = xp.asarray(rng.random(rows) < 0.7)
        histories = states.extend(histories, slots, xp.arange(rows), append=append)
        scores.append(np.asarray(step))
    return scores


def runner_mismatches(cupy) -> list:
    """A left-aligned GroupQueryAttention model (ONNX Runtime on the CPU) with a CUDA state manager
    on ``cupy`` (its split reading each row's new step at the row's length) against a host state
    manager: the steps whose scores differ (none when the split stored the right states)."""
    import tempfile
    from pathlib import Path

    from gpudecode.scorers.prefix_lm import PrefixLmScorer
    from gpudecode.testing import build_genai_lm

    emulator_device(cupy)
    with tempfile.TemporaryDirectory() as folder:
        path = build_genai_lm(5, vocab_size=16).save(Path(folder) / "lm.onnx")
        scorer = PrefixLmScorer(model=str(path), vocab_size=16, scores_kind="logits")
    assert scorer.spec.history_alignment == "left"
    host, device = step_scores(scorer, "cpu", np), step_scores(scorer, "cuda", cupy)
    return [step for step, (a, b) in enumerate(zip(host, device)) if not np.array_equal(a, b)]


@needs_gxx
def test_a_left_aligned_model_with_cuda_states_scores_as_with_host_states_in_emulation():
    assert_none_in_emulation("tests.test_split_positions", "runner_mismatches")


@needs_gxx
def test_the_cuda_split_at_positions_equals_new_step_states_in_emulation():
    assert_none_in_emulation("tests.test_split_positions", "split_position_mismatches")


@pytest.mark.gpu
def test_the_cuda_split_at_positions_equals_new_step_states_on_cuda():
    assert split_position_mismatches(pytest.importorskip("cupy")) == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{np.dtype(c[1])}-{c[2]}of{c[3]}-T{c[4]}-S{c[5]}")
def test_the_host_split_at_positions_takes_the_same_steps(case):
    assert case_problems(np, np.asarray, lambda variables: manager("cpu", variables), case,
                         np.random.default_rng(3)) == []


def test_the_host_split_without_positions_reads_the_last_steps():
    variables = kv_variables(1, np.float32, "heads")
    presents, positions = case_inputs(np.random.default_rng(8), variables, 4, 4, 5, 1)
    states = manager("cpu", variables)
    slots = states.split(presents)
    for v, variable in enumerate(variables):
        want = expected_tokens(variable, presents[variable.output_name], np.full(4, 5), 4, 1)
        assert np.asarray(pool_tokens(states, slots, v, np.asarray)).tobytes() == np.asarray(want).tobytes()


def test_positions_out_of_range_are_clamped_into_the_time_axis():
    variables = kv_variables(1, np.float32, "heads")
    presents, _ = case_inputs(np.random.default_rng(9), variables, 3, 3, 4, 1)
    states = manager("cpu", variables)
    slots = states.split(presents, positions=np.array([-2, 7, 1]))
    for v, variable in enumerate(variables):
        want = expected_tokens(variable, presents[variable.output_name], np.array([0, 4, 1]), 3, 1)
        assert np.asarray(pool_tokens(states, slots, v, np.asarray)).tobytes() == np.asarray(want).tobytes()


def test_positions_must_cover_the_rows():
    variables = kv_variables(1, np.float32, "heads")
    presents, _ = case_inputs(np.random.default_rng(2), variables, 3, 3, 4, 1)
    with pytest.raises(ValueError, match="positions must have shape"):
        manager("cpu", variables).split(presents, positions=np.zeros(2, np.int32))
