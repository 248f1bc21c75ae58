"""Descriptions of a stateful model's tensors, shared by the session layer and the state managers."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class StateVariable:
    """One (input, output) pair of a stateful model, e.g. ``past-key-0`` -> ``present-key-0``.

    ``shape`` is the declared input shape with ``None`` for dynamic dimensions. ``time_axis`` is
    the dynamic non-batch axis (transformer states) or ``None`` (LSTM states: one per hypothesis).
    """

    input_name: str
    output_name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]
    batch_axis: int = 0
    time_axis: int | None = None

    @property
    def token_shape(self) -> tuple[int, ...]:
        """Shape of one token state: the declared shape without the batch and time axes."""
        dims = tuple(
            d for axis, d in enumerate(self.shape) if axis not in (self.batch_axis, self.time_axis)
        )
        if any(d is None for d in dims):
            raise ValueError(
                f"state variable {self.input_name!r}: shape {self.shape} has a dynamic dimension "
                "besides the batch and time axes"
            )
        return dims  # type: ignore[return-value]

    @property
    def token_size(self) -> int:
        """Elements in one token state."""
        return int(np.prod(self.token_shape, dtype=np.int64))
