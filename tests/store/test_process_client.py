"""A scheduler and a worker in one process, as vLLM's "uni" executor runs them (one GPU, TP=1),
ride an HA leader failover together: loads and lookups come back once the new leader serves.

With a client each, Mooncake's one watch of the master view per process went to the second
client made (the scheduler's): the worker's stayed on the dead leader until its 30 s re-read of
etcd, and every load failed with -900 meanwhile (connector.store.process_client). The shared
client is closed by the last of its users, once the calls each of them waits for returned.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from types import SimpleNamespace

import pytest

from connector.config import load_config
from connector.metadata import BlockTransfer, StepMetadata
from connector.scheduler.scheduler import MooncakeStoreScheduler
from connector.store.keys import KeyBuilder, Layout
from connector.store.process_client import scheduler_store, worker_store
from tests.conftest import ha_group, in_process_config
from tests.store.test_kv_events_store import ask, request
from tests.worker_kit import LAYERS, hashes, run_step, settled_saves

BS = 32
BLOCKS = 4


@pytest.fixture
def cluster(ha_etcd, monkeypatch):
    c = ha_group(ha_etcd, "one-client").start()
    for k, v in c.env.items():
        monkeypatch.setenv(k, v)
    yield c
    c.stop()


def test_a_worker_and_its_scheduler_follow_a_failover_together(cluster, ha_etcd,
                                                               make_worker_on):
    target = SimpleNamespace(store_config=lambda **kw: in_process_config(cluster, ha_etcd, **kw))
    worker = make_worker_on(target, prefix="one")
    sched = MooncakeStoreScheduler(
        worker.config, KeyBuilder("one", Layout("unit-model", "bfloat16", BS, 2, 32, LAYERS, 1)),
        BS)
    sched.add_layout({0: worker.kv_signature})
    tries = iter(range(10**6))

    def loads() -> bool:
        i = next(tries)
        done, errors = run_step(worker, StepMetadata(
            loads=(BlockTransfer(f"load{i}", tuple(range(8, 8 + BLOCKS)), hs),)))
        return done == {f"load{i}"} and not errors

    def lookups() -> bool:
        req = request("blocks", BLOCKS)
        req.request_id = f"lookup{next(tries)}"
        return ask(sched, req)[0] == BLOCKS * BS

    try:
        hs = hashes("blocks", BLOCKS)
        run_step(worker, StepMetadata(saves=(BlockTransfer("w", tuple(range(BLOCKS)), hs),),
                                      free_after_jobs=("w",)))
        assert loads() and lookups()
        time.sleep(1.5)  # > --oplog_poll_interval_ms: the standby has applied the puts
        old = cluster.leader()
        old.kill()
        assert not loads(), "a load succeeded with the leader dead: no failover was tested"
        cluster.wait_serving(60, exclude=old)
        t_serving = time.monotonic()
        back: dict[str, float] = {}
        while len(back) < 2:
            for name, works in (("loads", loads), ("lookups", lookups)):
                if name not in back and works():
                    back[name] = round(time.monotonic() - t_serving, 2)
            assert time.monotonic() - t_serving < 60, f"only {back} came back"
            time.sleep(0.1)
        print(f"after the new leader served: {back} s")
        # A probe round and the store node's remount, not Mooncake's re-read every 30 s.
        assert max(back.values()) < 10.0, back
    finally:
        sched.shutdown()


def test_the_shared_client_closes_after_its_last_user_and_their_calls(master):
    cfg = load_config(master.store_config(), environ={}).store
    worker = worker_store(cfg, cfg, 0, 16 * 2**20, "fail", 2.0)
    sched = scheduler_store(cfg, 0, 2**20, "fail", 2.0)
    assert sched is worker  # one client, breaker and probe
    client, lookup_done = worker.client, threading.Event()
    sched.close([lookup_done.wait])  # a lookup still inside a call
    assert worker.ready() is client and client.batch_is_exist(["k"]) == [0]
    worker.close()
    assert worker.ready() is None
    time.sleep(0.1)
    assert client.batch_is_exist(["k"]) == [0]  # still open: the lookup's call may be inside
    lookup_done.set()
    deadline = time.monotonic() + 5
    while any(t.name == "mcpool-close" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the shared client was never closed"
        time.sleep(0.02)
    again = scheduler_store(cfg, 0, 2**20, "fail", 2.0)  # no open worker: one of its own
    try:
        assert again is not worker and again.ready() is not None
    finally:
        again.close()


def test_a_scheduler_shut_down_twice_leaves_its_workers_client_open(master, store_node,
                                                                    make_worker_on):
    worker = make_worker_on(master, prefix="twice")
    sched = MooncakeStoreScheduler(worker.config, KeyBuilder(
        "twice", Layout("unit-model", "bfloat16", BS, 2, 32, LAYERS, 1)), BS)
    sched.shutdown()
    sched.shutdown()
    hs = hashes("twice", 2)
    done, errors = run_step(worker, StepMetadata(saves=(BlockTransfer("w", (0, 1), hs),),
                                                 free_after_jobs=("w",)))
    assert done == {"w"} and not errors
    assert settled_saves(worker, 2)["save_keys|0"] == 2  # the client was open


def test_a_closed_worker_handle_keeps_nothing_of_its_worker_alive(master):
    cfg = load_config(master.store_config(), environ={}).store

    class Worker:  # what the handle's callbacks refer to: the KV caches, in a real worker
        def registered(self, client) -> None:
            pass

    owner = Worker()
    handle = worker_store(cfg, cfg, 0, 16 * 2**20, "fail", 2.0,
                          on_probe_error=lambda o=owner: o)
    handle.on_connect(owner.registered)
    sched = scheduler_store(cfg, 0, 2**20, "fail", 2.0)
    alive = weakref.ref(owner)
    handle.close()
    sched.close()
    del owner
    gc.collect()
    assert alive() is None  # though the scheduler still holds the handle
