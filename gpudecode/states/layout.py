"""How one state variable's batched tensor maps onto token states: ``[pre, rows, mid, time, inner]``.

The declared shape ``[pre dims..., BATCH, mid dims..., TIME, inner dims...]`` flattens to
``pre`` x ``rows`` x ``mid`` x ``time`` x ``inner``; one token state is the contiguous
``[pre, mid, inner]`` (the declared shape without the batch and time axes, in order). LSTM states
have no time axis and are laid out as ``time = 1``, ``mid = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpudecode.spec import StateVariable


@dataclass(frozen=True)
class VariableLayout:
    variable: StateVariable
    pre: int
    mid: int
    inner: int
    storage_dtype: np.dtype

    @classmethod
    def of(cls, variable: StateVariable, storage_dtype) -> "VariableLayout":
        shape, batch, time = variable.shape, variable.batch_axis, variable.time_axis
        token_shape = variable.token_shape  # raises for dynamic dims besides batch and time
        del token_shape
        if not 0 <= batch < len(shape):
            raise ValueError(
                f"state variable {variable.input_name!r}: batch axis {batch} outside shape {shape}"
            )
        if time is None:
            pre = _product(shape[:batch])
            mid = 1
            inner = _product(shape[batch + 1 :])
        else:
            if not batch < time < len(shape):
                raise ValueError(
                    f"state variable {variable.input_name!r}: the time axis ({time}) must come after "
                    f"the batch axis ({batch}) in shape {shape}"
                )
            pre = _product(shape[:batch])
            mid = _product(shape[batch + 1 : time])
            inner = _product(shape[time + 1 :])
        return cls(variable=variable, pre=pre, mid=mid, inner=inner, storage_dtype=np.dtype(storage_dtype))

    @property
    def name(self) -> str:
        return self.variable.input_name

    @property
    def model_dtype(self) -> np.dtype:
        return np.dtype(self.variable.dtype)

    @property
    def token_shape(self) -> tuple[int, ...]:
        return tuple(self.variable.token_shape)

    @property
    def token_size(self) -> int:
        return self.pre * self.mid * self.inner

    def tensor_shape(self, rows: int, time: int | None = None) -> tuple[int, ...]:
        """The model's tensor shape for ``rows`` hypotheses and ``time`` token states."""
        shape = list(self.variable.shape)
        shape[self.variable.batch_axis] = rows
        if self.variable.time_axis is not None:
            shape[self.variable.time_axis] = time
        return tuple(int(d) for d in shape)

    def rows_and_time(self, shape: tuple[int, ...], what: str) -> tuple[int, int]:
        """``(rows, time)`` of a tensor of this variable, after checking its other dimensions."""
        v = self.variable
        expected = list(v.shape)
        if len(shape) != len(expected):
            raise ValueError(
                f"{what} {v.output_name!r}: expected {len(expected)} dimensions {self._pattern()}, "
                f"got shape {tuple(shape)}"
            )
        for axis, (want, got) in enumerate(zip(expected, shape)):
            if axis in (v.batch_axis, v.time_axis):
                continue
            if want != got:
                raise ValueError(
                    f"{what} {v.output_name!r}: expected shape {self._pattern()}, got {tuple(shape)}"
                )
        rows = int(shape[v.batch_axis])
        time = int(shape[v.time_axis]) if v.time_axis is not None else 1
        return rows, time

    def _pattern(self) -> str:
        v = self.variable
        names = []
        for axis, d in enumerate(v.shape):
            names.append("N" if axis == v.batch_axis else "T" if axis == v.time_axis else str(d))
        return "[" + ", ".join(names) + "]"


def _product(dims) -> int:
    return int(np.prod([int(d) for d in dims], dtype=np.int64)) if dims else 1
