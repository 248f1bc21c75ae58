"""Size rounding shared by every layer (imports nothing from the package)."""

from __future__ import annotations


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): buffer capacities and bucket sizes
    rounded up so they grow a few times, never per step."""
    return 1 << max(int(n) - 1, 0).bit_length()
