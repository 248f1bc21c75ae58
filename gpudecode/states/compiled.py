"""Whether the host state managers run their per-step bookkeeping compiled (numba, the ``cpu-jit``
extra): the resident merge's matching and row copies (:mod:`gpudecode.states.resident`), the
histories' extension (:func:`gpudecode.states.history.extend_histories`), the pool's allocation,
mark and sweep (:class:`gpudecode.states.pool.StatePool`) and the split's copies into the pool
(:class:`gpudecode.states.host.HostStateCopy`), each a loop over rows in
:mod:`gpudecode.states.host_jit` doing what the numpy version does (which stays the oracle: the
tests compare them). Without numba, or with ``StateManager.compiled`` False, the numpy versions run.
"""

from __future__ import annotations

import functools

import numpy as np

from gpudecode.backend import numba_available


def available() -> bool:
    """Whether numba is installed (:func:`gpudecode.backend.numba_available`: found, not imported,
    so a manager that never steps on the host never imports it)."""
    return numba_available()


#: the state dtypes the compiled copies take (numba has no float16 or bfloat16 arrays)
COPIED_DTYPES = frozenset(map(np.dtype, (np.float32, np.float64, np.int8, np.int16, np.int32, np.int64)))


def copies(dtype) -> bool:
    """Whether the compiled loops copy states of ``dtype`` (else the numpy versions do)."""
    return np.dtype(dtype) in COPIED_DTYPES


@functools.cache
def compiled_loops():
    """The compiled loops' module, :mod:`gpudecode.states.host_jit` (numba is imported by the first
    call; later calls cost less than an import statement, once or more a step)."""
    from gpudecode.states import host_jit

    return host_jit
