"""Stats payload: aggregation across TP ranks, vLLM's own msgpack transport, bounded size, and
the Prometheus exporter fed with it: known series at 0 from startup, the tenant label, and
traced jobs as OpenMetrics exemplars."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import REGISTRY
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from connector import PooledMooncakeStoreConnector
from connector.observability.events import LoadEvent, LookupEvent, SaveEvent
from connector.observability.metric_catalog import KNOWN_FAILURES
from connector.observability.prom import PooledStorePromMetrics
from connector.observability.stats import (
    EXEMPLAR_CAP,
    SAMPLE_CAP,
    PooledStoreStats,
    StatsRecorder,
    WorkerGauges,
    parse_key,
    stat_key,
)


def gauges(depth: int) -> WorkerGauges:
    return WorkerGauges(load_queue_depth=depth, save_queue_depth=0, recv_threads=1,
                        recv_threads_active=1, load_inflight=(0,),
                        threads_stuck={"load": 0, "save": 0}, staging_buffers=1, preload_bytes=0,
                        layout=None)


def load_event(thread: int, rank: int, code: str = "", t: float = 100.0) -> LoadEvent:
    return LoadEvent(thread, rank, "h", 4, 0 if code else 4096, 4 if code else 0, code,
                     t, t + 0.001, t + 0.0015, t + 0.002, t + 0.005, True)


def rank_stats(rank: int, threads: int = 2) -> PooledStoreStats:
    rec = StatsRecorder(rank, threads, lambda: gauges(rank + 1))
    for t in range(threads):
        rec.on_load(load_event(t, rank))
    rec.on_load(load_event(0, rank, code="-704"))
    rec.on_save(SaveEvent(rank, "h", 3, 1, 2, 3 * 4096, "", "save", 0, 0.1, 0.2, 0.3, 0.4))
    return rec.snapshot()


def test_aggregate_across_tp_ranks_keeps_rank_and_thread_identity():
    agg = rank_stats(0).aggregate(rank_stats(1))
    c = agg.data["c"]
    assert c["load_bytes|0|1"] == c["load_bytes|1|1"] == 4096
    assert c["load_jobs|0|0|ok"] == c["load_jobs|1|0|ok"] == 1
    assert c["failures|0|load|-704"] == c["failures|1|load|-704"] == 1
    assert c["load_error_blocks|1"] == 4 and c["save_error_keys|1"] == 2
    g = agg.data["g"]
    assert (g["load_queue_depth|0"], g["load_queue_depth|1"]) == (1, 2)  # one per rank
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
    rec = StatsRecorder(0, 1, lambda: gauges(depth["v"]))
    assert rec.snapshot().data["g"]["load_queue_depth|0"] == 3
    assert rec.snapshot() is None
    depth["v"] = 0
    assert rec.snapshot().data["g"]["load_queue_depth|0"] == 0


def test_payload_keys_are_checked_against_the_catalogue():
    assert stat_key("failures", 0, "load", "-704") == "failures|0|load|-704"
    fam, labels = parse_key("load_jobs|1|3|ok")
    assert fam.key == "load_jobs" and labels == {"tp_rank": "1", "thread": "3", "status": "ok"}
    assert parse_key("lookups|hit")[1] == {"result": "hit"}  # cache_prefix comes from config
    for bad in (("load_job", 0, 1), ("load_jobs", 0, 1)):  # misspelt family, a label short
        with pytest.raises(ValueError, match="stats key"):
            stat_key(*bad)
    assert parse_key("nonsense|1") is None and parse_key("load_jobs|0") is None


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
    assert get("vllm:mooncake_pool_load_bytes_total", {**labels, "tenant": "default"}) == 4096
    assert get("vllm:mooncake_pool_load_prepare_seconds_count", labels) == 1
    assert get("vllm:mooncake_pool_load_queue_depth",
               {"model_name": "m", "engine": "0", "tp_rank": "1"}) == 2
    assert get("vllm:mooncake_pool_failures_total", {"model_name": "m", "engine": "0",
               "tp_rank": "0", "op": "load", "code": "-704", "tenant": "default"}) == 1
    # 50 us resolution at the bottom of the latency buckets.
    assert get("vllm:mooncake_pool_load_prepare_seconds_bucket", {**labels, "le": "5e-05"}) == 0


def fresh_types():
    """Metric classes on a registry of their own (a test's families start empty)."""
    reg = CollectorRegistry()

    def on(cls):
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **kw:
                                           cls.__init__(self, *a, registry=reg, **kw)})
    return {Gauge: on(Gauge), Counter: on(Counter), Histogram: on(Histogram)}, reg


def vllm_cfg(tp: int = 2, **extra) -> SimpleNamespace:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={
            "master_server_address": "127.0.0.1:1", "metadata_server": "P2PHANDSHAKE",
            **extra}))


def test_known_series_are_exported_as_zero_from_startup():
    types, reg = fresh_types()
    PooledStorePromMetrics(vllm_cfg(tp=2, cache_prefix="tenant-a"), types,
                           ["model_name", "engine"], {0: ["m", "0"]})
    text = generate_latest(reg).decode()
    base = {"model_name": "m", "engine": "0", "tenant": "default"}
    for rank in ("0", "1"):
        for op, code in KNOWN_FAILURES:
            if op != "lookup" or rank == "0":
                assert reg.get_sample_value("vllm:mooncake_pool_failures_total", {
                    **base, "tp_rank": rank, "op": op, "code": code}) == 0, (rank, op, code)
        assert reg.get_sample_value("vllm:mooncake_pool_load_error_blocks_total",
                                    {"model_name": "m", "engine": "0", "tp_rank": rank}) == 0
    for result in ("hit", "miss", "error", "timeout"):
        assert reg.get_sample_value("vllm:mooncake_pool_lookups_total", {
            **base, "cache_prefix": "tenant-a", "result": result}) == 0
    assert reg.get_sample_value("vllm:mooncake_pool_lookup_hit_tokens_total",
                                {**base, "cache_prefix": "tenant-a"}) == 0
    assert 'tp_rank="2"' not in text  # bounded: only the engine's ranks
    assert "load_tier_tokens_total{" not in text  # no disk tier configured: no tier series


def test_tier_series_exported_with_the_disk_tier():
    types, reg = fresh_types()
    prom = PooledStorePromMetrics(vllm_cfg(tp=1, enable_offload=True, tenant_id="t1"), types,
                                  ["model_name", "engine"], {0: ["m", "0"]})
    base = {"model_name": "m", "engine": "0", "tp_rank": "0", "tenant": "t1"}
    for tier in ("memory", "disk", "unknown"):
        assert reg.get_sample_value("vllm:mooncake_pool_load_tier_tokens_total",
                                    {**base, "tier": tier}) == 0
    rec = StatsRecorder(0, 1)
    ev = load_event(0, 0, t=1.0)
    ev.tiers = {"disk": (64, 8192), "memory": (32, 4096)}
    rec.on_load(ev)
    prom.observe(rec.snapshot().data, 0)
    assert reg.get_sample_value("vllm:mooncake_pool_load_tier_tokens_total",
                                {**base, "tier": "disk"}) == 64
    assert reg.get_sample_value("vllm:mooncake_pool_load_tier_bytes_total",
                                {**base, "tier": "memory"}) == 4096


def test_lookups_carry_the_cache_prefix_and_tenant_of_the_config():
    types, reg = fresh_types()
    prom = PooledStorePromMetrics(vllm_cfg(tp=1, cache_prefix="tenant-b", tenant_id="t-b"), types,
                                  ["model_name", "engine"], {0: ["m", "0"]})
    rec = StatsRecorder()
    rec.on_lookup(LookupEvent("hit", 8, 64, 32, 0.001))
    prom.observe(rec.snapshot().data, 0)
    labels = {"model_name": "m", "engine": "0", "cache_prefix": "tenant-b", "tenant": "t-b"}
    assert reg.get_sample_value("vllm:mooncake_pool_lookups_total",
                                {**labels, "result": "hit"}) == 1
    assert reg.get_sample_value("vllm:mooncake_pool_lookup_hit_tokens_total", labels) == 64
    assert reg.get_sample_value("vllm:mooncake_pool_lookup_miss_tokens_total", labels) == 32


def test_traced_jobs_become_openmetrics_exemplars_counted_once():
    rec = StatsRecorder(0, 1)
    traced, plain = load_event(0, 0, t=1.0), load_event(0, 0, t=2.0)
    rec.on_load(traced)
    rec.traced_load(traced, "ab" * 16, "cd" * 8)
    rec.on_load(plain)
    rec.traced_load(traced, "ef" * 16, "01" * 8)  # not the thread's last job any more: ignored
    data = rec.snapshot().data
    job = "load_job_seconds|0|0"
    assert data["x"][job] == [[traced.t_end - traced.t_enqueue, "ab" * 16, "cd" * 8]]
    assert len(data["h"][job]) == 1 and len(data["x"]["load_transfer_seconds|0|0"]) == 1
    merged = PooledStoreStats(data=pickle.loads(pickle.dumps(data)))
    for _ in range(EXEMPLAR_CAP + 1):  # past the cap exemplars are plain samples again
        merged.aggregate(PooledStoreStats(data=pickle.loads(pickle.dumps(data))))
    assert len(merged.data["x"][job]) == EXEMPLAR_CAP
    assert len(merged.data["x"][job]) + len(merged.data["h"][job]) == 2 * (EXEMPLAR_CAP + 2)
    types, reg = fresh_types()
    prom = PooledStorePromMetrics(vllm_cfg(tp=1), types, ["model_name", "engine"],
                                  {0: ["m", "0"]})
    prom.observe(data, 0)
    labels = {"model_name": "m", "engine": "0", "tp_rank": "0", "thread": "0"}
    assert reg.get_sample_value("vllm:mooncake_pool_load_job_seconds_count", labels) == 2
    om = openmetrics.generate_latest(reg).decode()
    bucket = next(line for line in om.splitlines()  # `vllm:` is escaped to `vllm_` here
                  if "pool_load_job_seconds_bucket" in line and " # " in line)
    assert f'# {{span_id="{"cd" * 8}",trace_id="{"ab" * 16}"}}' in bucket
    assert " # " not in generate_latest(reg).decode()  # the text format has no exemplars


def test_only_jobs_that_ran_their_phases_feed_the_phase_histograms():
    """A load copied from its preload, or expired by the watchdog, had no preparation or
    transfer of its own; a save lost before it ran waited for nothing. Their zeros dragged the
    Preparation, Transfer and ready-wait panels toward 0 (a slow network hidden by preloads).
    They still count as jobs, with their queue wait."""
    import dataclasses

    rec = StatsRecorder(0, 1, lambda: gauges(0))
    rec.on_load(load_event(0, 0))
    rec.on_load(dataclasses.replace(load_event(0, 0), nbytes=0, preloaded=True, phases=False))
    rec.on_load(dataclasses.replace(load_event(0, 0, code="timeout"), phases=False))
    rec.on_save(SaveEvent(0, "h", 3, 1, 2, 3 * 4096, "", "save", 0, 0.1, 0.2, 0.3, 0.4))
    rec.on_save(SaveEvent(0, "h", 0, 0, 4, 0, "abandoned", "save", 0, 0.5, 0.5, 0.5, 0.5,
                          ran=False))
    snap = rec.snapshot().data
    h = {k: len(v) for k, v in snap["h"].items() if v}
    assert h["load_prepare_seconds|0|0"] == h["load_transfer_seconds|0|0"] == 1
    assert h["load_job_seconds|0|0"] == h["load_queue_wait_seconds|0|0"] == 3
    assert h["save_ready_wait_seconds|0"] == 1
    assert snap["c"]["load_jobs|0|0|ok"] == 2 and snap["c"]["save_error_keys|0"] == 6


def test_the_store_share_of_ttft_resolves_past_20_s_as_vllms_ttft_does():
    """A queued request under overload waits minutes for a slot: its ttft_store_* samples
    land in buckets up to vLLM's own time_to_first_token_seconds top (2,560 s), not all in
    +Inf above 20 s, where histogram_quantile reads every one as 20 s."""
    from vllm.v1.metrics.buckets import TIME_TO_FIRST_TOKEN_BUCKETS

    types, reg = fresh_types()
    prom = PooledStorePromMetrics(vllm_cfg(tp=1), types, ["model_name", "engine"],
                                  {0: ["m", "0"]})
    prom.observe({"h": {"ttft_store_seconds|async": [100.0],
                        "ttft_store_phase_seconds|admit": [30.0],
                        "load_transfer_seconds|0|0": [30.0]}}, 0)
    base = {"model_name": "m", "engine": "0"}

    def bucket(name: str, le: str, **labels: str) -> float | None:
        return reg.get_sample_value(f"vllm:mooncake_pool_{name}_bucket",
                                    {**base, **labels, "le": le})

    assert (bucket("ttft_store_seconds", "80.0", mode="async"),
            bucket("ttft_store_seconds", "160.0", mode="async")) == (0, 1)
    assert bucket("ttft_store_phase_seconds", "40.0", phase="admit") == 1
    ours = {float(s.labels["le"]) for m in reg.collect() if m.name.endswith("ttft_store_seconds")
            for s in m.samples if s.name.endswith("_bucket")}
    assert {b for b in TIME_TO_FIRST_TOKEN_BUCKETS if b >= 20} <= ours, "vLLM's, from 20 s up"
    # The transfer histograms keep their 50 us .. 20 s range.
    assert bucket("load_transfer_seconds", "40.0", tp_rank="0", thread="0") is None
