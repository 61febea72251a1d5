"""OpenTelemetry tracing subscriber: one span per load job (`mooncake.load`, with children
`queue_wait`, `prepare`, `master_lookup`, `transfer`), per save job (`mooncake.save`, with
`ready_wait`, `exists`, `put`), and, on the scheduler, per request that loaded from the store
(`mooncake.request`, from its arrival to its prefill, with one child per phase of `ttft`;
its parent is the request's incoming trace context, when it has one).

Configured by the standard OTEL_* environment variables: tracing is on when
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (or OTEL_EXPORTER_OTLP_ENDPOINT) is set and OTEL_SDK_DISABLED
is not "true"; OTEL_TRACES_SAMPLER[_ARG] choose the jobs (`sampling.TraceSampler`). With tracing
off, or the always_off sampler, the subscriber is not even registered.

Two span writers, same spans, both with the ids the connector's sampler chose (the metrics
carry them as exemplars):
- `OtlpWriter` (http/protobuf): encodes the spans straight to OTLP protobuf and posts them over
  OTLP/HTTP (`connector.observability.otlp_http`), the cheap path;
- `SdkWriter` (grpc): through an OpenTelemetry SDK TracerProvider of our own, at several times
  the CPU of the OTLP writer (both per load job: docs/benchmark.md, from the benchmark JSON).
vLLM installs an SDK provider in every process when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set;
the connector does not export through it: its sampler (read from the same OTEL_TRACES_SAMPLER)
would sample the connector's jobs a second time, and it picks its own ids.

Off the data path: a receive thread only samples the finished job's event (choosing its trace
id, which the metrics then carry as an exemplar) and appends it to a bounded queue (a few
microseconds); a `mcpool-trace` thread builds the spans from the
event's timestamps in batches, so the next job's transfer never waits for tracing. If the
tracer falls behind (more than MAX_PENDING events waiting) new events are dropped and counted,
never blocking a load.
The parent context is captured when the job is enqueued and carried in the job, because thread
instrumentation does not follow work through a long-lived queue.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from connector.observability import otlp_http
from connector.observability.events import (
    QUEUED_THREAD,
    LoadEvent,
    RequestEvent,
    SaveEvent,
    Subscriber,
)
from connector.observability.sampling import (
    DEFAULT_SAMPLE_RATIO,  # noqa: F401 - re-exported (bench)
    DEFAULT_SAMPLER,
    TraceSampler,
)

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level
MAX_PENDING = 16_384  # events waiting for the trace thread (a few seconds at full rate)
BATCH_INTERVAL_S = 0.1
YIELD_EVERY = 16  # jobs whose spans are built between GIL yields


def tracing_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _protocol(environ: Mapping[str, str], default: str = "http/protobuf") -> str:
    return environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                       environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", default))


Phases = list[tuple[str, float, float]]  # a job's child spans: (name, start, end)
Ids = tuple[bytes, bytes, bytes]  # (trace id, root span id, parent span id or b"")


class PresetIds(RandomIdGenerator):
    """Gives the SDK the ids the connector chose for the next root span (only the trace thread
    starts spans on our provider); child spans get random ids."""

    def __init__(self) -> None:
        self.trace_id = self.span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id or super().generate_trace_id()

    def generate_span_id(self) -> int:
        span_id, self.span_id = self.span_id, 0
        return span_id or super().generate_span_id()


class SdkWriter:
    """Spans through an OpenTelemetry SDK TracerProvider (its processors apply). With `ids`
    (the provider's id generator) the spans get the connector's ids; without (a provider from
    elsewhere, e.g. tests and the benchmark) the SDK picks them and they are no exemplars."""

    def __init__(self, provider: Any, owned: bool, ids: PresetIds | None = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        self._provider, self._owned, self._ids = provider, owned, ids
        self.honours_ids = ids is not None
        self._tracer = provider.get_tracer("connector")
        self._set_in_context = trace.set_span_in_context
        self._error = lambda code: Status(StatusCode.ERROR, f"mooncake code {code}")

    @classmethod
    def own(cls, resource_attrs: dict[str, str], environ: Mapping[str, str]) -> SdkWriter:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        if _protocol(environ) == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        # The connector's sampler has decided already; the provider must not sample again.
        ids = PresetIds()
        provider = TracerProvider(resource=Resource.create(resource_attrs), sampler=ALWAYS_ON,
                                  id_generator=ids)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider, owned=True, ids=ids)

    def job(self, name: str, ids: Ids, parent: Any, t0: int, t1: int, attrs: dict[str, Any],
            code: str, phases: list[tuple[str, int, int]]) -> None:
        if self._ids is not None:
            self._ids.trace_id = int.from_bytes(ids[0], "big")
            self._ids.span_id = int.from_bytes(ids[1], "big")
        root = self._tracer.start_span(name, context=parent, start_time=t0, attributes=attrs)
        ctx = self._set_in_context(root)
        for child, a, b in phases:
            self._tracer.start_span(child, context=ctx, start_time=a).end(end_time=b)
        if code:
            root.set_status(self._error(code))
        root.end(end_time=t1)

    def flush(self) -> None:
        """The provider's span processor batches and exports on its own."""

    def force_flush(self) -> None:
        """Export what the provider's processors hold now (benchmarks, tests)."""
        self._provider.force_flush(30_000)

    def shutdown(self) -> None:
        if self._owned:
            self._provider.shutdown()


class OtlpWriter:
    """Spans encoded straight to OTLP protobuf, one HTTP post per batch (see otlp_http), with
    the ids `SpanExporter` chose when it sampled the job."""

    SCOPE = "connector"
    honours_ids = True

    def __init__(self, resource_attrs: dict[str, str], environ: Mapping[str, str]) -> None:
        self.exporter = otlp_http.OtlpHttpExporter(resource_attrs, environ)
        self._batch: list[bytes] = []

    def job(self, name: str, ids: Ids, parent: Any, t0: int, t1: int, attrs: dict[str, Any],
            code: str, phases: list[tuple[str, int, int]]) -> None:
        trace_id, root_id, parent_id = ids
        child_ids = random.randbytes(8 * len(phases))
        span, name_field = otlp_http.span, otlp_http.name_field
        self._batch.append(span(trace_id, root_id, parent_id, name_field(name), t0, t1,
                                otlp_http.attributes(attrs, 9),
                                f"mooncake code {code}" if code else ""))
        for i, (child, a, b) in enumerate(phases):
            self._batch.append(span(trace_id, child_ids[8 * i:8 * i + 8], root_id,
                                    name_field(child), a, b))

    def flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self.exporter.export(batch, self.SCOPE)

    def shutdown(self) -> None:
        self.flush()
        self.exporter.shutdown()


def make_writer(resource_attrs: dict[str, str],
                environ: Mapping[str, str] = os.environ) -> SdkWriter | OtlpWriter:
    """The lean OTLP/HTTP writer for http/protobuf, an SDK provider of our own for grpc. With no
    protocol variable the OTLP default (http/protobuf) applies, unless vLLM set up its provider
    in this process: that one exports over grpc by default, to the same endpoint."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    vllm_default = "grpc" if isinstance(trace.get_tracer_provider(), TracerProvider) \
        else "http/protobuf"
    if _protocol(environ, vllm_default) == "grpc":
        return SdkWriter.own(resource_attrs, environ)
    return OtlpWriter(resource_attrs, environ)


Traced = Callable[[LoadEvent, str, str], None]  # (event, trace id hex, root span id hex)


def _incoming_context(ev: RequestEvent) -> Any:
    """The request's incoming W3C trace context (the traceparent vLLM kept), or None."""
    if not ev.trace_headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(ev.trace_headers)


class SpanExporter(Subscriber):
    """Turns sampled job events into OpenTelemetry spans (lookups are covered by metrics; a
    span per scheduler lookup would be noise)."""

    MAX_BATCH = 512  # jobs per writer flush (one OTLP post)

    def __init__(self, sampler: TraceSampler | float, tp_rank: int, process_kind: str,
                 writer: SdkWriter | OtlpWriter | None = None,
                 on_traced: Traced | None = None) -> None:
        """`sampler`: a TraceSampler, or a ratio for parentbased_traceidratio. `writer`: where
        spans go; by default chosen by `make_writer`. `on_traced`: told the ids of every
        sampled load job, on the job's thread (the metrics' exemplars); only with a writer
        that uses those ids."""
        from opentelemetry import context, trace

        self.writer = writer or make_writer(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME", "vllm-mooncake-pool"),
             "mooncake_pool.process_kind": process_kind, "mooncake_pool.tp_rank": str(tp_rank)})
        self.get_context = context.get_current
        self._span_context = lambda ctx: trace.get_current_span(ctx).get_span_context()
        self.sampler = sampler if isinstance(sampler, TraceSampler) else \
            TraceSampler(DEFAULT_SAMPLER, sampler)
        self._on_traced = on_traced if self.writer.honours_ids else None
        self._offset_ns = time.time_ns() - time.perf_counter_ns()
        self._pending: deque[tuple[LoadEvent | SaveEvent | RequestEvent, Ids]] = deque()
        self.dropped = 0
        self._flush_lock = threading.Lock()  # the trace thread vs an explicit flush()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mcpool-trace", daemon=True)
        self._thread.start()

    # ---- receive / save threads: sample and hand over ----------------------------------------
    def _offer(self, ev: LoadEvent | SaveEvent | RequestEvent, parent_ctx: Any) -> None:
        parent = None if parent_ctx is None else self._span_context(parent_ctx)
        picked = self.sampler.sample(parent)
        if picked is None:
            return
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1  # racy increments may undercount; it is a diagnostic
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                logger.warning("tracing is behind: %d job spans dropped so far (lower "
                               "trace_sample_ratio)", self.dropped)
            return
        ids = (picked[0], random.randbytes(8), picked[1])
        self._pending.append((ev, ids))  # deque.append is atomic: no lock on the data path
        if self._on_traced is not None and isinstance(ev, LoadEvent):
            self._on_traced(ev, ids[0].hex(), ids[1].hex())

    def on_load(self, ev: LoadEvent) -> None:
        self._offer(ev, ev.trace_parent)

    def on_save(self, ev: SaveEvent) -> None:
        self._offer(ev, ev.trace_parent)

    def on_request(self, ev: RequestEvent) -> None:
        self._offer(ev, _incoming_context(ev))


    # ---- trace thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(BATCH_INTERVAL_S):
            self.flush()

    def flush(self) -> None:
        """Write the spans of every event handed over so far (trace thread, tests, shutdown)."""
        with self._flush_lock:
            n = 0
            while self._pending:
                ev, ids = self._pending.popleft()
                try:
                    if isinstance(ev, LoadEvent):
                        self._load_spans(ev, ids)
                    elif isinstance(ev, SaveEvent):
                        self._save_spans(ev, ids)
                    else:
                        self._request_spans(ev, ids)
                except Exception:  # a bad span must not stop the tracer
                    logger.exception("building spans failed")
                n += 1
                if n % YIELD_EVERY == 0:
                    # Let receive threads back in: they wait for the GIL after each store call,
                    # and a batch held for milliseconds would stall their next call.
                    time.sleep(0)
                if n % self.MAX_BATCH == 0:
                    self.writer.flush()
            self.writer.flush()

    def _ns(self, t: float) -> int:
        return self._offset_ns + int(t * 1e9)

    def _job(self, name: str, ids: Ids, parent: Any, t0: float, t1: float,
             attrs: dict[str, Any], code: str, phases: Phases) -> None:
        ns = self._ns
        self.writer.job(name, ids, parent, ns(t0), ns(t1), attrs, code,
                        [(n, ns(a), ns(b)) for n, a, b in phases])

    def _load_spans(self, ev: LoadEvent, ids: Ids) -> None:
        phases = [("queue_wait", ev.t_enqueue, ev.t_start), ("prepare", ev.t_start, ev.t_prepared)]
        if ev.lookup_sampled:
            phases.append(("master_lookup", ev.t_prepared, ev.t_lookup_end))
        phases.append(("transfer", ev.t_lookup_end, ev.t_end))
        thread = QUEUED_THREAD if ev.thread is None else ev.thread
        attrs = {"thread": thread, "tp_rank": ev.tp_rank, "keys": ev.keys,
                 "bytes": ev.nbytes, "status": "ok" if ev.ok else "error",
                 "error_code": ev.code, "failed_blocks": ev.failed_blocks,
                 "request_hash": ev.request_hash}
        self._job("mooncake.load", ids, ev.trace_parent, ev.t_enqueue, ev.t_end, attrs, ev.code,
                  phases)

    def _save_spans(self, ev: SaveEvent, ids: Ids) -> None:
        phases = [("ready_wait", ev.t_start, ev.t_ready), ("exists", ev.t_ready, ev.t_exists_end),
                  ("put", ev.t_exists_end, ev.t_end)]
        attrs = {"tp_rank": ev.tp_rank, "keys": ev.keys, "skipped_keys": ev.skipped,
                 "bytes": ev.nbytes, "status": "error" if ev.code else "ok",
                 "error_code": ev.code, "request_hash": ev.request_hash}
        self._job("mooncake.save", ids, ev.trace_parent, ev.t_enqueue, ev.t_end, attrs, ev.code,
                  phases)

    def _request_spans(self, ev: RequestEvent, ids: Ids) -> None:
        phases, t = [], ev.t_arrival
        for name, seconds in ev.phases:
            phases.append((name, t, t + seconds))
            t += seconds
        attrs = {"request_hash": ev.request_hash, "mode": ev.mode, "blocks": ev.blocks,
                 "status": "error" if ev.failed else "ok"}
        self._job("mooncake.request", ids, _incoming_context(ev), ev.t_arrival, t, attrs,
                  "load_error" if ev.failed else "", phases)

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.flush()
        self.writer.shutdown()
