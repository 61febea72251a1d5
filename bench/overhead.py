"""What observability costs on the load path.

1. Instrumentation: the same workload through otherwise identical workers:
   - `off`: no subscribers (no StatsRecorder, no tracing), and `off_again`, a second such
     worker: the A/A difference is the noise floor of the comparison;
   - `metrics`: StatsRecorder only (what the worker runs when tracing is not configured);
   - `trace 1.0`: StatsRecorder + SpanExporter sampling every job, exporting over OTLP/HTTP
     to a real local receiver;
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
from bench.otlp import OtlpReceiver, install_tracer_provider
from bench.testbed import Source, Testbed
from bench.workloads import Geometry, Workload
from connector.events import LoadEvent
from connector.stats import StatsRecorder
from connector.tracing import DEFAULT_SAMPLE_RATIO, SpanExporter

PER_EVENT_SAMPLES = 6_000
FLUSH_EVERY = 300  # jobs; keeps the BatchSpanProcessor queue (2048 spans) from dropping any


@dataclass
class Comparison:
    """Alternating rounds of several configurations of one workload."""

    workload: str
    threads: int
    rtt_ms: float
    baseline: str
    runs: dict[str, list[RunResult]] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def median_gbps(self, cfg: str) -> float:
        return statistics.median(r.gbps for r in self.runs[cfg])

    def paired_ratio(self, cfg: str) -> float:
        """Median over rounds of cfg/baseline throughput within the same round."""
        pairs = zip(self.runs[cfg], self.runs[self.baseline], strict=True)
        return statistics.median(a.gbps / b.gbps for a, b in pairs)

    def cpu_s_per_gb(self, cfg: str) -> float:
        vals = [r.cpu.get("client", 0.0) / r.gbps for r in self.runs[cfg] if r.gbps > 0]
        return statistics.median(vals) if vals else float("nan")

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"workload": self.workload, "threads": self.threads,
                               "master_rtt_ms": self.rtt_ms, "baseline": self.baseline,
                               "rounds": len(self.runs[self.baseline]), **self.notes,
                               "configs": {}}
        for cfg, runs in self.runs.items():
            ratio = self.paired_ratio(cfg)
            out["configs"][cfg] = {
                "gbps_median": round(self.median_gbps(cfg), 4),
                "gbps_reps": [round(r.gbps, 4) for r in runs],
                "ratio_to_baseline": round(ratio, 4),
                "loss_pct": round((1 - ratio) * 100, 2),
                "client_cpu_s_per_gb": round(self.cpu_s_per_gb(cfg), 3),
                "others_cores": [r.cpu.get("others") for r in runs],
                "error_blocks": sum(r.error_blocks for r in runs),
            }
        return out


def _alternate(drivers: dict[str, OursDriver], workload: Workload, rounds: int,
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


def per_event_cost_us(provider: Any, threads: int) -> dict[str, float]:
    """CPU microseconds per finished load job that each configuration's subscribers cost:
    the event fan-out on the receive thread, the recorder snapshots vLLM takes every step,
    and the span export thread (flushed before the clock stops). Deterministic where the
    end-to-end comparison is noisy."""
    import time

    t = time.perf_counter()
    ev = LoadEvent(thread=0, tp_rank=0, trace_id="0123456789abcdef", keys=4, nbytes=4 << 17,
                   failed_blocks=0, code="", t_enqueue=t, t_start=t + 1e-4,
                   t_prepared=t + 2e-4, t_lookup_end=t + 2e-4, t_end=t + 1e-3,
                   lookup_sampled=False)
    out = {}
    configs = {"off": lambda: [], "off_again": lambda: [],
               "metrics": lambda: [StatsRecorder(0, threads)],
               "trace_1.0": lambda: [StatsRecorder(0, threads),
                                     SpanExporter(1.0, 0, "bench")],
               "default": lambda: [StatsRecorder(0, threads),
                                   SpanExporter(DEFAULT_SAMPLE_RATIO, 0, "bench")]}
    for name, make in configs.items():
        subs = make()
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
                provider.force_flush(30_000)
        provider.force_flush(30_000)
        out[name] = round((time.process_time() - c0) / PER_EVENT_SAMPLES * 1e6, 2)
    return out


def span_shape_cost_us(endpoint: str) -> dict[str, float]:
    """CPU per job of the span shapes one could emit, through a private provider: 5 spans per
    job (root + queue_wait/prepare/master_lookup/transfer, as the connector does) or 1 span
    (phases as attributes), with a no-op exporter (SDK cost only) and with OTLP/HTTP."""
    import time

    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

    class _Null:
        def export(self, spans: Any) -> Any:
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 0) -> bool:
            return True

    attrs = {"thread": 1, "tp_rank": 0, "keys": 4, "bytes": 1 << 19, "status": "ok",
             "error_code": "", "failed_blocks": 0, "request_hash": "0123456789abcdef"}
    out = {}
    for exp_name, make in (("noop_exporter", _Null),
                           ("otlp_http", lambda: OTLPSpanExporter(endpoint=endpoint))):
        for spans in (5, 1):
            p = TracerProvider()
            p.add_span_processor(BatchSpanProcessor(make()))
            tr = p.get_tracer("bench")
            t = time.time_ns()
            c0 = time.process_time()
            for i in range(PER_EVENT_SAMPLES):
                root = tr.start_span("mooncake.load", start_time=t, attributes=attrs)
                ctx = trace.set_span_in_context(root)
                for _ in range(spans - 1):
                    tr.start_span("phase", context=ctx, start_time=t).end(end_time=t + 1000)
                root.end(end_time=t + 5000)
                if i % FLUSH_EVERY == FLUSH_EVERY - 1:
                    p.force_flush(30_000)
            p.force_flush(30_000)
            out[f"{spans}_span{'s' if spans > 1 else ''}_{exp_name}"] = round(
                (time.process_time() - c0) / PER_EVENT_SAMPLES * 1e6, 1)
            p.shutdown()
    return out


def instrumentation_cost(testbed: Testbed, geometry: Geometry, caches: dict[str, torch.Tensor],
                         source: Source, workload: Workload, threads: int, rounds: int,
                         duration_s: float, lookup_ratio: float, guard: Guard,
                         rtt_ms: float = 0.0) -> dict[str, Any]:
    receiver = OtlpReceiver().start()
    testbed.pids["otlp_receiver"] = receiver.proc.pid
    provider, counter = install_tracer_provider(receiver.traces_endpoint)
    master = testbed.set_rtt(rtt_ms)
    mk = lambda subs: OursDriver(testbed, master, geometry, caches, source, threads,
                                 lookup_ratio, subscribers=subs)
    drivers: dict[str, OursDriver] = {}
    try:
        drivers["off"] = mk([])
        drivers["off_again"] = mk([])  # A/A: the noise floor of this comparison
        drivers["metrics"] = mk(None)
        drivers["trace_1.0"] = mk(None)
        drivers["trace_1.0"].worker.add_subscriber(SpanExporter(1.0, 0, "bench"))
        drivers["default"] = mk(None)
        drivers["default"].worker.add_subscriber(
            SpanExporter(DEFAULT_SAMPLE_RATIO, 0, "bench"))
        comp = Comparison(workload.name, threads, rtt_ms, "off", notes={
            "otlp_receiver": receiver.kind, "default_trace_ratio": DEFAULT_SAMPLE_RATIO,
            "master_lookup_sample_ratio": lookup_ratio,
            "configs_meaning": {
                "off": "no subscribers (no StatsRecorder, no SpanExporter)",
                "off_again": "a second, identical 'off' worker (A/A noise floor)",
                "metrics": "StatsRecorder only (the worker's default without OTEL_* set)",
                "trace_1.0": "StatsRecorder + SpanExporter ratio 1.0 -> OTLP/HTTP",
                "default": f"StatsRecorder + SpanExporter ratio {DEFAULT_SAMPLE_RATIO}"}})
        _alternate(drivers, workload, rounds, duration_s, 20, testbed, source, caches,
                   geometry.block_bytes, comp, guard)
        provider.force_flush(10_000)
        comp.notes["spans_exported"] = counter.exported
        comp.notes["spans_export_failed"] = counter.failed
        summary = comp.summary()
        # CPU model: jobs/s at the 'off' throughput x extra CPU per job, as a share of the
        # client CPU the 'off' runs used.
        cost = per_event_cost_us(provider, threads)
        off = summary["configs"]["off"]
        jobs_s = off["gbps_median"] * 1e9 / (workload.sizes[0] * geometry.block_bytes)
        client = statistics.median(r.cpu.get("client", 0.0) for r in comp.runs["off"])
        summary["per_job_cpu_us"] = cost
        summary["span_shape_cpu_us_per_job"] = span_shape_cost_us(receiver.traces_endpoint)
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
        provider.shutdown()
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
        _alternate(drivers, workload, rounds, duration_s, 20, testbed, source, caches,
                   geometry.block_bytes, comp, guard)
        return comp.summary()
    finally:
        for d in drivers.values():
            d.close()
        testbed.set_rtt(0.0)
