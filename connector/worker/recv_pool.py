"""A pool of job threads sharing one queue, with a deadline per job.

Every KV load pays Python preparation and a master lookup before bytes move; with one thread
that is dead time on the NIC. N threads take whole jobs from one shared queue, so those
control phases overlap with other jobs' transfers (the store calls release the GIL). The save
path uses a pool of one.

The pool knows nothing about KV caches: it hands each job to `handler(job, slot, ticket)`,
keeps per-slot in-flight flags for the gauges, and survives any exception a handler raises.
`set_active(n)` parks slots n.. (they take no job at all), for `load_threads: auto`.

Deadlines. A store call cannot be cancelled, and a frozen peer can hold one for as long as
Mooncake's own timeouts. With `deadline_s`, a job's deadline is `deadline_s` after it was
submitted: a job still queued then is expired and never starts, and a running one is expired
(`on_expire(job, reason, slot)`), so the request goes on (vLLM recomputes) instead of waiting.
What keeps memory safe is the job's `Ticket`: a handler reads or writes memory vLLM owns only
inside `ticket.touching()`, and nothing expires a ticket in that state (the watchdog looks again
once the block exits; `drop` marks it, and it is expired as the block exits). `touching()` itself
refuses once the deadline has passed (and expires the job), so a chain of touching calls (a
chunked get, a save of several staging buffers) stops at the deadline: a job's total time is
its deadline plus at most the one call under way then.
A thread is *stuck* only when its own call outlives `deadline_s` (queue time does not count):
it is retired, its slot gets a fresh thread (and with it fresh thread-local buffers, see the
worker), at most `max_stuck` of them at a time, and the old thread exits once its call
returns, after `on_retire()` has released what it held.

A thread starts with the CPU affinity of the thread that starts it (`inherited_cpus`): in a
vLLM CPU worker that binds its OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`), that is the
rank's compute cores, where the rank's main thread spins between steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level
J = TypeVar("J")


def inherited_cpus() -> str:
    """The CPUs a thread started now by the calling thread may run on, as ranges ("0-3,8"),
    with how many the host has: for the startup log, so an operator sees a pool bound beside
    the compute threads."""
    cpus = sorted(os.sched_getaffinity(0))  # 0: the calling thread
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    spans = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"CPUs {spans} of {os.cpu_count()}"

QUEUED, RUNNING, TOUCHING, DONE, EXPIRED = range(5)
WATCHDOG_TICK_S = 0.05
TIMEOUT = "timeout"  # the reason given to on_expire for a job past its deadline
SHUTDOWN = "shutdown"  # the reason given to on_expire for a job still queued at close


class Ticket(Generic[J]):
    """One job's state, shared by its thread, the watchdog and `drop` under the pool's lock."""

    __slots__ = ("job", "deadline", "state", "slot", "started", "stuck", "held", "cancel",
                 "_lock", "_report")

    def __init__(self, job: J, deadline: float, lock: threading.Lock,
                 report: Callable[[Ticket[J], str], None] | None = None) -> None:
        self.job = job
        self.deadline = deadline
        self.state = QUEUED
        self.slot: int | None = None  # the slot whose thread runs it (None while queued)
        self.started = 0.0  # monotonic time a thread took it
        self.stuck = False  # its thread's call outlived the bound and was retired
        self.held = False  # it outlived the bound while the stuck budget was full (logged once)
        self.cancel = ""  # dropped while touching: expired with this reason as the block exits
        self._lock = lock
        self._report = report  # reports a job this ticket expired itself (the pool's)

    @property
    def expired(self) -> bool:
        return self.state == EXPIRED

    def _move(self, allowed: tuple[int, ...], to: int) -> bool:
        with self._lock:
            if self.state not in allowed:
                return False
            self.state = to
            return True

    def alive(self) -> bool:
        """Whether the job may make another store call: running, not dropped, and its
        deadline not passed (then it expires here, reported once, as in `touching`)."""
        with self._lock:
            ok = self.state == RUNNING
            late = ok and bool(self.deadline) and time.monotonic() >= self.deadline
            if late:
                self.state, ok = EXPIRED, False
        if late:
            self._expired_here(TIMEOUT)
        return ok

    @contextlib.contextmanager
    def touching(self) -> Iterator[bool]:
        """Yields True if the job may read or write memory vLLM owns (it has not expired, was
        not dropped, and its deadline has not passed); nothing can expire it until the block
        exits. Past the deadline it yields False and expires the job (reported once, here or
        by the watchdog, whichever comes first)."""
        late = False
        with self._lock:
            ok = self.state == RUNNING
            if ok and self.deadline and time.monotonic() >= self.deadline:
                self.state, ok, late = EXPIRED, False, True
            elif ok:
                self.state = TOUCHING
        if late:
            self._expired_here(TIMEOUT)
        try:
            yield ok
        finally:
            if ok:
                with self._lock:
                    reason, self.cancel = self.cancel, ""
                    if self.state == TOUCHING:
                        self.state = EXPIRED if reason else RUNNING
                    else:
                        reason = ""
                if reason:
                    self._expired_here(reason)

    def _expired_here(self, reason: str) -> None:
        if self._report is not None:
            self._report(self, reason)

    def finish(self) -> bool:
        """Mark the job done; False if it was expired or dropped first (that reported it)."""
        return self._move((RUNNING, TOUCHING), DONE)


class RecvPool(Generic[J]):
    def __init__(self, threads: int, handler: Callable[[J, int, Ticket[J]], None],
                 name: str = "mcpool-recv", active: int | None = None,
                 deadline_s: float = 0.0,
                 on_expire: Callable[[J, str, int | None], None] | None = None,
                 on_retire: Callable[[], None] | None = None,
                 on_replace: Callable[[], None] | None = None,
                 max_stuck: int | None = None) -> None:
        self._handler = handler
        self._name = name
        self._deadline_s = deadline_s
        self._on_expire = on_expire
        self._on_retire = on_retire
        self._on_replace = on_replace
        self.max_stuck = threads if max_stuck is None else max_stuck
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # active slots wait here for jobs
        self._park = threading.Condition(self._lock)  # parked slots wait here
        self._jobs: deque[Ticket[J]] = deque()
        self._live: deque[Ticket[J]] = deque()  # queued or running tickets, oldest first
        self.inflight = [0] * threads
        self.jobs_done = [0] * threads
        self.expired = 0  # jobs expired or dropped (reported once each)
        self.replaced = 0  # threads retired while stuck and replaced
        self.stuck = 0  # retired threads still inside their call
        # High-water marks since the last take_peaks(): a gauge sampled once per engine step
        # would miss a burst that the threads drain within the step.
        self._peak_depth = 0
        self._busy = [0] * threads
        self.active = max(1, min(threads if active is None else active, threads))
        self._closing = False
        self._owner: list[threading.Thread | None] = [None] * threads
        self._current: dict[threading.Thread, Ticket[J]] = {}  # retired threads included
        self._threads: list[threading.Thread] = []  # live ones (for close); pruned on spawn
        for i in range(threads):
            self._spawn(i)
        self._watchdog = None
        if deadline_s > 0:
            self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog",
                                              daemon=True)
            self._watchdog.start()

    @property
    def size(self) -> int:
        return len(self.inflight)

    def _spawn(self, slot: int) -> None:
        """Start a thread for `slot`; one that fails to start leaves the slot as it was."""
        t = threading.Thread(target=self._run, args=(slot,), name=f"{self._name}-{slot}",
                             daemon=True)
        prev, self._owner[slot] = self._owner[slot], t
        try:
            t.start()
        except BaseException:
            self._owner[slot] = prev
            raise
        self._threads = [th for th in self._threads if th.is_alive()] + [t]

    def submit(self, job: J) -> None:
        deadline = time.monotonic() + self._deadline_s if self._deadline_s > 0 else 0.0
        ticket = Ticket(job, deadline, self._lock, self._report)
        with self._lock:
            if self._closing:
                closing = True
            else:
                closing = False
                self._jobs.append(ticket)
                if deadline:
                    self._live.append(ticket)
                self._peak_depth = max(self._peak_depth, len(self._jobs))
                self._work.notify()
        if closing:
            self._expire_now(job, SHUTDOWN, None)

    def set_active(self, n: int) -> None:
        """Let slots 0..n-1 take jobs; the others park after their current job."""
        with self._lock:
            self.active = max(1, min(n, self.size))
            self._park.notify_all()
            self._work.notify_all()

    def depth(self) -> int:
        """Jobs waiting for a thread."""
        return len(self._jobs)

    def take_peaks(self) -> tuple[int, list[int]]:
        """Peak queue depth and per-slot busy flags since the previous call. Read and reset
        under the lock that submits and job starts raise them under (once per stats poll):
        a peak raised between the read and the reset was lost."""
        with self._lock:
            depth, self._peak_depth = max(self._peak_depth, self.depth()), 0
            busy = [max(b, f) for b, f in zip(self._busy, self.inflight, strict=True)]
            self._busy = [0] * len(busy)
        return depth, busy

    @property
    def idle(self) -> bool:
        """No job queued and no call running (a retired thread's included)."""
        with self._lock:
            return not self._jobs and not self._current

    def running(self) -> list[J]:
        """The jobs a thread is still running, a retired thread's and expired ones included."""
        with self._lock:
            return [t.job for t in self._current.values() if t.state != DONE]

    @property
    def stalled(self) -> bool:
        """A call in the pool (a retired thread's included) has outlived `deadline_s`."""
        if self._deadline_s <= 0:
            return False
        now = time.monotonic()
        with self._lock:
            return any(now - t.started > self._deadline_s for t in self._current.values())

    def drop(self, match: Callable[[J], bool], reason: str, running: bool = True,
             spare: int = 0) -> int:
        """Expire now every queued job (and, with `running`, every running one not inside
        `touching()`) that `match`es, but the `spare` oldest queued ones, reporting each with
        `reason`; returns how many. A running job's thread goes on with its call, but may no
        longer touch vLLM's memory. With `running`, a job inside `touching()` is marked and
        expired as its block exits (not counted here): it never touches the memory again."""
        with self._lock:
            states = (QUEUED, RUNNING) if running else (QUEUED,)
            hit = [t for t in (*self._jobs, *self._current.values())
                   if t.state in states and match(t.job)][spare:]
            for t in hit:
                t.state = EXPIRED
            if running:
                for t in self._current.values():
                    if t.state == TOUCHING and match(t.job):
                        t.cancel = reason
            if hit:
                self._prune()
        for t in hit:
            self._expire_now(t.job, reason, t.slot)
        return len(hit)

    def _prune(self) -> None:
        """With the lock held: forget expired tickets in the queue (no thread may be free to
        pop them, e.g. while every slot is stuck)."""
        self._jobs = deque(t for t in self._jobs if t.state == QUEUED)

    def _next(self, slot: int) -> tuple[Ticket[J] | None, bool]:
        """The next job for this slot's thread, and whether its deadline passed in the queue
        (then it is expired and must not start); (None, False) when the thread must exit."""
        me = threading.current_thread()
        with self._lock:
            while True:
                if self._owner[slot] is not me or (self._closing and not self._jobs):
                    return None, False
                if slot >= self.active and not self._closing:
                    self._park.wait()
                    continue
                if not self._jobs:
                    self._work.wait()
                    continue
                ticket = self._jobs.popleft()
                if ticket.state != QUEUED:  # expired while queued: already reported
                    continue
                now = time.monotonic()
                if ticket.deadline and now >= ticket.deadline:
                    ticket.state = EXPIRED  # before the watchdog saw it: never start it
                    return ticket, True
                ticket.state, ticket.slot, ticket.started = RUNNING, slot, now
                self._current[me] = ticket
                # With the lock: a retirement from now on finds it set, and clears it.
                self.inflight[slot] = self._busy[slot] = 1
                return ticket, False

    def _run(self, slot: int) -> None:
        me = threading.current_thread()
        while True:
            ticket, late = self._next(slot)
            if ticket is None:
                break
            if late:
                self._expire_now(ticket.job, TIMEOUT, None)
                continue
            try:
                self._handler(ticket.job, slot, ticket)
            except Exception:  # the handler reports its own failures; keep serving the queue
                logger.exception("%s thread %d: unhandled error in job", self._name, slot)
            finally:
                ticket.finish()
                with self._lock:
                    self._current.pop(me, None)
                    retired = self._owner[slot] is not me
                    if retired:
                        self.stuck -= 1
                if not retired:
                    self.inflight[slot] = 0
                    self.jobs_done[slot] += 1
            if retired:
                break
        if self._owner[slot] is not me and self._on_retire is not None:
            try:
                self._on_retire()
            except Exception:
                logger.exception("%s: releasing a retired thread's buffers failed", self._name)

    # ---- deadlines -------------------------------------------------------------------------
    def _report(self, ticket: Ticket[J], reason: str) -> None:
        """A ticket expired itself (its deadline passed at a touching(), or it was dropped
        while touching): report it like the watchdog would."""
        self._expire_now(ticket.job, reason, ticket.slot)

    def _expire_now(self, job: J, reason: str, slot: int | None) -> None:
        self.expired += 1
        if self._on_expire is not None:
            try:
                self._on_expire(job, reason, slot)
            except Exception:
                logger.exception("%s: reporting an expired job failed", self._name)

    def _watch(self) -> None:
        """Every tick: expire what is past its deadline, retire stuck threads. Nothing may end
        it (a replacement thread that fails to start, a callback that raises): `_load_in_step`
        and every deadline depend on it, so a failed tick is logged and the next one runs."""
        while True:
            time.sleep(WATCHDOG_TICK_S)
            try:
                if self._tick():
                    return
            except Exception:
                logger.exception("%s watchdog: tick failed; it goes on", self._name)

    def _tick(self) -> bool:
        """One watchdog pass; True once the pool is closed and nothing is left to expire.

        What is expired and which threads are stuck are both decided under one hold of the
        lock, at one instant, before any callback runs: an `on_expire` wakes whoever waits for
        the job (an in-step load's step), which may end the stuck call at once (a store node
        that answers again); a thread stuck at `now` must be retired all the same, or a call
        that outlived its bound goes uncounted (threads_replaced) depending on who ran first."""
        now = time.monotonic()
        expired: list[Ticket[J]] = []
        replaced_before = self.replaced
        with self._lock:
            if self._closing and not self._live:
                return True
            keep: deque[Ticket[J]] = deque()
            while self._live and self._live[0].deadline <= now:
                t = self._live.popleft()
                if t.state in (QUEUED, RUNNING):
                    t.state = EXPIRED
                    expired.append(t)
                elif t.state == TOUCHING:  # never inside touching(): look again next tick
                    keep.append(t)
            self._live.extendleft(reversed(keep))
            if any(t.slot is None for t in expired):
                self._prune()
            try:  # a failed retirement must not keep the expired jobs from being reported
                for holder, t in list(self._current.items()):
                    if not t.stuck and now - t.started > self._deadline_s:
                        t.stuck = True
                        self._retire(holder, t)
            except Exception:
                logger.exception("%s watchdog: retiring a stuck thread failed", self._name)
        for t in expired:
            self._expire_now(t.job, TIMEOUT, t.slot)
        for _ in range(self.replaced - replaced_before):
            if self._on_replace is not None:
                self._on_replace()
        return False

    def _retire(self, holder: threading.Thread, ticket: Ticket[J]) -> None:
        """Called with the lock held: `holder` has been inside one call for longer than the
        bound (its own call, not its job's queue time): replace it if the bound allows."""
        if ticket.slot is None or self._owner[ticket.slot] is not holder:
            return
        if self._closing:  # a fresh thread would take a queued job past close()'s count
            return
        if self.stuck >= self.max_stuck:  # looked at again each tick: retired once room frees
            ticket.stuck = False
            if not ticket.held:
                ticket.held = True
                logger.warning("%s: a call has run past the %.1fs bound and %d stuck threads "
                               "already wait for their calls; its slot waits too", self._name,
                               self._deadline_s, self.stuck)
            return
        try:
            self._spawn(ticket.slot)
        except Exception:  # e.g. no thread can start now: try again next tick
            ticket.stuck = False
            logger.exception("%s: replacing stuck thread %d failed", self._name, ticket.slot)
            return
        self.stuck += 1
        self.replaced += 1
        self.inflight[ticket.slot] = 0
        logger.warning("%s thread %d is stuck in a store call past its %.1fs bound: retired "
                       "(exits when the call returns), replaced by a fresh thread",
                       self._name, ticket.slot, self._deadline_s)

    # ---- shutdown --------------------------------------------------------------------------
    def close(self, timeout: float = 5.0, drain: float = 0.0) -> list[threading.Thread]:
        """Stop taking jobs, stop the threads, and return those still inside a call after
        `timeout` (the caller must not free what they use until they return). With `drain`,
        the threads first go on with the queued jobs for up to `drain` seconds (each still
        within its deadline); what is still queued then, or without `drain` at once, is
        failed fast (reported with reason "shutdown")."""
        with self._lock:
            self._closing = True  # later submits fail at once; parked slots help drain
            self._park.notify_all()
            self._work.notify_all()
        start = time.monotonic()
        threads = list(self._threads)
        if drain > 0:  # a thread exits once the queue is empty
            for t in threads:
                t.join(max(0.0, start + drain - time.monotonic()))
        with self._lock:
            queued = [t for t in self._jobs if t.state == QUEUED]
            for t in queued:
                t.state = EXPIRED
            self._jobs.clear()
            self._work.notify_all()
            # and every thread started since (a replacement spawned before close began)
            threads += [t for t in self._threads if t not in threads]
        for t in queued:
            self._expire_now(t.job, SHUTDOWN, None)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        busy = [t for t in threads if t.is_alive()]
        if busy:
            logger.warning("%s: threads still inside a store call at shutdown: %s",
                           self._name, [t.name for t in busy])
        return busy
