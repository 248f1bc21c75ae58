"""Search types by name: what each needs, how its options are made, how it decodes a batch.

The :class:`~gpudecode.decoder.Decoder` looks the config's ``search.type`` up here and knows
nothing about any one search: it checks the type's requirements (:meth:`SearchType.check`),
builds the encoder, the scorers, the special labels and (where asked for) the transducer networks,
and hands them to the type as a :class:`SearchSetup`.

The built-in types are registered by :mod:`gpudecode.search.builtin`, imported on the first
lookup (so importing this module, as the config does, loads no search and no ONNX Runtime). Any
other module registers its own with :func:`register_search`; a type registered before the config
is validated is a valid ``search.type``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

#: The module that registers the built-in search types.
_BUILTIN_MODULE = "gpudecode.search.builtin"
#: The built-in type names (what :data:`_BUILTIN_MODULE` registers), known without importing it.
BUILTIN_SEARCH_TYPES = ("label-sync", "ctc-prefix", "ctc-greedy", "transducer", "transducer-greedy")
#: What a search type says of label scorers.
SCORER_RULES = ("required", "optional", "forbidden")
#: Special labels a search type may need (``models.vocabulary`` keys).
SPECIAL_LABELS = ("blank", "sentence_end")

_REGISTRY: dict[str, SearchType] = {}


class SearchTypeError(ValueError):
    """A search type that is not registered, or a config that does not give it what it needs.
    The message starts with the config key at fault."""


@dataclass(frozen=True, kw_only=True)
class SearchSetup:
    """What a search type gets from the decoder, built once per :class:`~gpudecode.decoder.Decoder`.

    - ``config``: the config's ``search`` section (``SearchConfig``; ``config.options`` holds
      settings of types that have keys of their own);
    - ``scorers``: (name, scorer, scale) triples of the config's ``scorers``;
    - ``xp``: the array module of the run (numpy or cupy);
    - ``blank``, ``sentence_end``: label indices (``blank`` None unless the type needs it;
      ``sentence_end`` the vocabulary's, or None without one);
    - ``prediction``, ``joint``: the transducer networks (types with ``needs_transducer``);
    - ``options``: what the type's ``make_options`` made (None while it runs);
    - ``tuning``, ``stats``: how the search runs and where it reports (None: its defaults).
    """

    config: Any
    scorers: tuple = ()
    xp: ModuleType = np
    blank: int | None = None
    sentence_end: int | None = None
    prediction: Any = None
    joint: Any = None
    options: Any = None
    tuning: Any = None
    stats: Any = None

    def run_settings(self) -> dict[str, Any]:
        """``tuning=`` and ``stats=`` keywords for a search function, where set."""
        return {k: v for k, v in (("tuning", self.tuning), ("stats", self.stats)) if v is not None}


@dataclass(frozen=True, kw_only=True)
class SearchType:
    """One search type.

    - ``name``: the ``search.type`` value; ``title``: how messages name it;
    - ``decode(setup, batch)``: per utterance of ``batch`` (a ``UtteranceBatch`` of encoder
      outputs, ``inputs["encoder-states"]`` the encoder's main output) its n-best list;
    - ``make_options(setup)``: the search's options object (an instance of ``options_class``)
      from ``setup.config`` and the labels (None: the type has no options object);
    - ``scorers``: label scorers ``"required"``, ``"optional"`` or ``"forbidden"``;
      ``alternative``: the type to suggest when scorers are given to one that forbids them;
    - ``needs_encoder``: ``models.encoder`` must be set (``encoder_role`` says why);
      ``needs_transducer``: ``models.transducer`` too (prediction and joint networks);
    - ``labels``: special labels the vocabulary must define (``"blank"``, ``"sentence_end"``).
    """

    name: str
    decode: Callable[[SearchSetup, Any], list]
    make_options: Callable[[SearchSetup], Any] | None = None
    options_class: type | None = None
    title: str = ""
    scorers: str = "optional"
    alternative: str | None = None
    needs_encoder: bool = False
    encoder_role: str = "the encoder"
    needs_transducer: bool = False
    labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or ":" in self.name:
            raise ValueError(f"a search type name must be a non-empty string without ':', got {self.name!r}")
        if self.scorers not in SCORER_RULES:
            raise ValueError(f"SearchType {self.name!r}: scorers must be one of {', '.join(SCORER_RULES)}, "
                             f"got {self.scorers!r}")
        unknown = set(self.labels) - set(SPECIAL_LABELS)
        if unknown:
            raise ValueError(f"SearchType {self.name!r}: unknown special labels {sorted(unknown)}; "
                             f"valid: {', '.join(SPECIAL_LABELS)}")
        if not self.title:
            object.__setattr__(self, "title", f"search type {self.name!r}")

    def check(self, config) -> None:
        """Raises :class:`SearchTypeError` when ``config`` (a whole ``Config``) does not give this
        type what it needs (scorers, encoder, transducer networks)."""
        if self.scorers == "required" and not config.scorers:
            raise SearchTypeError(f"scorers: {self.title} needs at least one label scorer")
        if self.scorers == "forbidden" and config.scorers:
            hint = f"; use search.type {self.alternative}" if self.alternative else ""
            raise SearchTypeError(f"scorers: {self.title} fuses no scorers{hint}")
        models = config.models
        if self.needs_transducer and (models.encoder is None or models.transducer is None):
            raise SearchTypeError(f"models.transducer: {self.title} needs models.encoder and models.transducer "
                                  "(prediction and joint networks)")
        if self.needs_encoder and models.encoder is None:
            raise SearchTypeError(f"models.encoder: {self.title} needs {self.encoder_role}")


def register_search(search_type: SearchType) -> SearchType:
    """Makes ``search_type`` available under its name; returns it. Registering another type
    under a taken name is an error (the same object again is not)."""
    if not isinstance(search_type, SearchType):
        raise TypeError(f"register_search: expected a SearchType, got {search_type!r}")
    existing = _REGISTRY.get(search_type.name)
    if existing is not None and existing is not search_type:
        raise ValueError(f"search type {search_type.name!r} is already registered")
    _REGISTRY[search_type.name] = search_type
    return search_type


def unregister_search(name: str) -> None:
    """Removes a type registered by :func:`register_search` (built-ins stay)."""
    if name in BUILTIN_SEARCH_TYPES:
        raise ValueError(f"search type {name!r} is built in")
    _REGISTRY.pop(name, None)


def is_search_type(name: str) -> bool:
    """Whether ``name`` is a built-in or registered search type (imports nothing)."""
    return name in BUILTIN_SEARCH_TYPES or name in _REGISTRY


def search_type_names() -> tuple[str, ...]:
    """Built-in names first, in their order, then the registered ones, sorted (imports nothing)."""
    return BUILTIN_SEARCH_TYPES + tuple(sorted(set(_REGISTRY) - set(BUILTIN_SEARCH_TYPES)))


def search_type(name: str) -> SearchType:
    """The type registered as ``name`` (the built-ins are imported on first use)."""
    if name in BUILTIN_SEARCH_TYPES and name not in _REGISTRY:
        importlib.import_module(_BUILTIN_MODULE)
        if name not in _REGISTRY:  # a bug in the built-in module, not bad input
            raise AssertionError(f"module {_BUILTIN_MODULE} does not register {name!r}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SearchTypeError(f"search.type: {name!r} is not a search type; valid: "
                              f"{', '.join(search_type_names())}") from None
