"""An idle engine is stepped while a worker's gauges still move, and left idle once every rank
reported settled (connector.scheduler.gauge_refresh)."""

from __future__ import annotations

import threading
import time

from connector.metadata import WorkerReport
from connector.scheduler.gauge_refresh import GaugeRefresh

PERIOD = 0.05


def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_steps_are_asked_for_while_a_rank_is_unsettled_and_not_after():
    wakes = threading.Semaphore(0)
    g = GaugeRefresh(wakes.release, PERIOD)
    try:
        time.sleep(3 * PERIOD)
        assert not g.due and not wakes.acquire(blocking=False), "asked with every rank settled"
        g.report({0: False, 1: True})  # rank 1: a store call still running
        assert wakes.acquire(timeout=5) and g.due
        g.stepped()  # vLLM stepped: its outputs carried the gauges
        assert not g.due
        assert wakes.acquire(timeout=5) and g.due  # still unsettled: again a period later
        g.report({1: False})
        g.stepped()
        time.sleep(PERIOD)  # a tick that checked before the report may still wake once
        while wakes.acquire(blocking=False):
            pass
        g.stepped()
        time.sleep(5 * PERIOD)
        assert not g.due and not wakes.acquire(blocking=False), "asked once every rank settled"
    finally:
        g.shutdown()


def test_ranks_reports_merge_across_tp():
    """vLLM aggregates the ranks' worker metadata: each rank's state reaches the scheduler."""
    merged = WorkerReport({}, None, {}, {0: True}).aggregate(WorkerReport({}, None, {}, {1: False}))
    assert merged.unsettled == {0: True, 1: False}
