"""Extension routes that work as documented (issue item 7, and item 5's custom scorer without
``vocab_size``): registered scorer names pass the config check, the custom-scorer example runs as
its docstring writes it, ``module:Class`` scorers are imported from the config's folder with their
file options resolved against it, and the scorer contract (``vocab_size``, ``score`` shape and
dtype) is checked with an error naming the scorer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from gpudecode.config import ConfigError, apply_overrides, load_config, validate_config
from gpudecode.decoder import Decoder
from gpudecode.scorers import LabelScorer, register_scorer, registry
from gpudecode.scorers.base import ScorerContractError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "configs" / "random-aed.yaml"
FEATURES = {p.stem: np.load(p) for p in sorted((ROOT / "examples" / "features").glob("*.npy"))}
VOCAB = 12  # examples/models/vocab.txt


class Flat(LabelScorer):
    """The same log-probability for every label: the decoder's ranking is unchanged."""

    def __init__(self, *, vocab_size=VOCAB, dtype="float32", columns=None):
        self.vocab_size = vocab_size
        self.dtype, self.columns = dtype, columns

    def initial_context(self, groups, ctx=None):
        return None

    def score(self, ctx):
        columns = self.vocab_size if self.columns is None else self.columns
        return self.layout.xp.full((self.layout.num_lanes, columns), -1.0, dtype=self.dtype)

    def extend(self, ctx, parents, labels):
        return None


class NoVocabSize(Flat):
    def __init__(self):
        pass


@pytest.fixture
def registry_restored():
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def _config(scorer: dict, *overrides: str):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["scorers"].append(scorer)
    return validate_config(apply_overrides(data, overrides), EXAMPLE.parent)


def cli(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "gpudecode", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def test_a_registered_scorer_name_passes_the_config_check_and_decodes(registry_restored):
    with pytest.raises(ConfigError, match=r"scorers\[1\]\.type: invalid choice 'test-flat'"):
        _config({"type": "test-flat", "name": "flat"})
    register_scorer("test-flat")(Flat)
    config = _config({"type": "test-flat", "name": "flat", "scale": 0.5})
    assert config.scorers[1].type == "test-flat"
    decoder = Decoder(config)
    assert isinstance(decoder.scorers[1][1], Flat)
    plain = Decoder.from_config(EXAMPLE).decode(FEATURES)
    flat = decoder.decode(FEATURES)  # a flat scorer adds -0.5 per label: same labels
    assert {k: [h.labels for h in v] for k, v in flat.items()} == {k: [h.labels for h in v] for k, v in plain.items()}
    message = str(pytest.raises(ConfigError, _config, {"type": "test-flatt"}).value)
    assert "(did you mean 'test-flat'?)" in message and "test-flat" in message.split("valid choices:")[1]


def test_the_custom_scorer_example_runs_as_its_docstring_writes_it(tmp_path):
    import examples.custom_scorer as example

    doc = example.__doc__
    snippet = re.search(r"scorers:\n(.*?)\n\n", doc, re.S).group(0)
    documented = yaml.safe_load(snippet)["scorers"][0]
    bundled = yaml.safe_load((ROOT / "examples" / "custom_scorer.yaml").read_text())
    assert documented in bundled["scorers"]  # the docstring's entry is the bundled config's
    assert "    gpudecode decode examples/custom_scorer.yaml" in doc
    out = tmp_path / "out"
    run = cli("decode", "examples/custom_scorer.yaml", "--output", out, cwd=ROOT)  # as written, no PYTHONPATH
    assert run.returncode == 0, run.stderr
    assert "WER" in run.stdout and len((out / "text").read_text().splitlines()) == 8
    elsewhere = cli("decode", ROOT / "examples" / "custom_scorer.yaml", "--output", tmp_path / "out2", cwd=tmp_path)
    assert elsewhere.returncode == 0, elsewhere.stderr  # the config's folder is enough
    assert (tmp_path / "out2" / "text").read_text() == (out / "text").read_text()
    resolved = yaml.safe_load((out / "config.resolved.yaml").read_text())["scorers"][1]
    assert resolved["base_dir"] == str(ROOT / "examples") and resolved["options"]["log_probs"] == \
        "custom_scorer_bigram.npy"


def test_module_class_scorers_import_from_the_config_folder_and_resolve_their_file_options(tmp_path,
                                                                                           monkeypatch):
    folder = tmp_path / "exp"
    (folder / "tables").mkdir(parents=True)
    (folder / "table_scorer_for_test.py").write_text(
        "import numpy as np\n"
        "from gpudecode.scorers import LabelScorer\n\n"
        "class TableScorer(LabelScorer):\n"
        "    path_options = ('table',)\n\n"
        "    def __init__(self, *, table):\n"
        "        self.row = np.load(table).astype(np.float32)\n"
        "        self.vocab_size = self.row.size\n\n"
        "    def initial_context(self, groups, ctx=None):\n"
        "        return None\n\n"
        "    def score(self, ctx):\n"
        "        return self.layout.xp.broadcast_to(self.layout.xp.asarray(self.row), "
        "(self.layout.num_lanes, self.vocab_size))\n\n"
        "    def extend(self, ctx, parents, labels):\n"
        "        return None\n")
    np.save(folder / "tables" / "row.npy", np.zeros(VOCAB, np.float32))
    data = yaml.safe_load(EXAMPLE.read_text())
    for key in ("encoder", "vocabulary"):
        data["models"][key]["path"] = str((EXAMPLE.parent / data["models"][key]["path"]).resolve())
    data["scorers"][0]["model"] = str((EXAMPLE.parent / data["scorers"][0]["model"]).resolve())
    data["scorers"].append({"type": "table_scorer_for_test:TableScorer", "name": "table",
                            "options": {"table": "tables/row.npy"}})
    (folder / "exp.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)  # neither the working directory nor the Python path holds the module
    path_before = list(sys.path)
    decoder = Decoder.from_config(folder / "exp.yaml")
    assert sys.path == path_before  # found in the config's folder, the Python path left as it was
    table = decoder.scorers[1][1]
    assert type(table).__name__ == "TableScorer" and table.vocab_size == VOCAB
    assert set(decoder.decode(FEATURES)) == set(FEATURES)
    del sys.modules["table_scorer_for_test"]
    with pytest.raises(ConfigError, match=r"scorers\[1\]\.type: scorer type 'no_such_module_here:X': module "
                                          r"'no_such_module_here' not found on the Python path, "):
        Decoder(_config({"type": "no_such_module_here:X", "name": "x"}))


def test_a_scorer_without_vocab_size_is_named_at_construction(tmp_path):
    with pytest.raises(ScorerContractError, match=(
            r"^scorer 'novocab' \(tests\.test_scorer_contract\.NoVocabSize\) has no "
            r"vocab_size after construction: a LabelScorer sets self\.vocab_size")):
        Decoder(_config({"type": "tests.test_scorer_contract:NoVocabSize", "name": "novocab"}))
    with pytest.raises(ScorerContractError, match=(
            r"scorer 'wide' \(tests\.test_scorer_contract\.Flat\) has vocab_size 13, but the vocabulary has 12 "
            "labels")):
        Decoder(_config({"type": "tests.test_scorer_contract:Flat", "name": "wide", "options": {"vocab_size": 13}}))
    with pytest.raises(ConfigError, match=(
            r"scorers\[1\]\.options: scorer type 'tests\.test_scorer_contract:Flat': cannot build Flat with options "
            r"\['colums'\]")):
        Decoder(_config({"type": "tests.test_scorer_contract:Flat", "name": "typo", "options": {"colums": 3}}))
    with pytest.raises(ConfigError, match=r"scorers\[1\]\.options: scorer type 'length-reward': cannot build"):
        Decoder(_config({"type": "length-reward", "name": "len", "options": {"rewrd": 0.5}}))
    out = tmp_path / "out"
    run = cli("decode", EXAMPLE, "--output", out, "-o",
              "scorers.1={type: 'tests.test_scorer_contract:NoVocabSize', name: novocab}", cwd=ROOT)
    assert run.returncode == 1
    assert "Error: scorer 'novocab' (tests.test_scorer_contract.NoVocabSize) has no vocab_size" in run.stderr
    assert "Traceback" not in run.stderr and not out.exists()


@pytest.mark.parametrize("options, problem", [
    ({"dtype": "int64"}, "score() returned dtype int64, expected float32 (or float16) log-probabilities"),
    ({"columns": 11}, "score() returned shape (8, 11), expected [N=8, V=12]"),
])
def test_score_output_shape_and_dtype_are_checked_naming_the_scorer(options, problem):
    decoder = Decoder(_config({"type": "tests.test_scorer_contract:Flat", "name": "odd", "options": options},
                              "search.batch_size=2"))
    with pytest.raises(ScorerContractError) as caught:
        decoder.decode(FEATURES)
    assert str(caught.value) == f"scorer 'odd' (tests.test_scorer_contract.Flat): {problem}"
