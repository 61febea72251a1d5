"""`load_threads: auto`: adapt the number of active receive threads online.

Why: the best thread count depends on where a load's time goes. When preparation and master
round trips dominate (small jobs, a slow master, an RDMA data path), more threads overlap them
and throughput scales; when the data path itself is CPU-bound (TCP on a small host), extra
threads only contend and throughput drops. Measured on one 2-core host: 4 threads are 3.5x one
thread at a 5 ms master RTT, and 0.75x at no delay (docs/benchmark.md). No fixed value is right
for both.

How: hill climbing on load throughput, measured only in saturated windows (jobs queued and
the active threads busy nearly all the time: the pool's capacity at that count; windows with
idle gaps are skipped), so only while the pool is the bottleneck. The tuner
is a subscriber of the worker's load events: each receive thread adds its job's bytes, queue
wait and service time to its own slot (no lock on the data path); a tuner thread reads the
sums every `window_s`.
A probe moves the active count, skips one window for the transition, measures
`MEASURE_WINDOWS`, and keeps the move if throughput rose by `UP_GAIN` (more threads) or fell
by less than `DOWN_LOSS` (fewer threads). A kept move is followed at once by a twice larger
one in the same direction (so 2 -> 8 threads takes three probes); a failed one is reverted,
the step drops back to one thread and the next probe waits twice as long (exponential
back-off, so a well-placed setting is rarely disturbed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from connector.events import LoadEvent, LookupEvent, SaveEvent

logger = logging.getLogger(f"vllm.{__name__}")

WINDOW_S = 0.5
MIN_JOBS = 6  # a window with fewer finished jobs says nothing
SATURATED = 0.8  # busy share of the active threads' time for a window to be compared
BACKLOG = 0.25  # mean queue wait above this share of mean service time = jobs are waiting
UP_GAIN = 1.05
DOWN_LOSS = 0.95
MEASURE_WINDOWS = 2
MAX_HOLD = 32  # windows between probes after repeated reverts


@dataclass
class Window:
    jobs: int
    nbytes: int
    wait_s: float
    service_s: float  # summed over the jobs: thread-seconds spent on them
    threads: int  # active threads during the window
    seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def backlogged(self) -> bool:
        return self.jobs >= MIN_JOBS and self.wait_s > BACKLOG * self.service_s

    @property
    def saturated(self) -> bool:
        """Jobs queued and every active thread busy nearly all the window: its throughput is
        the pool's capacity at this thread count. Partly idle windows (bursty load) would
        make any setting look slower, so they are not compared."""
        return self.backlogged and self.service_s >= SATURATED * self.threads * self.seconds


class HillClimber:
    """The decision logic, fed one window at a time (pure: no threads, no clock)."""

    def __init__(self, start: int, maximum: int) -> None:
        self.active = max(1, min(start, maximum))
        self.maximum = maximum
        self._baseline: list[float] = []  # throughput samples at the current setting
        self._probe: tuple[int, int] | None = None  # (previous setting, windows seen)
        self._probe_samples: list[float] = []
        self._hold = 1  # windows to wait before the next probe
        self._since_change = 0
        self._direction = 1
        self._step = 1

    def step(self, w: Window) -> int:
        """Account one window; returns the active thread count to use next."""
        if not w.saturated:
            return self.active
        if self._probe is not None:
            return self._judge_probe(w)
        self._baseline = (self._baseline + [w.gbps])[-MEASURE_WINDOWS:]
        self._since_change += 1
        if self._since_change >= self._hold \
                and len(self._baseline) >= MEASURE_WINDOWS:
            target = self._clamp(self.active + self._direction * self._step)
            if target == self.active:  # at a bound: look the other way
                self._direction, self._step = -self._direction, 1
                target = self._clamp(self.active + self._direction)
            if target != self.active:
                self._probe, self._probe_samples = (self.active, 0), []
                self.active = target
        return self.active

    def _judge_probe(self, w: Window) -> int:
        previous, seen = self._probe
        seen += 1
        self._probe = (previous, seen)
        if seen == 1:  # transition window: threads spinning up or draining
            return self.active
        self._probe_samples.append(w.gbps)
        if len(self._probe_samples) < MEASURE_WINDOWS:
            return self.active
        before = sum(self._baseline) / len(self._baseline)
        after = sum(self._probe_samples) / len(self._probe_samples)
        more = self.active > previous
        keep = after >= before * (UP_GAIN if more else DOWN_LOSS)
        self._probe = None
        self._since_change = 0
        if keep:
            self._baseline = self._probe_samples
            self._hold = 1  # keep going, faster, in the direction that paid
            self._step *= 2
        else:
            self.active = previous
            self._direction = -self._direction  # try the other side next time
            self._step = 1
            self._hold = min(MAX_HOLD, self._hold * 2)
        return self.active

    def _clamp(self, n: int) -> int:
        return max(1, min(self.maximum, n))


class ThreadTuner:
    """Subscriber + tuner thread that applies `HillClimber` to a receive pool."""

    def __init__(self, threads: int, set_active: Callable[[int], None],
                 start: int = 2, window_s: float = WINDOW_S) -> None:
        self._climber = HillClimber(start, threads)
        self._set_active = set_active
        self._window_s = window_s
        # Per receive thread: [jobs, bytes, queue wait s, service s], written by that thread only.
        self._slots = [[0, 0, 0.0, 0.0] for _ in range(threads)]
        self._last = [0, 0, 0.0, 0.0]
        set_active(self._climber.active)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcpool-autotune", daemon=True)
        self._thread.start()

    def on_load(self, ev: LoadEvent) -> None:
        s = self._slots[ev.thread]
        s[0] += 1
        s[1] += ev.nbytes
        s[2] += ev.t_start - ev.t_enqueue
        s[3] += ev.t_end - ev.t_start

    def on_save(self, ev: SaveEvent) -> None:
        pass

    def on_lookup(self, ev: LookupEvent) -> None:
        pass

    def _totals(self) -> list[float]:
        return [sum(s[i] for s in self._slots) for i in range(4)]

    def _run(self) -> None:
        while not self._stop.wait(self._window_s):
            now = self._totals()
            d = [a - b for a, b in zip(now, self._last, strict=True)]
            self._last = now
            before = self._climber.active
            after = self._climber.step(Window(int(d[0]), int(d[1]), d[2], d[3], before,
                                              self._window_s))
            if after != before:
                self._set_active(after)
                logger.debug("auto load threads: %d -> %d", before, after)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
