"""``gpudecode bench peers``: the options, the cell arithmetic and the table on synthetic results (no
torch), and under ``-m peers`` one tiny run on the CPU where torch and transformers are installed::

    PYTHONPATH=. .venv-peers/bin/python -m pytest -m peers tests/test_bench_peers.py
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gpudecode.bench import peers
from gpudecode.bench.peers import (
    PeerBenchOptions,
    format_table,
    options_from_text,
    output_name,
    parse_shapes,
    side_result,
)
from gpudecode.cli import main as cli_main


def test_shapes_parse_and_refuse_what_is_not_a_shape():
    assert parse_shapes("6x512, 12X768x50000") == ((6, 512), (12, 768, 50000))
    for bad in ("6x500", "6", "x512", "0x512", "6x512,", "6x512x2", "6x512x100x3"):
        with pytest.raises(ValueError, match="shapes"):
            parse_shapes(bad)


@pytest.mark.parametrize("field,value,message", [
    ("genai_prompts", 33, "genai_prompts"), ("dtype", "bfloat16", "dtype"), ("families", ("gpt2", "t5"), "families"),
    ("device", "tpu", "device"), ("beams", (), "beams"), ("prompts", (0, 4), "prompts"),
    ("new_tokens", 0, "new_tokens"), ("threads", -1, "threads"), ("shapes", ((6,),), "shapes"),
])
def test_options_refuse_what_no_side_runs(field, value, message):
    with pytest.raises(ValueError, match=message):
        PeerBenchOptions(**{field: value})


def test_prompts_are_in_every_shapes_vocabulary():
    options = PeerBenchOptions(shapes=((2, 64, 50), (2, 64)), vocab=1000, prompts=(40,), genai_prompts=8)
    prompts = peers.make_prompts(options)
    assert prompts.shape == (40, options.prompt_length)
    assert prompts.min() > peers.EOS and prompts.max() < 50


def test_output_names_follow_the_bench_files():
    assert output_name(PeerBenchOptions(device="cuda")) == "peers"
    assert output_name(PeerBenchOptions(device="cpu")) == "peers-cpu"
    assert output_name(PeerBenchOptions(device="cuda", dtype="float16")) == "peers-float16"


def test_a_side_is_timed_per_step_against_the_reference_with_its_parity():
    result = side_result(0.48, new_tokens=48, num_prompts=64, reference_seconds=0.96,
                         sequences=[[5, 6], [7, 8], [9, 9]], reference_sequences=[[5, 6], [7, 1], [9, 9]],
                         scores=[-1.0, -2.5, -3.0], reference_scores=[-1.0, -2.0, -3.25])
    assert result["ms_per_step"] == pytest.approx(10.0)
    assert result["tokens_per_s"] == pytest.approx(64 * 48 / 0.48)
    assert result["ratio_to_hf"] == pytest.approx(2.0)
    assert result["equal"] == 2
    assert result["max_score_diff"] == pytest.approx(0.5)
    reference = side_result(0.96, new_tokens=48, num_prompts=64, reference_seconds=None)
    assert reference["ratio_to_hf"] is None and "equal" not in reference


def synthetic_results() -> dict:
    ref = side_result(0.96, new_tokens=48, num_prompts=64, reference_seconds=None)
    ours = side_result(0.24, new_tokens=48, num_prompts=64, reference_seconds=0.96, sequences=[[1]] * 64,
                       reference_sequences=[[1]] * 63 + [[2]], scores=[0.0] * 64, reference_scores=[2e-5] + [0.0] * 63)
    cell = {"family": "gpt2", "layers": 6, "width": 512, "vocab": 10000, "export": "torch.onnx", "dtype": "float32",
            "prompts": 64, "beam": 8, "new_tokens": 48,
            "sides": {"gpudecode": ours, "hf_generate": ref, "gpudecode_prepared": {"note": "prepare not available"}}}
    return {"benchmark": "peers", "config": {"device": "cuda"}, "cells": [cell], "notes": ["no GenAI cells"],
            "models": [{"family": "gpt2", "layers": 6, "width": 512, "export": "torch.onnx",
                        "export_max_abs_logit_diff": 3e-6, "prepared_form": "group-query-attention"},
                       {"family": "llama", "layers": 6, "width": 512, "export": "GenAI builder (fp16)",
                        "prepared_form": "already-fast", "gpudecode_prepared_load": "ModelError: no"}]}


def test_the_table_has_a_row_per_side_in_order_with_ratio_and_parity():
    table = format_table(synthetic_results()).splitlines()
    rows = [line for line in table if line.startswith("| gpt2")]
    assert [row.split("|")[5].strip() for row in rows] == ["hf_generate", "gpudecode", "gpudecode_prepared"]
    hf, ours, prepared = ([c.strip() for c in row.split("|")[1:-1]] for row in rows)
    assert ours[5:] == ["5.00", "12,800", "4.00", "63 / 64", "2.0e-05"]
    assert hf[7:] == ["—", "—", "—"] and prepared[5:] == ["—"] * 5
    assert "gpt2 6×512 torch.onnx 64 × 8 gpudecode_prepared: prepare not available" in table
    assert "no GenAI cells" in table
    assert any("prepared: group-query-attention" in line and "3.0e-06" in line for line in table)
    assert ("llama 6×512 GenAI builder (fp16): prepared: already-fast; gpudecode_prepared did not load: "
            "ModelError: no") in table


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = peers.plot_peers(synthetic_results(), tmp_path / "peers.png")
    assert path and (tmp_path / "peers.png").stat().st_size > 0


def test_the_command_line_text_becomes_the_options():
    assert options_from_text(device="cpu", shapes="2x128", vocab=2000, prompts="16", beams="1,8", new_tokens=24,
                             genai_prompts=16, families="llama", compile=True) == \
        PeerBenchOptions(device="cpu", shapes=((2, 128),), vocab=2000, beams=(1, 8), prompts=(16,), genai_prompts=16,
                         new_tokens=24, families=("llama",), compile=True)
    with pytest.raises(ValueError, match="beams"):
        options_from_text(shapes="2x128", beams="1,b", prompts="16", families="gpt2")


@pytest.mark.parametrize("arguments,message", [(["--genai-prompts", "64"], "genai_prompts"),
                                               (["--shapes", "6x500"], "shapes"), (["--beams", "x"], "beams"),
                                               (["--families", "t5"], "families")])
def test_the_command_refuses_bad_options_before_it_runs(arguments, message):
    result = CliRunner().invoke(cli_main, ["bench", "peers", "--device", "cpu", *arguments])
    assert result.exit_code == 2 and message in result.output


@pytest.mark.peers
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_tiny_run_has_every_ratio_and_full_parity(tmp_path, device):
    """float32, where torch and transformers are installed (``cuda``: also under ``-m gpu``)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    options = PeerBenchOptions(device=device, shapes=((2, 64),), vocab=300, beams=(1, 4), prompts=(6,),
                               genai_prompts=5, new_tokens=8, prompt_length=5)
    results = peers.run_peers_bench(options, output_dir=tmp_path, name=output_name(options))
    assert json.loads((tmp_path / f"{output_name(options)}.json").read_text())["cells"] == results["cells"]
    exports = {(c["family"], c["export"]) for c in results["cells"]}
    assert {("gpt2", "torch.onnx"), ("llama", "torch.onnx")} <= exports
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        pass
    else:  # GenAI's float32 CUDA export does not load: said so, no cells
        if device == "cuda":
            assert peers.GENAI_NO_FLOAT32_CUDA in results["notes"]
            assert ("llama", "GenAI builder") not in exports
        else:
            assert ("llama", "GenAI builder") in exports
    for cell in results["cells"]:
        where = f"{cell['family']} {cell['export']} beam {cell['beam']}"
        assert cell["sides"]["hf_generate"]["s"] > 0, where
        assert "gpudecode" in cell["sides"], where
        for side, r in cell["sides"].items():
            if side == "hf_generate" or "note" in r and "s" not in r:
                continue
            assert r["ratio_to_hf"] > 0, (where, side)
            assert r["equal"] == cell["prompts"], (where, side)  # float32: the same best sequences
            assert r["max_score_diff"] < 1e-3, (where, side)
        assert "s" in cell["sides"]["gpudecode"], where
        graphs = [r["captured_graphs"] for side, r in cell["sides"].items() if side.startswith("gpudecode") and "s" in r]
        assert graphs and (device != "cpu" or not any(graphs)), where  # each toolkit side says; none on the CPU
    table = format_table(results)
    assert table.count("| gpudecode |") == len(results["cells"])
