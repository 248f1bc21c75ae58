"""``run_transducer_bench`` runs end to end at toy sizes (numpy; the figures come from the GPU)."""

import json

from gpudecode.bench.transducer import format_table, run_transducer_bench


def test_transducer_bench_smoke(tmp_path):
    results = run_transducer_bench(num_utts=2, encoder_frames=24, encoder_layers=1, encoder_dim=16, num_features=8,
                                   vocab_size=12, prediction_dim=8, prediction_hidden_dim=8, prediction_embed_dim=4,
                                   joint_dim=8, beams=(1, 4, 8), max_symbols_per_frame=2, device="cpu",
                                   output_dir=tmp_path)
    assert [c["search"] for c in results["cells"]] == ["greedy", "beam1", "beam4", "beam8", "beam8+lm"]
    assert [c["lm"] for c in results["cells"]] == [False] * 4 + [True]
    assert all(c["frames_per_s"] > 0 for c in results["cells"])
    assert set(results["ratios"]) == {"end_to_end_beam8_over_greedy", "search_beam1_over_greedy",
                                      "search_beam4_over_greedy", "search_beam8_over_greedy", "lm_fusion_cost_beam8"}
    cell = {c["search"]: c for c in results["cells"]}
    assert results["ratios"]["lm_fusion_cost_beam8"] == cell["beam8+lm"]["seconds"] / cell["beam8"]["seconds"]
    assert results["config"]["encoder_frames"] == 2 * 6
    assert json.loads((tmp_path / "transducer.json").read_text())["benchmark"] == "transducer"
    assert "frames/s" in format_table(results)


def test_the_lm_cell_fuses_the_lm_and_its_beam_runs_plainly_too(tmp_path):
    """An LM beam outside ``beams`` is added as a plain cell, so the fusion cost has its baseline."""
    results = run_transducer_bench(num_utts=2, encoder_frames=24, encoder_layers=1, encoder_dim=16, num_features=8,
                                   vocab_size=12, prediction_dim=8, prediction_hidden_dim=8, prediction_embed_dim=4,
                                   joint_dim=8, beams=(1,), lm_beam=2, lm_hidden_dim=8, lm_embed_dim=4,
                                   max_symbols_per_frame=2, device="cpu", output_dir=tmp_path)
    assert [c["search"] for c in results["cells"]] == ["greedy", "beam1", "beam2", "beam2+lm"]
    assert [c["scores"] for c in results["cells"][2:]] == [["transducer"], ["lm", "transducer"]]  # the LM fused
    assert results["config"]["lm"].startswith("LSTM 1x8")
    none = run_transducer_bench(num_utts=2, encoder_frames=24, encoder_layers=1, encoder_dim=16, num_features=8,
                                vocab_size=12, prediction_dim=8, prediction_hidden_dim=8, prediction_embed_dim=4,
                                joint_dim=8, beams=(1,), lm_beam=None, device="cpu", output_dir=tmp_path / "none")
    assert [c["search"] for c in none["cells"]] == ["greedy", "beam1"] and none["config"]["lm"] is None
