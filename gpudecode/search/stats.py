"""What a search reports about its own run: host time of its loops and waits, its transfers.

Pass a :class:`SearchStats` to a search (``stats=``) to have it filled; the searches keep no
accounting of their own (without one they measure nothing). Benchmarks read it; tests read its
counters and may set its observers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gpudecode.backend import HostClock, to_host_all


@dataclasses.dataclass(eq=False)
class SearchStats:
    """Counters and clocks a search adds to (they are never reset by the search).

    - ``step_loop``: host time of the label-synchronous step loops without continuous batching
      (``count``: steps), apart from admission before and the n-best lists after;
    - ``refills``: host time of continuous batching's refills (finalise, release, admit, reset;
      ``count``: refills);
    - ``host_waits``: host time spent waiting for the GPU in the search's reads (``count``: waits);
    - ``transfers``: device→host reads of the search (each one synchronisation);
    - ``fused_launches``: runs of the fused CTC search kernel and of the fused transducer
      selection (one per search or symbol step);
    - ``replayed_frames``: scored CTC frames run as a launch of a captured CUDA graph
      (``SearchTuning.captured_ctc_frames``);
    - ``on_transfer``: called with the arrays of every such read, before it;
    - ``on_top_k``: called with (keys, k) of every top-k the search's array code runs.
    """

    step_loop: HostClock = dataclasses.field(default_factory=HostClock)
    refills: HostClock = dataclasses.field(default_factory=HostClock)
    host_waits: HostClock = dataclasses.field(default_factory=HostClock)
    transfers: int = 0
    fused_launches: int = 0
    replayed_frames: int = 0
    on_transfer: Callable[[tuple], None] | None = None
    on_top_k: Callable[[object, int], None] | None = None

    def reset(self) -> None:
        """Zeroes the clocks and counters (the observers stay)."""
        for clock in (self.step_loop, self.refills, self.host_waits):
            clock.reset()
        self.transfers = self.fused_launches = self.replayed_frames = 0


def read_back(tuning, stats: SearchStats | None, *arrays) -> tuple:
    """Every device→host read of a search: :func:`gpudecode.backend.to_host_all` of ``arrays``
    (one synchronisation, waiting as ``tuning.host_wait`` says), counted in ``stats``."""
    if stats is None:
        return to_host_all(*arrays, wait=tuning.host_wait)
    stats.transfers += 1
    if stats.on_transfer is not None:
        stats.on_transfer(arrays)
    return to_host_all(*arrays, wait=tuning.host_wait, clock=stats.host_waits)


def observed_top_k(stats: SearchStats | None, keys, k: int) -> None:
    """Tells ``stats.on_top_k`` of a top-k (nothing without stats or observer)."""
    if stats is not None and stats.on_top_k is not None:
        stats.on_top_k(keys, k)
