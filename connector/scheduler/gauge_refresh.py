"""Stepping an idle engine while its workers' gauges still move, so /metrics follows them.

A worker's gauges (threads stuck in a store call, jobs queued or in flight, preload rows held)
and its master outage time reach /metrics only in an engine step's output, and an idle engine
takes no step: a store node that froze under the last request and recovered after it left
`threads_stuck` at 1 on /metrics (a critical alert firing on a healthy engine) until the next
request, and a hang that began while idle never showed. Each worker says in its report whether
it is settled (`MooncakeStoreWorker.settled`: nothing queued or running in any pool, no preload
rows held, the master answering); while a rank is not, this asks vLLM for a step whenever
`GAUGE_RESEND_S` passed without one (`has_pending_push_work`, and a wake of the engine loop:
`engine_wakeup`). The step schedules nothing; the workers' outputs carry their gauges and a
fresh report. Once every rank reported settled, an idle engine stays idle.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from connector.observability.stats import GAUGE_RESEND_S


class GaugeRefresh:
    def __init__(self, wake: Callable[[], None], period_s: float = GAUGE_RESEND_S) -> None:
        self._wake, self._period = wake, period_s
        self._unsettled: set[int] = set()  # TP ranks whose last report said not settled
        self._last_step = time.monotonic()
        self.due = False  # a step is wanted (has_pending_push_work)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcpool-gauges", daemon=True)
        self._thread.start()

    def report(self, unsettled: dict[int, bool]) -> None:
        """Ranks' states from a step's worker report (those whose state changed)."""
        for rank, busy in unsettled.items():
            if busy:
                self._unsettled.add(rank)
            else:
                self._unsettled.discard(rank)

    def stepped(self) -> None:
        """A step is being scheduled: its outputs carry the workers' gauges."""
        self.due = False
        self._last_step = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self._period / 2):
            if self._unsettled and time.monotonic() - self._last_step >= self._period:
                self.due = True
                self._wake()

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
