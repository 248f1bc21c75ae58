"""The README's examples run as written."""

import os
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_python_api_decodes_the_bundled_audio(monkeypatch):
    (block,) = [b for b in _python_blocks() if "Decoder.from_config" in b]
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    best = namespace["best"]
    assert namespace["decoder"].vocabulary.tokens(best.labels) == ["eight", "four"]
    assert set(best.scores) == {"decoder", "ctc", "lm", "length"}
    # the total is the sum of the scorers' scores at the scales of configs/example.yaml
    config = yaml.safe_load((ROOT / "configs" / "example.yaml").read_text())
    scales = {scorer["name"]: scorer["scale"] for scorer in config["scorers"]}
    assert scales.keys() == best.scores.keys()
    assert abs(sum(best.scores[k] * scales[k] for k in scales) - best.score) < 1e-4


def test_readme_first_command_is_the_example_config():
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```\n(.*?)```", text[text.index("## Two commands"):], flags=re.S).group(1)
    assert "gpudecode decode configs/example.yaml" in first
    assert os.path.exists(ROOT / "configs" / "example.yaml")
