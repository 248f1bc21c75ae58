"""``label_separate_<K>`` of ``kernels/label_step.cu`` (finished lists kept apart from the beam, as
Hugging Face's and ONNX Runtime GenAI's beam searches keep them) selects exactly what the array
version ``beam.select_separate`` selects: every array of the new beam and finished lists, parents
and labels bit for bit, on random states with ties, NaN, ±inf and ±0, done and hopeless groups,
``min_length``, length normalisation and both semantics; and a search with it gives the numpy
search's n-best lists. Run by the kernel emulator here, on CUDA under the ``gpu`` marker."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpudecode.scorers.base import LaneLayout
from gpudecode.search import LabelSyncOptions, label_step, label_sync_search
from gpudecode.search.beam import Beam, Finished, select_separate
from tests.test_ctc_prefix_kernel import assert_none_in_emulation, needs_gxx
from tests.test_label_sync_cpu import STEP_SETTINGS, calls_of, random_step
from tests.test_search_finished_modes import BEAM, EOS, LIMITS, SETTINGS, V, table_batch
from tests.test_search_label_sync import TrigramTableScorer, random_tables

#: (beam, vocab, float16 log-probs of the first scorer): one lane list per lane, several segments
#: of a lane (V > label_step.SEGMENT), beams whose 2 × beam candidates fill a 16-key list and the
#: largest, 32 (GenAI's merge then holds 48 entries)
CASES = [(1, 7, False), (3, 7, False), (4, 7, True), (8, 5, False), (2, label_step.SEGMENT + 40, False),
         (label_step.MAX_SEPARATE_BEAM, 3, False)]


def _on(cupy, beam: Beam) -> Beam:
    finished = Finished(**{f.name: cupy.asarray(getattr(beam.finished, f.name))
                           for f in dataclasses.fields(Finished) if getattr(beam.finished, f.name) is not None})
    return Beam(scores=cupy.asarray(beam.scores), scorer_scores=cupy.asarray(beam.scorer_scores),
                lengths=cupy.asarray(beam.lengths), ended=cupy.asarray(beam.ended), finished=finished)


def _arrays(beam: Beam, parents, labels) -> dict:
    fields = {f"beam.{k}": getattr(beam, k) for k in ("scores", "scorer_scores", "lengths", "ended")}
    for field in dataclasses.fields(Finished):
        fields[f"finished.{field.name}"] = getattr(beam.finished, field.name)
    return {**fields, "parents": parents, "labels": labels}


def _differences(want: dict, got: dict, where: str) -> list[str]:
    bad = []
    for name, value in want.items():
        value, other = np.asarray(value), np.asarray(got[name])
        if other.dtype != value.dtype or other.shape != value.shape:
            bad.append(f"{where}: {name}: {other.dtype}{other.shape} != {value.dtype}{value.shape}")
        elif value.dtype.kind == "f":  # bit for bit (NaN payloads aside)
            if not ((np.isnan(value) & np.isnan(other)) | (value.view(np.int32) == other.view(np.int32))).all():
                bad.append(f"{where}: {name}: {other} != {value}")
        elif not np.array_equal(other, value):
            bad.append(f"{where}: {name}: {other} != {value}")
    return bad


def step_mismatches(cupy, seeds=range(4)) -> list[str]:
    """Every array of one step by the kernels on ``cupy`` against the array version on numpy."""
    bad = []
    for settings in STEP_SETTINGS:
        for beam_size, vocab, half in CASES:
            options = LabelSyncOptions(beam_size=beam_size, sentence_end=EOS % 5, max_labels_per_input=1.0, **settings)
            for special in (False, True):
                for seed in seeds:
                    beam, combined, log_probs, deadline, step, layout = random_step(seed, options, num_groups=4,
                                                                                    vocab=vocab, special=special)
                    if half:  # a float16 decoder's log-probs, read as they are
                        log_probs[0] = log_probs[0].astype(np.float16)
                    with np.errstate(invalid="ignore"):  # -inf + inf among the candidates
                        expected = select_separate(beam, combined, log_probs, deadline, step, layout, options)
                    fields, finished, parents, labels = label_step.select_separate_kernel(
                        _on(cupy, beam), [(cupy.asarray(combined), 1.0)], [cupy.asarray(lp) for lp in log_probs],
                        cupy.asarray(deadline), step, LaneLayout(num_groups=4, beam_size=beam_size, xp=cupy), options)
                    got = Beam(**fields, finished=Finished(**finished))
                    host = {k: cupy.asnumpy(v) for k, v in _arrays(got, parents, labels).items()}
                    bad += _differences(_arrays(*expected), host, f"{settings} beam {beam_size} V {vocab} "
                                                                  f"half {half} special {special} seed {seed}")
    return bad


def _nbest(results):
    return [[(h.labels, h.length, h.score, h.scores, h.truncated) for h in nbest] for nbest in results]


def search_mismatches(cupy) -> list[str]:
    """The peer-semantics cases: a search on ``cupy`` (the kernels every step) against numpy's."""
    bad = []
    for seed in (0, 1):
        tables = random_tables(seed, len(LIMITS), V, EOS, eos_bias=1.0)
        for settings in SETTINGS:
            for continuous in (None, 2):
                options = LabelSyncOptions(beam_size=BEAM, sentence_end=EOS, max_labels_per_input=1.0, nbest=BEAM,
                                           **settings)
                def search(xp):
                    return label_sync_search([("lm", TrigramTableScorer(V), 1.0), ("twice", TrigramTableScorer(V), 0.5)],
                                             table_batch(tables), options, xp=xp, max_active_utterances=continuous)

                with calls_of(label_step.select_separate_kernel) as calls:
                    results = [search(np), search(cupy)]
                if not calls:
                    bad.append(f"seed {seed} {settings} continuous {continuous}: the kernels did not run")
                if _nbest(results[1]) != _nbest(results[0]):
                    bad.append(f"seed {seed} {settings} continuous {continuous}: {_nbest(results[1])[:1]} != "
                               f"{_nbest(results[0])[:1]}")
    return bad


def test_the_separate_kernels_take_beams_up_to_16():
    cupy_like = object()
    assert label_step.use_kernel(cupy_like, 16, 2, "separate")
    assert not label_step.use_kernel(cupy_like, 17, 2, "separate-genai")  # 2 × beam candidates <= 32
    assert label_step.use_kernel(cupy_like, 17, 2, "in-beam")
    assert not label_step.use_kernel(np, 4, 1, "separate")


@needs_gxx
def test_the_separate_kernels_equal_the_array_version_in_emulation():
    assert_none_in_emulation("tests.test_label_step_separate", "step_mismatches")


@needs_gxx
def test_a_search_with_separate_lists_gives_the_numpy_nbest_in_emulation():
    assert_none_in_emulation("tests.test_label_step_separate", "search_mismatches")


@pytest.mark.gpu
def test_the_separate_kernels_equal_the_array_version_on_cuda():
    cupy = pytest.importorskip("cupy")
    assert step_mismatches(cupy, seeds=range(12)) == []


@pytest.mark.gpu
def test_a_search_with_separate_lists_gives_the_numpy_nbest_on_cuda():
    cupy = pytest.importorskip("cupy")
    assert search_mismatches(cupy) == []
