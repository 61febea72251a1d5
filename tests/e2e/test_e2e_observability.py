"""A real `vllm serve` with 4 receive threads: every connector family shows up on vLLM's own
/metrics with samples for each thread that did work, the queue-depth gauge rises during a
burst, and spans reach a real OTLP collector with the right names, links and attributes.
With OTEL_TRACES_SAMPLER=always_on every load job has its spans, and the job and transfer
histograms carry their trace ids as exemplars that a real Prometheus stores. A second engine
(always_off, the default lookup-probe ratio) exports the known series as 0 before any load,
shows a lookup sample on every thread that worked under light traffic, and exports no span.
"""

from __future__ import annotations

import random
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from connector.observability.metric_catalog import FAMILIES, KNOWN_FAILURES, LOOKUP_RESULTS, PREFIX
from connector.worker.save_guard import UNSAFE_CODE
from dashboards.local_prometheus import LocalPrometheus
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.conftest import POOLED_SERVICE, corrupt_stored_block, engine_extra
from tests.e2e.store_kit import wait_for_scrapes
from tests.helm_kit import engine_scrape_path

pytestmark = pytest.mark.side_by_side

QUIET_SERVICE = "always-off-engine"


@pytest.fixture(scope="module")
def burst(pooled_server, prompts, store_client, filled_store):
    """Reset vLLM's local cache and fire concurrent requests whose prefixes are in the store,
    plus new prompts twice each (saves, and dedup of the second save) and one corrupt block
    (a failed load, recomputed). Scrapes /metrics every 20 ms meanwhile."""
    rng = random.Random(7)
    fresh = [[rng.randrange(3, 1000) for _ in range(4 * BLOCK_SIZE + 3)] for _ in range(4)]
    broken = [rng.randrange(3, 1000) for _ in range(5 * BLOCK_SIZE + 1)]
    # Prompts of distinct prefixes, stored first: each needs a load of its own in the burst,
    # however quickly the engine serves (requests that share a prefix may instead hit the
    # local cache once the first of them has loaded, so their load count depends on timing).
    distinct = [[rng.randrange(3, 1000) for _ in range(6 * BLOCK_SIZE + 5)] for _ in range(16)]
    for p in distinct:
        pooled_server.complete(p, max_tokens=1)
    pooled_server.complete(broken)
    corrupt_stored_block(pooled_server, store_client, filled_store, broken, 2)
    pooled_server.reset_prefix_cache()
    before = pooled_server.metrics()
    t0 = time.time_ns()
    depth_seen: list[float] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            depth_seen.append(metric_sum(pooled_server.metrics(), PREFIX + "load_queue_depth"))
            time.sleep(0.02)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    work = prompts * 4 + distinct + fresh * 2 + [broken]
    with ThreadPoolExecutor(len(work)) as pool:
        list(pool.map(lambda p: pooled_server.complete(p, max_tokens=4), work))
    time.sleep(1.0)
    stop.set()
    scraper.join()
    after = pooled_server.metrics()
    return before, after, depth_seen, (t0, time.time_ns())


def samples_of(metrics: dict[str, float], family) -> dict[str, float]:
    name = family.name + ("_count" if family.kind == "histogram" else
                          "_total" if family.kind == "counter" else "")
    return {k: v for k, v in metrics.items() if k.split("{")[0] == name}


def test_every_family_has_samples(burst):
    _, after, _, _ = burst
    # Counters of trouble a healthy engine never meets (a hung store call, a tuner error, a
    # save that lost keys, 4,096 request timelines open at once): exported at 0 from startup;
    # the fault tests (test_deadlines, test_store_faults' full store) and tests/unit/test_ttft.py
    # see them move.
    zero_when_healthy = {"threads_replaced", "autotune_errors", "master_failovers",
                         "master_down_seconds", "master_probe_errors", "save_error_keys",
                         "ttft_store_dropped"}
    # But one: the corrupt block's load fails, and when it ran in the step, the save guard
    # drops the saves of the requests computed in that step (code "unsafe": their blocks may
    # rest on it). Whether it shared a step with others depends on scheduling, so the lost
    # keys are checked to be the guard's, never the store's.
    save_codes = {k.split('code="')[1].split('"')[0] for k, v in after.items()
                  if k.startswith(PREFIX + "failures_total{") and 'op="save"' in k and v}
    assert save_codes <= {UNSAFE_CODE}, f"saves failed on a healthy store: {save_codes}"
    if save_codes:
        zero_when_healthy.remove("save_error_keys")
    # The per-tier families exist with a disk tier only (tier_metrics): test_disk_tier's
    # engines export them; this engine has none.
    tier_only = {"load_tier_tokens", "load_tier_bytes"}
    # The store's KV events are off on this engine: their families are exported at 0 from
    # startup (tests/e2e/test_kv_events.py sees them move).
    zero_when_healthy |= {"kv_events", "kv_events_dropped", "kv_events_removals",
                          "kv_events_sweeps", "kv_events_sweep_keys",
                          "kv_events_sweep_seconds"}
    # Arrivals past lookup_ahead (16) unasked lookups: whether the burst's arrivals outrun the
    # scheduler that far depends on timing (tests/store/test_scheduler.py floods it).
    # Preloads: only for requests queued behind full sequence slots, which this burst's
    # scheduling may not produce (tests/e2e/test_e2e_step_loads.py queues them and sees them
    # used; tests/store/test_preload.py every other outcome).
    either = {"lookups_deferred", "preload_keys"}
    for fam in FAMILIES:
        got = samples_of(after, fam)
        if fam.key in tier_only:
            assert not got, (fam.exported, got)
            continue
        assert got, f"{fam.exported} missing from /metrics"
        if fam.key in zero_when_healthy:
            assert all(v == 0 for v in got.values()), (fam.exported, got)
        elif fam.kind != "gauge" and fam.key not in either:
            # the burst includes a failed load, so failures count too
            assert any(v > 0 for v in got.values()), f"{fam.exported} has no non-zero sample"
    assert metric_sum(after, PREFIX + "failures_total", op="load", code="-600") >= 1
    assert metric_sum(after, PREFIX + "save_skipped_keys_total") > 0
    assert metric_sum(after, PREFIX + "recv_threads") == 4


def test_per_thread_families_for_each_thread_that_worked(burst):
    before, after, _, _ = burst
    delta = {k: after[k] - before.get(k, 0) for k in after}
    worked = [t for t in "0123" if metric_sum(delta, PREFIX + "load_jobs_total", thread=t) > 0]
    assert len(worked) >= 2, "a burst should spread over the pool"
    for t in worked:
        for fam in FAMILIES:
            if "thread" not in fam.labels or fam.kind == "gauge":
                continue
            name = fam.name + ("_count" if fam.kind == "histogram" else "_total")
            assert metric_sum(delta, name, thread=t) > 0, f"{name} thread={t}"


def test_queue_depth_rises_during_burst_and_returns_to_zero(burst):
    _, after, depth_seen, _ = burst
    assert max(depth_seen) > 0, (len(depth_seen), sorted(set(depth_seen)))
    assert metric_sum(after, PREFIX + "load_queue_depth") == 0


def test_spans_reach_the_collector(burst, otlp_collector):
    deadline = time.monotonic() + 120  # ends as soon as both are there
    while True:
        spans = otlp_collector.spans()
        loads = [s for s in spans if s.name == "mooncake.load"]
        if (any(s.status.endswith("ERROR") for s in loads)
                and any(s.name == "mooncake.save" for s in spans)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert loads, "no mooncake.load span exported"
    by_id = {s.span_id: s for s in spans}
    children: dict[str, list] = {}
    for s in spans:
        children.setdefault(s.parent_id, []).append(s)
    for load in loads:
        kids = {c.name: c for c in children.get(load.span_id, [])}
        assert set(kids) == {"queue_wait", "prepare", "master_lookup", "transfer"}
        for kid in kids.values():
            assert kid.trace_id == load.trace_id and by_id[kid.parent_id] is load
            assert load.start_ns <= kid.start_ns <= kid.end_ns <= load.end_ns
        assert {"thread", "tp_rank", "keys", "bytes", "status", "error_code",
                "request_hash"} <= set(load.attributes)
        assert load.resource["service.name"]
    assert len({s.attributes["thread"] for s in loads}) >= 2
    failed = [s for s in loads if s.status.endswith("ERROR")]
    assert failed and failed[0].attributes["error_code"] == '-600'
    saves = [s for s in spans if s.name == "mooncake.save"]
    assert saves
    assert {c.name for c in children[saves[0].span_id]} == {"ready_wait", "exists", "put"}


def children_of(spans) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        out.setdefault(s.parent_id, []).append(s)
    return out


def burst_loads(otlp_collector, window: tuple[int, int], expected: int) -> list:
    """The `pooled_server` load spans that started during the burst (waiting until there are
    `expected`, up to 120 s on a busy host)."""
    deadline = time.monotonic() + 120
    while True:
        spans = otlp_collector.spans()
        loads = [s for s in spans if s.name == "mooncake.load"
                 and s.resource.get("service.name") == POOLED_SERVICE
                 and window[0] <= s.start_ns <= window[1]]
        if len(loads) >= expected or time.monotonic() > deadline:
            return loads, spans
        time.sleep(0.5)


def test_always_on_traces_every_load_job_of_the_burst(burst, otlp_collector):
    before, after, _, window = burst
    jobs = metric_sum(after, PREFIX + "load_jobs_total") - \
        metric_sum(before, PREFIX + "load_jobs_total")
    assert jobs >= 10
    loads, spans = burst_loads(otlp_collector, window, jobs)
    assert len(loads) == jobs, f"{len(loads)} mooncake.load spans for {jobs} load jobs"
    children = children_of(spans)
    for load in loads:
        assert {c.name for c in children.get(load.span_id, [])} == {
            "queue_wait", "prepare", "master_lookup", "transfer"}


def test_exemplars_link_histograms_to_exported_traces(burst, pooled_server, otlp_collector,
                                                      tmp_path):
    """The path the Helm chart's engine monitors scrape (vLLM's `/metrics/` mount) serves
    OpenMetrics with exemplars; a real Prometheus with exemplar storage, scraping that path,
    keeps them, and their trace ids are traces the collector received."""
    _, _, _, window = burst
    path = engine_scrape_path(tmp_path)  # from `helm template`: ServiceMonitor and PodMonitor
    req = urllib.request.Request(pooled_server.url + path, headers={
        "Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        text = r.read().decode()
    assert re.search(r'pool_load_job_seconds_bucket\{.*\} [0-9.e+-]+ # \{span_id="[0-9a-f]{16}",'
                     r'trace_id="[0-9a-f]{32}"\}', text), f"no exemplar on {path}"
    with urllib.request.urlopen(pooled_server.url + "/metrics", timeout=10) as r:
        assert " # {" not in r.read().decode()  # the plain text format carries none
    host_port = pooled_server.url.removeprefix("http://")
    with LocalPrometheus({"vllm": [host_port]}, exemplars=True,
                         metrics_paths={"vllm": path}, workdir=str(tmp_path)) as prom:
        prom.wait_for_targets()
        wait_for_scrapes(prom, time.time())  # the exemplars of the burst are stored
        stored: dict[str, set[str]] = {}
        for fam in ("load_job_seconds", "load_transfer_seconds"):
            res = prom.api("query_exemplars", query=f"{PREFIX}{fam}_bucket",
                           start=window[0] / 1e9 - 60, end=time.time() + 1)
            stored[fam] = {e["labels"]["trace_id"] for series in res
                           for e in series["exemplars"]}
    assert stored["load_job_seconds"] and stored["load_transfer_seconds"], stored
    loads, _ = burst_loads(otlp_collector, (0, time.time_ns()), 1)
    exported = {s.trace_id.lower() for s in loads}
    for fam, ids in stored.items():
        assert ids <= exported, f"{fam}: exemplar trace ids not in the collector: " \
            f"{sorted(ids - exported)[:3]}"


@pytest.fixture(scope="module")
def quiet(tiny_model, master, filled_store, otlp_collector):
    """An engine with the always_off sampler and the default lookup-probe ratio (0.1), its
    /metrics scraped before any request, then light traffic: one round of the stored prompts."""
    extra = engine_extra(master, cache_prefix=filled_store, load_threads=4)
    env = {**otlp_collector.otel_env(), "OTEL_TRACES_SAMPLER": "always_off",
           "OTEL_SERVICE_NAME": QUIET_SERVICE}
    server = VllmServer(tiny_model, connector_kv_config(extra), env=env).start()
    try:
        startup = server.metrics()
        yield server, startup
    finally:
        server.stop()


@pytest.fixture(scope="module")
def quiet_traffic(quiet, prompts):
    server, _ = quiet
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda p: server.complete(p, max_tokens=4), prompts))
    time.sleep(2.0)  # the last stats reach the API server; the trace thread would have run
    return server.metrics()


def test_known_series_are_zero_before_any_load(quiet, filled_store):
    _, startup = quiet
    assert metric_sum(startup, PREFIX + "load_jobs_total") == 0  # really before any load
    for op, code in KNOWN_FAILURES:
        got = [v for k, v in startup.items() if k.startswith(PREFIX + "failures_total{")
               and f'code="{code}"' in k and f'op="{op}"' in k]
        assert got == [0.0], (op, code, got)
    for result in LOOKUP_RESULTS:
        assert [v for k, v in startup.items() if k.startswith(PREFIX + "lookups_total{")
                and f'result="{result}"' in k and f'cache_prefix="{filled_store}"' in k] == [0.0]
    assert [v for k, v in startup.items()
            if k.startswith(PREFIX + "load_error_blocks_total{")] == [0.0]


def test_light_traffic_shows_a_lookup_sample_on_every_thread_that_worked(quiet_traffic):
    worked = [t for t in "0123"
              if metric_sum(quiet_traffic, PREFIX + "load_jobs_total", thread=t) > 0]
    assert worked, "the stored prompts should have been loaded"
    jobs = metric_sum(quiet_traffic, PREFIX + "load_jobs_total")
    assert jobs < 10 * len(worked), "light traffic: fewer than ten jobs per thread"
    for t in worked:
        assert metric_sum(quiet_traffic, PREFIX + "load_master_lookup_seconds_count",
                          thread=t) > 0, f"thread {t} worked but shows no lookup sample"


def test_lookups_and_tokens_carry_the_tenant(quiet_traffic, filled_store):
    hits = metric_sum(quiet_traffic, PREFIX + "lookup_hit_tokens_total",
                      cache_prefix=filled_store)
    assert hits > 0
    assert metric_sum(quiet_traffic, PREFIX + "lookups_total", cache_prefix=filled_store,
                      result="hit") > 0


def test_always_off_exports_no_connector_span(quiet, quiet_traffic, burst, otlp_collector):
    """Enough jobs that the old fixed 0.05 ratio would have traced one (1 - 0.95^60 > 95%,
    saves not counted)."""
    server, _ = quiet
    rng = random.Random(11)
    fresh = [[rng.randrange(3, 1000) for _ in range(4 * BLOCK_SIZE + 3)] for _ in range(12)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: server.complete(p, max_tokens=2), fresh))
        time.sleep(1.0)  # the saves drain: the first round's lookups find every prompt
        for _ in range(12):  # 72 loads, at least 60 even if a round is served partly locally
            server.reset_prefix_cache()
            list(pool.map(lambda p: server.complete(p, max_tokens=2), fresh[:6]))
    time.sleep(2.0)
    after = server.metrics()
    assert metric_sum(after, PREFIX + "load_jobs_total") >= 60
    services = {s.resource.get("service.name") for s in otlp_collector.spans()}
    assert POOLED_SERVICE in services  # the always_on engine's spans are there, by name
    assert QUIET_SERVICE not in services
