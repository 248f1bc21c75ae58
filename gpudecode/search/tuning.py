"""How the searches run (not what they find): stop-test reads, fused kernels, host waits.

One frozen :class:`SearchTuning` is passed to every search (``tuning=``; from the config's
``search.tuning`` section or the Python API). Every setting changes speed only: the n-best lists
are the same whichever way it is set (the tests check each against the other).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gpudecode import defaults
from gpudecode.backend import HostWait


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchTuning:
    """Settings that trade host work against GPU work.

    - ``lagged_stop_test``: the label-synchronous search reads its stop test ``stop_test_lag``
      steps late (None: on CuPy only). The host then queues steps k + 1 .. k + lag before it
      waits for step k's flag, so the GPU never drains between steps, even while the host wakes
      up; the price is up to ``stop_test_lag`` more steps after the last lane ends, which change
      nothing (ended lanes only carry themselves);
    - ``stop_test_every``: with lagged reads, the stop flag is posted every this many steps:
      between two waits the host queues that many steps back to back, so a host that naps
      through long GPU steps wakes once per ``stop_test_every`` steps. Up to
      lag · every + every - 1 steps may follow the one where the last lane ended;
    - ``lagged_continuous_mask``: continuous batching reads its finished-groups mask one step
      late (None: on CuPy only); a finished group then carries itself one more step;
    - ``fused_label_step``, ``fused_ctc_frames``, ``fused_transducer_step``: on CuPy, run the
      label-synchronous step's selection, the CTC prefix search's frames (without scorers all in
      one launch, with scorers a launch per frame) and the transducer step's selection as fused
      kernels (off: the array versions);
    - ``captured_ctc_frames``: on CuPy, a CTC prefix search whose scorers are all capturable
      (``LabelScorer.capturable``: a recurrent LM with dense states and CUDA graphs) replays its
      scored frames, after the first two, as two alternating CUDA graphs of the whole frame — the
      scorers' steps, the cache and the frame kernel (``gpudecode.search.frame_graphs``) — one
      launch per frame instead of a dozen host calls (off: launched as they come);
    - ``ctc_prefilter``: the fused CTC kernel lists each frame's best labels first instead of
      scanning every label (off: the full scan);
    - ``host_wait``: how the host waits for the GPU (:class:`gpudecode.backend.HostWait`);
    - ``compiled_cpu_loops``: on numpy, run the CTC prefix search's frames (without scorers all in
      one call, with scorers a call per frame), the transducer search's selection and the
      label-synchronous step's selection as compiled loops (numba, the ``cpu-jit`` extra: ``gpudecode.search.ctc_cpu``,
      ``gpudecode.search.transducer_cpu``, ``gpudecode.search.label_sync_cpu``) where numba
      imports (off, or without numba: the array versions);
    - ``cpu_threads``: the compiled CTC loop's threads (numba's), utterances spread over them
      (1: the calling thread alone).
    """

    lagged_stop_test: bool | None = None
    stop_test_lag: int = defaults.STOP_TEST_LAG
    stop_test_every: int = defaults.STOP_TEST_EVERY
    lagged_continuous_mask: bool | None = None
    fused_label_step: bool = True
    fused_ctc_frames: bool = True
    captured_ctc_frames: bool = True
    ctc_prefilter: bool = True
    fused_transducer_step: bool = True
    host_wait: HostWait = HostWait()
    compiled_cpu_loops: bool = True
    cpu_threads: int = defaults.CPU_THREADS

    def __post_init__(self) -> None:
        for name in ("stop_test_lag", "stop_test_every", "cpu_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SearchTuning.{name}: expected an int >= 1, got {value!r}")
        for name in ("lagged_stop_test", "lagged_continuous_mask"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"SearchTuning.{name}: expected None, True or False, got {getattr(self, name)!r}")
        if not isinstance(self.host_wait, HostWait):
            raise ValueError(f"SearchTuning.host_wait: expected a HostWait, got {self.host_wait!r}")

    def lagged(self, setting: bool | None, xp) -> bool:
        """``setting`` (``lagged_stop_test`` or ``lagged_continuous_mask``), None meaning "on CuPy"."""
        return setting if setting is not None else xp is not np


#: The settings the searches use when given none.
DEFAULT_TUNING = SearchTuning()
