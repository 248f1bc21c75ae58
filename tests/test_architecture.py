"""The import graph of ``gpudecode/``: no cycles, and every import goes down the layers of
docs/architecture.md (the same table as :data:`LAYERS` here).

Every ``import`` and ``from ... import`` of every module counts, top-level or inside a function
(a function-level import is a dependency all the same, only a later one); imports under
``if TYPE_CHECKING:`` do not (they never run). ``from package import name`` is an edge to the
submodule ``package.name`` where one exists, else to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "gpudecode"
PACKAGE = "gpudecode"

#: The layers, lowest first: a module may import modules of its own layer and of the layers
#: before it, never of a later one. A module belongs to the layer of the longest entry that is
#: its name or a package above it (names relative to ``gpudecode``; "" is the package itself).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("", "defaults", "sizes", "spec", "backend", "kernels", "hypothesis")),
    ("io", ("io",)),
    ("states and session", ("states", "session", "prepare.detect")),
    ("scorers", ("scorers",)),
    ("search", ("search",)),
    ("config", ("config",)),
    ("decoder", ("decoder",)),
    ("jobs", ("job", "run", "engines")),
    ("testing", ("testing",)),
    ("applications", ("cli", "__main__", "inspect", "bench", "prepare")),
)
#: Modules only tests, benchmarks and tools may import: the library never does.
NOT_FOR_THE_LIBRARY = ("testing", "bench", "cli", "__main__")
#: Who may import them anyway (besides themselves).
TOOLS = ("testing", "bench", "cli", "__main__")


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(tree: ast.AST):
    """(module, names, level) of every import statement, skipping ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), 0
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", tuple(a.name for a in node.names), node.level
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its code)."""
    modules = module_names(root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for module, names, level in _imports(ast.parse(path.read_text(), str(path))):
            if level:
                base = package.split(".")[:len(package.split(".")) - level + 1]
                module = ".".join(base + ([module] if module else []))
            if module != PACKAGE and not module.startswith(PACKAGE + "."):
                continue
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            targets.update(submodules)
            if len(submodules) < len(names) or not names:
                targets.add(known(module))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a cycle or several)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _entry(name: str, entries) -> str | None:
    """The longest of ``entries`` that is ``name`` (relative to the package) or a package above it."""
    relative = name[len(PACKAGE) + 1:] if name != PACKAGE else ""
    matches = [e for e in entries if e == relative or (e and relative.startswith(e + "."))]
    return max(matches, key=len) if matches else None


def layer_of(name: str, layers=LAYERS) -> int:
    entries = {e: i for i, (_, group) in enumerate(layers) for e in group}
    entry = _entry(name, entries)
    if entry is None:
        raise AssertionError(f"module {name} is in no layer: add it to LAYERS and to docs/architecture.md")
    return entries[entry]


def wrong_directions(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Imports that go up the layers, or from the library into its tools."""
    problems = []
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target, layers) > layer_of(source, layers):
                problems.append(f"{source} ({layers[layer_of(source, layers)][0]}) imports {target} "
                                f"({layers[layer_of(target, layers)][0]})")
            elif _entry(target, NOT_FOR_THE_LIBRARY) and not _entry(source, TOOLS):
                problems.append(f"{source} (library) imports {target} (for tests and tools only)")
    return problems


def test_gpudecode_has_no_import_cycle():
    graph = import_graph()
    assert "gpudecode.search.label_sync" in graph and graph["gpudecode.search.batching"]
    assert cycles(graph) == []


def test_imports_go_down_the_documented_layers():
    assert wrong_directions(import_graph()) == []


def test_every_module_is_in_a_layer():
    for name in module_names():
        layer_of(name)


def test_the_checks_find_a_planted_cycle_and_an_upward_import():
    graph = {"gpudecode.a": {"gpudecode.b"}, "gpudecode.b": {"gpudecode.c"}, "gpudecode.c": {"gpudecode.a"},
             "gpudecode.d": {"gpudecode.a"}, "gpudecode.e": set()}
    assert cycles(graph) == [["gpudecode.a", "gpudecode.b", "gpudecode.c"]]
    del graph["gpudecode.c"]
    assert cycles(graph) == []
    layers = (("low", ("a", "b")), ("high", ("d", "e")))
    assert wrong_directions({"gpudecode.d": {"gpudecode.a"}, "gpudecode.a": set()}, layers) == []
    assert wrong_directions({"gpudecode.a": {"gpudecode.e"}, "gpudecode.e": set()}, layers) == [
        "gpudecode.a (low) imports gpudecode.e (high)"]


def test_the_graph_counts_function_level_and_relative_imports(tmp_path):
    package = tmp_path / "gpudecode"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .one import f\n")
    (package / "sub" / "one.py").write_text("def f():\n    from gpudecode.sub import two\n")
    (package / "sub" / "two.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpudecode.sub import one\n"
        "from .. import sub\n")
    graph = import_graph(package)
    assert graph == {"gpudecode": set(), "gpudecode.sub": {"gpudecode.sub.one"},
                     "gpudecode.sub.one": {"gpudecode.sub.two"}, "gpudecode.sub.two": {"gpudecode.sub"}}
    assert cycles(graph) == [["gpudecode.sub", "gpudecode.sub.one", "gpudecode.sub.two"]]


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_docs_list_the_same_layers(layer):
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    assert f"| {layer} |" in text
