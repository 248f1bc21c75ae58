"""The container for a reference model and helpers shared by the builders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True, kw_only=True)
class ReferenceModel:
    """A small ONNX model and a plain-numpy forward (``oracle``) that computes the same outputs.

    ``oracle(feeds)`` takes the feeds the ONNX model takes and returns every graph output by name.
    ``states`` maps each state input to its output (``past-key-0`` -> ``present-key-0``);
    ``time_axis`` is the time axis of the transformer state inputs (``None`` for LSTM states).
    """

    model: onnx.ModelProto
    oracle: Callable[[Feeds], Feeds]
    dtype: np.dtype = np.dtype(np.float32)
    vocab_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    head_dim: int = 0
    states: dict[str, str] = field(default_factory=dict)
    time_axis: int | None = None
    sequence_oracle: Callable[[list[int], Feeds | None], np.ndarray] | None = None

    def sequence_log_probs(self, tokens: list[int], encoder_inputs: Feeds | None = None) -> np.ndarray:
        """Teacher-forced log-probabilities [len(tokens), V] of one unpadded label sequence.

        Row p is what the step model outputs as ``scores`` when it is fed ``tokens[p]`` at position
        p with the states of ``tokens[:p]`` (so ``tokens`` usually starts with sentence-begin).
        ``encoder_inputs`` holds the step model's per-utterance inputs for ONE utterance, with a
        batch axis of 1, e.g. ``{k: v[u : u + 1]}`` sliced from the encoder's outputs; positions at
        or beyond ``encoder-states-size`` are cut off, not masked. Computed in float32.
        """
        if self.sequence_oracle is None:
            raise ValueError("this reference model has no sequence oracle (it is not a step model)")
        return self.sequence_oracle(list(tokens), encoder_inputs)

    def serialized(self) -> bytes:
        """The model as bytes (``onnxruntime.InferenceSession`` accepts them directly)."""
        return self.model.SerializeToString()

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(self.serialized())
        return path

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.model.graph.input]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.model.graph.output]


def hf_attention_inputs(prefix_length: np.ndarray, past_time: int) -> tuple[np.ndarray, np.ndarray]:
    """Hugging Face step inputs for right-aligned (left-padded) histories.

    prefix_length [N] (valid past positions per row, the last ones of ``past_time``) ->
    (attention_mask [N, past_time + 1] int64, 1 = attend, the new token last; position_ids [N, 1]
    int64 = prefix_length).
    """
    prefix_length = np.asarray(prefix_length, dtype=np.int64)
    if prefix_length.ndim != 1:
        raise ValueError(f"prefix_length: expected shape [N], got {prefix_length.shape}")
    if np.any(prefix_length < 0) or np.any(prefix_length > past_time):
        raise ValueError(f"prefix_length: expected values in [0, {past_time}], got {prefix_length}")
    positions = np.arange(past_time + 1, dtype=np.int64)
    attention_mask = (positions[None, :] >= past_time - prefix_length[:, None]).astype(np.int64)
    return attention_mask, prefix_length[:, None].copy()
