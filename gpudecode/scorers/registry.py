"""Scorer types by name: built-ins in an explicit dict, user classes as ``module:Class``.

Built-in scorers register themselves with :func:`register_scorer`; their modules are listed in
``_BUILTIN_MODULES`` and imported on first lookup (so ``import gpudecode.scorers`` does not load
ONNX Runtime). A custom scorer is any :class:`~gpudecode.scorers.base.LabelScorer` subclass
named as ``"package.module:Class"``, or registered by the user's own code with the decorator.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gpudecode.scorers.base import LabelScorer, check_vocab_size

#: Built-in type name -> the module that registers it. The lead adds ``onnx-decoder`` and
#: ``recurrent-lm`` here when their modules exist.
_BUILTIN_MODULES: dict[str, str] = {
    "ctc-prefix": "gpudecode.scorers.ctc_prefix",
    "length-reward": "gpudecode.scorers.length_reward",
    "onnx-decoder": "gpudecode.scorers.onnx_decoder",
    "prefix-lm": "gpudecode.scorers.prefix_lm",
    "recurrent-lm": "gpudecode.scorers.onnx_decoder",
}

#: Registered type name -> class (filled by :func:`register_scorer`).
_REGISTRY: dict[str, type] = {}

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

#: What a class needs to be usable as a label scorer without subclassing LabelScorer.
_REQUIRED_METHODS = ("begin", "admit", "initial_context", "score", "extend", "release")


class ScorerTypeError(ValueError):
    """A scorer type string that names no usable scorer class."""


def register_scorer(name: str) -> Callable[[type], type]:
    """Class decorator: make the class available as scorer type ``name``."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"a scorer type name must be a non-empty string without ':', got "
                         f"{name!r}")

    def decorate(cls: type) -> type:
        problem = _not_a_scorer(cls)
        if problem:
            raise TypeError(f"register_scorer({name!r}): {problem}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"scorer type {name!r} is already registered "
                             f"({existing.__module__}.{existing.__qualname__})")
        _REGISTRY[name] = cls
        return cls

    return decorate


def is_registered_scorer_type(name: str) -> bool:
    """Whether ``name`` is registered now (by a built-in module or a user's
    ``@register_scorer``), without importing anything."""
    return name in _REGISTRY or name in _BUILTIN_MODULES


def user_registered_types() -> tuple[str, ...]:
    """Names registered by user code so far (the built-ins left out), sorted."""
    return tuple(sorted(n for n in _REGISTRY if n not in _BUILTIN_MODULES))


def registered_scorer_types() -> tuple[str, ...]:
    """Every built-in or registered type name, sorted (built-in modules are imported)."""
    for name in _BUILTIN_MODULES:
        _import_builtin(name)
    return tuple(sorted(_REGISTRY))


def scorer_class(type_name: str, search_path: Sequence[str | Path] = ()) -> type:
    """The class for ``type_name``: a registered/built-in name or ``"module:Class"``.

    A module that the interpreter's own import path does not find is looked for in the folders
    of ``search_path``, in order (a config passes its own folder and the working directory).
    Raises :class:`ScorerTypeError` naming the string and what failed.
    """
    if not isinstance(type_name, str):
        raise ScorerTypeError(f"scorer type must be a string, got {type_name!r}")
    if ":" not in type_name:
        if type_name in _BUILTIN_MODULES:
            _import_builtin(type_name)
        if type_name in _REGISTRY:
            return _REGISTRY[type_name]
        known = ", ".join(registered_scorer_types())
        raise ScorerTypeError(f"unknown scorer type {type_name!r}; registered types: {known}; "
                              "or name a custom scorer class as 'module:Class'")
    if not _IMPORT_PATH.match(type_name):
        raise ScorerTypeError(f"scorer type {type_name!r}: expected 'package.module:Class'")
    module_name, class_name = type_name.split(":")
    try:
        module = _import_module(module_name, search_path)
    except ModuleNotFoundError as exc:
        where = "".join(f", {Path(p)}" for p in search_path)
        raise ScorerTypeError(f"scorer type {type_name!r}: module {module_name!r} not found on the "
                              f"Python path{where} ({exc})") from exc
    except Exception as exc:  # the module exists but fails on import
        raise ScorerTypeError(f"scorer type {type_name!r}: importing module {module_name!r} "
                              f"failed ({type(exc).__name__}: {exc})") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ScorerTypeError(f"scorer type {type_name!r}: module {module_name!r} has no "
                              f"attribute {class_name!r}")
    problem = _not_a_scorer(cls)
    if problem:
        raise ScorerTypeError(f"scorer type {type_name!r}: {problem}")
    return cls


def create_scorer(type_name: str, /, *, search_path: Sequence[str | Path] = (),
                  expected_vocab_size: int | None = None, name: str | None = None, **options) -> LabelScorer:
    """An instance of :func:`scorer_class` ``(type_name, search_path)`` built with keyword ``options``.

    Its ``vocab_size`` is checked at once (present, and equal to ``expected_vocab_size``, else to
    ``options["vocab_size"]``, when either is given); ``name`` (the config's scorer name) goes into
    the errors of the contract checks."""
    cls = scorer_class(type_name, search_path)
    try:
        scorer = cls(**options)
    except TypeError as exc:
        raise ScorerTypeError(f"scorer type {type_name!r}: cannot build "
                              f"{cls.__qualname__} with options {sorted(options)} ({exc})") from exc
    expected = expected_vocab_size if expected_vocab_size is not None else options.get("vocab_size")
    check_vocab_size(scorer, name or type_name, expected)
    return scorer


def _import_module(module_name: str, search_path: Sequence[str | Path]):
    """``importlib.import_module``; where the interpreter's path does not find the top-level package,
    the folders of ``search_path`` are put at the end of ``sys.path`` for this import only."""
    top = module_name.partition(".")[0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != top or not search_path:
            raise
    added = [str(Path(p)) for p in search_path if str(Path(p)) not in sys.path]
    sys.path.extend(added)
    try:
        return importlib.import_module(module_name)
    finally:
        for folder in added:
            sys.path.remove(folder)


def _import_builtin(name: str) -> None:
    importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY:  # a bug in the built-in module, not bad input
        raise AssertionError(f"module {_BUILTIN_MODULES[name]} does not register {name!r}")


def _not_a_scorer(obj) -> str:
    """Why ``obj`` is not a label-scorer class ('' when it is one)."""
    if not inspect.isclass(obj):
        return f"{obj!r} is not a class (a LabelScorer subclass is expected)"
    if issubclass(obj, LabelScorer):
        return ""
    missing = [m for m in _REQUIRED_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        return (f"{obj.__module__}.{obj.__qualname__} is not a LabelScorer (subclass "
                f"gpudecode.scorers.LabelScorer; missing methods: {', '.join(missing)})")
    return ""
