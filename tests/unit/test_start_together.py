"""`devkit.vllm_server.start_together`: the engines a test needs at once start at the same time,
and a failed start leaves no engine running."""

from __future__ import annotations

import threading

import pytest

from devkit.vllm_server import start_together


class FakeServer:
    """What start_together uses of a VllmServer: `start(timeout)` and `stop()`."""

    def __init__(self, barrier: threading.Barrier | None = None, fails: bool = False) -> None:
        self.barrier, self.fails = barrier, fails
        self.started = self.stopped = False

    def start(self, timeout: float) -> FakeServer:
        if self.barrier is not None:
            self.barrier.wait(timeout=10)  # BrokenBarrierError unless the others start too
        if self.fails:
            raise RuntimeError("vllm serve exited")
        self.started = True
        return self

    def stop(self) -> None:
        self.stopped = True


def test_the_starts_overlap():
    barrier = threading.Barrier(3)  # each start returns only once all three are starting
    servers = [FakeServer(barrier) for _ in range(3)]
    assert start_together(servers) == servers
    assert all(s.started and not s.stopped for s in servers)


def test_a_failed_start_stops_the_others_and_is_raised():
    barrier = threading.Barrier(3)
    servers = [FakeServer(barrier), FakeServer(barrier, fails=True), FakeServer(barrier)]
    with pytest.raises(RuntimeError, match="vllm serve exited"):
        start_together(servers)
    assert all(s.stopped for s in servers)
