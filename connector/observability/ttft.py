"""Where a store hit's time to first token goes: one timeline per request that loads from the
store, from its arrival at the scheduler until its prefill runs.

The scheduler and the workers live in different processes (or threads, with TP=1) and clocks,
so each side times what it sees, and only durations cross:

- worker (`LoadClock`, a subscriber of the load events): for each request, when the step's
  metadata arrived, when its load was queued, when a receive thread took it, when it was done,
  and when vLLM heard of it. At each step's end these go to the scheduler as `LoadTimes`, vLLM's
  worker-to-scheduler metadata (`build_connector_worker_meta`), merged over TP ranks;
- scheduler (`RequestClock`): arrival, the lookup's answer, the load sent to the workers, the
  load seen done, the prefill scheduled. With the workers' durations it publishes one
  `RequestEvent` per request (metrics: `ttft_store_*` histograms; tracing: a
  `mooncake.request` span); `handoff` is what the scheduler waited beyond the workers' own
  account (messaging, and the step that ends before the scheduler hears of a load).

Phases (metric_catalog.TTFT_PHASES), consecutive and summing to the request's store time:
lookup, admit, load_start, load_queue, load_transfer, load_report, handoff, reschedule. A load
done inside the engine step (`sync`) has no handoff or reschedule: the step waited for it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from connector.observability.events import (
    LoadEvent,
    Publisher,
    RequestEvent,
    Subscriber,
    request_hash,
)

# Timelines kept per side; past it the oldest is dropped. On the scheduler every request looked
# up and not finished holds one (vLLM bounds its running requests, not its waiting queue, so no
# setting bounds them): a drop there is counted (ttft_store_dropped).
MAX_OPEN = 4096
FINISHED_STEPS = 3  # steps a finished request's in-step load may wait for the workers' account


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One request's load on one TP rank, as durations (seconds) on that rank's clock."""

    start: float  # step metadata received -> load queued
    queue: float  # queued -> a receive thread took it
    transfer: float  # taken -> done (store get and copies into the KV cache)
    report: float  # done -> reported to vLLM
    blocks: int
    failed: bool
    in_step: bool = False  # loaded inside the engine step (connector.scheduler.step_loads)
    ranks: int = 1
    preloaded: bool = False  # some job copied from a preload: its transfer was a memory copy

    @property
    def seconds(self) -> float:
        return self.start + self.queue + self.transfer + self.report


class LoadTimes(KVConnectorWorkerMetadata):
    """A step's finished loads by request id, as one worker (or, after `aggregate`, every TP
    rank) timed them. `in_step`: every rank can load inside the engine step (staged
    transfers and an in-step pool)."""

    def __init__(self, loads: dict[str, RankLoad], in_step: bool) -> None:
        self.loads = loads
        self.in_step = in_step

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another rank's: per request, the slower rank's durations (the request waits
        for every rank), with the ranks counted."""
        if not isinstance(other, LoadTimes):
            return self
        for rid, theirs in other.loads.items():
            mine = self.loads.get(rid)
            self.loads[rid] = theirs if mine is None else merge(mine, theirs)
        self.in_step = self.in_step and other.in_step
        return self


def merge(a: RankLoad, b: RankLoad) -> RankLoad:
    slow = a if a.seconds >= b.seconds else b
    return RankLoad(slow.start, slow.queue, slow.transfer, slow.report, slow.blocks,
                    a.failed or b.failed, slow.in_step, a.ranks + b.ranks,
                    a.preloaded or b.preloaded)


@dataclass(slots=True)
class _WorkerLoad:
    req_id: str
    t_received: float
    parts: int = 0  # jobs queued; the load is complete when as many events were seen
    seen: int = 0
    t_enqueue: float = math.inf
    t_start: float = math.inf
    t_end: float = 0.0
    t_reported: float = 0.0
    blocks: int = 0  # token blocks (see on_load)
    failed: bool = False
    in_step: bool = False
    group_blocks: dict[int, int] = field(default_factory=dict)  # blocks per KV cache group
    preloaded: bool = False


class LoadClock(Subscriber):
    """Worker side: each request's load timestamps, from the worker's step hooks and the load
    events (any thread), handed to the scheduler once vLLM has been told the load is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, _WorkerLoad] = {}  # by request hash (the events carry it)
        self.in_step = False  # set once the worker knows it can load inside a step

    def _entry(self, req_id: str, now: float) -> _WorkerLoad:
        key = request_hash(req_id)
        w = self._open.get(key)
        if w is None:
            if len(self._open) >= MAX_OPEN:
                del self._open[next(iter(self._open))]
            w = self._open[key] = _WorkerLoad(req_id, now)
        return w

    def received(self, req_ids: Iterable[str], now: float) -> None:
        """The step's metadata with these loads reached the worker."""
        with self._lock:
            for rid in req_ids:
                self._entry(rid, now)

    def queued(self, parts: Mapping[str, int], now: float) -> None:
        """Jobs per request just queued (the metadata time defaults to now)."""
        with self._lock:
            for rid, n in parts.items():
                self._entry(rid, now).parts += n

    def on_load(self, ev: LoadEvent) -> None:
        with self._lock:
            w = self._open.get(ev.request_hash)
            if w is None:
                return
            w.seen += 1
            w.t_enqueue = min(w.t_enqueue, ev.t_enqueue)
            w.t_start = min(w.t_start, ev.t_start)
            w.t_end = max(w.t_end, ev.t_end)
            # Token blocks: a hybrid model's groups each load (part of) the same prefix, so
            # the blocks of the group with the most, not their sum (step_loads charges these).
            w.group_blocks[ev.group] = w.group_blocks.get(ev.group, 0) + ev.keys
            w.blocks = max(w.group_blocks.values())
            w.failed = w.failed or not ev.ok
            w.preloaded = w.preloaded or ev.preloaded

    def reported(self, req_ids: Iterable[str], now: float, in_step: bool = False) -> None:
        """vLLM has been told these loads are done (in_step: the step that waited for them
        goes on)."""
        with self._lock:
            for rid in req_ids:
                w = self._open.get(request_hash(rid))
                if w is not None and not w.t_reported:
                    w.t_reported, w.in_step = now, in_step

    def take(self) -> LoadTimes | None:
        """The reported loads whose every job has ended (an event may trail its report by a
        moment: that load goes with the next step's)."""
        with self._lock:
            done = [k for k, w in self._open.items() if w.t_reported and w.parts
                    and w.seen >= w.parts]
            loads = {}
            for k in done:
                w = self._open.pop(k)
                loads[w.req_id] = RankLoad(
                    start=max(0.0, w.t_enqueue - w.t_received),
                    queue=max(0.0, w.t_start - w.t_enqueue),
                    transfer=max(0.0, w.t_end - w.t_start),
                    report=max(0.0, w.t_reported - w.t_end), blocks=w.blocks, failed=w.failed,
                    in_step=w.in_step, preloaded=w.preloaded)
        return LoadTimes(loads, self.in_step) if loads else None


@dataclass(slots=True)
class _Timeline:
    t_arrival: float
    trace_headers: Mapping[str, str] | None
    t_answer: float = 0.0  # the lookup's answer was in
    t_sent: float = 0.0  # the load went out in the step's metadata
    t_seen: float = 0.0  # the scheduler saw the load done (async)
    t_scheduled: float = 0.0  # the prefill was scheduled (async)
    mode: str = ""
    blocks: int = 0
    worker: RankLoad | None = None


class RequestClock:
    """Scheduler side: the timeline of every request that may load from the store, published
    as a `RequestEvent` once its prefill is scheduled and every rank's account is in. Called on
    the engine's scheduler thread only."""

    def __init__(self, events: Publisher, tp_size: int,
                 count: Callable[..., None] = lambda *_: None) -> None:
        self._events = events
        self._tp_size = tp_size
        self._count = count  # StatsRecorder.count: the timelines dropped unpublished
        self._open: dict[str, _Timeline] = {}
        # Finished requests whose in-step load still waits for the workers' account (vLLM
        # finishes a request before it hands the scheduler that step's worker output), with
        # the steps left to wait.
        self._finished: dict[str, tuple[_Timeline, int]] = {}

    def arrived(self, req_id: str, trace_headers: Mapping[str, str] | None) -> None:
        """Past MAX_OPEN the oldest arrival's timeline goes, counted: under a queue that long
        it is the longest-waiting request's, so the breakdown would otherwise lose the slowest
        requests without a trace."""
        if len(self._open) >= MAX_OPEN:
            del self._open[next(iter(self._open))]
            self._count("ttft_store_dropped")
        self._open[req_id] = _Timeline(time.perf_counter(), trace_headers)

    def answered(self, req_id: str, t_end: float) -> None:
        tl = self._open.get(req_id)
        if tl is not None and not tl.t_answer:
            tl.t_answer = t_end or time.perf_counter()

    def sent(self, req_id: str, mode: str, blocks: int, now: float) -> None:
        tl = self._open.get(req_id)
        if tl is not None:
            tl.t_sent, tl.mode, tl.blocks = now, mode, blocks
            tl.t_answer = tl.t_answer or now

    def seen_done(self, req_ids: Iterable[str], now: float) -> None:
        for rid in req_ids:
            tl = self._open.get(rid)
            if tl is not None and tl.t_sent and not tl.t_seen:
                tl.t_seen = now

    def scheduled(self, req_ids: Iterable[str], now: float) -> None:
        """Once per step: these requests' prefill is scheduled."""
        self._finished = {rid: (tl, n - 1) for rid, (tl, n) in self._finished.items() if n > 1}
        for rid in req_ids:
            tl = self._open.get(rid)
            if tl is not None and tl.t_seen and not tl.t_scheduled:
                tl.t_scheduled = now
                self._publish(rid, tl)

    def worker_times(self, times: LoadTimes) -> None:
        for rid, load in times.loads.items():
            tl, left = self._open.get(rid), 0
            if tl is None and rid in self._finished:
                tl, left = self._finished.pop(rid)
            if tl is None or not tl.t_sent:
                continue
            tl.worker = load if tl.worker is None else merge(tl.worker, load)
            if not self._publish(rid, tl) and left:
                self._finished[rid] = (tl, left)

    def forget(self, req_id: str) -> None:
        """The request finished or was preempted."""
        tl = self._open.pop(req_id, None)
        if tl is not None and tl.mode == "sync":
            if len(self._finished) < MAX_OPEN:
                self._finished[req_id] = (tl, FINISHED_STEPS)
            else:
                self._count("ttft_store_dropped")

    def _publish(self, rid: str, tl: _Timeline) -> bool:
        """Publish the request's event if its timeline is complete."""
        w = tl.worker
        if w is None or w.ranks < self._tp_size or (tl.mode == "async" and not tl.t_scheduled):
            return False
        self._open.pop(rid, None)
        phases = [("lookup", tl.t_answer - tl.t_arrival), ("admit", tl.t_sent - tl.t_answer),
                  ("load_start", w.start), ("load_queue", w.queue),
                  ("load_transfer", w.transfer), ("load_report", w.report)]
        if tl.mode == "async":
            phases += [("handoff", tl.t_seen - tl.t_sent - w.seconds),
                       ("reschedule", tl.t_scheduled - tl.t_seen)]
        self._events.request(RequestEvent(
            request_hash(rid), tl.mode, tl.blocks, w.failed, tl.t_arrival,
            tuple((name, max(0.0, s)) for name, s in phases), tl.trace_headers))
        return True
