"""`load_threads: auto` inside a real `vllm serve`: the tuner starts at one active thread and,
under a burst of loads that queue up behind a slow master (10 ms round trip through a delay
proxy, two master RPCs per load job), raises the active count. The change shows on vLLM's
/metrics, the threads it woke take jobs, and outputs stay exact.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from connector.observability.metric_catalog import PREFIX
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.conftest import engine_extra
from tests.e2e.store_kit import wait_for_saves

pytestmark = pytest.mark.timed

REQUESTS = 720  # at ~45 jobs/s on one thread, enough backlog for the tuner's first probe
CLIENTS = 64


@pytest.fixture(scope="module")
def auto_server(tiny_model, master, store_node):
    from bench.proxy import DelayProxy

    proxy = DelayProxy(master.address, rtt_ms=10.0).start()
    extra = engine_extra(master, cache_prefix="auto-e2e", load_threads="auto",
                         load_threads_max=4, master_lookup_sample_ratio=1.0)
    extra["master_server_address"] = proxy.address
    server = VllmServer(tiny_model, connector_kv_config(extra)).start()
    yield server
    server.stop()
    proxy.stop()


def wait_stored(server: VllmServer, keys: int) -> None:
    """Until the engine wrote `keys` blocks (its saves run after the responses)."""
    wait_for_saves(server, keys, families=("save_keys",))


def test_auto_raises_threads_under_queued_loads(auto_server):
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 1000) for _ in range(2 * BLOCK_SIZE + 1)]
               for _ in range(REQUESTS)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        first = list(pool.map(lambda p: auto_server.complete(p, max_tokens=1), prompts))
    wait_stored(auto_server, 2 * REQUESTS)
    auto_server.reset_prefix_cache()
    active = PREFIX + "recv_threads_active"
    before = auto_server.metrics()
    assert metric_sum(before, active) == 1  # starts at vLLM's default

    seen: list[float] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            seen.append(metric_sum(auto_server.metrics(), active))
            time.sleep(0.1)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            again = list(pool.map(lambda p: auto_server.complete(p, max_tokens=1), prompts))
    finally:
        stop.set()
        scraper.join()
    after = auto_server.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert again == first
    assert metric_sum(delta, PREFIX + "load_jobs_total", status="ok") >= REQUESTS * 0.9
    assert metric_sum(delta, PREFIX + "load_jobs_total", status="error") == 0
    assert max(seen) >= 2, seen
    # The threads the tuner woke took jobs; the ones it never woke took none (a parked
    # thread must not take even one job).
    woken = int(max(seen))
    jobs = [metric_sum(delta, PREFIX + "load_jobs_total", thread=str(t)) for t in range(4)]
    assert all(n > 1 for n in jobs[1:woken]) and all(n == 0 for n in jobs[woken:]), jobs
