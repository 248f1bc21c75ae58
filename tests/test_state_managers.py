"""numpy state managers against a hand-written reference of RASR's state semantics.

The reference keeps every hypothesis as a Python list of token states (one dict of arrays per
token) and builds the merged inputs with plain loops: obviously correct, slow, test-only. The
helpers here (``Reference``, ``Scenario``) are shared with tests/test_state_gpu.py.
"""

from __future__ import annotations

import logging
import math
import zlib

import numpy as np
import pytest

from gpudecode.backend import GpuUnavailableError, gpu_available, to_host
from gpudecode.spec import StateVariable
from gpudecode.states import (
    STATE_MANAGER_REGISTRY,
    StateHistory,
    StateManagerConfigError,
    StateManagerOptions,
    create_state_manager,
    resolve_type,
)
from gpudecode.states.pool import StatePool

# ---- state variable layouts ----------------------------------------------------------------------


def kv_variables(num_layers: int, dtype, layout: str) -> list[StateVariable]:
    """Key/value states: ``heads`` [N, H, T, D], ``flat`` [N, T, H*D], ``layered`` [2, N, 3, T, 2],
    ``chunks`` [N, 5, T, x] with 16-byte spans (x = 16 / itemsize: FasterTransformer's key layout)."""
    shapes = {
        "heads": ((None, 2, None, 3), 0, 2),
        "flat": ((None, None, 6), 0, 1),
        "layered": ((2, None, 3, None, 2), 1, 3),
        "chunks": ((None, 5, None, 16 // np.dtype(dtype).itemsize), 0, 2),
    }
    shape, batch_axis, time_axis = shapes[layout]
    variables = []
    for layer in range(num_layers):
        for kind in ("key", "value"):
            variables.append(
                StateVariable(
                    input_name=f"past_{kind}_{layer}",
                    output_name=f"present_{kind}_{layer}",
                    dtype=np.dtype(dtype),
                    shape=shape,
                    batch_axis=batch_axis,
                    time_axis=time_axis,
                )
            )
    return variables


def lstm_variables(dtype, layered: bool) -> list[StateVariable]:
    shape, batch_axis = ((2, None, 5), 1) if layered else ((None, 5), 0)
    return [
        StateVariable(input_name=f"{n}_in", output_name=f"{n}_out", dtype=np.dtype(dtype), shape=shape,
                      batch_axis=batch_axis, time_axis=None)
        for n in ("h", "c")
    ]


def token_view(array: np.ndarray, variable: StateVariable) -> np.ndarray:
    """``[N, T, *token_shape]`` view (``[N, *token_shape]`` for LSTM states) of a batched tensor."""
    if variable.time_axis is None:
        return np.moveaxis(array, variable.batch_axis, 0)
    return np.moveaxis(array, (variable.batch_axis, variable.time_axis), (0, 1))


def batched_shape(variable: StateVariable, rows: int, time: int) -> tuple[int, ...]:
    shape = list(variable.shape)
    shape[variable.batch_axis] = rows
    if variable.time_axis is not None:
        shape[variable.time_axis] = time
    return tuple(shape)


# ---- the hand-written reference ------------------------------------------------------------------


class Reference:
    """RASR semantics by hand. ``hyps[b]`` is the list of token states of hypothesis b, each a dict
    input name -> array of the token shape, exactly as the model emitted it (after the storage
    round trip ``stored``)."""

    def __init__(self, variables, *, max_history=None, keep_first=False, lstm=False, stored=lambda a: a):
        self.variables = variables
        self.max_history = max_history
        self.keep_first = keep_first
        self.lstm = lstm
        self.stored = stored
        self.hyps: list[list[dict]] = []

    def window(self, tokens: list) -> list:
        if self.lstm:
            return tokens[-1:]
        limit = self.max_history
        if limit is None or len(tokens) <= limit:
            return list(tokens)
        if limit == 0:
            return []
        if self.keep_first:
            kept = [tokens[0]]
            for k in range(len(tokens) - (limit - 1), len(tokens)):
                kept.append(tokens[k])
            return kept
        return [tokens[k] for k in range(len(tokens) - limit, len(tokens))]

    def time_size(self) -> int:
        if self.lstm:
            return 1
        return max([len(self.window(h)) for h in self.hyps], default=0)

    def merge(self, rows=None, time=None):
        rows = len(self.hyps) if rows is None else rows
        time = self.time_size() if time is None else time
        inputs = {}
        prefix = np.zeros(rows, dtype=np.int32)
        for v in self.variables:
            out = np.zeros(batched_shape(v, rows, time), dtype=v.dtype)
            view = token_view(out, v)
            for b, tokens in enumerate(self.hyps):
                kept = self.window(tokens)
                prefix[b] = len(kept)
                for j, token in enumerate(kept):
                    if self.lstm:
                        view[b] = token[v.input_name]
                    else:
                        view[b, time - len(kept) + j] = token[v.input_name]
            inputs[v.input_name] = out
        return inputs, prefix

    def split(self, outputs: dict, num_new: int, counts) -> list[list[dict]]:
        """New token states per row, read at ``out_T - num_new + p``."""
        rows = []
        for b in range(len(counts)):
            tokens = []
            for p in range(int(counts[b])):
                token = {}
                for v in self.variables:
                    view = token_view(outputs[v.output_name], v)
                    if self.lstm:
                        token[v.input_name] = self.stored(view[b].copy())
                    else:
                        time = view.shape[1]
                        token[v.input_name] = self.stored(view[b, time - num_new + p].copy())
                tokens.append(token)
            rows.append(tokens)
        return rows

    def extend(self, new_tokens, parents, append):
        children = []
        for c, parent in enumerate(parents):
            tokens = list(self.hyps[parent])
            if append[c]:
                tokens = tokens + new_tokens[parent] if not self.lstm else (new_tokens[parent] or tokens)
            children.append(tokens)
        self.hyps = children


def random_outputs(rng, variables, rows: int, time: int):
    return {
        v.output_name: rng.standard_normal(batched_shape(v, rows, time)).astype(v.dtype) for v in variables
    }


def bits(array) -> np.ndarray:
    """The raw bytes of an array (bit-identical comparisons, NaN included)."""
    array = np.ascontiguousarray(to_host(array))
    return array.view(np.uint8)


class Scenario:
    """A random search on one manager, checked step by step against the reference (or, with
    ``twin``, run in lock step on a second manager whose merges must be bit-identical)."""

    def __init__(self, manager, reference: Reference | None, rng, *, twin=None, full_time_axis=True, nan_buffers=False):
        self.manager, self.reference, self.rng, self.twin = manager, reference, rng, twin
        self.full_time_axis = full_time_axis
        self.nan_buffers = nan_buffers
        self.lstm = manager.family == "lstm"

    def _managers(self):
        return [self.manager] + ([self.twin] if self.twin is not None else [])

    def start(self, num_rows: int, prefill_max: int = 0):
        self.histories = [m.initial_histories(num_rows) for m in self._managers()]
        if self.reference is not None:
            self.reference.hyps = [[] for _ in range(num_rows)]
        if prefill_max and not self.lstm:
            counts = self.rng.integers(0, prefill_max + 1, size=num_rows).astype(np.int32)
            counts[0] = prefill_max  # the largest count is num_new_tokens
            outputs = random_outputs(self.rng, self.manager.state_variables, num_rows, prefill_max)
            self._split_extend(outputs, prefill_max, counts, np.arange(num_rows), np.ones(num_rows, bool))

    def _split_extend(self, outputs, num_new, counts, parents, append):
        new = []
        for i, m in enumerate(self._managers()):
            xp = m.xp
            slots = m.split(outputs, num_new_tokens=num_new, token_counts=None if counts is None else xp.asarray(counts))
            new.append(slots)
            self.histories[i] = m.extend(self.histories[i], slots, xp.asarray(parents), append=xp.asarray(append))
        if self.reference is not None:
            rows = len(self.reference.hyps)
            counts_ = np.full(rows, num_new) if counts is None else counts
            self.reference.extend(self.reference.split(outputs, num_new, counts_), parents, append)
        for i, m in enumerate(self._managers()):
            m.retain(self.histories[i])
        return new

    def check_merge(self, padded: bool = False):
        m = self.manager
        ref_inputs = ref_prefix = None
        time = None
        if self.reference is not None:
            time = self.reference.time_size()
            ref_inputs, ref_prefix = self.reference.merge()
        elif not self.lstm:
            time = int(to_host(self.histories[0].lengths).max(initial=0))
            time = min(time, m.options.max_history if m.options.max_history is not None else time)
        merged = []
        for i, mgr in enumerate(self._managers()):
            rows = self.histories[i].num_rows
            if padded or self.nan_buffers:
                extra_rows, extra_time = (3, 2) if padded else (0, 0)
                out_time = (time or 0) + extra_time if not self.lstm else 1
                out = {}
                for layout in mgr.layouts:
                    shape = layout.tensor_shape(rows + extra_rows, out_time)
                    out[layout.name] = mgr.xp.full(shape, np.nan, dtype=layout.model_dtype)
                prefix_out = mgr.xp.full(rows + extra_rows, -7, dtype=np.int32)
                result = mgr.merge(self.histories[i], out=out, prefix_lengths_out=prefix_out)
            else:
                result = mgr.merge(self.histories[i], time_size=None if self.lstm else time)
            merged.append(result)
        first = merged[0]
        if self.twin is not None:
            for name, array in first.inputs.items():
                assert np.array_equal(bits(array), bits(merged[1].inputs[name])), f"{name} differs from the twin"
                assert not np.isnan(to_host(array).astype(np.float64)).any(), f"{name}: unwritten (NaN) elements"
            assert np.array_equal(to_host(first.prefix_lengths), to_host(merged[1].prefix_lengths))
        if ref_inputs is not None:
            rows = len(self.reference.hyps)
            if padded:
                full_time = first.time_size
                ref_inputs, ref_prefix = self.reference.merge(rows=rows + 3, time=full_time)
            for name, expected in ref_inputs.items():
                got = to_host(first.inputs[name])
                assert got.shape == expected.shape, (name, got.shape, expected.shape)
                assert np.array_equal(bits(got), bits(expected)), f"merge of {name} differs from the reference"
            assert np.array_equal(to_host(first.prefix_lengths), ref_prefix)
        return first

    def step(self, *, max_children: int = 12, keep_probability: float = 0.8):
        m = self.manager
        rows = self.histories[0].num_rows
        if self.lstm or not self.full_time_axis:
            out_time = 1
        else:
            out_time = self.check_merge().time_size + 1 if self.reference is None else self.reference.time_size() + 1
        outputs = random_outputs(self.rng, m.state_variables, rows, out_time)
        num_children = int(self.rng.integers(1, max_children + 1))
        parents = np.sort(self.rng.integers(0, rows, size=num_children))  # shared prefixes
        append = self.rng.random(num_children) < keep_probability  # ragged lengths
        self._split_extend(outputs, 1, None, parents, append)


def assert_pool_consistent(manager, histories: StateHistory):
    """Live slots == the distinct slots in the windows of ``histories``."""
    table, lengths = to_host(histories.table), to_host(histories.lengths)
    referenced = set()
    limit = 1 if manager.family == "lstm" else manager.options.max_history
    first = manager.options.always_include_first_token_state
    for b in range(table.shape[0]):
        row = list(table[b, : lengths[b]])
        if limit is not None and len(row) > limit:
            row = ([row[0]] + row[len(row) - limit + 1 :] if limit >= 1 else []) if first else row[len(row) - limit :]
        referenced.update(int(s) for s in row if s >= 0)
    stats = manager.statistics()
    assert stats.live_slots == len(referenced), (stats.live_slots, len(referenced))
    return stats


# ---- merge / split against the reference ---------------------------------------------------------

TRANSFORMER_CASES = [
    # (layout, dtype, storage_dtype, max_history, keep_first)
    ("heads", np.float32, None, None, False),
    ("flat", np.float32, None, None, False),
    ("heads", np.float32, None, 0, False),
    ("heads", np.float32, None, 1, False),
    ("flat", np.float32, None, 1, True),
    ("heads", np.float32, None, 3, False),
    ("flat", np.float32, None, 3, True),
    ("heads", np.float16, None, 4, True),
    ("flat", np.float16, None, None, False),
    ("layered", np.float32, None, 3, True),
    ("heads", np.float32, "float16", 3, False),
    ("chunks", np.float16, None, None, False),
    ("chunks", np.float32, None, 3, True),
    ("chunks", np.float32, "float16", 2, False),
    ("flat", np.float16, "float32", None, False),
]


def _case_id(case):
    layout, dtype, storage, limit, first = case
    return f"{layout}-{np.dtype(dtype).name}-store{storage}-L{limit}-first{int(first)}"


@pytest.mark.parametrize("case", TRANSFORMER_CASES, ids=_case_id)
@pytest.mark.parametrize("full_time_axis", [True, False], ids=["full-axis", "new-step"])
def test_transformer_merge_split_match_reference(case, full_time_axis):
    layout, dtype, storage, limit, first = case
    variables = kv_variables(2, dtype, layout)
    options = StateManagerOptions(
        type="transformer-cpu", max_history=limit, always_include_first_token_state=first,
        slots_per_chunk=16, storage_dtype=storage,
    )
    manager = create_state_manager(options, variables, execution_provider="cpu")
    stored = (lambda a: a.astype(storage).astype(dtype)) if storage else (lambda a: a)
    reference = Reference(variables, max_history=limit, keep_first=first, stored=stored)
    rng = np.random.default_rng(zlib.crc32(_case_id(case).encode()))
    scenario = Scenario(manager, reference, rng, full_time_axis=full_time_axis)
    scenario.start(num_rows=5, prefill_max=4)
    scenario.check_merge()
    ragged = shared = False
    for step in range(8):
        scenario.step()
        merged = scenario.check_merge(padded=step % 3 == 2)
        assert_pool_consistent(manager, scenario.histories[0])
        ragged |= len({len(h) for h in reference.hyps}) > 1
        table = scenario.histories[0].table
        shared |= len(table) > len({tuple(row) for row in table.tolist()}) or (
            table.shape[1] > 0 and len(set(table[:, 0].tolist())) < len(table)
        )
    assert ragged and shared, "the scenario should produce ragged histories with shared prefixes"
    assert merged.inputs[variables[0].input_name].dtype == np.dtype(dtype)


def test_merge_default_time_size_is_longest_kept_history():
    variables = kv_variables(1, np.float32, "heads")
    manager = create_state_manager(StateManagerOptions(type="transformer-cpu", max_history=3), variables,
                                   execution_provider="cpu")
    rng = np.random.default_rng(1)
    histories = manager.initial_histories(2)
    for step in range(5):
        slots = manager.split(random_outputs(rng, variables, 2, 1))
        histories = manager.extend(histories, slots, np.array([0, 1]), append=np.array([True, step == 0]))
    merged = manager.merge(histories)
    assert merged.time_size == 3
    assert merged.inputs["past_key_0"].shape == (2, 2, 3, 3)
    assert merged.prefix_lengths.tolist() == [3, 1]
    # row 1 keeps only its first token: two zero positions on the left
    assert not merged.inputs["past_key_0"][1, :, :2].any() and merged.inputs["past_key_0"][1, :, 2].any()


def test_family_behaviour_of_the_managers():
    """What differs between families is the managers' own: history limit, time axis, trimming."""
    transformer = create_state_manager(StateManagerOptions(type="transformer-cpu", max_history=3),
                                       kv_variables(1, np.float32, "heads"), execution_provider="cpu")
    lstm = create_state_manager(StateManagerOptions(type="lstm-cpu"), lstm_variables(np.float32, False),
                                execution_provider="cpu")
    assert (transformer.max_history, transformer.has_time_axis) == (3, True)
    assert (lstm.max_history, lstm.has_time_axis) == (1, False)
    assert transformer.initial_histories(2).width == 0 and lstm.initial_histories(2).width == 1
    wide = StateHistory(table=np.arange(8, dtype=np.int32).reshape(2, 4), lengths=np.array([2, 1], np.int32))
    trimmed = transformer.trimmed(wide, 2)
    assert trimmed.table.tolist() == [[0, 1], [4, 5]] and trimmed.lengths is wide.lengths
    assert transformer.trimmed(wide, 4) is wide and lstm.trimmed(wide, 1) is wide


def left_aligned_merge_keeps_the_padding(manager_type: str, execution_provider: str, xp, layout="heads") -> None:
    """A left-aligned merge writes each row's kept states first, exactly the right-aligned ones,
    and leaves every position after them, and the rows past N, as the buffer held them."""
    variables = kv_variables(1, np.float32, layout)
    managers = {alignment: create_state_manager(
        StateManagerOptions(type=manager_type, max_history=4, history_alignment=alignment), variables,
        execution_provider=execution_provider) for alignment in ("right", "left")}
    merged = {}
    for alignment, manager in managers.items():
        rng = np.random.default_rng(3)
        histories = manager.initial_histories(3)
        for step in range(6):
            slots = manager.split(random_outputs(rng, variables, 3, 1))
            histories = manager.extend(histories, slots, np.array([0, 1, 2]),
                                       append=np.array([True, step < 2, step < 5]))
        out = {v.input_name: xp.full(batched_shape(v, 5, 6), 7.0, np.float32) for v in variables}
        merged[alignment] = manager.merge(histories, out=out)
    right, left = (to_host(merged[a].inputs["past_key_0"]) for a in ("right", "left"))
    kept = to_host(merged["left"].prefix_lengths).tolist()
    assert kept == [4, 2, 4, 0, 0] == to_host(merged["right"].prefix_lengths).tolist()
    for row in range(3):
        k = kept[row]
        assert np.array_equal(left[row, :, :k], right[row, :, 6 - k:])
        assert (left[row, :, k:] == 7.0).all(), f"row {row}: the padding was written"
        assert not right[row, :, :6 - k].any()
    assert (left[3:] == 7.0).all() and not right[3:].any()


@pytest.mark.parametrize("layout", ["heads", "chunks"])
def test_left_aligned_merge_keeps_the_padding(layout):
    left_aligned_merge_keeps_the_padding("transformer-cpu", "cpu", np, layout)


def test_merge_into_smaller_time_truncates_like_max_history():
    variables = kv_variables(1, np.float32, "flat")
    manager = create_state_manager(StateManagerOptions(type="transformer-cpu"), variables, execution_provider="cpu")
    rng = np.random.default_rng(2)
    histories = manager.initial_histories(1)
    outputs = []
    for _ in range(4):
        out = random_outputs(rng, variables, 1, 1)
        outputs.append(out["present_key_0"][0, 0])
        histories = manager.extend(histories, manager.split(out), np.array([0]))
    merged = manager.merge(histories, time_size=2)
    assert merged.prefix_lengths.tolist() == [2]
    assert np.array_equal(merged.inputs["past_key_0"][0], np.stack(outputs[2:]))


@pytest.mark.parametrize("layered", [False, True], ids=["NH", "LNH"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_lstm_merge_split_match_reference(layered, dtype):
    variables = lstm_variables(dtype, layered)
    manager = create_state_manager(StateManagerOptions(type="lstm", slots_per_chunk=8), variables,
                                   execution_provider="cpu")
    assert manager.family == "lstm" and manager.device == "cpu"
    reference = Reference(variables, lstm=True)
    scenario = Scenario(manager, reference, np.random.default_rng(3))
    scenario.start(num_rows=4)
    merged = scenario.check_merge()
    assert not merged.inputs["h_in"].any(), "the initial LSTM state is zero"
    for step in range(10):
        scenario.step(keep_probability=0.7)
        scenario.check_merge(padded=step % 4 == 1)
        stats = assert_pool_consistent(manager, scenario.histories[0])
        assert stats.live_slots <= scenario.histories[0].num_rows


@pytest.mark.parametrize("state_type,dtype", [("transformer-16bit", np.int16), ("transformer-8bit", np.int8)])
def test_integer_state_managers_copy_model_integers(state_type, dtype):
    variables = [
        StateVariable(input_name="past", output_name="present", dtype=np.dtype(dtype), shape=(None, 2, None, 4),
                      time_axis=2)
    ]
    manager = create_state_manager(StateManagerOptions(type=state_type, max_history=2), variables,
                                   execution_provider="cuda")  # host only, whatever the provider
    assert manager.device == "cpu" and manager.pool.dtypes == [np.dtype(dtype)]
    info = np.iinfo(dtype)
    rng = np.random.default_rng(4)
    histories = manager.initial_histories(2)
    written = []
    for _ in range(3):
        out = rng.integers(info.min, info.max + 1, size=(2, 2, 1, 4)).astype(dtype)
        written.append(out[:, :, 0])
        histories = manager.extend(histories, manager.split({"present": out}), np.array([0, 1]))
    merged = manager.merge(histories)
    assert merged.inputs["past"].dtype == dtype
    assert np.array_equal(merged.inputs["past"], np.stack(written[1:], axis=2))


@pytest.mark.parametrize(
    "compression,bits,scale,restore",
    [
        ("reduced-precision", 8, None, lambda x: x.astype(np.float16).astype(np.float32)),
        ("fixed-quantisation", 8, 0.05, lambda x: (np.clip(np.rint(x / np.float32(0.05)), -128, 127) * np.float32(0.05)).astype(np.float32)),
        ("fixed-quantisation", 16, 0.001, lambda x: (np.clip(np.rint(x / np.float32(0.001)), -32768, 32767) * np.float32(0.001)).astype(np.float32)),
    ],
)
def test_host_state_compression(compression, bits, scale, restore):
    variables = kv_variables(1, np.float32, "heads")
    options = StateManagerOptions(type="transformer-cpu", state_compression=compression, state_compression_bits=bits,
                                  state_compression_scale=scale)
    manager = create_state_manager(options, variables, execution_provider="cpu")
    expected_storage = {"reduced-precision": np.float16, 8: np.int8, 16: np.int16}
    assert manager.pool.dtypes[0] == expected_storage.get(compression, expected_storage[bits])
    rng = np.random.default_rng(5)
    out = random_outputs(rng, variables, 3, 1)
    out["present_key_0"] *= 4  # some values beyond the int8 range: clipped
    histories = manager.extend(manager.initial_histories(3), manager.split(out), np.arange(3))
    merged = manager.merge(histories)
    assert np.array_equal(merged.inputs["past_key_0"], restore(out["present_key_0"]))
    assert not np.array_equal(merged.inputs["past_key_0"], out["present_key_0"])


# ---- pool invariants -----------------------------------------------------------------------------


@pytest.mark.parametrize("limit,first", [(None, False), (4, False), (4, True), (1, False)])
def test_pool_invariants_over_1000_random_steps(limit, first):
    variables = [StateVariable(input_name="past", output_name="present", dtype=np.dtype(np.float32),
                               shape=(None, None, 1), time_axis=1)]
    spc = 8
    manager = create_state_manager(
        StateManagerOptions(type="transformer-cpu", slots_per_chunk=spc, max_history=limit,
                            always_include_first_token_state=first),
        variables, execution_provider="cpu",
    )
    reference = Reference(variables, max_history=limit, keep_first=first)
    rng = np.random.default_rng(6)
    scenario = Scenario(manager, reference, rng, full_time_axis=False)
    scenario.start(num_rows=4)
    peak_seen = 0
    for step in range(1000):
        rows = scenario.histories[0].num_rows
        if step % 97 == 96:  # an utterance finishes: its lanes leave, a new one enters
            manager.release_all()
            assert manager.statistics().live_slots == 0
            scenario.start(num_rows=int(rng.integers(1, 8)))
            continue
        live_before = manager.statistics().live_slots
        # split + extend + retain, with the live count right after the split checked
        value = np.full((rows, 1, 1), step, dtype=np.float32) + np.arange(rows, dtype=np.float32)[:, None, None] / 64
        slots = manager.split({"present": value})
        after_split = manager.statistics()
        assert after_split.live_slots == live_before + rows
        if limit is not None:
            assert after_split.live_slots <= (limit + 1) * rows
        peak_seen = max(peak_seen, after_split.live_slots)
        num_children = int(rng.integers(1, 9))
        parents = np.sort(rng.integers(0, rows, size=num_children))
        append = rng.random(num_children) < 0.85
        new_tokens = reference.split({"present": value}, 1, np.ones(rows, int))
        reference.extend(new_tokens, parents, append)
        scenario.histories[0] = manager.extend(scenario.histories[0], slots, parents, append=append)
        manager.retain(scenario.histories[0])
        stats = assert_pool_consistent(manager, scenario.histories[0])
        if limit is not None:
            assert stats.live_slots <= limit * num_children
            assert scenario.histories[0].width <= limit
        assert stats.peak_live_slots == peak_seen
        assert stats.capacity_slots <= math.ceil(stats.peak_live_slots / spc) * spc
        if step % 10 == 0:
            scenario.check_merge()  # slots still referenced were never reused
    manager.release_all()
    final = manager.statistics()
    assert final.live_slots == 0 and final.capacity_slots >= final.peak_live_slots
    assert final.slab_bytes == final.capacity_slots * 4


def test_pool_grows_by_whole_chunks_and_reuses_freed_slots():
    pool = StatePool([(3,)], [np.float32], slots_per_chunk=4)
    assert pool.capacity == 0
    slots = pool.allocate(3, 2)
    assert slots.shape == (3, 2) and pool.capacity == 8 and pool.num_chunks == 2
    assert sorted(slots.ravel().tolist()) == list(range(6))
    keep = StateHistory(table=slots[:1].copy(), lengths=np.array([2], dtype=np.int32))
    pool.retain(keep)
    assert pool.statistics().live_slots == 2
    again = pool.allocate(2, 3, token_counts=np.array([3, 1], dtype=np.int32))
    assert again[1, 1:].tolist() == [-1, -1]
    valid = again[again >= 0]
    assert pool.capacity == 8 and not set(valid.tolist()) & set(slots[0].tolist())
    stats = pool.statistics()
    assert stats.live_slots == 6 and stats.peak_live_slots == 6 and stats.bytes_per_slot == 12
    pool.close()
    with pytest.raises(RuntimeError, match="after close"):
        pool.allocate(1, 1)


def test_pool_shuffled_free_list_scatters_allocations():
    pool = StatePool([(1,)], [np.float32], slots_per_chunk=64)
    pool.reserve(64)
    pool.shuffle_free_slots(seed=3)
    slots = pool.allocate(1, 64)[0]
    assert sorted(slots.tolist()) == list(range(64)) and slots.tolist() != list(range(64))


# ---- options and factory errors ------------------------------------------------------------------

CONFIG_ERRORS = [
    (dict(type="transformer-gpu"), "state_manager.type: unknown type 'transformer-gpu'; valid: transformer, "),
    (dict(max_history=-1), "state_manager.max_history: expected a non-negative integer or None, got -1"),
    (dict(max_history=2.5), "state_manager.max_history: expected a non-negative integer or None, got 2.5"),
    (dict(type="lstm", max_history=3), "state_manager.max_history: 'lstm' keeps one state per hypothesis"),
    (dict(always_include_first_token_state=True), "always_include_first_token_state: needs max_history"),
    (dict(slots_per_chunk=0), "state_manager.slots_per_chunk: expected a positive integer, got 0"),
    (dict(storage_dtype="int4"), "state_manager.storage_dtype: unknown dtype 'int4'; valid: None, model, float32"),
    (dict(state_compression="zip"), "state_manager.state_compression: unknown compression 'zip'; valid: none, "),
    (dict(state_compression="fixed-quantisation"), "fixed-quantisation needs a positive scale"),
    (dict(state_compression="fixed-quantisation", state_compression_scale=-1.0), "needs a positive scale"),
    (dict(state_compression_scale=0.1), "state_compression_scale: only used with state_compression 'fixed-quantisation'"),
    (dict(state_compression_bits=4), "state_manager.state_compression_bits: expected 8 or 16, got 4"),
    (dict(type="transformer-16bit", storage_dtype="float16"), "'transformer-16bit' stores the model's int16 states"),
    (dict(type="transformer-8bit", state_compression="reduced-precision"), "'transformer-8bit' stores the model's int8"),
    (dict(storage_dtype="float16", state_compression="reduced-precision"), "set either storage_dtype or state_compression"),
    (dict(device_id=-1), "state_manager.device_id: expected a non-negative integer, got -1"),
]


@pytest.mark.parametrize("kwargs,message", CONFIG_ERRORS, ids=[m[:40] for _, m in CONFIG_ERRORS])
def test_option_errors(kwargs, message):
    with pytest.raises(StateManagerConfigError) as error:
        StateManagerOptions(**kwargs)
    assert message in str(error.value)
    assert isinstance(error.value, ValueError)


@pytest.mark.skipif(gpu_available(), reason="a GPU is present")
@pytest.mark.parametrize("state_type", ["transformer-cuda", "lstm-cuda"])
def test_forcing_cuda_without_gpu_names_the_reason(state_type):
    with pytest.raises(GpuUnavailableError) as error:
        StateManagerOptions(type=state_type)
    text = str(error.value)
    assert f"state_manager.type: {state_type!r} needs CUDA (the GPU was requested but cannot be used: CuPy" in text
    assert f"'{state_type.replace('-cuda', '-cpu')}'" in text


@pytest.mark.skipif(gpu_available(), reason="a GPU is present")
def test_automatic_type_falls_back_to_cpu_without_gpu():
    assert resolve_type("transformer", "cuda") == "transformer-cpu"
    assert resolve_type("lstm", "cuda") == "lstm-cpu"
    assert resolve_type("transformer-16bit", "cuda") == "transformer-16bit"
    manager = create_state_manager(StateManagerOptions(), kv_variables(1, np.float32, "heads"), execution_provider="cuda")
    assert manager.device == "cpu" and manager.options.type == "transformer-cpu"


def test_automatic_type_picks_cuda_when_gpu_and_cuda_provider(fake_gpu):
    assert resolve_type("transformer", "cuda") == "transformer-cuda"
    assert resolve_type("lstm", "cuda") == "lstm-cuda"
    assert resolve_type("transformer", "cpu") == "transformer-cpu"
    with pytest.raises(ValueError, match="execution_provider: unknown provider 'tpu'; valid: cpu, cuda"):
        resolve_type("transformer", "tpu")


def test_state_compression_on_gpu_manager_warns_once_and_is_ignored(fake_gpu, monkeypatch, caplog):
    created = []

    class FakeGpuManager:
        def __init__(self, options, variables, *, device):
            created.append((options, device))

    monkeypatch.setitem(STATE_MANAGER_REGISTRY, "transformer-cuda", (FakeGpuManager, "cuda"))
    options = StateManagerOptions(type="transformer", state_compression="reduced-precision")
    with caplog.at_level(logging.WARNING, logger="gpudecode.states.factory"):
        create_state_manager(options, kv_variables(1, np.float32, "heads"), execution_provider="cuda")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "state_compression='reduced-precision' is ignored" in warnings[0].getMessage()
    assert created[0][1] == "cuda" and created[0][0].state_compression == "none"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gpudecode.states.factory"):
        create_state_manager(options, kv_variables(1, np.float32, "heads"), execution_provider="cpu")
    assert not caplog.records  # honoured by the host manager: no warning


FACTORY_ERRORS = [
    ("transformer-cpu", kv_variables(1, np.int16, "heads"),
     "state variable 'past_key_0': expected float states (float32, float16, bfloat16, float64), got int16; use transformer-16bit"),
    ("transformer-16bit", kv_variables(1, np.float32, "heads"), "'transformer-16bit', state variable 'past_key_0': expected int16 state tensors, got float32"),
    ("transformer-8bit", kv_variables(1, np.int16, "heads"), "expected int8 state tensors, got int16"),
    ("transformer-cpu", lstm_variables(np.float32, False), "state variable 'h_in' has no time axis"),
    ("lstm-cpu", kv_variables(1, np.float32, "heads"), "state variable 'past_key_0' has a time axis"),
    ("transformer-cpu", [StateVariable(input_name="x", output_name="y", dtype=np.dtype(np.float32), shape=(None, None, 4),
                                       batch_axis=1, time_axis=0)], "'x': the time axis (0) must come after the batch axis (1)"),
    ("transformer-cpu", [StateVariable(input_name="x", output_name="y", dtype=np.dtype(np.float32), shape=(None, None, None),
                                       time_axis=1)], "has a dynamic dimension besides the batch and time axes"),
    ("transformer-cpu", [], "the model has no state variables"),
]


@pytest.mark.parametrize("state_type,variables,message", FACTORY_ERRORS, ids=[m[:40] for *_, m in FACTORY_ERRORS])
def test_factory_errors(state_type, variables, message):
    with pytest.raises(ValueError) as error:
        create_state_manager(StateManagerOptions(type=state_type), variables, execution_provider="cpu")
    assert message in str(error.value)


def test_merge_and_split_input_errors():
    variables = kv_variables(1, np.float32, "heads")
    manager = create_state_manager(StateManagerOptions(type="transformer-cpu"), variables, execution_provider="cpu")
    rng = np.random.default_rng(7)
    good = random_outputs(rng, variables, 2, 1)
    with pytest.raises(ValueError, match=r"split: the model outputs lack state output 'present_value_0'"):
        manager.split({"present_key_0": good["present_key_0"]})
    with pytest.raises(ValueError, match=r"split: state output 'present_key_0': expected dtype float32, got float16"):
        manager.split({**good, "present_key_0": good["present_key_0"].astype(np.float16)})
    with pytest.raises(ValueError, match=r"expected shape \[N, 2, T, 3\], got \(2, 4, 1, 3\)"):
        manager.split({**good, "present_key_0": np.zeros((2, 4, 1, 3), np.float32)})
    with pytest.raises(ValueError, match=r"split: the state outputs disagree on \(N, T\)"):
        manager.split({**good, "present_key_0": np.zeros((3, 2, 1, 3), np.float32)})
    with pytest.raises(ValueError, match="fewer than num_new_tokens=2"):
        manager.split(good, num_new_tokens=2)
    histories = manager.initial_histories(2)
    with pytest.raises(ValueError, match="merge: out has no buffer for state input 'past_value_0'"):
        manager.merge(histories, out={"past_key_0": np.zeros((2, 2, 1, 3), np.float32)})
    small = {name: np.zeros((1, 2, 1, 3), np.float32) for name in ("past_key_0", "past_value_0")}
    with pytest.raises(ValueError, match="merge: out buffers hold 1 rows, the histories 2"):
        manager.merge(histories, out=small)
    with pytest.raises(ValueError, match=r"history table: expected a \[N, T\] int32 array"):
        manager.merge(StateHistory(table=np.zeros((2, 1), np.int64), lengths=np.zeros(2, np.int32)))
    lstm = create_state_manager(StateManagerOptions(type="lstm-cpu"), lstm_variables(np.float32, False),
                                execution_provider="cpu")
    with pytest.raises(ValueError, match="an LSTM step adds exactly one state per row"):
        lstm.split({}, num_new_tokens=2)
