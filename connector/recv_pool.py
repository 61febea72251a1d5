"""A pool of receive threads sharing one job queue.

Every KV load pays Python preparation and a master lookup before bytes move; with one thread
that is dead time on the NIC. N threads take whole jobs from one shared queue, so those
control phases overlap with other jobs' transfers (the store calls release the GIL).

The pool knows nothing about KV caches: it hands each job to `handler(job, thread_index)`,
keeps per-thread in-flight flags for the gauges, and survives any exception a handler raises.
`set_active(n)` parks threads n.. (they stop taking jobs), for `load_threads: auto`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level
J = TypeVar("J")
_STOP = object()


class RecvPool(Generic[J]):
    def __init__(self, threads: int, handler: Callable[[J, int], None],
                 name: str = "mcpool-recv") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._handler = handler
        self.inflight = [0] * threads
        self.jobs_done = [0] * threads
        # High-water marks since the last take_peaks(): a gauge sampled once per engine step
        # would miss a burst that the threads drain within the step.
        self._peak_depth = 0
        self._busy = [0] * threads
        self.active = threads  # threads with index < active take jobs
        self._gate = threading.Condition()
        self._closing = False
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def size(self) -> int:
        return len(self._threads)

    def submit(self, job: J) -> None:
        self._queue.put(job)
        self._peak_depth = max(self._peak_depth, self._queue.qsize())

    def set_active(self, n: int) -> None:
        """Let threads 0..n-1 take jobs; the others park after their current job."""
        with self._gate:
            self.active = max(1, min(n, self.size))
            self._gate.notify_all()

    def depth(self) -> int:
        """Jobs waiting for a thread."""
        return self._queue.qsize()

    def take_peaks(self) -> tuple[int, list[int]]:
        """Peak queue depth and per-thread busy flags since the previous call."""
        depth, self._peak_depth = max(self._peak_depth, self.depth()), 0
        busy = [max(b, f) for b, f in zip(self._busy, self.inflight, strict=True)]
        self._busy = [0] * len(busy)
        return depth, busy

    def _run(self, index: int) -> None:
        while True:
            if index >= self.active:
                with self._gate:
                    while index >= self.active and not self._closing:
                        self._gate.wait()
            job = self._queue.get()
            if job is _STOP:
                return
            self.inflight[index] = self._busy[index] = 1
            try:
                self._handler(job, index)
            except Exception:  # the handler reports its own failures; keep serving the queue
                logger.exception("receive thread %d: unhandled error in load job", index)
            finally:
                self.inflight[index] = 0
                self.jobs_done[index] += 1

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the queued jobs; never blocks longer than `timeout` in total."""
        with self._gate:
            self._closing = True  # parked threads go on to take their stop marker
            self._gate.notify_all()
        for _ in self._threads:
            self._queue.put(_STOP)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in self._threads if t.is_alive()]
        if busy:
            logger.warning("receive threads still busy at shutdown (left as daemons): %s", busy)
