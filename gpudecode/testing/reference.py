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
    ``hidden_dim`` is the model width (transformer model_dim, encoder E, LSTM hidden size).
    """

    model: onnx.ModelProto
    oracle: Callable[[Feeds], Feeds]
    dtype: np.dtype = np.dtype(np.float32)
    vocab_size: int = 0
    hidden_dim: int = 0
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
