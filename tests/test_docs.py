"""The documentation speaks of the product: a short README, links that resolve, every result file
docs/performance.md cites present, and no text that narrates the repository's development."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: Labels of numbered development rounds ("session 12", "call 5", "s15call5b").
RUN_LABEL = re.compile(r"session [0-9]|call [0-9]|s[0-9]+call", re.IGNORECASE)
#: Where no such label may appear (the issue's grep: README.md docs gpudecode .ci tools).
SEARCHED = ("README.md", "docs", "gpudecode", ".ci", "tools")
#: Files outside the repository that the README once pointed to.
OUTSIDE = ("DESIGN.md", "GPU.md", ".gpu/kit", "../shared")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _searched_files():
    for name in SEARCHED:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for file in files:
            if "__pycache__" in file.parts or file.suffix in {".png", ".pyc", ".so", ".onnx", ".npy", ".npz"}:
                continue
            if "build" in file.relative_to(ROOT).parts:  # tools/kernel-emulator's compiled cache
                continue
            yield file


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def test_readme_keeps_the_test_command():
    """.ci/run runs the line after the marker."""
    command = subprocess.run(
        ["awk", r"/<!-- test-command -->/ {grab=1; next} grab && /^[^`]/ {print; exit}", str(README)],
        capture_output=True, text=True, check=True).stdout.strip()
    assert "python -m pytest" in command


def test_no_development_round_labels():
    found = []
    for file in _searched_files():
        text = file.read_text(encoding="utf-8", errors="replace")
        found += [f"{file.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
                  for m in RUN_LABEL.finditer(text)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.name)
def test_docs_point_to_no_files_outside_the_repository(path):
    text = path.read_text(encoding="utf-8")
    assert not [name for name in OUTSIDE if name in text]


def test_performance_log_is_gone():
    assert not (DOCS / "performance-log.md").exists()


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.name)
def test_relative_links_resolve(path):
    missing = []
    for target in MARKDOWN_LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):
            continue  # a web address
        file, _, anchor = target.partition("#")
        linked = path.parent / file if file else path
        if not linked.exists():
            missing.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            missing.append(target)
    assert not missing


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_result_file_cited_by_performance_md_exists():
    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"bench/([\w.-]+\.(?:json|png|log))", text))
    assert cited
    assert not [name for name in cited if not (DOCS / "bench" / name).exists()]


def test_docs_bench_holds_one_result_per_benchmark():
    """Every JSON in docs/bench is cited by docs/performance.md, and none is named after a run."""
    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    results = sorted(p.name for p in (DOCS / "bench").glob("*.json"))
    assert not [name for name in results if f"bench/{name}" not in text]
    assert not [name for name in results if re.search(r"-(s\d+)?call\d|-session\d|-rerun|-run\d", name)]


def test_readme_config_example_is_valid():
    """The README's own-model config passes validation as written (its model files are placeholders)."""
    import yaml

    from gpudecode.config import validate_config

    (block,) = re.findall(r"```yaml\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    config = validate_config(yaml.safe_load(block))
    assert [s.type for s in config.scorers] == ["onnx-decoder", "recurrent-lm"]
