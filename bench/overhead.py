"""What observability costs on the load path.

1. Instrumentation: the same workload through otherwise identical workers:
   - `off`: no subscribers (no StatsRecorder, no tracing), and `off_again`, a second such
     worker: the A/A difference is the noise floor of the comparison;
   - `metrics`: StatsRecorder only (what the worker runs when tracing is not configured);
   - `trace_1.0`: StatsRecorder + SpanExporter sampling every job with its default (lean
     OTLP/HTTP) writer, exporting to a real local receiver;
   - `trace_1.0_sdk`: the same through an OpenTelemetry SDK TracerProvider (the path taken
     when vLLM set one up in the worker process);
   - `default`: StatsRecorder + SpanExporter at the connector's default ratio.
   The configurations alternate in rounds (order rotated every round), several rounds, and
   the loss is the median of the per-round paired ratios to `off`, because run-to-run noise on
   a shared 2-core box (±15 %) is far larger than the effect being measured. Client CPU per GB
   is reported too: it shows the cost even when throughput hides it.
2. Master-lookup probe: `master_lookup_sample_ratio` makes sampled jobs issue one extra
   replica-list RPC to time the master lookup separately. Its cost is an extra round trip per
   sampled job, so it is measured with the RTT on.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.drivers import OursDriver
from bench.loop import Guard, RunResult, run_workload
from bench.otlp import CountingExporter, counting_provider
from bench.testbed import Source, Testbed
from bench.workloads import Geometry, Workload
from connector.observability.events import LoadEvent
from connector.observability.stats import StatsRecorder
from connector.observability.tracing import (
    DEFAULT_SAMPLE_RATIO,
    OtlpWriter,
    SdkWriter,
    SpanExporter,
)
from devkit.otlp_collector import RotelCollector

PER_EVENT_SAMPLES = 6_000
FLUSH_EVERY = 300  # jobs; keeps the SDK's BatchSpanProcessor queue (2048 spans) from dropping

# The configurations compared: name -> (trace ratio or None for no tracing, span writer, meaning)
CONFIGS: dict[str, tuple[float | None, str, str]] = {
    "off": (None, "", "no subscribers (no StatsRecorder, no SpanExporter)"),
    "off_again": (None, "", "a second, identical 'off' worker (A/A noise floor)"),
    "metrics": (None, "", "StatsRecorder only (the worker's default without OTEL_* set)"),
    "trace_1.0": (1.0, "otlp", "StatsRecorder + SpanExporter ratio 1.0, lean OTLP/HTTP writer "
                               "(the default)"),
    "trace_1.0_sdk": (1.0, "sdk", "StatsRecorder + SpanExporter ratio 1.0 through an SDK "
                                  "TracerProvider (as when vLLM set one up) -> OTLP/HTTP"),
    "default": (DEFAULT_SAMPLE_RATIO, "otlp",
                f"StatsRecorder + SpanExporter ratio {DEFAULT_SAMPLE_RATIO} (lean writer)"),
}


@dataclass
class Comparison:
    """Alternating rounds of several configurations of one workload."""

    workload: str
    threads: int
    rtt_ms: float
    baseline: str
    runs: dict[str, list[RunResult]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    also_baseline: tuple[str, ...] = ()

    def median_gbps(self, cfg: str) -> float:
        return statistics.median(r.gbps for r in self.runs[cfg])

    def _base(self, rnd: int) -> float:
        """A round's baseline: the mean of the identical baseline configurations (`off` and
        `off_again` average out half of one run's noise)."""
        names = [self.baseline] + [n for n in self.also_baseline if n in self.runs]
        return statistics.mean(self.runs[n][rnd].gbps for n in names)

    def paired_ratio(self, cfg: str) -> float:
        """Median over rounds of cfg/baseline throughput within the same round."""
        return statistics.median(r.gbps / self._base(i) for i, r in enumerate(self.runs[cfg]))

    def aa_ratio(self) -> float | None:
        """Median of off_again/off: how far two identical configurations drift apart here."""
        if not self.also_baseline or self.also_baseline[0] not in self.runs:
            return None
        pairs = zip(self.runs[self.also_baseline[0]], self.runs[self.baseline], strict=True)
        return statistics.median(a.gbps / b.gbps for a, b in pairs)

    def cpu_s_per_gb(self, cfg: str) -> float:
        vals = [r.cpu.get("client", 0.0) / r.gbps for r in self.runs[cfg] if r.gbps > 0]
        return statistics.median(vals) if vals else float("nan")

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"workload": self.workload, "threads": self.threads,
                               "master_rtt_ms": self.rtt_ms, "baseline": self.baseline,
                               "rounds": len(self.runs[self.baseline]), **self.notes,
                               "configs": {}}
        if self.also_baseline:
            out["baseline"] = " + ".join((self.baseline, *self.also_baseline)) + " (mean)"
            aa = self.aa_ratio()
            out["aa_loss_pct"] = None if aa is None else round((1 - aa) * 100, 2)
        for cfg, runs in self.runs.items():
            ratio = self.paired_ratio(cfg)
            out["configs"][cfg] = {
                "gbps_median": round(self.median_gbps(cfg), 4),
                "gbps_reps": [round(r.gbps, 4) for r in runs],
                "ratio_to_baseline": round(ratio, 4),
                "loss_pct": round((1 - ratio) * 100, 2),
                "client_cpu_s_per_gb": round(self.cpu_s_per_gb(cfg), 3),
                "others_cores": [r.cpu.get("others") for r in runs],
                "cores_by_process": {k: round(statistics.median(r.cpu.get(k, 0.0) for r in runs), 3)
                                     for k in runs[0].cpu if k != "others"},
                "error_blocks": sum(r.error_blocks for r in runs),
            }
        return out


def alternate(drivers: dict[str, OursDriver], workload: Workload, rounds: int,
               duration_s: float, min_requests: int, testbed: Testbed, source: Source,
               caches: dict[str, torch.Tensor], block_bytes: int, comp: Comparison,
               guard: Guard) -> None:
    names = list(drivers)
    for d in drivers.values():  # warm connections
        run_workload(d, workload, source, caches, block_bytes, 0.0, 4, verify=False)
    for rnd in range(rounds):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            r = guard.run(lambda name=name, rnd=rnd: run_workload(
                drivers[name], workload, source, caches, block_bytes, duration_s, min_requests,
                testbed.cpu_meter(), verify=(rnd == 0)), testbed.cpu_meter)
            comp.runs.setdefault(name, []).append(r)


def _flush(subs: Sequence[Any]) -> None:
    """Build and export every handed-over span (the trace and export threads' work)."""
    for sub in subs:
        if isinstance(sub, SpanExporter):
            sub.flush()
            if isinstance(sub.writer, SdkWriter):
                sub.writer.force_flush()


class _Writers:
    """Span writers for the configurations, all exporting to one local OTLP receiver, with
    their exported / failed span counts."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self.made: list[Any] = []
        self._counters: list[Any] = []  # CountingExporter or OtlpHttpExporter: exported, failed

    def make(self, kind: str) -> Any:
        if kind == "sdk":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            counter = CountingExporter(OTLPSpanExporter(endpoint=self._endpoint))
            writer = SdkWriter(counting_provider(counter), owned=True)
        else:
            writer = OtlpWriter({"service.name": "mcpool-bench"},
                                {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self._endpoint})
            counter = writer.exporter
        self.made.append(writer)
        self._counters.append(counter)
        return writer

    def subscribers(self, cfg: str, threads: int) -> list[Any]:
        ratio, kind, _ = CONFIGS[cfg]
        if cfg.startswith("off"):
            return []
        subs: list[Any] = [StatsRecorder(0, threads)]
        if ratio is not None:
            subs.append(SpanExporter(ratio, 0, "bench", writer=self.make(kind)))
        return subs

    def counts(self) -> tuple[int, int]:
        return (sum(c.exported for c in self._counters),
                sum(c.failed for c in self._counters))


def per_event_cost_us(writers: _Writers, threads: int) -> dict[str, float]:
    """CPU microseconds per finished load job that each configuration's subscribers cost:
    the event fan-out on the receive thread, the recorder snapshots vLLM takes every step, and
    the trace and export threads (flushed before the clock stops). Deterministic where the
    end-to-end comparison is noisy."""
    import time

    t = time.perf_counter()
    ev = LoadEvent(thread=0, tp_rank=0, request_hash="0123456789abcdef", keys=4, nbytes=4 << 17,
                   failed_blocks=0, code="", t_enqueue=t, t_start=t + 1e-4,
                   t_prepared=t + 2e-4, t_lookup_end=t + 2e-4, t_end=t + 1e-3,
                   lookup_sampled=False)
    out = {}
    for name in CONFIGS:
        subs = writers.subscribers(name, threads)
        c0 = time.process_time()
        for i in range(PER_EVENT_SAMPLES):
            ev.thread = i % threads
            for sub in subs:
                sub.on_load(ev)
            if i % 200 == 0:  # vLLM takes a stats snapshot every engine step
                for sub in subs:
                    if isinstance(sub, StatsRecorder):
                        sub.snapshot()
            if i % FLUSH_EVERY == FLUSH_EVERY - 1:
                _flush(subs)
        _flush(subs)
        out[name] = round((time.process_time() - c0) / PER_EVENT_SAMPLES * 1e6, 2)
        for sub in subs:
            if isinstance(sub, SpanExporter):
                sub.shutdown()
    return out


def instrumentation_cost(testbed: Testbed, geometry: Geometry, caches: dict[str, torch.Tensor],
                         source: Source, workload: Workload, threads: int, rounds: int,
                         duration_s: float, lookup_ratio: float, guard: Guard,
                         rtt_ms: float = 0.0) -> dict[str, Any]:
    receiver = RotelCollector(print_spans=False).start()
    testbed.pids["otlp_receiver"] = receiver.proc.pid
    writers = _Writers(receiver.traces_endpoint)
    master = testbed.set_rtt(rtt_ms)
    drivers: dict[str, OursDriver] = {}
    try:
        for cfg in CONFIGS:
            drivers[cfg] = OursDriver(testbed, master, geometry, caches, source, threads,
                                      lookup_ratio, subscribers=writers.subscribers(cfg, threads))
        notes = {"otlp_receiver": receiver.kind, "default_trace_ratio": DEFAULT_SAMPLE_RATIO,
                 "master_lookup_sample_ratio": lookup_ratio,
                 "configs_meaning": {k: v[2] for k, v in CONFIGS.items()}}
        comp = Comparison(workload.name, threads, rtt_ms, "off", also_baseline=("off_again",),
                          notes=notes)
        alternate(drivers, workload, rounds, duration_s, 20, testbed, source, caches,
                   geometry.block_bytes, comp, guard)
        for d in drivers.values():
            _flush(d.worker.events.subscribers)
        comp.notes["spans_exported"], comp.notes["spans_export_failed"] = writers.counts()
        summary = comp.summary()
        # CPU model: jobs/s at the 'off' throughput x extra CPU per job, as a share of the
        # client CPU the 'off' runs used.
        cost = per_event_cost_us(writers, threads)
        off = summary["configs"]["off"]
        jobs_s = off["gbps_median"] * 1e9 / (workload.sizes[0] * geometry.block_bytes)
        client = statistics.median(r.cpu.get("client", 0.0) for r in comp.runs["off"])
        summary["per_job_cpu_us"] = cost
        for cfg, v in summary["configs"].items():
            extra = (cost[cfg] - cost["off"]) * jobs_s / 1e6
            v["cpu_model_loss_pct"] = round(100 * extra / client, 2) if client else None
        summary["cpu_model"] = ("extra CPU per job (per_job_cpu_us) x jobs/s of 'off', as a "
                                "share of the client CPU of 'off': the throughput loss when the "
                                "client is the bottleneck")
        return summary
    finally:
        for d in drivers.values():
            d.close()
        for w in writers.made:
            w.shutdown()
        receiver.stop()
        testbed.pids.pop("otlp_receiver", None)


def lookup_probe_cost(testbed: Testbed, geometry: Geometry, caches: dict[str, torch.Tensor],
                      source: Source, workload: Workload, threads: int, rounds: int,
                      duration_s: float, rtt_ms: float, ratios: Sequence[float],
                      guard: Guard) -> dict[str, Any]:
    master = testbed.set_rtt(rtt_ms)
    drivers = {f"ratio_{r:g}": OursDriver(testbed, master, geometry, caches, source, threads, r)
               for r in ratios}
    try:
        comp = Comparison(workload.name, threads, rtt_ms, f"ratio_{ratios[0]:g}", notes={
            "what": "master_lookup_sample_ratio: share of load jobs that issue an extra "
                    "batch_get_replica_desc RPC to time the master lookup"})
        alternate(drivers, workload, rounds, duration_s, 20, testbed, source, caches,
                   geometry.block_bytes, comp, guard)
        return comp.summary()
    finally:
        for d in drivers.values():
            d.close()
        testbed.set_rtt(0.0)
