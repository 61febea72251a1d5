"""The thread-count sweep: every (master RTT, workload, driver, thread count) cell, with the
repetitions interleaved so slow drift on a shared machine spreads over all cells instead of
biasing whichever ran last.

Runs of the same thread count for the different drivers are adjacent, so the ours/in-tree
ratio of each repetition compares runs a few seconds apart; the reported ratio is the median
of those paired ratios.

One driver per (kind, threads) lives for a whole RTT setting (its store client is connected
through that setting's proxy) and all drivers load into one shared set of KV tensors.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from bench.drivers import Driver, InTreeDriver, OursDriver, PhaseTotals, one_key_get_ms
from bench.loop import Guard, RunResult, percentile, run_workload
from bench.testbed import Source, Testbed
from bench.workloads import Geometry, Workload

logger = logging.getLogger(__name__)


@dataclass
class Cell:
    """All repetitions of one (rtt, workload, driver, threads) combination."""

    rtt_ms: float
    workload: Workload
    driver: str
    threads: int
    runs: list[RunResult] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return statistics.median(r.gbps for r in self.runs)

    def latency_ms(self, q: float) -> float:
        """Percentile over the requests of all repetitions."""
        return percentile([x for r in self.runs for x in r.latencies_ms], q)

    def phases(self) -> PhaseTotals | None:
        parts = [r.phases for r in self.runs if r.phases is not None]
        if not parts:
            return None
        total = PhaseTotals()
        for p in parts:
            for k, v in p.sums.items():
                total.sums[k] += v
            for k, v in p.counts.items():
                total.counts[k] += v
            for k, v in p.jobs_per_thread.items():
                total.jobs_per_thread[k] += v
        return total

    def cpu(self) -> dict[str, float]:
        keys = {k for r in self.runs for k in r.cpu}
        return {k: round(statistics.median(r.cpu.get(k, 0.0) for r in self.runs), 2)
                for k in sorted(keys)}


def make_driver(kind: str, master: str, testbed: Testbed, geometry: Geometry,
                caches: dict[str, torch.Tensor], source: Source, threads: int,
                lookup_ratio: float, split: int = 0) -> Driver:
    if kind in ("ours", "ours-multibuf"):  # the connector with staging auto / off
        return OursDriver(testbed, master, geometry, caches, source, threads, lookup_ratio,
                          split_blocks=split, staging="auto" if kind == "ours" else "off")
    if kind == "in-tree":
        return InTreeDriver(testbed, master, geometry, caches, source, threads)
    raise ValueError(f"unknown driver {kind!r}")


def run_sweep(testbed: Testbed, geometry: Geometry, caches: dict[str, torch.Tensor],
              source: Source, rtts: Sequence[float], workloads: Sequence[Workload],
              threads: Sequence[int], kinds: Sequence[str], reps: int, duration_s: float,
              min_requests: Callable[[Workload], int], lookup_ratio: float,
              guard: Guard, mbps: float = 0.0) -> tuple[list[Cell], dict[float, float]]:
    """All cells, and the measured 1-key get latency (ms) at each RTT setting."""
    cells: dict[tuple, Cell] = {}
    get_ms: dict[float, float] = {}
    for rtt in rtts:
        master = testbed.set_rtt(rtt, mbps)
        get_ms[rtt] = one_key_get_ms(testbed, master, source)
        # The connector splits long requests itself (load_split_blocks), so each split size
        # gets its own "ours" workers; the in-tree pool has no such option (the benchmark
        # submits the sub-jobs).
        splits = sorted({0} | {w.split for w in workloads})
        drivers = {(k, t, sp): make_driver(k, master, testbed, geometry, caches, source, t,
                                           lookup_ratio, sp)
                   for k in kinds for t in threads for sp in splits
                   if sp == 0 or k.startswith("ours")}
        try:
            for d in drivers.values():  # connect to the store node before timing anything
                run_workload(d, workloads[0], source, caches, geometry.block_bytes, 0.0, 2,
                             verify=False)
            for rep in range(reps):
                for w in workloads:
                    # Same thread count back to back across drivers (paired comparisons
                    # see the same machine state), driver order and T order alternating.
                    ts = list(threads) if rep % 2 == 0 else list(threads)[::-1]
                    ks = list(kinds) if (rep // 2) % 2 == 0 else list(kinds)[::-1]
                    order = [((k, t), drivers.get((k, t, w.split)) or drivers[(k, t, 0)])
                             for t in ts for k in ks]
                    for (kind, t), d in order:
                        r = guard.run(lambda d=d, w=w: run_workload(
                            d, w, source, caches, geometry.block_bytes, duration_s,
                            min_requests(w), testbed.cpu_meter()), testbed.cpu_meter)
                        cell = cells.setdefault((rtt, w.name, kind, t), Cell(rtt, w, kind, t))
                        cell.runs.append(r)
                        logger.info("rtt %.1f ms %-22s %-7s T=%d rep %d: %.3f GB/s p50 %.1f ms"
                                    " errors %d, others %.2f cores, attempts %d", rtt, w.name,
                                    kind, t, rep, r.gbps, r.percentile(50), r.error_blocks,
                                    r.cpu.get("others", 0.0), r.attempts)
        finally:
            for d in drivers.values():
                d.close()
    testbed.set_rtt(0.0)
    return list(cells.values()), get_ms


def group_by(cells: Sequence[Cell]) -> dict[tuple[float, str, str], dict[int, Cell]]:
    """(rtt, workload, driver) -> {threads: cell}."""
    out: dict[tuple[float, str, str], dict[int, Cell]] = defaultdict(dict)
    for c in cells:
        out[(c.rtt_ms, c.workload.name, c.driver)][c.threads] = c
    return out
