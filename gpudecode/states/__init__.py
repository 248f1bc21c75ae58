"""Decoder states between search steps: the state pool and the state managers."""

from gpudecode.states.factory import (
    AUTOMATIC_TYPES,
    STATE_MANAGER_REGISTRY,
    create_state_manager,
    resolve_type,
)
from gpudecode.states.history import StateHistory, empty_histories, extend_histories, select_histories
from gpudecode.states.managers import LstmStateManager, MergedStates, StateManager, TransformerStateManager
from gpudecode.states.options import STATE_MANAGER_TYPES, StateManagerConfigError, StateManagerOptions
from gpudecode.states.pool import PoolStatistics, StatePool

__all__ = [
    "AUTOMATIC_TYPES",
    "LstmStateManager",
    "MergedStates",
    "PoolStatistics",
    "STATE_MANAGER_REGISTRY",
    "STATE_MANAGER_TYPES",
    "StateHistory",
    "StateManager",
    "StateManagerConfigError",
    "StateManagerOptions",
    "StatePool",
    "TransformerStateManager",
    "create_state_manager",
    "empty_histories",
    "extend_histories",
    "resolve_type",
    "select_histories",
]
