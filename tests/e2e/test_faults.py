"""Faults degrade to recompute: the master or the store node dies during a burst of loads, the
store is full. Every request completes with the right output, errors are counted by code, and
the cache comes back without restarting vLLM.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.proxy import DelayProxy
from connector.metadata import BlockTransfer, StepMetadata
from connector.metric_catalog import PREFIX as P
from connector.store import TIMEOUT_ENV
from devkit.local_cluster import free_port, local_pool
from devkit.processes import freeze, thaw
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.conftest import engine_extra
from tests.worker_kit import hashes, run_step, settled_saves

LOAD_TIMEOUT_S = 2.0
# Mooncake's own bound on one call (a transfer, a master RPC), pinned far past the connector's
# deadlines and any recompute here: a call to a frozen peer provably outlives load_timeout_s,
# whatever the host's speed or the caller's environment (which could override Mooncake's 30 s).
FROZEN_CALL_S = 60.0


@pytest.fixture(scope="module")
def cluster():
    with local_pool("256MB") as (master, node):
        # A 20 ms round trip to the master, as across a datacenter: lookups and loads are
        # still in flight when a fault strikes during a burst.
        proxy = DelayProxy(master.address, rtt_ms=20.0).start()
        yield master, node, proxy
        proxy.stop()


@pytest.fixture(scope="module")
def fault_server(tiny_model, cluster):
    master, _, proxy = cluster
    server = VllmServer(tiny_model, connector_kv_config(engine_extra(
        master, cache_prefix="faults", load_threads=4, lookup_timeout_s=1.0,
        load_timeout_s=LOAD_TIMEOUT_S, master_server_address=proxy.address)),
        env={var: str(round(FROZEN_CALL_S * unit)) for var, unit in TIMEOUT_ENV.items()}
    ).start()
    yield server
    server.stop()


def prompts(seed: int, n: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(10 * BLOCK_SIZE + 7)] for _ in range(n)]


def fill_then_burst(server: VllmServer, work: list[list[int]], fault, first: bool = False
                    ) -> tuple[list, float, float]:
    """Serve `work` once (computed, saved), drop vLLM's local cache, then serve it again as a
    concurrent burst while `fault()` runs (with `first`, just before the burst is sent);
    returns (reference outputs, seconds after the fault until the whole burst completed,
    seconds the first, computed pass took) after checking every output."""
    t0 = time.monotonic()
    reference = [server.complete(p) for p in work]
    compute_s = time.monotonic() - t0
    # Succeeds once vLLM frees the blocks, i.e. once the connector stored every save: the
    # burst then asks the store. (A fixed wait here was too short where computing outpaces
    # the save thread: the reset was refused and the burst hit vLLM's local cache instead.)
    server.reset_prefix_cache()
    faulted_at: list[float] = []

    def inject() -> None:
        if not first:
            time.sleep(0.05)
        fault()
        faulted_at.append(time.monotonic())

    injector = threading.Thread(target=inject)
    injector.start()
    if first:
        injector.join()
    with ThreadPoolExecutor(len(work)) as pool:
        outputs = list(pool.map(server.complete, work))
    done = time.monotonic()
    injector.join()
    assert outputs == reference, "a request affected by the fault produced different output"
    return reference, done - faulted_at[0], compute_s


def wait_for_cache(server: VllmServer, seed: int, timeout: float = 60.0) -> None:
    """The cache works again: a new prompt is saved, then loaded back from the store."""
    deadline = time.monotonic() + timeout
    while True:
        prompt = prompts(seed + int(time.monotonic() * 1000), 1)[0]
        first = server.complete(prompt)
        server.reset_prefix_cache()  # waits for the prompt's saves
        before = server.metrics()
        assert server.complete(prompt) == first
        delta = metric_sum(server.metrics(), P + "load_bytes_total") - metric_sum(
            before, P + "load_bytes_total")
        if delta > 0:
            return
        assert time.monotonic() < deadline, "the cache never came back after the fault"
        time.sleep(1.0)


def test_master_killed_during_burst(fault_server, cluster):
    master, _, _ = cluster
    before = fault_server.metrics()
    try:
        _, after_fault, _ = fill_then_burst(fault_server, prompts(1), master.kill)
    finally:
        failures = metric_sum(fault_server.metrics(), P + "failures_total", code="-900")
        master.start()  # same ports: the engine reconnects without a restart
    print(f"burst completed {after_fault:.2f}s after the master was killed")
    assert after_fault < 10.0, f"burst took {after_fault:.1f}s after the master died"
    assert failures > metric_sum(before, P + "failures_total", code="-900"), \
        "RPC failures while the master was down should be counted by code"
    wait_for_cache(fault_server, 100)


def test_store_node_killed_during_burst(fault_server, cluster):
    _, node, _ = cluster
    before = fault_server.metrics()
    try:
        _, after_fault, _ = fill_then_burst(fault_server, prompts(2), node.stop)
    finally:
        node.port = free_port()  # a new node process, as after a pod restart
        node.start()
    print(f"burst completed {after_fault:.2f}s after the store node was killed")
    assert after_fault < 10.0
    m = fault_server.metrics()
    assert metric_sum(m, P + "failures_total") > metric_sum(before, P + "failures_total")
    wait_for_cache(fault_server, 200)


def test_full_store_rejects_saves_and_keeps_serving(make_worker_on):
    with local_pool("16MB") as (master, _node):
        w = make_worker_on(master, prefix="full", heads=16)
        hs = hashes("full", 192)  # 192 x 128 KiB blocks (24 MiB) into a 16 MB segment
        for i in range(0, 192, 32):
            run_step(w, StepMetadata(saves=(BlockTransfer(f"s{i}", tuple(range(32)),
                                                          hs[i:i + 32]),),
                                     free_after_jobs=(f"s{i}",)))
        c = settled_saves(w, 192)  # every key written, or counted as lost
        assert c["save_keys|0"] > 0 and c["save_error_keys|0"] > 0, dict(c)
        rejected = sum(v for k, v in c.items() if k.startswith("failures|0|save|"))
        assert rejected > 0, dict(c)
        # Loads of what did fit (and was not evicted since) keep working.
        exists = w._connected().batch_is_exist(w._keys.keys(hs, 0))
        kept = [h for h, e in zip(hs, exists, strict=True) if e == 1]
        assert kept, "nothing stayed in the store"
        done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("r", (0,), kept[:1]),)))
        assert done == {"r"} and errors == set()


def test_shutdown_does_not_hang_with_jobs_queued(make_worker_on, cluster):
    master, _, _ = cluster
    w = make_worker_on(master, prefix="shutdown", threads=2)
    hs = hashes("shutdown", 16)
    w.start_load(StepMetadata(loads=tuple(BlockTransfer(f"q{i}", tuple(range(16)), hs)
                                          for i in range(200))))
    t0 = time.monotonic()
    w.shutdown()
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("which", ["store_node", "master"])
def test_frozen_peer_never_holds_a_request(fault_server, cluster, which):
    """SIGSTOP (a frozen peer: TCP open, nothing answers), then a burst of store hits. A
    frozen store node holds the loads' calls: each is recomputed after load_timeout_s; a
    frozen master holds the lookups: each is a miss after lookup_timeout_s. Either way every
    request completes with the exact output without waiting for a frozen call, and once the
    peer answers the cache hits again with no stuck thread or extra staging buffer left
    behind."""
    master, node, _ = cluster
    proc = (node if which == "store_node" else master).proc
    work = prompts(3 if which == "master" else 4)
    before = fault_server.metrics()
    try:
        _, after_fault, compute_s = fill_then_burst(
            fault_server, work, lambda: freeze(proc), first=True)
    finally:
        thaw(proc)
    print(f"burst completed {after_fault:.2f}s after the {which} froze (computing it took "
          f"{compute_s:.2f}s)")
    # The peer stays frozen until the burst is over, so a request that waited for a frozen
    # call could not complete before FROZEN_CALL_S: this bound holds however slow the host.
    assert after_fault < FROZEN_CALL_S, f"the burst waited {after_fault:.1f}s for the {which}"
    m = fault_server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(m, P + name, **labels) - metric_sum(before, P + name, **labels)

    if which == "store_node":
        # Every load of the burst reached the frozen node and ended at its deadline (none can
        # return before FROZEN_CALL_S), so each failed load counts code="timeout" and none
        # another code; and none was retried (one load job per request).
        failed = delta("load_jobs_total", status="error")
        codes = {k: v - before.get(k, 0) for k, v in m.items()
                 if k.startswith(P + "failures_total") and 'op="load"' in k
                 and v > before.get(k, 0)}
        assert 0 < failed <= len(work), f"{failed} failed loads for {len(work)} requests"
        assert delta("failures_total", op="load", code="timeout") == failed, codes
    else:
        assert delta("lookups_total", result="timeout") > 0
    wait_for_cache(fault_server, 300 if which == "master" else 400)
    deadline = time.monotonic() + 60
    while True:  # the stuck calls return once the peer answers; nothing leaks
        m = fault_server.metrics()
        stuck = metric_sum(m, P + "threads_stuck")
        buffers = metric_sum(m, P + "staging_buffers")
        if stuck == 0 and buffers <= 6:  # 4 receive threads, the in-step one, the save one
            break
        assert time.monotonic() < deadline, f"{stuck} stuck threads, {buffers} buffers"
        fault_server.complete(prompts(int(time.monotonic()), 1)[0], max_tokens=1)
        time.sleep(1.0)
