"""The lean OTLP/HTTP writer: what it posts must decode with the official opentelemetry-proto
classes into the same spans the SDK would make (ids, parent links, timestamps, attributes,
status, resource), honour the OTLP exporter environment (endpoint, headers, gzip), and never
raise when the collector is down."""

from __future__ import annotations

import gzip
import http.server
import threading
import time

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from connector.observability import otlp_http
from connector.observability.events import LoadEvent
from connector.observability.tracing import OtlpWriter, SpanExporter
from devkit.local_cluster import free_port


class Sink:
    """A real HTTP endpoint on loopback that keeps every request it receives."""

    def __init__(self, status: int = 200) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                sink.requests.append((dict(self.headers), body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def decoded(self) -> list[ExportTraceServiceRequest]:
        out = []
        for headers, body in self.requests:
            if headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            out.append(ExportTraceServiceRequest.FromString(body))
        return out

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def sink():
    s = Sink()
    yield s
    s.close()


def event(code: str = "", parent=None) -> LoadEvent:
    t = time.perf_counter()
    return LoadEvent(thread=3, tp_rank=1, request_hash="feed", keys=4,
                     nbytes=-1 if code else 1 << 19,
                     failed_blocks=4 if code else 0, code=code, t_enqueue=t, t_start=t + 0.001,
                     t_prepared=t + 0.002, t_lookup_end=t + 0.003, t_end=t + 0.004,
                     lookup_sampled=True, trace_parent=parent)


def export(sink: Sink, events, env: dict | None = None) -> list:
    writer = OtlpWriter({"service.name": "unit"},
                        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink.url, **(env or {})})
    exp = SpanExporter(1.0, 1, "worker", writer=writer)
    for ev in events:
        exp.on_load(ev)
    exp.shutdown()
    spans = [s for r in sink.decoded() for rs in r.resource_spans for ss in rs.scope_spans
             for s in ss.spans]
    return spans


def test_spans_decode_with_the_official_protobuf(sink):
    parent = SpanContext(0x1234, 0x99, is_remote=True, trace_flags=TraceFlags(1))
    spans = export(sink, [event(parent=set_span_in_context(NonRecordingSpan(parent))),
                          event(code="-704")])
    req = sink.decoded()[0]
    resource = {kv.key: kv.value.string_value for kv in req.resource_spans[0].resource.attributes}
    assert resource["service.name"] == "unit" and "telemetry.sdk.language" in resource
    assert req.resource_spans[0].scope_spans[0].scope.name == "connector"
    roots = [s for s in spans if s.name == "mooncake.load"]
    assert len(roots) == 2 and len(spans) == 10
    linked, fresh = roots
    assert linked.trace_id == (0x1234).to_bytes(16, "big")
    assert linked.parent_span_id == (0x99).to_bytes(8, "big")
    assert fresh.parent_span_id == b"" and fresh.trace_id != linked.trace_id
    for root in roots:
        children = [s for s in spans if s.parent_span_id == root.span_id]
        assert sorted(c.name for c in children) == ["master_lookup", "prepare", "queue_wait",
                                                    "transfer"]
        assert all(c.trace_id == root.trace_id for c in children)
        assert root.end_time_unix_nano - root.start_time_unix_nano == pytest.approx(4e6, abs=1e4)
        assert abs(root.start_time_unix_nano - time.time_ns()) < 60e9
        assert root.kind == root.SPAN_KIND_INTERNAL
    attrs = {kv.key: kv.value for kv in linked.attributes}
    assert attrs["thread"].int_value == 3 and attrs["bytes"].int_value == 1 << 19
    assert attrs["status"].string_value == "ok" and attrs["request_hash"].string_value == "feed"
    bad = {kv.key: kv.value for kv in fresh.attributes}
    assert bad["bytes"].int_value == -1  # negative ints survive the varint encoding
    assert fresh.status.code == fresh.status.STATUS_CODE_ERROR
    assert "-704" in fresh.status.message and linked.status.code == 0


def test_unsampled_parent_gets_no_spans(sink):
    parent = SpanContext(0x1234, 0x99, is_remote=True, trace_flags=TraceFlags(0))
    assert export(sink, [event(parent=set_span_in_context(NonRecordingSpan(parent)))]) == []


def test_headers_gzip_and_generic_endpoint(sink):
    base = sink.url.removesuffix("/v1/traces")
    writer = OtlpWriter({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": base + "/",
                             "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=a%20b,bogus",
                             "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip"})
    assert writer.exporter.url == sink.url
    exp = SpanExporter(1.0, 0, "worker", writer=writer)
    exp.on_load(event())
    exp.shutdown()
    headers, _ = sink.requests[0]
    assert headers["x-api-key"] == "a b" and headers["Content-Encoding"] == "gzip"
    assert len(sink.decoded()[0].resource_spans[0].scope_spans[0].spans) == 5


def test_collector_down_or_refusing_counts_failures():
    refusing = Sink(status=503)
    try:
        for url in (refusing.url, f"http://127.0.0.1:{free_port()}/v1/traces"):
            writer = OtlpWriter({}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url,
                                     "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "2000"})
            exp = SpanExporter(1.0, 0, "worker", writer=writer)
            exp.on_load(event())
            exp.shutdown()
            assert writer.exporter.failed == 5 and writer.exporter.exported == 0
    finally:
        refusing.close()


def test_vllm_provider_is_not_exported_through():
    """vLLM installs an SDK provider in every process when the endpoint variable is set;
    exporting through it would sample the jobs a second time (its sampler reads the same
    OTEL_TRACES_SAMPLER) and lose the connector's ids. It only makes grpc, vLLM's exporter
    default, the default protocol."""
    from opentelemetry import trace

    from connector.observability.tracing import SdkWriter, make_writer

    assert isinstance(make_writer({}, {}), OtlpWriter)
    writers = [make_writer({}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})]
    provider = TracerProvider()
    orig = trace.get_tracer_provider
    trace.get_tracer_provider = lambda: provider
    try:
        writers.append(make_writer({}, {}))
        explicit = make_writer({}, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    finally:
        trace.get_tracer_provider = orig
    assert isinstance(explicit, OtlpWriter)
    for w in writers:
        assert isinstance(w, SdkWriter) and w._provider is not provider and w.honours_ids
        w.shutdown()


def test_varint_matches_protobuf():
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    for v in (0, 1, 127, 128, 300, 2**40, -1, -(2**63), 2**63 - 1):
        assert AnyValue.FromString(otlp_http._any_value(v)).int_value == v
    assert AnyValue.FromString(otlp_http._any_value(2.5)).double_value == 2.5
    assert AnyValue.FromString(otlp_http._any_value(True)).bool_value is True
    assert AnyValue.FromString(otlp_http._any_value("ü")).string_value == "ü"


def test_exemplar_ids_are_the_exported_span_ids(sink):
    """The ids handed to the metrics (exemplars) when a job is sampled are the ids the root
    `mooncake.load` span is posted with."""
    writer = OtlpWriter({"service.name": "unit"}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": sink.url})
    told: list[tuple[str, str]] = []
    exp = SpanExporter(1.0, 1, "worker", writer=writer,
                       on_traced=lambda ev, trace_id, span_id: told.append((trace_id, span_id)))
    for _ in range(3):
        exp.on_load(event())
    exp.shutdown()
    roots = {(s.trace_id.hex(), s.span_id.hex()) for r in sink.decoded()
             for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans
             if s.name == "mooncake.load"}
    assert len(told) == 3 and set(told) == roots
