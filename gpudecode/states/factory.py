"""``create_state_manager``: options + state variables + execution provider -> a state manager."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from gpudecode.backend import gpu_available
from gpudecode.spec import StateVariable
from gpudecode.states.managers import StateManager
from gpudecode.states.options import STATE_MANAGER_TYPES, StateManagerConfigError, StateManagerOptions

logger = logging.getLogger(__name__)

# Both tables follow from STATE_MANAGER_TYPES (type -> family, placement) and the manager class
# of each family (StateManager.by_family): a new state layout adds its types there and its class.
#: concrete type -> (class, device)
STATE_MANAGER_REGISTRY: dict[str, tuple[type[StateManager], str]] = {
    name: (StateManager.by_family[family], placement)
    for name, (family, placement) in STATE_MANAGER_TYPES.items() if placement != "auto"
}
#: automatic type -> (host type, GPU type): ``<type>-cpu`` and ``<type>-cuda``
AUTOMATIC_TYPES: dict[str, tuple[str, str]] = {
    name: (f"{name}-cpu", f"{name}-cuda")
    for name, (_, placement) in STATE_MANAGER_TYPES.items() if placement == "auto"
}
EXECUTION_PROVIDERS = ("cpu", "cuda")


def resolve_type(state_manager_type: str, execution_provider: str) -> str:
    """The concrete type: ``transformer``/``lstm`` pick ``-cuda`` when the session runs on the CUDA
    execution provider and CuPy sees a GPU, else ``-cpu``; other types stay as they are."""
    if execution_provider not in EXECUTION_PROVIDERS:
        raise ValueError(
            f"execution_provider: unknown provider {execution_provider!r}; valid: {', '.join(EXECUTION_PROVIDERS)}"
        )
    if state_manager_type in AUTOMATIC_TYPES:
        host, gpu = AUTOMATIC_TYPES[state_manager_type]
        return gpu if execution_provider == "cuda" and gpu_available() else host
    if state_manager_type not in STATE_MANAGER_REGISTRY:
        raise StateManagerConfigError(
            f"state_manager.type: unknown type {state_manager_type!r}; valid: {', '.join(STATE_MANAGER_TYPES)}"
        )
    return state_manager_type


def create_state_manager(
    options: StateManagerOptions,
    state_variables: Sequence[StateVariable],
    *,
    execution_provider: str,
) -> StateManager:
    """A state manager for ``state_variables`` of a model run on ``execution_provider``."""
    concrete = resolve_type(options.type, execution_provider)
    cls, device = STATE_MANAGER_REGISTRY[concrete]
    if device == "cuda" and options.state_compression != "none":
        logger.warning(
            "state_manager.state_compression=%r is ignored by %r: GPU state managers keep states "
            "uncompressed (use storage_dtype: float16 to halve their memory)",
            options.state_compression,
            concrete,
        )
    changes = {"type": concrete}
    if device == "cuda":
        changes.update(state_compression="none", state_compression_scale=None)
    return cls(dataclasses.replace(options, **changes), state_variables, device=device)
