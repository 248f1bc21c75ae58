"""``gpudecode bench ctc`` runs end to end at toy sizes (numpy; the figures come from the GPU)."""

import json

from gpudecode.bench.ctc import format_table, run_ctc_bench


def test_ctc_bench_smoke(tmp_path):
    results = run_ctc_bench(num_utts=2, num_frames=12, vocab_sizes=(20,), beams=(1, 4), lm_hidden_dim=8,
                            lm_embed_dim=4, encoder_frames=16, encoder_layers=1, encoder_dim=16,
                            encoder_vocab_size=20, num_features=8, device="cpu", output_dir=tmp_path)
    kinds = {(c["search"], c["beam"], c["lm"]) for c in results["cells"]}
    assert kinds == {("greedy", 1, False), ("prefix", 1, False), ("prefix", 4, False),
                     ("prefix", 1, True), ("prefix", 4, True)}
    assert all(c["frames_per_s"] > 0 for c in results["cells"])
    assert set(results["ratios"]) == {"lm_fusion_cost_v20_beam1", "lm_fusion_cost_v20_beam4",
                                      "end_to_end_beam8_over_greedy", "end_to_end_beam8_nbest8_over_greedy"}
    assert json.loads((tmp_path / "ctc.json").read_text())["benchmark"] == "ctc"
    assert "frames/s" in format_table(results)
