"""Scorer registry (built-ins by name, user classes by ``module:Class``), the custom-scorer
example, the length reward, combination, and the default time-synchronous hooks."""

from __future__ import annotations

import numpy as np
import pytest

from gpudecode import defaults
from gpudecode.scorers import (
    LabelScorer,
    LaneLayout,
    LengthRewardScorer,
    ScorerTypeError,
    Transition,
    UtteranceBatch,
    combine_scores,
    create_scorer,
    register_scorer,
    registered_scorer_types,
    registry,
    scorer_class,
)
from gpudecode.search import LabelSyncOptions, label_sync_search


def test_builtin_length_reward_by_name():
    assert scorer_class("length-reward") is LengthRewardScorer
    scorer = create_scorer("length-reward", vocab_size=4, sentence_end=2, reward=0.5)
    scorer.begin(LaneLayout(num_groups=2, beam_size=3))
    scores = scorer.score(scorer.initial_context([0, 1]))
    assert scores.shape == (6, 4) and scores.dtype == np.float32
    assert scores[:, 2].tolist() == [0.0] * 6 and (scores[:, [0, 1, 3]] == 0.5).all()


def test_registered_builtins_are_valid_config_types():
    names = registered_scorer_types()
    assert "length-reward" in names
    assert set(names) <= set(defaults.BUILTIN_SCORER_TYPES)


@pytest.mark.parametrize("type_name, message", [
    ("no-such-scorer", r"unknown scorer type 'no-such-scorer'; registered types: .*length-reward"),
    ("gpudecode_no_such_module:Foo",
     r"scorer type 'gpudecode_no_such_module:Foo': module 'gpudecode_no_such_module' not found"),
    ("gpudecode.backend:NoSuchClass",
     (r"scorer type 'gpudecode.backend:NoSuchClass': module 'gpudecode.backend' has no "
      r"attribute 'NoSuchClass'")),
    ("gpudecode.backend:to_host", r"'gpudecode.backend:to_host': .* is not a class"),
    ("gpudecode.hypothesis:Hypothesis",
     (r"'gpudecode.hypothesis:Hypothesis': gpudecode.hypothesis.Hypothesis is not a "
      r"LabelScorer .*missing methods: begin, admit, initial_context, score, extend, release")),
    ("a:b:c", r"scorer type 'a:b:c': expected 'package.module:Class'"),
])
def test_registry_errors_name_the_string_and_the_failure(type_name, message):
    with pytest.raises(ScorerTypeError, match=message):
        scorer_class(type_name)


def test_bad_options_name_the_type():
    with pytest.raises(ScorerTypeError, match=r"'length-reward': cannot build "
                                              r"LengthRewardScorer with options \['colour'\]"):
        create_scorer("length-reward", colour="red")


@pytest.fixture
def registry_restored():
    """The scorer registry as it was before the test (the test registers types of its own)."""
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_register_scorer_decorator(registry_restored):

    @register_scorer("test-constant")
    class Constant(LabelScorer):
        vocab_size = 3

    assert scorer_class("test-constant") is Constant
    with pytest.raises(ValueError, match="'test-constant' is already registered"):
        register_scorer("test-constant")(type("Other", (LabelScorer,), {}))
    with pytest.raises(TypeError, match="is not a LabelScorer"):
        register_scorer("test-not-a-scorer")(dict)
    with pytest.raises(ValueError, match="without ':'"):
        register_scorer("a:b")


def test_duck_typed_class_is_accepted():
    assert registry._not_a_scorer(
        type("Duck", (), {m: (lambda self: None) for m in registry._REQUIRED_METHODS})) == ""


def test_custom_scorer_example_by_module_and_class():
    table = np.log(np.random.default_rng(7).dirichlet(np.ones(5), size=6)).astype(np.float32)
    scorer = create_scorer("examples.custom_scorer:BigramScorer", log_probs=table)
    assert type(scorer).__name__ == "BigramScorer" and scorer.vocab_size == 5
    options = LabelSyncOptions(beam_size=1, sentence_end=0, max_labels_per_input=1.0)
    (nbest,) = label_sync_search([("bigram", scorer, 1.0)],
                                 UtteranceBatch(ids=["x"], input_lengths=[6]), options)
    # beam 1 on a bigram table is greedy: follow the argmax chain from sentence-begin (row 5)
    prev, seq, score = 5, [], 0.0
    while len(seq) < 6:
        label = int(np.argmax(table[prev]))
        score += float(table[prev, label])
        if label == 0:
            break
        seq.append(label)
        prev = label
    assert nbest[0].labels == seq
    assert nbest[0].score == pytest.approx(score, abs=1e-4)


def test_custom_scorer_example_from_a_file(tmp_path):
    table = np.zeros((4, 3), dtype=np.float32)
    np.save(tmp_path / "bigram.npy", table)
    scorer = create_scorer("examples.custom_scorer:BigramScorer",
                           log_probs=str(tmp_path / "bigram.npy"))
    assert scorer.vocab_size == 3
    with pytest.raises(ValueError, match=r"must be \[V \+ 1, V\]"):
        create_scorer("examples.custom_scorer:BigramScorer", log_probs=np.zeros((3, 3)))


def test_combine_scores_is_the_weighted_sum_and_skips_zero_scales():
    a = np.array([[-1.0, -np.inf]], dtype=np.float32)
    b = np.array([[-2.0, -3.0]], dtype=np.float64)
    combined = combine_scores([a, b], [0.5, 2.0])
    assert combined.dtype == np.float32
    assert combined.tolist() == [[-4.5, -np.inf]]
    assert combine_scores([a, b], [0.0, 1.0]).tolist() == [[-2.0, -3.0]]  # no 0 · -inf = NaN
    assert combine_scores([a], [0.0]).tolist() == [[0.0, 0.0]]


class _Recorder(LabelScorer):
    vocab_size = 4

    def score(self, ctx):
        return np.arange(8, dtype=np.float32).reshape(2, 4) - ctx

    def extend(self, ctx, parents, labels):
        self.seen = (parents.tolist(), labels.tolist())
        return ctx


def test_default_time_synchronous_hooks():
    scorer = _Recorder()
    assert scorer.at_frames(10.0, np.array([3, 4])) == 10.0
    scorer.extend_transitions(0.0, np.array([1, 0, 1]), np.array([2, 3, 1]),
                              np.array([Transition.LABEL, Transition.BLANK, Transition.LOOP]))
    assert scorer.seen == ([1, 0, 1], [2, -1, -1])  # blank and loop carry the context
    candidates = scorer.score_candidates(1.0, np.array([[3, 0], [1, 1]]))
    assert candidates.tolist() == [[2.0, -1.0], [4.0, 4.0]]


def test_utterance_batch_checks_and_select():
    inputs = {"enc": np.arange(12.0).reshape(3, 2, 2)}
    utts = UtteranceBatch(ids=["a", "b", "c"], input_lengths=[2, 1, 2], inputs=inputs,
                          sizes={"enc": np.array([2, 1, 1])})
    sub = utts.select([2, 0])
    assert sub.ids == ("c", "a") and sub.input_lengths.tolist() == [2, 2]
    assert (sub.inputs["enc"] == inputs["enc"][[2, 0]]).all()
    assert sub.size_of("enc").tolist() == [1, 2] and sub.size_of("other").tolist() == [2, 2]
    with pytest.raises(ValueError, match=r"input 'enc': expected \[U=2, \.\.\.\]"):
        UtteranceBatch(ids=["a", "b"], input_lengths=[1, 1], inputs=inputs)
    with pytest.raises(ValueError, match=r"input_lengths: expected shape \(2,\)"):
        UtteranceBatch(ids=["a", "b"], input_lengths=[1, 1, 1])


def test_lane_layout():
    layout = LaneLayout(num_groups=3, beam_size=2)
    assert layout.num_lanes == 6
    assert layout.lane_groups().tolist() == [0, 0, 1, 1, 2, 2]
    assert layout.lanes_of([2, 0]).tolist() == [4, 5, 0, 1]
    with pytest.raises(ValueError, match="beam_size >= 1"):
        LaneLayout(num_groups=1, beam_size=0)


def test_bench_fixed_length_scorer_fixes_the_output_length():
    from gpudecode.bench.decode import EOS, FixedLengthScorer
    from gpudecode.search import LabelSyncOptions, label_sync_search
    from gpudecode.scorers import UtteranceBatch as Batch

    scorer = FixedLengthScorer(vocab_size=7, num_labels=5)
    nbest = label_sync_search([("fixed", scorer, 1.0)], Batch(ids=["a", "b"], input_lengths=[10, 12]),
                              LabelSyncOptions(beam_size=2, sentence_end=EOS, max_labels_per_input=1.0))
    assert [len(n[0].labels) for n in nbest] == [5, 5] and all(n[0].length == 6 for n in nbest)
