"""No module global of the library is rebound from outside its module: settings travel as options
(``SearchTuning``), measurements as stats (``SearchStats``), and tests inject what they observe.

An AST walk over the library, its tests and tools flags:

(a) an assignment to an attribute of a ``gpudecode`` module (``mod.NAME = ...``, ``mod.NAME += ...``,
    ``setattr(mod, "NAME", ...)``, ``del mod.NAME``) anywhere;
(b) ``monkeypatch.setattr`` / ``delattr`` on a ``gpudecode`` module, given as an object or as a
    ``"gpudecode.module.NAME"`` string;
(c) a ``global`` statement inside a library function (a module rebinding its own globals when
    called).

Names are resolved through each file's imports (``import gpudecode.x as y``, ``from gpudecode import
x``, ``from gpudecode.search import label_sync``); attributes of classes are not module globals.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gpudecode"


def _module_names() -> set[str]:
    """Dotted names of every module and package of the library."""
    names = set()
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.add(".".join(parts))
    return names


MODULES = _module_names()


def _imported_modules(tree: ast.AST, modules: set[str]) -> dict[str, str]:
    """Local name -> library module, for every import of a library module in the file (any scope)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != PACKAGE:
                    continue
                if alias.asname is not None:
                    if alias.name in modules:
                        bound[alias.asname] = alias.name
                else:
                    bound[PACKAGE] = PACKAGE  # `import gpudecode.x` binds `gpudecode`
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if dotted in modules:
                    bound[alias.asname or alias.name] = dotted
    return bound


def _resolve(node: ast.AST, bound: dict[str, str], modules: set[str]) -> str | None:
    """The library module an expression names (``label_sync``, ``gpudecode.search.label_sync``), or None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _resolve(node.value, bound, modules)
        if parent is not None and f"{parent}.{node.attr}" in modules:
            return f"{parent}.{node.attr}"
    return None


def _is_monkeypatch_call(func: ast.AST) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr in ("setattr", "delattr")
            and isinstance(func.value, ast.Name) and func.value.id in ("monkeypatch", "mp"))


def _string_target(node: ast.AST, modules: set[str]) -> str | None:
    """``"gpudecode.mod.NAME"`` -> the module, when the string names a library module's attribute."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
        module = node.value.rsplit(".", 1)[0]
        if module in modules:
            return module
    return None


def violations(source: str, filename: str = "<string>", *, library: bool = False,
               own_module: str | None = None, modules: set[str] = MODULES) -> list[str]:
    """Every rebinding of a library module's global in ``source`` (``library``: also ``global``
    statements; ``own_module``: the file's own module, whose globals it may assign at top level)."""
    tree = ast.parse(source, filename)
    bound = _imported_modules(tree, modules)
    found = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno}: {what}")

    def check_target(target: ast.AST, node: ast.AST, verb: str) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                check_target(element, node, verb)
        elif isinstance(target, ast.Attribute):
            module = _resolve(target.value, bound, modules)
            if module is not None and module != own_module:
                flag(node, f"{verb} {module}.{target.attr}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                check_target(target, node, "assigns")
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            check_target(node.target, node, "assigns")
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                check_target(target, node, "deletes")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
                module = _resolve(node.args[0], bound, modules)
                if module is not None and module != own_module:
                    flag(node, f"{func.id}() on {module}")
            elif _is_monkeypatch_call(func) and node.args:
                module = _resolve(node.args[0], bound, modules) or _string_target(node.args[0], modules)
                if module is not None:
                    flag(node, f"monkeypatch.{func.attr} on {module}")
        elif library and isinstance(node, ast.Global):
            flag(node, f"global {', '.join(node.names)}")
    return found


def _own_module(path: Path) -> str | None:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] != PACKAGE:
        return None
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _checked_files() -> list[Path]:
    files = sorted((ROOT / PACKAGE).rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    for folder in ("tools", ".ci"):
        for path in sorted((ROOT / folder).rglob("*")) if (ROOT / folder).is_dir() else ():
            if path.is_file() and (path.suffix == ".py" or _is_python_script(path)):
                files.append(path)
    return files


def _is_python_script(path: Path) -> bool:
    """A file without ``.py`` whose first line runs Python (e.g. ``.ci/gpu-profile``)."""
    try:
        with path.open("rb") as handle:
            first = handle.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def test_no_library_global_is_rebound():
    found = []
    for path in _checked_files():
        source = path.read_text(encoding="utf-8")
        if PACKAGE not in source:
            continue
        found += violations(source, str(path.relative_to(ROOT)), library=path.is_relative_to(ROOT / PACKAGE),
                            own_module=_own_module(path))
    assert not found, "module globals of the library rebound (pass options or stats instead):\n" + "\n".join(found)


PLANTED = [
    ("from gpudecode.search import label_sync\nlabel_sync.STOP_TEST_LAG = 3\n", "label_sync.STOP_TEST_LAG"),
    ("import gpudecode.backend as b\nb.HOST_WAITS += 1\n", "gpudecode.backend.HOST_WAITS"),
    ("import gpudecode.search.batching\ngpudecode.search.batching.REFILLS = None\n", "batching.REFILLS"),
    ("from gpudecode import backend\nsetattr(backend, 'X', 1)\n", "setattr() on gpudecode.backend"),
    ("from gpudecode.search import ctc_frame as cf\ndef f():\n    cf.enabled, y = False, 1\n", "ctc_frame.enabled"),
    ("from gpudecode.search import label_sync\n\ndef test_x(monkeypatch):\n"
     "    monkeypatch.setattr(label_sync, '_to_host', print)\n", "monkeypatch.setattr on gpudecode.search.label_sync"),
    ("def test_x(monkeypatch):\n    monkeypatch.setattr('gpudecode.backend.HOST_WAITS', None)\n",
     "monkeypatch.setattr on gpudecode.backend"),
    ("from gpudecode import search\ndef test_x(monkeypatch):\n    monkeypatch.delattr(search.topk, 'x')\n",
     "monkeypatch.delattr on gpudecode.search.topk"),
]


@pytest.mark.parametrize("source, expected", PLANTED)
def test_the_check_finds_a_planted_rebinding(source, expected):
    found = violations(source)
    assert len(found) == 1 and expected in found[0], found


def test_the_check_finds_a_global_statement_in_the_library_only():
    source = "COUNT = 0\n\ndef bump():\n    global COUNT\n    COUNT += 1\n"
    assert [v.split(": ", 1)[1] for v in violations(source, library=True)] == ["global COUNT"]
    assert violations(source) == []


def test_the_check_leaves_alone_what_is_not_a_library_global():
    source = """
import time
from gpudecode.search import ctc as ctc_module
from gpudecode.search.ctc import CtcPrefixOptions
from gpudecode import backend

def test_x(monkeypatch, scorer):
    monkeypatch.setattr(ctc_module._PrefixSearch, "run", None)   # a class attribute
    monkeypatch.setattr(time, "sleep", print)                     # the standard library
    monkeypatch.setattr(backend.time, "sleep", print)            # not a library module either
    scorer.session.run = print                                    # an object's attribute
    CtcPrefixOptions.beam_size = 3                                # a class attribute
"""
    assert violations(source) == []
    assert violations("LIMIT = 4\nimport gpudecode.search.topk as me\nme.LIMIT = 5\n",
                      own_module="gpudecode.search.topk") == []
