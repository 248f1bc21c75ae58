"""The batching benchmark's bookkeeping on the CPU (a tiny decoder): both modes keep the target
lengths, and the history-token counts agree with what the searches do."""

import numpy as np
import pytest

from gpudecode.bench.batching import format_table, make_lengths, run_batching_bench


@pytest.mark.parametrize("export, dtype", [("new-step", "float32"), ("fused", "float32"), ("ragged", "float32"),
                                           ("ragged", "float16"), ("gqa", "float32")])
def test_batching_bench_counts_steps_and_history_tokens(export, dtype):
    results = run_batching_bench(num_utts=12, max_active=4, beam=2, min_labels=2, max_labels=12, device="cpu",
                                 quick=True, export=export, dtype=dtype, rounds=2)
    assert (results["config"]["decoder_export"], results["config"]["dtype"]) == (export, dtype)
    static, continuous = results["cells"]["static"], results["cells"]["continuous"]
    at_once = results["cells"]["continuous-mask-at-once"]
    assert continuous["steps"] < static["steps"]  # refilled lanes: fewer steps for the same labels
    assert continuous["steps"] == at_once["steps"]  # numpy reads the finished-groups mask at once anyway
    _, targets = make_lengths(12, 2, 12)
    for cell in (static, continuous, at_once):
        # every step merges at least the histories' own tokens, padding on top
        assert cell["history_tokens_merged"] >= cell["history_tokens_kept"] > 0
        assert cell["history_padding"] == cell["history_tokens_merged"] / cell["history_tokens_kept"]
        # kept tokens: each step's histories hold one token per label emitted so far by every lane
        assert cell["history_tokens_kept"] >= int(targets.sum())
    assert "merged ÷ kept history tokens" in format_table(results)
    assert np.isclose(results["ratios"]["continuous_over_static_throughput"],
                      continuous["utterances_per_s"] / static["utterances_per_s"])
    assert np.isclose(results["ratios"]["continuous_mask_at_once_over_static_throughput"],
                      at_once["utterances_per_s"] / static["utterances_per_s"])
    for cell in (static, continuous, at_once):  # the fastest of the interleaved rounds counts
        assert len(cell["round_seconds"]) == results["config"]["rounds"] == 2
        assert cell["seconds"] == min(cell["round_seconds"]) and cell["utterances_per_s"] == 12 / cell["seconds"]
        assert np.isclose(cell["ms_per_step"], 1e3 * cell["seconds"] / cell["steps"])
        assert 0 < cell["host_cpu_ms_per_step"] and cell["waits_per_step"] == 0  # numpy: nothing to wait for
        assert 0 < cell["refill_host_cpu_ms_per_step"] < cell["host_cpu_ms_per_step"] if cell is not static \
            else cell["refills"] == 0
    # 12 utterances in 4 groups, refilled once 1 (an eighth) is free: at least 2 refills, at most 8 + the last
    assert 2 <= continuous["refills"] <= 9
