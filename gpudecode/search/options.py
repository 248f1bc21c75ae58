"""Validation shared by the search option dataclasses."""

from __future__ import annotations

import operator


def option_error(options, name: str, expected: str) -> ValueError:
    """``ValueError`` naming the option class, the field, what it expects and what it got."""
    return ValueError(f"{type(options).__name__}.{name}: expected {expected}, got {getattr(options, name)!r}")


def coerce_ints(options, names) -> None:
    """Turns integer-like fields (numpy integers too, never floats or bools) into ints, in place."""
    for name in names:
        value = getattr(options, name)
        if value is not None and not isinstance(value, bool):
            try:
                object.__setattr__(options, name, operator.index(value))
            except TypeError:
                raise option_error(options, name, "an int") from None
