"""The host's waits for the GPU (backend.wait_for), with stand-ins for CuPy events."""

import time

import pytest

from gpudecode import backend
from gpudecode.backend import HostClock, HostWait


class FakeEvent:
    """Done after ``polls`` queries of ``done``; counts synchronize() calls."""

    def __init__(self, polls: int):
        self.polls, self.queries, self.synchronized = polls, 0, 0

    @property
    def done(self) -> bool:
        self.queries += 1
        return self.queries > self.polls

    def synchronize(self) -> None:
        self.synchronized += 1


@pytest.fixture
def waits():
    """The accounting of the waits a test makes."""
    return HostClock()


def test_blocking_wait_sleeps_in_the_driver(waits):
    event = FakeEvent(polls=5)
    backend.wait_for(event, HostWait("block"), waits)
    assert (event.synchronized, event.queries) == (1, 0)
    assert waits.count == 1


def test_spinning_wait_polls_until_done(waits):
    event = FakeEvent(polls=5)
    backend.wait_for(event, HostWait("spin"), waits)
    assert (event.synchronized, event.queries) == (0, 6)


def test_napping_wait_polls_between_sleeps(monkeypatch):
    naps = []
    monkeypatch.setattr(time, "sleep", naps.append)
    default = backend.DEFAULT_HOST_WAIT
    assert (default.mode, default.nap_s) == ("nap", backend.NAP_S) and backend.NAP_S > 0  # the default
    event = FakeEvent(polls=3)
    backend.wait_for(event, HostWait("nap", nap_s=2e-4, max_nap_s=2e-4))  # every nap the same
    assert (event.synchronized, event.queries, naps) == (0, 4, [2e-4] * 3)
    assert HostWait("block").mode == "block"
    with pytest.raises(ValueError, match="host_wait"):
        HostWait("doze")
    with pytest.raises(ValueError, match="nap_s <= max_nap_s"):
        HostWait("nap", nap_s=2e-3, max_nap_s=1e-3)


def test_napping_wait_doubles_its_naps_up_to_the_longest(monkeypatch):
    """A long wait wakes the host a few times: naps of nap_s, 2·nap_s, … up to max_nap_s."""
    naps = []
    monkeypatch.setattr(time, "sleep", naps.append)
    assert backend.MAX_NAP_S > backend.NAP_S and backend.DEFAULT_HOST_WAIT.max_nap_s == backend.MAX_NAP_S  # the default
    wait = HostWait("nap", nap_s=1e-4, max_nap_s=5e-4)
    backend.wait_for(FakeEvent(polls=6), wait)
    assert naps == pytest.approx([1e-4, 2e-4, 4e-4, 5e-4, 5e-4, 5e-4])
    naps.clear()
    backend.wait_for(FakeEvent(polls=2), wait)  # every wait starts again with the shortest nap
    assert naps == pytest.approx([1e-4, 2e-4])


def test_waits_are_accounted_and_reset(waits):
    for _ in range(3):
        backend.wait_for(FakeEvent(polls=20_000), HostWait("spin"), waits)
    assert waits.count == 3
    assert waits.wall_s > 0 and waits.cpu_s > 0
    waits.reset()
    assert (waits.count, waits.cpu_s, waits.wall_s) == (0, 0.0, 0.0)
