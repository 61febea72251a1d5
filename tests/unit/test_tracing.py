"""SpanExporter's hand-off: receive threads only queue sampled events; the trace thread builds
the spans (root + phase children, parent context kept) off the data path; a full queue drops
and counts instead of blocking. Spans land in the SDK's in-memory exporter here (SdkWriter);
the lean OTLP writer is checked in test_otlp_http and, against a real collector, in
test_e2e_observability."""

from __future__ import annotations

import logging
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode, set_span_in_context

from connector.observability import tracing
from connector.observability.events import LoadEvent, SaveEvent
from connector.observability.tracing import SdkWriter, SpanExporter


@pytest.fixture
def traced():
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    exporters = []

    def make(ratio: float = 1.0) -> SpanExporter:
        exporters.append(SpanExporter(ratio, 0, "test", writer=SdkWriter(provider, False)))
        return exporters[-1]

    yield make, memory, provider
    for e in exporters:
        e.shutdown()


def load_event(code: str = "", parent=None, sampled: bool = True) -> LoadEvent:
    t = time.perf_counter()
    return LoadEvent(thread=2, tp_rank=0, request_hash="abcd", keys=4, nbytes=4096,
                     failed_blocks=4 if code else 0, code=code, t_enqueue=t, t_start=t + 0.001,
                     t_prepared=t + 0.002, t_lookup_end=t + 0.003 if sampled else t + 0.002,
                     t_end=t + 0.004, lookup_sampled=sampled, trace_parent=parent)


def test_load_spans_are_built_off_the_calling_thread(traced):
    make, memory, provider = traced
    exp = make()
    parent = provider.get_tracer("t").start_span("request")
    exp.on_load(load_event(parent=set_span_in_context(parent)))
    assert memory.get_finished_spans() == ()  # nothing built on the receive thread
    deadline = time.monotonic() + 5
    while len(memory.get_finished_spans()) < 5:
        assert time.monotonic() < deadline, "trace thread never built the spans"
        time.sleep(0.02)
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert set(spans) == {"mooncake.load", "queue_wait", "prepare", "master_lookup", "transfer"}
    root = spans["mooncake.load"]
    assert root.parent.span_id == parent.get_span_context().span_id
    assert root.context.trace_id == parent.get_span_context().trace_id
    for name in ("queue_wait", "prepare", "master_lookup", "transfer"):
        assert spans[name].parent.span_id == root.context.span_id
    assert root.attributes["thread"] == 2 and root.attributes["bytes"] == 4096
    assert abs((root.end_time - root.start_time) - 4_000_000) < 10_000  # event timestamps


def test_failed_load_sets_error_status_and_save_spans(traced):
    make, memory, _ = traced
    exp = make()
    exp.on_load(load_event(code="-704", sampled=False))
    t = time.perf_counter()
    exp.on_save(SaveEvent(tp_rank=0, request_hash="ef", keys=2, skipped=1, failed_keys=0,
                          nbytes=10, code="", failed_op="save", t_enqueue=t, t_start=t,
                          t_ready=t, t_exists_end=t, t_end=t + 0.001))
    exp.flush()
    names = sorted(s.name for s in memory.get_finished_spans())
    assert names == sorted(["mooncake.load", "queue_wait", "prepare", "transfer",
                            "mooncake.save", "ready_wait", "exists", "put"])
    load = next(s for s in memory.get_finished_spans() if s.name == "mooncake.load")
    assert load.status.status_code == StatusCode.ERROR and load.attributes["error_code"] == "-704"


def test_ratio_zero_builds_nothing(traced):
    make, memory, _ = traced
    exp = make(ratio=0.0)
    for _ in range(100):
        exp.on_load(load_event())
    exp.flush()
    assert memory.get_finished_spans() == ()


def test_full_queue_drops_and_counts(traced, monkeypatch):
    make, memory, _ = traced
    monkeypatch.setattr(tracing, "MAX_PENDING", 3)
    monkeypatch.setattr(tracing, "BATCH_INTERVAL_S", 3600)  # the trace thread stays asleep
    exp = make()
    for _ in range(10):
        exp.on_load(load_event(sampled=False))
    assert exp.dropped == 7
    exp.shutdown()  # drains what was queued
    assert len([s for s in memory.get_finished_spans() if s.name == "mooncake.load"]) == 3


def test_sdk_writer_of_our_own_uses_the_sampled_ids():
    """The ids told to the metrics (exemplars) are the ids of the exported root span, through
    the SDK too (its id generator hands over the ids the sampler chose)."""
    memory = InMemorySpanExporter()
    ids = tracing.PresetIds()
    provider = TracerProvider(id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    told: list[tuple[str, str]] = []
    exp = SpanExporter(1.0, 0, "test", writer=SdkWriter(provider, False, ids),
                       on_traced=lambda ev, trace_id, span_id: told.append((trace_id, span_id)))
    for _ in range(3):
        exp.on_load(load_event())
    exp.shutdown()
    roots = [s for s in memory.get_finished_spans() if s.name == "mooncake.load"]
    assert {(f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}") for s in roots} == \
        set(told) and len(told) == 3
    kids = [s for s in memory.get_finished_spans() if s.name != "mooncake.load"]
    assert len({s.context.span_id for s in kids + roots}) == len(kids) + len(roots)


@pytest.mark.parametrize("fail", [False, True], ids=["collector_stuck", "shutdown_fails"])
def test_subscribers_shutdown_is_bounded_and_its_error_logged(fail, caplog):
    """The connector stops its subscribers through Publisher.shutdown before it closes the
    store client: a tracer whose collector does not answer is left behind after SHUTDOWN_S
    (its exports would hold it STUCK_S), one whose exporter fails is logged, neither raises."""
    from connector.observability.events import SHUTDOWN_S, Publisher
    from tests.tracing_kit import STUCK_S, timed_shutdown, trace_with

    caplog.set_level(logging.WARNING, logger="vllm.connector.observability.events")
    events = Publisher()
    writer = trace_with(events.add, fail)
    took = timed_shutdown(events.shutdown, writer)
    assert took < SHUTDOWN_S + (STUCK_S - SHUTDOWN_S) / 2, took
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert ("failed to shut down" if fail else "still stopping after") in logged, logged
