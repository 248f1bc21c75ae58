"""CPU steps without per-step history copies: the resident merge (``gpudecode.states.resident``).

The oracle is the pool merge (``StateManager.merge``, left-aligned), which gathers every history
from the pool each step: the resident rows must hold exactly what it gives, through random steps
of split / extend (beams reordering, children that keep their parent's history) / retain / release,
with slots freed and reused, ``max_history`` and the first-token state. Then ONNX Runtime GenAI's
export (GroupQueryAttention writing the new step into the shared past/present buffer on the CPU
provider) decodes to the same n-best with ``cpu_in_place`` on and off, and a session that does not
write in place is caught by the first step's check and run plainly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gpudecode.scorers import UtteranceBatch
from gpudecode.scorers.prefix_lm import PrefixLmScorer
from gpudecode.search import LabelSyncOptions, label_sync_search
from gpudecode.spec import StateVariable
from gpudecode.states import StateManagerOptions, create_state_manager

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "peers" / "genai"


def variables(shape=(None, 2, None, 3), batch_axis=0, time_axis=2) -> list[StateVariable]:
    return [StateVariable(input_name=f"past_{k}", output_name=f"present_{k}", dtype=np.dtype(np.float32),
                          shape=shape, batch_axis=batch_axis, time_axis=time_axis) for k in ("key", "value")]


def manager(limit=None, first=False, **options):
    return create_state_manager(
        StateManagerOptions(type="transformer-cpu", slots_per_chunk=16, max_history=limit,
                            always_include_first_token_state=first, history_alignment="left", **options),
        variables(), execution_provider="cpu")


@pytest.mark.parametrize("limit,first", [(None, False), (5, False), (5, True)])
def test_resident_rows_hold_what_the_pool_merge_gathers(limit, first):
    states = manager(limit, first)
    assert states.resident_supported
    rng = np.random.default_rng(3)
    histories = states.initial_histories(6)
    checked_rows = 0
    for step in range(300):
        if step % 53 == 52:  # the utterances end, others start: every slot freed, then reused
            states.release_all()
            histories = states.initial_histories(int(rng.integers(1, 9)))
        rows = histories.num_rows
        merged = states.merge_resident(histories)
        pool = states.merge(histories, time_size=merged.time_size)
        kept = np.asarray(pool.prefix_lengths)
        assert np.array_equal(merged.prefix_lengths, kept)
        valid = np.arange(merged.time_size)[None, :] < kept[:, None]  # [N, T]
        for name, array in pool.inputs.items():
            resident = merged.inputs[name]
            assert resident.shape[2] > merged.time_size  # room for the new step
            both = np.moveaxis(resident[:, :, :merged.time_size], 2, 1), np.moveaxis(array, 2, 1)  # [N, T, 2, 3]
            assert np.array_equal(both[0][valid], both[1][valid])
        checked_rows += int(valid.any(axis=1).sum())
        # the "model": writes a new step (unique values) at each row's length, in place
        for k, name in enumerate(merged.inputs):
            merged.inputs[name][np.arange(rows), :, kept] = step * 100 + np.arange(rows)[:, None, None] + k / 4 + \
                np.arange(6, dtype=np.float32).reshape(1, 2, 3) / 64
        new_steps = states.resident_new_steps(merged)
        assert new_steps["present_key"].shape == (rows, 2, 1, 3)
        assert np.array_equal(new_steps["present_key"][:, :, 0], merged.inputs["past_key"][np.arange(rows), :, kept])
        slots = states.split(new_steps)
        states.written_in_place(slots, merged.prefix_lengths)
        # the beams: children of random parents, some keeping the parent's history unchanged
        children = int(rng.integers(1, 9))
        parents = np.sort(rng.integers(0, rows, size=children))
        histories = states.extend(histories, slots, parents, append=rng.random(children) < 0.85)
        states.retain(histories)
    resident = states._resident
    assert checked_rows > 500
    assert resident.rows_moved > 100  # reordered rows were copied from rows holding their histories
    if limit is None:  # without truncation most histories are found resident, not gathered again
        assert resident.rows_fetched < resident.rows_moved


def test_resident_merge_is_refused_where_it_cannot_apply():
    assert not manager(cpu_in_place=False).resident_supported
    right = create_state_manager(StateManagerOptions(type="transformer-cpu"), variables(), execution_provider="cpu")
    assert not right.resident_supported  # right-aligned histories: the new step is not after each history
    layered = create_state_manager(StateManagerOptions(type="transformer-cpu", history_alignment="left"),
                                   variables((2, None, 3, None, 2), 1, 3), execution_provider="cpu")
    assert not layered.resident_supported  # batch axis not outermost
    compressed = manager(state_compression="reduced-precision")
    assert not compressed.resident_supported  # the pool's rounded states would differ from resident ones
    with pytest.raises(ValueError, match="cannot stay resident"):
        right.merge_resident(right.initial_histories(2))
    with pytest.raises(ValueError, match="cpu_in_place"):
        StateManagerOptions(cpu_in_place="yes")


# --- the GenAI export ------------------------------------------------------------------------------
DOCUMENT = json.loads((FIXTURE / "expected.json").read_text())
PROMPTS = DOCUMENT["prompts"]
EOS = DOCUMENT["eos"]


def genai_lm(in_place: bool) -> PrefixLmScorer:
    return PrefixLmScorer(model=str(FIXTURE), vocab_size=128, scores_kind="logits",
                          state_manager=StateManagerOptions(type="transformer-cpu", cpu_in_place=in_place))


def decode(lm, beam: int):
    sizes = np.array([len(p) for p in PROMPTS])
    table = np.zeros((len(PROMPTS), sizes.max()), np.int64)
    for u, p in enumerate(PROMPTS):
        table[u, :len(p)] = p
    batch = UtteranceBatch(ids=[str(u) for u in range(len(PROMPTS))], input_lengths=np.full(len(PROMPTS), 24),
                           inputs={"prompt": table}, sizes={"prompt": sizes})
    options = LabelSyncOptions(beam_size=beam, sentence_end=EOS, max_labels_per_input=1.0, nbest=beam,
                               finished="separate-genai", early_stopping=True, length_counts="prompt-and-labels")
    return [[(h.labels, h.score) for h in hyps] for hyps in label_sync_search([("lm", lm, 1.0)], batch, options)]


def same(a, b) -> None:
    assert [[labels for labels, _ in hyps] for hyps in a] == [[labels for labels, _ in hyps] for hyps in b]
    assert np.allclose([s for hyps in a for _, s in hyps], [s for hyps in b for _, s in hyps], atol=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_genai_export_decodes_the_same_in_place(beam):
    lm, plain = genai_lm(True), genai_lm(False)
    try:
        ours, theirs = decode(lm, beam), decode(plain, beam)
        assert lm.runner._resident and not plain.runner._resident
        resident = lm.states._resident
        assert resident is not None and plain.states._resident is None
        assert resident.rows_fetched <= 2 * len(PROMPTS) * beam  # gathered once after the prompt run, not per step
        if beam > 1:
            assert resident.rows_moved > 0
        same(ours, theirs)
    finally:
        lm.close()
        plain.close()


class _NotInPlace:
    """A session that ignores the output buffers it is given (a provider that does not write in place)."""

    def __init__(self, session):
        self._session = session

    def run(self, inputs, output_names=None, *, outputs=None, upload_outputs=False):
        return self._session.run(inputs, output_names, upload_outputs=upload_outputs)

    def __getattr__(self, name):
        return getattr(self._session, name)


def test_a_session_that_does_not_write_in_place_is_caught_and_run_plainly():
    lm, plain = genai_lm(True), genai_lm(False)
    try:
        lm.runner.session = _NotInPlace(lm.runner.session)
        with pytest.warns(UserWarning, match="merged from the pool every step on the CPU: its outputs"):
            ours = decode(lm, 4)
        assert not lm.runner._resident
        same(ours, decode(plain, 4))
    finally:
        lm.close()
        plain.close()


class _FailsLater(_NotInPlace):
    """A session whose fourth run with output buffers fails (after the first step's check)."""

    def __init__(self, session):
        super().__init__(session)
        self.bound_runs = 0

    def run(self, inputs, output_names=None, *, outputs=None, upload_outputs=False):
        if outputs:
            self.bound_runs += 1
            if self.bound_runs == 4:
                raise RuntimeError("shared buffer refused")
        return self._session.run(inputs, output_names, outputs=outputs, upload_outputs=upload_outputs)


def test_a_later_failure_of_the_shared_buffer_run_goes_on_plainly():
    lm, plain = genai_lm(True), genai_lm(False)
    try:
        session = lm.runner.session = _FailsLater(lm.runner.session)
        with pytest.warns(UserWarning, match=r"failed \(shared buffer refused\)"):
            ours = decode(lm, 4)
        assert session.bound_runs == 4 and not lm.runner._resident
        same(ours, decode(plain, 4))
    finally:
        lm.close()
        plain.close()


def test_resident_rows_stay_within_the_model_context():
    states = manager()
    histories = states.initial_histories(2)
    assert states.merge_resident(histories, time_size=40).inputs["past_key"].shape[2] == 64
    assert states.merge_resident(histories, key=1, time_size=40, max_positions=50).inputs["past_key"].shape[2] == 50
    assert states.merge_resident(histories, key=2, time_size=60, max_positions=50).inputs["past_key"].shape[2] == 61
