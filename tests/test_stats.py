"""Stats payload: aggregation across TP ranks, vLLM's own msgpack transport, bounded size, and
the Prometheus exporter fed with it."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import REGISTRY
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from connector import PooledMooncakeStoreConnector
from connector.events import LoadEvent, LookupEvent, SaveEvent
from connector.prom import PooledStorePromMetrics
from connector.stats import SAMPLE_CAP, PooledStoreStats, StatsRecorder


def load_event(thread: int, rank: int, code: str = "", t: float = 100.0) -> LoadEvent:
    return LoadEvent(thread, rank, "h", 4, 0 if code else 4096, 4 if code else 0, code,
                     t, t + 0.001, t + 0.0015, t + 0.002, t + 0.005, True)


def rank_stats(rank: int, threads: int = 2) -> PooledStoreStats:
    rec = StatsRecorder(rank, threads, lambda: {f"load_queue_depth|{rank}": rank + 1})
    for t in range(threads):
        rec.on_load(load_event(t, rank))
    rec.on_load(load_event(0, rank, code="-704"))
    rec.on_save(SaveEvent(rank, "h", 3, 1, 3 * 4096, "", "save", 0, 0.1, 0.2, 0.3, 0.4))
    return rec.snapshot()


def test_aggregate_across_tp_ranks_keeps_rank_and_thread_identity():
    agg = rank_stats(0).aggregate(rank_stats(1))
    c = agg.data["c"]
    assert c["load_bytes|0|1"] == c["load_bytes|1|1"] == 4096
    assert c["load_jobs|0|0|ok"] == c["load_jobs|1|0|ok"] == 1
    assert c["failures|0|load|-704"] == c["failures|1|load|-704"] == 1
    assert c["load_error_blocks|1"] == 4
    assert agg.data["g"] == {"load_queue_depth|0": 1, "load_queue_depth|1": 2}
    assert len(agg.data["h"]["load_prepare_seconds|1|0"]) == 2
    assert not agg.is_empty()
    red = agg.reduce()
    assert red["load_jobs"] == 6 and red["failures"] == 2 and red["load_prepare_p50_ms"] > 0
    assert agg.aggregate(PooledStoreStats()) is agg  # an empty rank changes nothing


def test_round_trip_through_vllm_transport():
    stats = rank_stats(0).aggregate(rank_stats(1))
    stats = pickle.loads(pickle.dumps(stats))  # worker -> engine core (shm queue)
    sched = SchedulerStats(kv_connector_stats=stats.to_dict())
    decoded = MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(sched))
    assert decoded.kv_connector_stats == stats.to_dict()
    rebuilt = PooledMooncakeStoreConnector.build_kv_connector_stats(decoded.kv_connector_stats)
    assert rebuilt.reduce() == stats.reduce()


def test_payload_is_bounded():
    rec = StatsRecorder(0, 1)
    for i in range(20 * SAMPLE_CAP):
        rec.on_load(load_event(0, 0, t=float(i)))
        rec.on_lookup(LookupEvent("hit", 8, 64, 0, 0.001))
    data = rec.snapshot().data
    assert all(len(v) <= SAMPLE_CAP for v in data["h"].values())
    assert data["c"]["load_jobs|0|0|ok"] == 20 * SAMPLE_CAP  # counters stay exact
    merged = PooledStoreStats(data=pickle.loads(pickle.dumps(data))).aggregate(
        PooledStoreStats(data=data))
    assert all(len(v) <= SAMPLE_CAP for v in merged.data["h"].values())
    assert rec.snapshot() is None  # nothing new: vLLM sends nothing


def test_idle_worker_sends_gauges_only_when_they_change():
    depth = {"v": 3}
    rec = StatsRecorder(0, 1, lambda: {"load_queue_depth|0": depth["v"]})
    assert rec.snapshot().data["g"] == {"load_queue_depth|0": 3}
    assert rec.snapshot() is None
    depth["v"] = 0
    assert rec.snapshot().data["g"] == {"load_queue_depth|0": 0}


def test_prometheus_export_and_duplicate_registration():
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    cfg = SimpleNamespace(kv_transfer_config=None)
    first = PooledStorePromMetrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})
    # A second connector of this class (MultiConnector) must not raise Duplicated timeseries.
    second = PooledStorePromMetrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]})
    stats = rank_stats(0).aggregate(rank_stats(1))
    first.observe(stats.to_dict(), 0)
    second.observe({"c": {"not_a_family|0": 1, "load_bytes|0": 5}}, 0)  # malformed: ignored
    get = REGISTRY.get_sample_value
    labels = {"model_name": "m", "engine": "0", "tp_rank": "1", "thread": "1"}
    assert get("vllm:mooncake_pool_load_bytes_total", labels) == 4096
    assert get("vllm:mooncake_pool_load_prepare_seconds_count", labels) == 1
    assert get("vllm:mooncake_pool_load_queue_depth",
               {"model_name": "m", "engine": "0", "tp_rank": "1"}) == 2
    assert get("vllm:mooncake_pool_failures_total", {"model_name": "m", "engine": "0",
               "tp_rank": "0", "op": "load", "code": "-704"}) == 1
    # 50 us resolution at the bottom of the latency buckets.
    assert get("vllm:mooncake_pool_load_prepare_seconds_bucket", {**labels, "le": "5e-05"}) == 0
