"""Typed options of the state managers (config ``state_manager``), validated when constructed."""

from __future__ import annotations

from dataclasses import dataclass

from gpudecode import defaults
from gpudecode.backend import GpuUnavailableError, require_cupy

DEFAULT_TYPE = defaults.STATE_MANAGER_TYPE
DEFAULT_SLOTS_PER_CHUNK = defaults.SLOTS_PER_CHUNK

# type -> (family, placement); placement "auto" resolves by execution provider (see factory)
STATE_MANAGER_TYPES: dict[str, tuple[str, str]] = {
    "transformer": ("transformer", "auto"),
    "transformer-cpu": ("transformer", "cpu"),
    "transformer-cuda": ("transformer", "cuda"),
    "transformer-16bit": ("transformer", "cpu"),
    "transformer-8bit": ("transformer", "cpu"),
    "lstm": ("lstm", "auto"),
    "lstm-cpu": ("lstm", "cpu"),
    "lstm-cuda": ("lstm", "cuda"),
}
# the state tensors of these types are integers of the model itself (RASR's quantised managers)
INTEGER_STATE_TYPES = {"transformer-16bit": "int16", "transformer-8bit": "int8"}

# "fixed-quantisation": round(x / scale) as int8 or int16; "reduced-precision": float16
STATE_COMPRESSIONS = defaults.STATE_COMPRESSIONS
QUANTISATION_BITS = (8, 16)
# "model" (or None): the model's own dtype
STORAGE_DTYPES = tuple(dict.fromkeys((*defaults.STORAGE_DTYPES, "bfloat16")))


class StateManagerConfigError(ValueError):
    """A state manager option is invalid; the message names the option and the valid choices."""


@dataclass(frozen=True, kw_only=True)
class StateManagerOptions:
    """How decoder states are kept between search steps.

    - ``type``: one of :data:`STATE_MANAGER_TYPES`.
    - ``max_history``: keep only the last L token states (``None``: all); transformer only.
    - ``always_include_first_token_state``: keep the very first token state in front of the last
      L - 1 (RASR); needs ``max_history``.
    - ``slots_per_chunk``: pool growth step, in token states.
    - ``storage_dtype``: dtype of the pool (``None`` or ``"model"``: the model's); ``float16``
      halves the memory, merge converts back to the model's dtype.
    - ``state_compression``: host managers only — how float states are stored between steps:
      ``none``; ``reduced-precision`` (float16); ``fixed-quantisation`` (``round(x / scale)``
      clipped to ``state_compression_bits`` = 8 or 16 bit integers, ``state_compression_scale``
      required). Ignored with one logged warning by GPU managers.
    - ``device_id``: CUDA device of the GPU managers.
    - ``history_alignment``: ``right`` (RASR: padding on the left) or ``left`` (each row's history
      first, for models whose attention reads only each row's own length); set from the model's
      ``HISTORY_ALIGNMENT`` metadata by the scorers.
    - ``cpu_in_place``: host managers only — for a CPU model that writes each new step into its
      past buffer in place (ONNX Runtime's ``GroupQueryAttention``: left-aligned histories), keep
      the merged states between steps (:mod:`gpudecode.states.resident`), so that a step copies
      only the rows a beam reorders instead of gathering every history from the pool (False:
      every step merges from the pool). The results are the same either way.
    - ``dense_recurrent``: ``lstm`` managers — keep the states as dense per-lane arrays fed to the
      model as they are instead of the slot pool (:mod:`gpudecode.states.dense`). None: on CUDA,
      where the model allows it; True: on the host too (numpy arrays); False: never. The results
      are the same either way.
    """

    type: str = DEFAULT_TYPE
    max_history: int | None = None
    always_include_first_token_state: bool = False
    slots_per_chunk: int = DEFAULT_SLOTS_PER_CHUNK
    storage_dtype: str | None = None
    state_compression: str = defaults.STATE_COMPRESSION
    state_compression_bits: int = 8
    state_compression_scale: float | None = None
    device_id: int = 0
    history_alignment: str = "right"
    cpu_in_place: bool = True
    dense_recurrent: bool | None = None

    def __post_init__(self) -> None:
        if self.history_alignment not in ("right", "left"):
            raise StateManagerConfigError(
                f"state_manager.history_alignment: expected 'right' or 'left', got {self.history_alignment!r}")
        if not isinstance(self.cpu_in_place, bool):
            raise StateManagerConfigError(f"state_manager.cpu_in_place: expected true or false, got {self.cpu_in_place!r}")
        if self.type not in STATE_MANAGER_TYPES:
            raise StateManagerConfigError(
                f"state_manager.type: unknown type {self.type!r}; valid: {', '.join(STATE_MANAGER_TYPES)}"
            )
        family, placement = STATE_MANAGER_TYPES[self.type]
        if self.max_history is not None and (
            isinstance(self.max_history, bool) or not isinstance(self.max_history, int) or self.max_history < 0
        ):
            raise StateManagerConfigError(
                f"state_manager.max_history: expected a non-negative integer or None, got {self.max_history!r}"
            )
        if family == "lstm" and self.max_history is not None:
            raise StateManagerConfigError(
                f"state_manager.max_history: {self.type!r} keeps one state per hypothesis; "
                "max_history applies to transformer state managers only"
            )
        if self.always_include_first_token_state and self.max_history is None:
            raise StateManagerConfigError(
                "state_manager.always_include_first_token_state: needs max_history "
                "(without it every token state is kept anyway)"
            )
        if isinstance(self.slots_per_chunk, bool) or not isinstance(self.slots_per_chunk, int) or self.slots_per_chunk <= 0:
            raise StateManagerConfigError(
                f"state_manager.slots_per_chunk: expected a positive integer, got {self.slots_per_chunk!r}"
            )
        if self.storage_dtype == "model":
            object.__setattr__(self, "storage_dtype", None)
        if self.storage_dtype is not None and self.storage_dtype not in STORAGE_DTYPES:
            raise StateManagerConfigError(
                f"state_manager.storage_dtype: unknown dtype {self.storage_dtype!r}; "
                f"valid: None, {', '.join(STORAGE_DTYPES)}"
            )
        if self.state_compression not in STATE_COMPRESSIONS:
            raise StateManagerConfigError(
                f"state_manager.state_compression: unknown compression {self.state_compression!r}; "
                f"valid: {', '.join(STATE_COMPRESSIONS)}"
            )
        if self.state_compression_bits not in QUANTISATION_BITS:
            raise StateManagerConfigError(
                f"state_manager.state_compression_bits: expected 8 or 16, got {self.state_compression_bits!r}"
            )
        if self.state_compression == "fixed-quantisation":
            scale = self.state_compression_scale
            if scale is None or isinstance(scale, bool) or not float(scale) > 0:
                raise StateManagerConfigError(
                    "state_manager.state_compression_scale: fixed-quantisation needs a positive scale "
                    f"(a state x is stored as round(x / scale)), got {scale!r}"
                )
        elif self.state_compression_scale is not None:
            raise StateManagerConfigError(
                "state_manager.state_compression_scale: only used with state_compression "
                f"'fixed-quantisation', not {self.state_compression!r}"
            )
        if self.type in INTEGER_STATE_TYPES and (
            self.storage_dtype is not None or self.state_compression != "none"
        ):
            raise StateManagerConfigError(
                f"state_manager.type: {self.type!r} stores the model's {INTEGER_STATE_TYPES[self.type]} "
                "states as they are; storage_dtype and state_compression do not apply"
            )
        if self.state_compression != "none" and self.storage_dtype is not None and placement != "cuda":
            raise StateManagerConfigError(
                "state_manager: set either storage_dtype or state_compression, not both"
            )
        if placement == "cuda":
            try:
                require_cupy()
            except GpuUnavailableError as error:
                raise GpuUnavailableError(
                    f"state_manager.type: {self.type!r} needs CUDA ({error}). "
                    f"Use {family!r} (picks the GPU when there is one) or '{family}-cpu'."
                ) from error
        if isinstance(self.device_id, bool) or not isinstance(self.device_id, int) or self.device_id < 0:
            raise StateManagerConfigError(
                f"state_manager.device_id: expected a non-negative integer, got {self.device_id!r}"
            )

    @property
    def family(self) -> str:
        """``"transformer"`` or ``"lstm"``."""
        return STATE_MANAGER_TYPES[self.type][0]
