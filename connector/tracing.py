"""OpenTelemetry tracing subscriber: one span per load job (`mooncake.load`, with children
`queue_wait`, `prepare`, `master_lookup`, `transfer`) and per save job (`mooncake.save`, with
`ready_wait`, `exists`, `put`).

Configured by the standard OTEL_* environment variables: tracing is on when
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (or OTEL_EXPORTER_OTLP_ENDPOINT) is set and OTEL_SDK_DISABLED
is not "true". Spans are built after the job ends from the timestamps in its event, so the
data path pays nothing for them; with tracing off the subscriber is not even registered.
The parent context is captured when the job is enqueued and carried in the job, because thread
instrumentation does not follow work through a long-lived queue.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping
from typing import Any

from connector.events import LoadEvent, LookupEvent, SaveEvent

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level
DEFAULT_SAMPLE_RATIO = 0.05


def tracing_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def sample_ratio(configured: float | None, environ: Mapping[str, str] = os.environ) -> float:
    """extra_config trace_sample_ratio, else OTEL_TRACES_SAMPLER_ARG for ratio samplers."""
    if configured is not None:
        return configured
    if "traceidratio" in environ.get("OTEL_TRACES_SAMPLER", ""):
        try:
            return min(1.0, max(0.0, float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))))
        except ValueError:
            logger.warning("OTEL_TRACES_SAMPLER_ARG is not a number; using %s",
                           DEFAULT_SAMPLE_RATIO)
    return DEFAULT_SAMPLE_RATIO


def _make_provider(resource_attrs: dict[str, str]) -> tuple[Any, bool]:
    """vLLM's SDK provider when it set one up in this process, else our own (owned=True)."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current, False
    proto = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                           os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
    if proto == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    provider = TracerProvider(resource=Resource.create(resource_attrs))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider, True


class SpanExporter:
    """Subscriber that turns sampled job events into OpenTelemetry spans."""

    def __init__(self, ratio: float, tp_rank: int, process_kind: str) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import Status, StatusCode

        self._provider, self._owned = _make_provider(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME", "vllm-mooncake-pool"),
             "mooncake_pool.process_kind": process_kind, "mooncake_pool.tp_rank": str(tp_rank)})
        self._tracer = self._provider.get_tracer("connector")
        self._set_in_context = trace.set_span_in_context
        self._error = lambda code: Status(StatusCode.ERROR, f"mooncake code {code}")
        self.get_context = context.get_current
        self._ratio = ratio
        self._tp_rank = tp_rank
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def _ns(self, t: float) -> int:
        return self._offset_ns + int(t * 1e9)

    def _emit(self, name: str, parent: Any, t0: float, t1: float, attrs: dict[str, Any],
              code: str, phases: list[tuple[str, float, float]]) -> None:
        root = self._tracer.start_span(name, context=parent, start_time=self._ns(t0),
                                       attributes=attrs)
        ctx = self._set_in_context(root)
        for child, a, b in phases:
            self._tracer.start_span(child, context=ctx, start_time=self._ns(a)).end(
                end_time=self._ns(b))
        if code:
            root.set_status(self._error(code))
        root.end(end_time=self._ns(t1))

    def on_load(self, ev: LoadEvent) -> None:
        if random.random() >= self._ratio:
            return
        phases = [("queue_wait", ev.t_enqueue, ev.t_start), ("prepare", ev.t_start, ev.t_prepared)]
        if ev.lookup_sampled:
            phases.append(("master_lookup", ev.t_prepared, ev.t_lookup_end))
        phases.append(("transfer", ev.t_lookup_end, ev.t_end))
        attrs = {"thread": ev.thread, "tp_rank": ev.tp_rank, "keys": ev.keys,
                 "bytes": ev.nbytes, "status": "ok" if ev.ok else "error",
                 "error_code": ev.code, "failed_blocks": ev.failed_blocks,
                 "request_hash": ev.trace_id}
        self._emit("mooncake.load", ev.trace_parent, ev.t_enqueue, ev.t_end, attrs, ev.code,
                   phases)

    def on_save(self, ev: SaveEvent) -> None:
        if random.random() >= self._ratio:
            return
        phases = [("ready_wait", ev.t_start, ev.t_ready), ("exists", ev.t_ready, ev.t_exists_end),
                  ("put", ev.t_exists_end, ev.t_end)]
        attrs = {"tp_rank": ev.tp_rank, "keys": ev.keys, "skipped_keys": ev.skipped,
                 "bytes": ev.nbytes, "status": "error" if ev.code else "ok",
                 "error_code": ev.code, "request_hash": ev.trace_id}
        self._emit("mooncake.save", ev.trace_parent, ev.t_enqueue, ev.t_end, attrs, ev.code,
                   phases)

    def on_lookup(self, ev: LookupEvent) -> None:
        """Lookups are covered by metrics; a span per scheduler lookup would be noise."""

    def shutdown(self) -> None:
        if self._owned:
            self._provider.shutdown()
