"""`load_threads: auto`: adapt the number of active receive threads online.

Why: the best thread count depends on where a load's time goes. When preparation and master
round trips dominate (small jobs, a slow master, an RDMA data path), more threads overlap them
and throughput scales; when the data path itself is CPU-bound (TCP on a small host), extra
threads only contend and throughput drops. On a 2-core host 4 threads load several times
faster than one at a 5 ms master RTT and slower than one with no delay (the figures:
docs/benchmark.md, rendered from docs/benchmark.json). No fixed value is right for both.

How: hill climbing on load throughput, measured only in saturated windows (jobs queued and
the active threads busy nearly all the time: the pool's capacity at that count; windows with
idle gaps are skipped), so only while the pool is the bottleneck. The tuner is a subscriber of
the worker's load events: each receive thread adds its job's bytes, queue wait and service
time to its own slot (under an uncontended lock: the watchdog adds a job of that thread that
expired); a tuner thread reads the sums every `window_s`.

It starts at one thread (vLLM's default). A probe moves the active count, skips one window
for the transition (as after the start and after a revert), and compares the median of
`MEASURE_WINDOWS` windows with the median of as many windows just before (medians: one
disturbed window on a shared host must not decide).
A thread has to pay: more threads are kept only for `UP_GAIN` more throughput; fewer are kept
when throughput did not fall. Steps double while moves pay (1 -> 2 -> 4 -> 8 threads in three
probes). A failed probe is reverted (after a single window if the loss is clear), and the wait
before the next one doubles (exponential back-off up to `MAX_HOLD` windows, so a well-placed
setting is rarely disturbed and a changed workload is still noticed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median

from connector.observability.events import LoadEvent, Subscriber

logger = logging.getLogger(f"vllm.{__name__}")

WINDOW_S = 0.5
MIN_JOBS = 6  # a window with fewer finished jobs says nothing
SATURATED = 0.9  # busy share of the active threads' time for a window to be compared
BACKLOG = 0.25  # mean queue wait above this share of mean service time = jobs are waiting
UP_GAIN = 1.05  # more threads must raise throughput this much to stay
DOWN_KEEP = 1.0  # fewer threads stay if throughput is at least this share of before
MEASURE_WINDOWS = 3
CLEAR_LOSS = 0.85  # a probe window this far below the baseline reverts the probe at once
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
    """The decision logic, fed one window at a time (pure: no threads, no clock).

    A probe ends in one of three ways:
    - paid (throughput up by `UP_GAIN`, either direction): keep it and probe again at once,
      twice as far the same way, unless that way is blocked by a bound;
    - tie (fewer threads, throughput not lower, `DOWN_KEEP`): keep the cheaper setting, but
      treat it as a plateau: step back to one thread and wait twice as long;
    - lost: revert, look the other way next time, wait twice as long.
    Only a move that paid and can go on resets the wait. Near a plateau's edge (7 and 8
    threads within noise of each other) probes would otherwise keep flipping between the
    two and each flip restart probing at full speed.
    """

    def __init__(self, start: int, maximum: int) -> None:
        self.active = max(1, min(start, maximum))
        self.maximum = maximum
        self._baseline: list[float] = []  # throughput samples at the current setting
        self._probe: int | None = None  # the setting before the probe under way
        self._probe_samples: list[float] = []
        self._skip = 1  # windows to ignore after a change (the start included): threads
        # spinning up or draining, connections opening
        self._hold = 1  # windows to wait before the next probe
        self._since_change = 0
        self._direction = 1
        self._step = 1

    def step(self, w: Window) -> int:
        """Account one window; returns the active thread count to use next."""
        if not w.saturated:
            return self.active
        if self._skip:
            self._skip -= 1
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
                self._probe, self._probe_samples = self.active, []
                self.active, self._skip = target, 1
        return self.active

    def _judge_probe(self, w: Window) -> int:
        previous = self._probe
        self._probe_samples.append(w.gbps)
        gain = _ratio(median(self._probe_samples), median(self._baseline))
        # A clear loss (below CLEAR_LOSS, so judged lost below) ends the probe at once:
        # reverting is the safe side, so one window may decide it, and probing a worse
        # setting costs two windows instead of four.
        if len(self._probe_samples) < MEASURE_WINDOWS and gain >= CLEAR_LOSS:
            return self.active
        fewer = self.active < previous
        self._probe = None
        self._since_change = 0
        if gain >= UP_GAIN:  # paid: go on, faster, unless a bound ends this direction
            self._baseline = self._probe_samples
            self._step *= 2
            blocked = self._clamp(self.active + self._direction) == self.active
            self._hold = min(MAX_HOLD, self._hold * 2) if blocked else 1
        elif fewer and gain >= DOWN_KEEP:  # tie: the cheaper setting, then a plateau wait
            self._baseline = self._probe_samples
            self._step = 1
            self._hold = min(MAX_HOLD, self._hold * 2)
        else:  # lost
            self.active, self._skip = previous, 1
            self._direction = -self._direction  # try the other side next time
            self._step = 1
            self._hold = min(MAX_HOLD, self._hold * 2)
        return self.active

    def _clamp(self, n: int) -> int:
        return max(1, min(self.maximum, n))


def _ratio(probe: float, baseline: float) -> float:
    """probe / baseline; windows that moved no bytes compare as equal (no division by 0)."""
    if baseline > 0:
        return probe / baseline
    return float("inf") if probe > 0 else 1.0


class ThreadTuner(Subscriber):
    """Subscriber + tuner thread that applies `HillClimber` to a receive pool."""

    def __init__(self, threads: int, set_active: Callable[[int], None],
                 start: int = 1, window_s: float = WINDOW_S,
                 on_error: Callable[[], None] | None = None) -> None:
        self._climber = HillClimber(start, threads)
        self._set_active = set_active
        self._window_s = window_s
        # Per receive thread: [jobs, bytes, queue wait s, service s]. Written by that thread,
        # and by the watchdog for a job of it that expired: under the lock (uncontended).
        self._slots = [[0, 0, 0.0, 0.0] for _ in range(threads)]
        self._lock = threading.Lock()
        self._last = [0, 0, 0.0, 0.0]
        self.errors = 0  # windows the tuner failed to judge (logged; tuning goes on)
        self._on_error = on_error
        set_active(self._climber.active)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcpool-autotune", daemon=True)
        self._thread.start()

    def on_load(self, ev: LoadEvent) -> None:
        if ev.thread is None:  # expired in the queue: no thread's service to measure
            return
        if ev.thread >= len(self._slots):
            return  # the in-step load thread (connector.scheduler.step_loads) is not the pool's
        s = self._slots[ev.thread]
        with self._lock:
            s[0] += 1
            s[1] += ev.nbytes
            s[2] += ev.t_start - ev.t_enqueue
            s[3] += ev.t_end - ev.t_start

    def _totals(self) -> list[float]:
        with self._lock:
            return [sum(s[i] for s in self._slots) for i in range(4)]

    def _run(self) -> None:
        while not self._stop.wait(self._window_s):
            try:
                self._tick()
            except Exception:  # never let one bad window end tuning silently
                self.errors += 1
                logger.exception("auto load threads: window skipped after an error")
                if self._on_error is not None:
                    self._on_error()

    def _tick(self) -> None:
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
