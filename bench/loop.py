"""The closed-loop request driver: keeps a workload's requests outstanding against a driver,
polling it like vLLM's engine loop polls the connector (errors, then completions, each step).

Latency is per request, from submission to the poll that sees it finished (the same method for
every driver; with split requests, until the last part finished: reported by the connector
itself when it splits, counted here when the sub-jobs are built on the benchmark side).
Throughput is the bytes of finished requests over the time from the first submission to the
last completion.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from bench.drivers import Driver, PhaseTotals, check_loaded
from bench.testbed import CpuMeter, Source, wait_until_quiet
from bench.workloads import Workload

T = TypeVar("T")

POLL_S = 0.001  # one engine step's worth of polling granularity
COLLECT_EVERY_S = 0.02  # how often the worker's stats are snapshotted (vLLM: every step)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (inclusive method); NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


@dataclass
class RunResult:
    workload: str
    driver: str
    threads: int
    requests: int
    blocks: int
    seconds: float
    gbps: float
    latencies_ms: list[float]
    error_blocks: int
    verified_blocks: int
    cpu: dict[str, float] = field(default_factory=dict)
    phases: PhaseTotals | None = None
    jobs_per_thread: list[int] = field(default_factory=list)
    attempts: int = 1

    def percentile(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


def run_workload(driver: Driver, workload: Workload, source: Source,
                 caches: dict[str, torch.Tensor], block_bytes: int, duration_s: float,
                 min_requests: int, meter: CpuMeter | None = None, verify: bool = True
                 ) -> RunResult:
    """Run `workload` for about `duration_s` (and at least `min_requests`), then drain."""
    for c in caches.values():
        c.zero_()  # so a block that was not loaded this run cannot pass the check
    num_blocks = next(iter(caches.values())).shape[0]
    stream = workload.requests(source.count, num_blocks)
    parent: dict[str, str] = {}
    left: dict[str, int] = {}
    submitted: dict[str, float] = {}
    sizes: dict[str, int] = {}
    latencies: list[float] = []
    done_blocks = errors = finished = 0
    driver.take_phases()  # drop anything from before this run
    if meter is not None:
        meter.start()
    t0 = last_done = time.perf_counter()
    next_collect = t0 + COLLECT_EVERY_S
    stopping = False
    while True:
        now = time.perf_counter()
        if not stopping:
            batch = []
            while (req := stream.take()) is not None:
                # A driver that splits requests itself (the connector's load_split_blocks)
                # gets whole requests; otherwise sub-jobs are built here, each its own job id.
                native = workload.split and driver.split_blocks == workload.split
                parts = [req] if native else req.parts(workload.split)
                left[req.req_id], submitted[req.req_id] = len(parts), now
                sizes[req.req_id] = len(req.src)
                for p in parts:
                    parent[p.req_id] = req.req_id
                batch.extend(parts)
            if batch:
                driver.submit(batch)
        time.sleep(POLL_S)
        done, bad = driver.poll()
        now = time.perf_counter()
        errors += len(bad)
        for job in done:
            rid = parent.pop(job)
            left[rid] -= 1
            if left[rid] == 0:
                del left[rid]
                latencies.append((now - submitted.pop(rid)) * 1e3)
                done_blocks += sizes.pop(rid)
                finished += 1
                last_done = now
                stream.release(rid)
        if now >= next_collect:
            driver.collect()
            next_collect = now + COLLECT_EVERY_S
        stopping = stopping or (now - t0 >= duration_s and finished >= min_requests)
        if stopping and not left:
            break
    cpu = meter.stop() if meter is not None else {}
    elapsed = max(1e-9, last_done - t0)
    verify = verify and stream.exclusive
    verified = check_loaded(caches, source, list(stream.last.values())) if verify else 0
    phases = driver.take_phases()
    jobs = [phases.jobs_per_thread.get(str(i), 0) for i in range(driver.threads)] \
        if phases is not None else []
    return RunResult(workload.name, driver.label, driver.threads, finished, done_blocks, elapsed,
                     done_blocks * block_bytes / elapsed / 1e9, latencies, errors, verified,
                     cpu, phases, jobs)


@dataclass(frozen=True)
class Guard:
    """Re-run a measurement that other processes disturbed.

    A run during which the rest of the machine used `threshold` cores or more is repeated
    (after waiting up to `max_wait_s` for a quiet second), at most `retries` times; the least
    disturbed attempt is kept and its `cpu["others"]` stays in the results.
    """

    threshold: float = 0.25
    retries: int = 0
    max_wait_s: float = 30.0

    def attempt(self, measure: Callable[[], tuple[T, float]], meter: Callable[[], CpuMeter]
                ) -> tuple[T, int]:
        """The least disturbed of the attempts and how many were made; `measure` returns its
        result and the cores the rest of the machine used meanwhile."""
        best: tuple[T, float] | None = None
        for attempt in range(self.retries + 1):
            r, others = measure()
            if best is None or others < best[1]:
                best = (r, others)
            if others < self.threshold or attempt == self.retries:
                break
            wait_until_quiet(meter(), self.threshold, self.max_wait_s)
        return best[0], attempt + 1

    def run(self, measure: Callable[[], RunResult], meter: Callable[[], CpuMeter]
            ) -> RunResult:
        def measured() -> tuple[RunResult, float]:
            r = measure()
            return r, r.cpu.get("others", 0.0)

        best, attempts = self.attempt(measured, meter)
        best.attempts = attempts
        return best
