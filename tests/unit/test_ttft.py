"""Where a store hit's TTFT goes (connector.observability.ttft): the worker's per-request load times
(from its step hooks and the load events) and their merge over TP ranks through vLLM's transport;
the scheduler's timeline, phase by phase, for an asynchronous and an in-step load; the metrics and
the `mooncake.request` span built from it; and the in-step policy
(connector.scheduler.step_loads)."""

from __future__ import annotations

import pickle

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from connector.observability import ttft
from connector.observability.events import (
    LoadEvent,
    Publisher,
    RequestEvent,
    Subscriber,
    request_hash,
)
from connector.observability.metric_catalog import TTFT_PHASES
from connector.observability.stats import StatsRecorder
from connector.observability.tracing import SdkWriter, SpanExporter
from connector.observability.ttft import LoadClock, LoadTimes, RankLoad, RequestClock
from connector.scheduler import step_loads
from connector.scheduler.step_loads import StepLoadPolicy


def load_event(req_id: str, t_enqueue: float, t_start: float, t_end: float, keys: int = 4,
               code: str = "") -> LoadEvent:
    return LoadEvent(0, 0, request_hash(req_id), keys, 0 if code else keys * 10, 0, code,
                     t_enqueue, t_start, t_start, t_start, t_end, False)


class Events(Subscriber):
    def __init__(self) -> None:
        self.requests: list[RequestEvent] = []

    def on_request(self, ev: RequestEvent) -> None:
        self.requests.append(ev)


def test_worker_clock_times_each_request_from_metadata_to_report():
    clock = LoadClock()
    clock.in_step = True
    clock.received(["a"], 10.0)
    clock.queued({"a": 2}, 10.5)  # split into two jobs
    clock.on_load(load_event("a", 10.5, 10.6, 11.0))
    clock.reported(["a"], 11.5)
    assert clock.take() is None  # one job's event still to come: not complete yet
    clock.on_load(load_event("a", 10.5, 10.7, 11.2))
    times = clock.take()
    assert times.in_step and set(times.loads) == {"a"}
    a = times.loads["a"]
    assert (a.start, a.queue, a.transfer, a.report) == pytest.approx((0.5, 0.1, 0.6, 0.3))
    assert a.blocks == 8 and not a.failed and a.ranks == 1
    assert clock.take() is None  # handed over once


def test_worker_clock_ignores_events_of_requests_it_was_not_told_about():
    clock = LoadClock()
    clock.on_load(load_event("x", 1.0, 1.1, 1.2))
    clock.reported(["x"], 1.3)
    assert clock.take() is None


def test_load_times_merge_over_ranks_keeps_the_slower_rank_through_pickle():
    r0 = LoadTimes({"a": RankLoad(0.1, 0.0, 0.2, 0.1, 4, False)}, in_step=True)
    r1 = LoadTimes({"a": RankLoad(0.1, 0.1, 0.5, 0.1, 4, True),
                    "b": RankLoad(0.0, 0.0, 0.1, 0.0, 2, False)}, in_step=False)
    agg = pickle.loads(pickle.dumps(r0)).aggregate(pickle.loads(pickle.dumps(r1)))
    a = agg.loads["a"]
    assert (a.transfer, a.ranks, a.failed) == (0.5, 2, True)
    assert agg.loads["b"].ranks == 1 and agg.in_step is False


def test_worker_reports_count_the_ranks_holding_each_preload_through_pickle():
    """vLLM folds the TP ranks' reports into the first (KVOutputAggregator): per request,
    the ranks whose preload was read whole add up, the layouts and load times merge."""
    from connector.metadata import WorkerReport

    r0 = WorkerReport({0: "sig"}, None, {"a": 1, "b": 1})
    r1 = WorkerReport({1: "sig"}, LoadTimes({"x": RankLoad(0.0, 0.0, 0.1, 0.0, 2, False)},
                                            True), {"a": 1})
    agg = pickle.loads(pickle.dumps(r0)).aggregate(pickle.loads(pickle.dumps(r1)))
    assert agg.preloaded == {"a": 2, "b": 1}
    assert agg.layout == {0: "sig", 1: "sig"} and agg.load_times.loads["x"].blocks == 2


def test_async_timeline_has_every_phase_and_they_sum_to_the_store_time(monkeypatch):
    events = Events()
    clock = RequestClock(Publisher(events), tp_size=1)
    now = iter([1.0])
    monkeypatch.setattr(ttft.time, "perf_counter", lambda: next(now))
    clock.arrived("r", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    clock.answered("r", 1.004)
    clock.sent("r", "async", 30, 1.010)
    clock.seen_done(["r"], 1.100)
    clock.worker_times(LoadTimes({"r": RankLoad(0.020, 0.005, 0.030, 0.015, 30, False)}, True))
    assert events.requests == []  # the prefill is not scheduled yet
    clock.scheduled(["other", "r"], 1.130)
    (ev,) = events.requests
    phases = dict(ev.phases)
    assert list(phases) == list(TTFT_PHASES)
    assert phases == pytest.approx({"lookup": 0.004, "admit": 0.006, "load_start": 0.020,
                                    "load_queue": 0.005, "load_transfer": 0.030,
                                    "load_report": 0.015, "handoff": 0.020,
                                    "reschedule": 0.030})
    assert ev.seconds == pytest.approx(0.130) and ev.mode == "async" and ev.blocks == 30
    assert ev.request_hash == request_hash("r") and ev.trace_headers
    clock.scheduled(["r"], 2.0)
    assert len(events.requests) == 1  # published once


def test_in_step_load_of_a_request_finished_in_that_step_is_still_published():
    """vLLM finishes a one-step request before it passes the scheduler that step's worker
    output, so the timeline must outlive request_finished for a few steps."""
    events = Events()
    clock = RequestClock(Publisher(events), tp_size=2)
    clock.arrived("r", None)
    clock.answered("r", 0.0)
    clock.sent("r", "sync", 4, 5.0)
    clock.forget("r")  # request_finished comes first
    clock.worker_times(LoadTimes({"r": RankLoad(0.0, 0.001, 0.004, 0.0, 4, False)}, True))
    assert events.requests == []  # one TP rank of two so far
    clock.scheduled([], 5.1)
    clock.worker_times(LoadTimes({"r": RankLoad(0.0, 0.001, 0.006, 0.0, 4, False)}, True))
    (ev,) = events.requests
    assert [p for p, _ in ev.phases] == list(TTFT_PHASES[:6])  # no handoff, no reschedule
    assert dict(ev.phases)["load_transfer"] == pytest.approx(0.006)


def test_a_finished_request_whose_workers_never_report_is_dropped():
    clock = RequestClock(Publisher(), tp_size=1)
    clock.arrived("r", None)
    clock.sent("r", "sync", 4, 1.0)
    clock.forget("r")
    for _ in range(ttft.FINISHED_STEPS):
        clock.scheduled([], 2.0)
    assert not clock._finished and not clock._open


def test_timelines_dropped_past_the_bound_are_counted(monkeypatch):
    """More requests looked up and not finished than MAX_OPEN: the oldest arrival's timeline
    goes (a store hit's TTFT never published), and so does a finished in-step load's past the
    bound; each is counted on /metrics, not lost without a trace."""
    monkeypatch.setattr(ttft, "MAX_OPEN", 2)
    rec = StatsRecorder()
    clock = RequestClock(Publisher(rec), tp_size=1, count=rec.count)
    for rid in ("oldest", "b", "c"):
        clock.arrived(rid, None)
    assert list(clock._open) == ["b", "c"]
    for rid in ("b", "c"):
        clock.sent(rid, "sync", 1, 1.0)
        clock.forget(rid)  # finished before the workers' account: kept while room lasts
    clock.arrived("d", None)
    clock.sent("d", "sync", 1, 1.0)
    clock.forget("d")
    assert list(clock._finished) == ["b", "c"] and not clock._open
    assert rec.snapshot().data["c"] == {"ttft_store_dropped": 2}


def test_request_event_feeds_histograms_and_a_span_per_request():
    ev = RequestEvent("abcd", "async", 30, True, 100.0,
                      tuple((p, 0.001 * (i + 1)) for i, p in enumerate(TTFT_PHASES)),
                      {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    rec = StatsRecorder()
    rec.on_request(ev)
    h = rec.snapshot().data["h"]
    assert h["ttft_store_seconds|async"] == [pytest.approx(0.036)]
    assert h["ttft_store_phase_seconds|handoff"] == [pytest.approx(0.007)]
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    exp = SpanExporter(1.0, 0, "scheduler", writer=SdkWriter(provider, False))
    exp.on_request(ev)
    exp.shutdown()
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert set(spans) == {"mooncake.request", *TTFT_PHASES}
    root = spans["mooncake.request"]
    assert f"{root.context.trace_id:032x}" == "a" * 32  # joins the request's incoming trace
    assert f"{root.parent.span_id:016x}" == "b" * 16
    assert root.status.status_code == StatusCode.ERROR and root.attributes["blocks"] == 30
    assert abs((root.end_time - root.start_time) - 36_000_000) < 10_000
    # Phases follow one another from the arrival.
    starts = [spans[p].start_time for p in TTFT_PHASES]
    assert starts == sorted(starts) and starts[0] == root.start_time


def times(per_block: float, blocks: int = 10, failed: bool = False,
          in_step: bool = True) -> LoadTimes:
    return LoadTimes({"x": RankLoad(0.0, 0.0, per_block * blocks, 0.0, blocks, failed)},
                     in_step)


def test_policy_puts_loads_in_the_step_within_its_budget():
    p = StepLoadPolicy(0.020)
    assert not p.take(1)  # no estimate yet: asynchronous
    p.observe(times(0.001))
    assert p.take(12) and not p.take(12) and p.take(8)  # 20 ms per step, shared
    p.new_step()
    assert p.take(20) and not p.take(1)


def test_policy_stays_asynchronous_when_off_or_unsafe_or_after_a_failure(monkeypatch):
    off = StepLoadPolicy(0.0)
    off.observe(times(0.001))
    assert not off.take(1)
    unsafe = StepLoadPolicy(0.020)
    unsafe.observe(times(0.001, in_step=False))  # a worker that cannot stop a late copy
    assert not unsafe.take(1)
    p = StepLoadPolicy(0.020)
    p.observe(times(0.001))
    p.observe(times(0.001, failed=True))
    assert not p.take(1)
    now = step_loads.time.monotonic()
    monkeypatch.setattr(step_loads.time, "monotonic", lambda: now + step_loads.BACKOFF_S + 1)
    assert p.take(1)


def test_policy_estimate_does_not_stick_on_one_slow_in_step_load():
    """One slow in-step load (a host hiccup) must not switch in-step loads off for good:
    no in-step load would ever refresh its estimate, but asynchronous loads still do (they
    read slower than in-step ones, so they are the pessimistic estimate)."""
    p = StepLoadPolicy(0.020)
    p.observe(LoadTimes({"x": RankLoad(0.0, 0.0, 0.5, 0.0, 10, False, in_step=True)}, True))
    assert not p.take(4)  # 10 blocks took 500 ms in the step
    for _ in range(3):  # asynchronous loads (of a worker that can load in the step): 1 ms/block
        p.observe(LoadTimes({"y": RankLoad(0.0, 0.0, 0.010, 0.0, 10, False, in_step=False)},
                            True))
    p.new_step()
    assert p.take(4), "the slow in-step load's estimate stuck"


def test_policy_charges_a_fixed_cost_per_load():
    """Loads of 1 and 10 blocks took 10 and 19 ms: about 9 ms per load plus 1 ms per block.
    A per-block rate alone would charge 5 blocks far more (or one block far less)."""
    p = StepLoadPolicy(0.020)
    p.observe(times(0.010, blocks=1))
    p.observe(times(0.0019, blocks=10))
    assert p.take(5)
    assert abs(p.cost(5) - 0.014) < 0.001, p.cost(5)
    assert not p.take(1)  # 9 ms + 1 ms does not fit the 6 ms left


def test_worker_clock_counts_token_blocks_on_hybrid_models():
    """A hybrid model loads each group's blocks of the same prefix in a job of its own (here
    a full-attention group of 8 blocks and a sliding-window group of 2): the load covers 8
    token blocks, the unit the scheduler charges, not 10."""
    clock = LoadClock()
    clock.received(["h"], 10.0)
    clock.queued({"h": 2}, 10.0)
    full = load_event("h", 10.0, 10.1, 10.5, keys=8)
    window = load_event("h", 10.0, 10.1, 10.3, keys=2)
    window.group = 1
    clock.on_load(full)
    clock.on_load(window)
    clock.reported(["h"], 10.6)
    assert clock.take().loads["h"].blocks == 8


def test_policy_charges_copies_from_preloads_apart_from_store_reads():
    """A load copied from its preload (connector.worker.preload) took a memory copy's time:
    it is the estimate of other copies, never of store reads (it would put reads of the same
    size in the step, over budget). A copy is charged a read's estimate until one was seen."""
    p = StepLoadPolicy(0.020)
    fast = RankLoad(0.0, 0.0, 0.0001, 0.0, 10, False, in_step=True, preloaded=True)
    p.observe(LoadTimes({"x": fast}, True))
    assert p.cost(10) is None and not p.take(1)
    assert p.cost(10, copied=True) == pytest.approx(0.0001)
    read = RankLoad(0.0, 0.0, 0.050, 0.0, 10, False)  # an asynchronous read: 5 ms per block
    p.observe(LoadTimes({"y": read}, True))
    assert p.cost(5) == pytest.approx(0.025) and not p.take(5)
    taken = sum(p.take(10, copied=True) for _ in range(300))
    assert 199 <= taken <= 200  # 0.1 ms each: the 20 ms budget holds 200 (to rounding)
    q = StepLoadPolicy(0.020)
    q.observe(LoadTimes({"y": read}, True))
    assert q.cost(10, copied=True) == q.cost(10) == pytest.approx(0.050)  # no copy seen yet
    merged = LoadTimes({"x": fast}, True).aggregate(LoadTimes({"x": RankLoad(
        0.0, 0.0, 0.5, 0.0, 10, False, in_step=True)}, True))
    assert merged.loads["x"].preloaded  # a rank that copied makes the request's load so
