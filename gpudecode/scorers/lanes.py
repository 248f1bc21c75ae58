"""Per-utterance inputs of a step model, kept in lane buffers across the steps of a search.

A model input that belongs to the utterance, not the hypothesis (precomputed cross-attention
keys/values, encoder states, their sizes or mask), is written once at admission into a buffer
with a row per lane, or a row per utterance (``grouped``: the model attends each group of beam
rows to its utterance's row). Buffers keep their addresses while their shape holds, so captured
CUDA graphs stay bound to them; ``version`` changes whenever a buffer is replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gpudecode.backend import to_host
from gpudecode.scorers.base import LaneLayout, UtteranceBatch
from gpudecode.session import ModelSpec, UtteranceInput, hf_encoder_attention_mask
from gpudecode.sizes import next_power_of_two


class LaneInputs:
    """The per-utterance input buffers of one scorer, on the array module ``xp``.

    ``grouped``: one row per utterance (else one per lane); ``group_size`` is then the beam, the
    lanes sharing a row. ``rows``: buffer rows, set by :meth:`resize` (CUDA graphs bind whole
    buckets, so there may be more than lanes).
    """

    def __init__(self, spec: ModelSpec, xp, *, grouped: bool, io_map: Mapping[str, str] | None = None):
        self.spec = spec
        self.xp = xp
        self.grouped = grouped
        self.io_map = dict(io_map or {})
        self.buffers: dict[str, Any] = {}  # input name -> [rows, ...] buffer
        self.rows: int | None = None
        self.version = 0  # changes whenever a buffer is replaced (views of the old ones go stale)
        self.layout: LaneLayout | None = None
        self._filled: dict[str, np.ndarray] = {}  # host: frames written in each row of a buffer

    @property
    def group_size(self) -> int:
        """Lanes per buffer row."""
        return self.layout.beam_size if self.grouped else 1

    def resize(self, layout: LaneLayout, rows: int) -> None:
        """Buffers of ``rows`` rows for ``layout``; they stay (with the addresses captured graphs
        are bound to) when the row count does not change, as admissions overwrite their rows."""
        self.layout = layout
        if rows != self.rows:
            self.buffers = {}
            self.version += 1
        self.rows = rows

    def write_utterances(self, utterances: UtteranceBatch, groups, *, produced=None, sizes=None,
                         source_of: Callable[[UtteranceInput], str] | None = None) -> None:
        """Per-utterance inputs of ``utterances`` -> the rows of ``groups``.

        Each input comes from ``produced`` (e.g. an initializer's outputs, [U, ...]) when it holds
        the input's source (``source_of(input)``, default its metadata source or name), else from
        ``utterances.inputs``. ``encoder_attention_mask`` is built from the sizes when nobody
        brings it; ``encoder-states-size`` always is.
        """
        produced = produced or {}
        source_of = source_of or (lambda u: u.source or u.name)
        xp, spec = self.xp, self.spec
        # the buffer rows of the groups: one per utterance, or each of its lanes
        host_rows = np.asarray(groups, dtype=np.int64) if self.grouped else self.layout.lanes_of(groups)
        rows = xp.asarray(host_rows)
        size_name = self.io_map.get("encoder-states-size", "encoder-states-size")
        sizes_source, mask_input, time_size = None, None, None
        for u in spec.utterance_inputs:
            if u.name == size_name:
                continue
            source = source_of(u)
            if source in produced:
                data = produced[source]
            elif source in utterances.inputs:
                data = utterances.inputs[source]
                sizes_source = source
            elif u.name == "encoder_attention_mask":
                mask_input = u
                continue
            else:
                raise ValueError(
                    f"{spec.source}: per-utterance input '{u.name}' needs '{source}' from the encoder, "
                    f"but the utterances bring {sorted(utterances.inputs)}"
                    + (f" and the initializer {sorted(produced)}" if produced else "")
                )
            data = xp.asarray(data).astype(u.dtype, copy=False)
            if u.time_axis is not None:
                time_size = data.shape[u.time_axis]
            self.write(u.name, data, rows, u.time_axis, host_rows)
        if sizes is None:
            sizes = utterances.size_of(sizes_source) if sizes_source else utterances.input_lengths
        if not spec.masked_frames and time_size is not None and (np.asarray(to_host(sizes)) != time_size).any():
            raise ValueError(f"{spec.source}: utterances of {sorted(set(np.asarray(to_host(sizes)).tolist()))} "
                             f"frames padded to {time_size}: the model cannot mask padded frames (no "
                             "encoder-states-size or encoder_attention_mask input)")
        if mask_input is not None:
            if time_size is None:
                raise ValueError(f"{spec.source}: 'encoder_attention_mask' has no encoder input to "
                                 "take its length from")
            valid = hf_encoder_attention_mask(xp.asarray(sizes), time_size)
            self.write(mask_input.name, valid.astype(mask_input.dtype), rows, mask_input.time_axis, host_rows)
        size_input = next((u for u in spec.utterance_inputs if u.name == size_name), None)
        if size_input is not None:
            self.write(size_name, xp.asarray(sizes).astype(size_input.dtype), rows, None, host_rows)

    def write(self, name: str, data, targets, time_axis: int | None, host_targets: np.ndarray) -> None:
        """buffer[targets] = each utterance's data, repeated beam times for per-lane buffers
        (``targets``: the lanes, or the groups when grouped; ``host_targets`` the same on the
        host); buffers grow by rounding up."""
        xp, beam = self.xp, self.layout.beam_size
        rows = data if self.grouped else xp.repeat(data, beam, axis=0)
        buffer = self.buffers.get(name)
        shape = list(rows.shape)
        shape[0] = self.rows
        if time_axis is not None and not self.spec.masked_frames:
            # nothing masks padded frames (a fixed-length encoder): every utterance's frames exactly
            if buffer is not None and buffer.shape[time_axis] != rows.shape[time_axis]:
                raise ValueError(f"{self.spec.source}: per-utterance input '{name}' has {rows.shape[time_axis]} "
                                 f"frames, earlier utterances {buffer.shape[time_axis]}; the model cannot mask "
                                 "padded frames, so every utterance needs the same number")
            shape[time_axis] = rows.shape[time_axis]
        elif time_axis is not None:
            shape[time_axis] = next_power_of_two(rows.shape[time_axis])
            if buffer is not None:
                shape[time_axis] = max(shape[time_axis], buffer.shape[time_axis])
        if buffer is None or tuple(buffer.shape) != tuple(shape):
            grown = xp.zeros(shape, dtype=rows.dtype)
            if buffer is not None:
                grown[tuple(slice(0, d) for d in buffer.shape)] = buffer
            else:
                self._filled[name] = np.zeros(shape[0], dtype=np.int64)
            buffer = grown
            self.buffers[name] = buffer
            self.version += 1  # views of the buffers taken before go stale
        if time_axis is not None:
            filled, length = self._filled[name], rows.shape[time_axis]  # host: frames written per row
            stale = filled[host_targets] > length  # old utterances' frames beyond the new ones' lengths
            if stale.any():
                buffer[xp.asarray(host_targets[stale])] = 0
            filled[host_targets] = length
            index = [targets] + [slice(None)] * (rows.ndim - 1)
            index[time_axis] = slice(0, rows.shape[time_axis])
            buffer[tuple(index)] = rows
        else:
            buffer[targets] = rows
