"""Non-finite scores (NaN, +inf) are an error naming the scorer and the utterances — or, with
``io.on_bad_input: skip``, those utterances are skipped and reported — in the label-synchronous
search (every finished mode, continuous batching), CTC (prefix and greedy) and the transducer (beam
and greedy). A -inf score (a masked or impossible label) is legitimate and never reported; an
utterance whose every hypothesis scores -inf is.

Oracles: the utterances and scorers named are the ones the test poisoned; a skipped run's other
transcripts are those of a clean run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from gpudecode.cli import main
from gpudecode.scorers import LabelScorer, UtteranceBatch
from gpudecode.search import (
    CtcPrefixOptions,
    LabelSyncOptions,
    TransducerOptions,
    ctc_greedy_search,
    ctc_prefix_search,
    label_sync_search,
    transducer_greedy_search,
    transducer_search,
)
from gpudecode.search.nonfinite import NonFiniteScores
from gpudecode.search.stats import SearchStats
from tests.test_truncation import ROWS, V, RowScorer, batch, log_softmax, prediction_network

# +inf next to a -inf makes NaN in the search's sums (what the check is for); numpy warns of it
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "example.yaml"
END = 1
VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


class NonFiniteScorer(LabelScorer):
    """0 for every label, except ``value`` (``nan``, ``inf`` or ``-inf``) at ``labels`` (None: all)
    for the utterances ``bad`` (ids)."""

    def __init__(self, *, vocab_size: int, bad=(), value: str = "nan", labels=None):
        self.vocab_size, self.bad, self.value = vocab_size, set(bad), VALUES[value]
        self.columns = np.zeros(vocab_size, bool)
        self.columns[slice(None) if labels is None else list(labels)] = True

    def begin(self, layout):
        super().begin(layout)
        self._bad = layout.xp.zeros(layout.num_groups, bool)

    def admit(self, utterances, groups):
        xp = self.layout.xp
        self._bad[xp.asarray(groups)] = xp.asarray([u in self.bad for u in utterances.ids])

    def initial_context(self, groups, ctx=None):
        return None

    def score(self, ctx):
        xp = self.layout.xp
        poisoned = self._bad[self.layout.lane_groups()][:, None] & xp.asarray(self.columns)[None, :]
        return xp.where(poisoned, np.float32(self.value), np.float32(0)).astype(np.float32)

    def extend(self, ctx, parents, labels):
        return None


IDS = ["runs", "ends", "other"]
ROWS3 = {**ROWS, "other": ROWS["runs"]}


def label_sync(poison: NonFiniteScorer, finished="in-beam", active=None):
    options = LabelSyncOptions(beam_size=2, sentence_end=END, max_labels=4, finished=finished)
    return label_sync_search([("table", RowScorer(ROWS3), 1.0), ("poison", poison, 1.0)],
                             batch(IDS, [6, 6, 6]), options, max_active_utterances=active)


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("finished,active", [("in-beam", None), ("separate", None), ("separate-genai", None),
                                             ("in-beam", 1), ("separate", 2)])
def test_label_sync_names_the_scorer_and_the_utterances(value, finished, active):
    # label 4 is never the best label: a NaN there would otherwise pass unseen (ranked as -inf)
    poison = NonFiniteScorer(vocab_size=V, bad=["ends", "other"], value=value, labels=[4])
    with pytest.raises(NonFiniteScores) as error:
        label_sync(poison, finished, active)
    assert sorted(error.value.utterance_ids) == ["ends", "other"] and error.value.scorers == ["poison"]
    assert "non-finite scores (NaN or +inf) from scorer(s) 'poison' for 2 utterance(s)" in str(error.value)
    assert "'runs'" not in str(error.value) and "io.on_bad_input: skip" in str(error.value)


@pytest.mark.parametrize("finished,active", [("in-beam", None), ("separate", None), ("in-beam", 1)])
def test_minus_inf_masks_are_legitimate(finished, active):
    clean = label_sync(NonFiniteScorer(vocab_size=V), finished, active)
    masked = label_sync(NonFiniteScorer(vocab_size=V, bad=IDS, value="-inf", labels=[0, 2, 5]), finished, active)
    # the masked labels were never chosen, so nothing changes
    assert [[h.labels for h in n] for n in masked] == [[h.labels for h in n] for n in clean]


def test_an_utterance_whose_every_hypothesis_scores_minus_inf_is_reported():
    with pytest.raises(NonFiniteScores, match=r"no hypothesis with a finite score \(every hypothesis scored "
                                              r"-inf\) for 1 utterance\(s\): 'ends'") as error:
        label_sync(NonFiniteScorer(vocab_size=V, bad=["ends"], value="-inf"))
    assert error.value.scorers == []


def test_a_nan_on_an_ended_lane_is_not_reported():
    """Lanes that ended are still scored; what a scorer gives them is never used. This one gives
    NaN rows to every lane that emitted sentence-end, while "runs" keeps the search going."""

    class NanAfterEnd(NonFiniteScorer):
        def initial_context(self, groups, ctx=None):
            return self.layout.xp.zeros(self.layout.num_lanes, bool)

        def score(self, ended):
            return self.layout.xp.where(ended[:, None], np.float32(np.nan), np.float32(0)) * self.layout.xp.ones(
                (1, self.vocab_size), np.float32)

        def extend(self, ended, parents, labels):
            return ended[parents] | (labels == END)

    for finished in ("in-beam", "separate"):
        options = LabelSyncOptions(beam_size=2, sentence_end=END, max_labels=4, finished=finished)
        nbest = label_sync_search([("table", RowScorer(ROWS), 1.0), ("poison", NanAfterEnd(vocab_size=V), 1.0)],
                                  batch(["runs", "ends"], [6, 6]), options)
        assert nbest[0][0].labels == [3] * 4 and nbest[1][0].labels == [] and np.isfinite(nbest[1][0].score)


def test_the_check_adds_no_device_to_host_transfer():
    """The maxima travel with the search's final read: a static label-synchronous search still reads
    once per step (the stop test, none after the last step) plus once at the end; the CTC prefix
    search with a scorer and no score cache reads the lengths and the results only."""
    stats = SearchStats()
    options = LabelSyncOptions(beam_size=2, sentence_end=END, max_labels=5)
    label_sync_search([("table", RowScorer(ROWS), 1.0), ("poison", NonFiniteScorer(vocab_size=V), 1.0)],
                      batch(["runs", "ends"], [9, 9]), options, stats=stats)
    assert stats.step_loop.count == 5 and stats.transfers == (5 - 1) + 1
    stats = SearchStats()
    ctc_prefix_search(ctc_log_probs(), np.array([5, 5]), CtcPrefixOptions(beam_size=2, max_cached_score_vectors=0),
                      [("lm", NonFiniteScorer(vocab_size=V), 0.5)], ids=["a", "b"], stats=stats)
    assert stats.transfers == 2


# --- CTC ------------------------------------------------------------------------------------------
def ctc_log_probs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, V)).astype(np.float32)
    return (x - np.log(np.exp(x).sum(axis=2, keepdims=True))).astype(np.float32)


def test_ctc_frame_log_probs_with_nan_name_ctc_and_padding_is_ignored():
    log_probs = ctc_log_probs()
    log_probs[0, 4] = np.nan  # utterance "a" has 4 frames: padding
    lengths = np.array([4, 5])
    assert all(ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=2), ids=["a", "b"]))
    assert all(ctc_greedy_search(log_probs, lengths, ids=["a", "b"]))
    log_probs[1, 2, 3] = np.nan
    with pytest.raises(NonFiniteScores, match=r"scorer\(s\) 'ctc' for 1 utterance\(s\): 'b';"):
        ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=2), ids=["a", "b"])
    with pytest.raises(NonFiniteScores, match=r"scorer\(s\) 'ctc' for 1 utterance\(s\): 'b';"):
        ctc_greedy_search(log_probs, lengths, ids=["a", "b"])
    log_probs[1, 2] = -np.inf  # a frame no label can take: no path at all
    with pytest.raises(NonFiniteScores, match=r"no hypothesis with a finite score .* for 1 utterance\(s\): 'b';"):
        ctc_greedy_search(log_probs, lengths, ids=["a", "b"])
    with pytest.raises(NonFiniteScores, match=r"no hypothesis with a finite score .* for 1 utterance\(s\): 'b';"):
        ctc_prefix_search(log_probs, lengths, CtcPrefixOptions(beam_size=2), ids=["a", "b"])


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_ctc_with_a_fused_scorer_names_the_scorer(value):
    poison = NonFiniteScorer(vocab_size=V, bad=["a"], value=value, labels=[5])
    with pytest.raises(NonFiniteScores) as error:
        ctc_prefix_search(ctc_log_probs(), np.array([5, 5]), CtcPrefixOptions(beam_size=2), [("lm", poison, 0.5)],
                          ids=["a", "b"])
    assert error.value.utterance_ids == ["a"] and error.value.scorers == ["lm"]
    masked = NonFiniteScorer(vocab_size=V, bad=["a", "b"], value="-inf", labels=[5])
    assert all(ctc_prefix_search(ctc_log_probs(), np.array([5, 5]), CtcPrefixOptions(beam_size=2),
                                 [("lm", masked, 0.5)], ids=["a", "b"]))


# --- transducer -----------------------------------------------------------------------------------
def poisoned_joint(encoder_frames, prediction):
    """Label 3 for every frame; NaN for label 4 where the frame's second value is positive."""
    rows = np.tile(log_softmax([1, -5, -5, 2, -5, -5]), (len(encoder_frames), 1))
    rows[np.asarray(encoder_frames)[:, 1] > 0, 4] = np.nan
    return rows


def test_transducer_joint_nan_names_the_transducer_and_the_utterance():
    encoder = np.zeros((2, 3, 4), np.float32)
    encoder[1, 2, 1] = 1  # utterance "b", its last frame
    with pytest.raises(NonFiniteScores) as error:
        transducer_search(encoder, np.array([3, 3]), prediction_network(), poisoned_joint,
                          TransducerOptions(beam_size=2, blank=0), ids=["a", "b"])
    assert error.value.utterance_ids == ["b"] and error.value.scorers == ["transducer"]
    encoder[1, 2, 1] = 0
    assert all(transducer_search(encoder, np.array([3, 3]), prediction_network(), poisoned_joint,
                                 TransducerOptions(beam_size=2, blank=0), ids=["a", "b"]))


def test_transducer_greedy_nan_names_the_transducer():
    def all_nan_for_b(encoder_frames, prediction):
        rows = poisoned_joint(encoder_frames, prediction)
        rows[np.asarray(encoder_frames)[:, 1] > 0] = np.nan
        return rows

    encoder = np.zeros((2, 3, 4), np.float32)
    encoder[1, :, 1] = 1
    with pytest.raises(NonFiniteScores, match=r"scorer\(s\) 'transducer' for 1 utterance\(s\): 'b';"):
        transducer_greedy_search(encoder, np.array([3, 3]), prediction_network(), all_nan_for_b, blank=0,
                                 ids=["a", "b"])


# --- the command line -----------------------------------------------------------------------------
BAD = "test-00001-yweweler"


def config_with(tmp_path, value: str, labels=None, on_bad_input="stop", batch_size=16) -> Path:
    config = yaml.safe_load(EXAMPLE.read_text())
    for key in ("encoder", "vocabulary"):
        config["models"][key]["path"] = str((EXAMPLE.parent / config["models"][key]["path"]).resolve())
    for scorer in config["scorers"]:
        if "model" in scorer:
            scorer["model"] = str((EXAMPLE.parent / scorer["model"]).resolve())
    config["scorers"].append({"type": "tests.test_nonfinite:NonFiniteScorer", "name": "poison", "scale": 1.0,
                              "options": {"vocab_size": 12, "bad": [BAD], "value": value, "labels": labels}})
    config["search"]["batch_size"] = batch_size
    config["io"] = {"features": {"path": str(ROOT / "examples/fsdd-model/test-audio")},
                    "formats": ["text", "jsonl"], "on_bad_input": on_bad_input}
    path = tmp_path / f"{value}-{on_bad_input}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def decode(config: Path, output: Path):
    return CliRunner().invoke(main, ["decode", str(config), "--output", str(output)])


def transcripts(folder: Path) -> dict[str, str]:
    return dict(line.partition(" ")[::2] for line in (folder / "text").read_text().splitlines())


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The example's transcripts with the poison scorer giving only zeros."""
    tmp = tmp_path_factory.mktemp("clean")
    result = decode(config_with(tmp, "-inf", labels=[]), tmp / "out")
    assert result.exit_code == 0, result.output
    return transcripts(tmp / "out")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_the_cli_stops_with_an_error_line_naming_scorer_and_utterance(tmp_path, clean, value):
    result = decode(config_with(tmp_path, value, batch_size=1), tmp_path / "out")
    assert result.exit_code != 0
    assert (f"Error: non-finite scores (NaN or +inf) from scorer(s) 'poison' for 1 utterance(s): '{BAD}'"
            in result.output)
    written = transcripts(tmp_path / "out")  # batches decoded before it stay written, and nothing empty
    assert BAD not in written and all(written[u] == clean[u] for u in written)
    lines = (tmp_path / "out" / "nbest.jsonl").read_text().splitlines()
    assert len(lines) == len(written) and all(json.loads(line)["nbest"] for line in lines)


def test_the_cli_skips_and_reports_with_on_bad_input_skip(tmp_path, clean):
    result = decode(config_with(tmp_path, "nan", on_bad_input="skip"), tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert re.search(r"skipped \(bad input\)\s+1\n", result.output)
    assert f"skipped: utterance '{BAD}': non-finite scores (NaN or +inf) from scorer(s) 'poison'" in result.output
    assert transcripts(tmp_path / "out") == {u: t for u, t in clean.items() if u != BAD}  # the others decoded again


def test_the_cli_decodes_with_minus_inf_masks(tmp_path, clean):
    # blank is never emitted by the label-synchronous search: masking it changes nothing
    result = decode(config_with(tmp_path, "-inf", labels=[0]), tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert transcripts(tmp_path / "out") == clean and len(clean) == 8
