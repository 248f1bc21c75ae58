"""loso.py's wiring of the FSDD families (examples/fsdd/loso.py): every system's shipped config,
with the fold's overrides, validates and reads the fold's own models; options after ``--`` reach
the training script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpudecode.config import load_config

RECIPE_DIR = Path(__file__).resolve().parents[1] / "examples" / "fsdd"
if str(RECIPE_DIR) not in sys.path:
    sys.path.insert(0, str(RECIPE_DIR))

import loso  # noqa: E402

#: the models each family exports into a fold's folder
EXPORTED = {"ctc": {"ctc-encoder.onnx"},
            "aed": {"aed-encoder.onnx", "aed-decoder.onnx"},
            "transducer": {"transducer-encoder.onnx", "transducer-prediction.onnx", "transducer-joint.onnx"}}


def _model_paths(config) -> dict[str, Path]:
    """Every model file a config reads, by where it is named."""
    paths = {"encoder": Path(config.models.encoder.path)}
    if config.models.transducer is not None:
        paths["prediction"] = Path(config.models.transducer.prediction)
        paths["joint"] = Path(config.models.transducer.joint)
    for scorer in config.scorers:
        if getattr(scorer, "model", None):
            paths[scorer.name] = Path(scorer.model)
    return paths


@pytest.mark.parametrize("family", sorted(loso.FAMILIES))
def test_every_system_reads_the_folds_models(family, tmp_path):
    fam = loso.FAMILIES[family]
    assert fam.systems, f"{family}: no systems"
    exp = tmp_path / "george" / family
    for system in fam.systems:
        config = load_config(system.config, [*fam.model_overrides(exp), *system.overrides])
        paths = _model_paths(config)
        from_fold = {p.name for p in paths.values() if p.parent == exp}
        assert from_fold == EXPORTED[family], f"{system.name}: {paths}"
        # the rest (the LMs) are the shipped models: trained on generated text, no folds
        assert all(p.parent == exp or p.name.endswith("-lm.onnx") for p in paths.values()), paths


def test_the_transducer_and_aed_start_from_the_folds_ctc_checkpoint():
    assert loso.FAMILIES["ctc"].init_from is None
    assert loso.FAMILIES["aed"].init_from == loso.FAMILIES["transducer"].init_from == "ctc"


def test_options_after_the_separator_go_to_training():
    args = loso.parse_args(["--family", "aed", "--jobs", "3", "--decode-only", "--", "--aug-tempo", "0.1",
                            "--jobs", "9"])
    assert args.family == "aed" and args.jobs == 3 and args.decode_only
    assert args.extra == ["--aug-tempo", "0.1", "--jobs", "9"]
    assert loso.parse_args([]).extra == [] and not loso.parse_args([]).decode_only


def test_every_stage_of_the_gpu_script_is_documented_and_known(tmp_path):
    """loso_gpu.sh: the stages its header describes are the stages its case statement runs, and an
    unknown stage stops it (exit 2) with that list."""
    import re
    import subprocess

    script = RECIPE_DIR / "loso_gpu.sh"
    text = script.read_text()
    documented = {name for line in re.findall(r"^# ([a-z][a-z-]*(?:, [a-z][a-z-]*)*):", text, re.M)
                  for name in line.split(", ")}
    handled = {name for labels in re.findall(r"^    ([a-z][a-z|-]*)\)", text, re.M) for name in labels.split("|")}
    assert documented == handled and {"ship-synth", "synth-aed", "synth-transducer"} <= handled
    done = subprocess.run(["bash", str(script), "no-such-stage"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "EXP": str(tmp_path / "exp")})
    assert done.returncode == 2, done.stderr
    listed = set(re.search(r"\(([^)]*)\)", done.stderr).group(1).split())
    assert listed == handled
