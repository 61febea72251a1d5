"""A real `vllm serve` with 4 receive threads: every connector family shows up on vLLM's own
/metrics with samples for each thread that did work, the queue-depth gauge rises during a
burst, and spans reach a real OTLP collector with the right names, links and attributes.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from connector.metric_catalog import FAMILIES, PREFIX
from devkit.vllm_server import BLOCK_SIZE, metric_sum
from tests.conftest import corrupt_stored_block


@pytest.fixture(scope="module")
def burst(pooled_server, prompts, store_client, filled_store):
    """Reset vLLM's local cache and fire concurrent requests whose prefixes are in the store,
    plus new prompts twice each (saves, and dedup of the second save) and one corrupt block
    (a failed load, recomputed). Scrapes /metrics every 20 ms meanwhile."""
    rng = random.Random(7)
    fresh = [[rng.randrange(3, 1000) for _ in range(4 * BLOCK_SIZE + 3)] for _ in range(4)]
    broken = [rng.randrange(3, 1000) for _ in range(5 * BLOCK_SIZE + 1)]
    pooled_server.complete(broken)
    corrupt_stored_block(pooled_server, store_client, filled_store, broken, 2)
    pooled_server.reset_prefix_cache()
    before = pooled_server.metrics()
    depth_seen: list[float] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            depth_seen.append(metric_sum(pooled_server.metrics(), PREFIX + "load_queue_depth"))
            time.sleep(0.02)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    work = prompts * 4 + fresh * 2 + [broken]
    with ThreadPoolExecutor(len(work)) as pool:
        list(pool.map(lambda p: pooled_server.complete(p, max_tokens=4), work))
    time.sleep(1.0)
    stop.set()
    scraper.join()
    after = pooled_server.metrics()
    return before, after, depth_seen


def samples_of(metrics: dict[str, float], family) -> dict[str, float]:
    name = family.name + ("_count" if family.kind == "histogram" else
                          "_total" if family.kind == "counter" else "")
    return {k: v for k, v in metrics.items() if k.split("{")[0] == name}


def test_every_family_has_samples(burst):
    _, after, _ = burst
    for fam in FAMILIES:
        got = samples_of(after, fam)
        assert got, f"{fam.exported} missing from /metrics"
        if fam.kind != "gauge":  # the burst includes a failed load, so failures count too
            assert any(v > 0 for v in got.values()), f"{fam.exported} has no non-zero sample"
    assert metric_sum(after, PREFIX + "failures_total", op="load", code="-600") >= 1
    assert metric_sum(after, PREFIX + "save_skipped_keys_total") > 0
    assert metric_sum(after, PREFIX + "recv_threads") == 4


def test_per_thread_families_for_each_thread_that_worked(burst):
    before, after, _ = burst
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
    _, after, depth_seen = burst
    assert max(depth_seen) > 0, (len(depth_seen), sorted(set(depth_seen)))
    assert metric_sum(after, PREFIX + "load_queue_depth") == 0


def test_spans_reach_the_collector(burst, otlp_collector):
    deadline = time.monotonic() + 15
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
