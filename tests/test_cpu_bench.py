"""``gpudecode bench cpu`` runs end to end at toy sizes (the peers where they import), and the exact
CTC log-likelihood it judges differing transcripts by equals brute force."""

import itertools
import json

import numpy as np
import pytest

from gpudecode.bench.cpu import ctc_log_likelihood, format_table, run_cpu_bench


def brute_force_log_likelihood(log_probs: np.ndarray, labels: list[int], blank: int = 0) -> float:
    """log Σ over every frame alignment that collapses (merge repeats, drop blanks) to ``labels``."""
    total = -np.inf
    frames, classes = log_probs.shape
    for path in itertools.product(range(classes), repeat=frames):
        collapsed = [c for i, c in enumerate(path) if c != blank and (i == 0 or path[i - 1] != c)]
        if collapsed == labels:
            total = np.logaddexp(total, sum(log_probs[t, c] for t, c in enumerate(path)))
    return float(total)


@pytest.mark.parametrize("labels", [[], [1], [2, 2], [1, 2], [2, 1, 2], [1, 1, 1]])
def test_ctc_log_likelihood_equals_brute_force(labels):
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 3))
    log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert ctc_log_likelihood(log_probs, labels) == pytest.approx(brute_force_log_likelihood(log_probs, labels),
                                                                  abs=1e-9)


def test_ctc_log_likelihoods_sum_to_one_over_all_label_sequences():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((3, 3))
    log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    sequences = [list(s) for n in range(4) for s in itertools.product((1, 2), repeat=n)]
    total = np.logaddexp.reduce([ctc_log_likelihood(log_probs, s) for s in sequences])
    assert total == pytest.approx(0.0, abs=1e-9)


def test_cpu_bench_smoke(tmp_path):
    results = run_cpu_bench(num_utts=2, num_frames=10, vocab_size=6, beams=(2,), lm_prompts=2, genai_beams=(1,),
                            gpt2_beams=(2,), cores=2, output_dir=tmp_path)
    written = json.loads((tmp_path / "cpu.json").read_text())
    assert written["benchmark"] == "cpu" and written["config"]["threads"] == 1
    assert {"ctc", "genai", "gpt2"} <= set(written)
    assert [(c["inputs"], c["beam"]) for c in written["ctc"]["cells"]] == [("peaky", 2), ("flat", 2)]
    assert written["ctc"]["all_cores"]["cores"] == 2
    for ctc in written["ctc"]["cells"]:
        assert ctc["gpudecode_batched_frames_per_s"] > 0 and ctc["gpudecode_per_utterance_frames_per_s"] > 0
        assert ctc["gpudecode_threaded_frames_per_s"] > 0  # all cores: the toolkit's threads
        if written["ctc"]["pyctcdecode"] is None:
            assert "note" in written["ctc"]
        else:
            assert 0 <= ctc["best_equal"] <= 2 and ctc["pyctcdecode_frames_per_s"] > 0
            assert all(d["higher"] in ("gpudecode", "pyctcdecode", "equal") for d in ctc["differing"])
    for part, beam in (("genai", 1), ("gpt2", 2)):
        cell = written[part]["cells"][0]
        assert cell["beam"] == beam and cell["gpudecode_tokens_per_s"] > 0 and cell["gpudecode_tokens"] > 0
    assert [(c["ends"], c["beam"]) for c in written["genai"]["cells"]] == [("eos", 1), ("max-length", 1)]
    eos, full = written["genai"]["cells"]  # sentence-end masked: every prompt runs to the context
    assert full["gpudecode_tokens"] > eos["gpudecode_tokens"]
    assert "frames/s" in format_table(results) and "tokens/s" in format_table(results)
    assert "gpudecode 2 threads frames/s" in format_table(results)


def test_cpu_bench_refuses_unknown_parts_and_inputs():
    with pytest.raises(ValueError, match="unknown parts"):
        run_cpu_bench(parts=("ctc", "kenlm"))
    with pytest.raises(ValueError, match="ctc_inputs"):
        run_cpu_bench(ctc_inputs=("speech",))


def test_peaky_log_probs_are_peaky():
    from gpudecode.bench.cpu import peaky_log_probs

    log_probs = peaky_log_probs(4, 200, 30)
    assert log_probs.dtype == np.float32
    np.testing.assert_allclose(np.exp(log_probs).sum(2), 1.0, atol=1e-5)
    assert np.exp(log_probs.max(2)).mean() > 0.75 and 0.4 < (log_probs.argmax(2) == 0).mean() < 0.8
