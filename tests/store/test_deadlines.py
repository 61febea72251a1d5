"""No request hangs on a frozen peer, and no stuck transfer writes into memory vLLM got back.

A frozen store node or master (SIGSTOP: TCP stays open, nothing answers) holds a Mooncake call
for up to Mooncake's own timeout (30 s). Against a real master and store node of this module's
own: loads past `load_timeout_s` are reported as load errors (vLLM recomputes) and their KV
blocks stay untouched even after the stuck calls return; stuck threads are replaced with
bounded, counted buffers; saves past `save_timeout_s` release their blocks and what they store
late is removed; shutdown fails queued jobs fast; a stale save never strands a newer load.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest
import torch

import connector.worker as worker_mod
from connector.metadata import BlockTransfer, StepMetadata
from tests.worker_kit import hashes, kv_caches, run_step

TIMEOUT_S = 1.0
STAGED = {"staging": "on", "staging_buffer_size": 2 * 16 * 1024}  # 2 blocks per call


@pytest.fixture(scope="module")
def cluster():
    from devkit.local_cluster import MooncakeMaster, StoreNode

    master = MooncakeMaster().start()
    node = StoreNode(master, segment_size="64MB").start()
    yield master, node
    node.stop()
    master.stop()


@contextmanager
def frozen(proc):
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def stored(make_worker_on, master, prefix: str, n: int = 8):
    """A worker that saved n blocks of seed 5 (on the store node), and their hashes."""
    w = make_worker_on(master, caches=kv_caches(seed=5), prefix=prefix, **STAGED)
    hs = hashes(prefix, n)
    run_step(w, StepMetadata(saves=(BlockTransfer("seed", tuple(range(n)), hs),),
                             free_after_jobs=("seed",)))
    return hs


@pytest.mark.parametrize("which", ["node", "master"])
def test_loads_past_deadline_are_recomputed_and_never_written(make_worker_on, cluster, which):
    master, node = cluster
    prefix = f"deadline-{which}"
    hs = stored(make_worker_on, master, prefix)
    dst = kv_caches(seed=None)
    w = make_worker_on(master, threads=2, caches=dst, prefix=prefix, load_timeout_s=TIMEOUT_S,
                       **STAGED)
    loads = tuple(BlockTransfer(f"r{i}", tuple(range(10 + 8 * (i % 4), 18 + 8 * (i % 4))), hs)
                  for i in range(6))
    with frozen((node if which == "node" else master).proc):
        t0 = time.monotonic()
        done, errors = run_step(w, StepMetadata(loads=loads), timeout=TIMEOUT_S + 10)
        took = time.monotonic() - t0
        g = w.recorder.current_gauges()
    assert done == {t.req_id for t in loads}
    assert errors == {b for t in loads for b in t.block_ids}  # all recomputed
    assert took < TIMEOUT_S + 3, f"burst took {took:.1f}s with load_timeout_s={TIMEOUT_S}"
    # Both running jobs' threads were stuck and replaced; never more than the pool size.
    assert 1 <= g["threads_stuck|0|load"] <= w.pool.size
    assert g["staging_buffers|0"] <= 2 * w.pool.size
    # The stuck calls return after SIGCONT: their threads exit, their buffers are released,
    # and nothing they fetched lands in blocks that vLLM got back.
    wait_until(lambda: w.pool.stuck == 0, 40, "stuck threads never returned")
    wait_until(lambda: w.staging_buffers <= w.pool.size, 5, "staging buffers leaked")
    assert not any(t[:, 10:42].any() for t in dst.values()), "a stuck load wrote into the cache"
    c = w.recorder.snapshot().data["c"]
    assert c["failures|0|load|timeout"] >= 2 and c["threads_replaced|0|load"] >= 1, c
    # After the freeze the same loads hit again, byte-exact.
    done, errors = run_step(w, StepMetadata(loads=loads[:1]), timeout=30)
    assert done == {"r0"} and errors == set()
    src = kv_caches(seed=5)
    for name in src:
        assert torch.equal(dst[name][:, 10:18], src[name][:, 0:8])


def test_zero_copy_load_holds_its_blocks_until_the_call_returns(make_worker_on, cluster):
    """Multi-buffer gets write straight into the KV blocks: such a job is never expired while
    its call runs (Mooncake's transfer timeout bounds it), so no late write can land in
    blocks vLLM reuses."""
    master, node = cluster
    hs = stored(make_worker_on, master, "zerocopy")
    dst = kv_caches(seed=None)
    w = make_worker_on(master, threads=1, caches=dst, prefix="zerocopy", staging="off",
                       load_timeout_s=TIMEOUT_S)
    with frozen(node.proc):
        w.start_load(StepMetadata(loads=(BlockTransfer("z", tuple(range(8)), hs),)))
        time.sleep(TIMEOUT_S + 1)
        assert w.get_finished() == (None, None)  # held: the call may still write
    wait_until(lambda: w.ledger.idle(), 40, "the zero-copy load never finished")
    assert w.get_finished()[1] == {"z"}


def test_save_past_deadline_releases_blocks_and_removes_late_writes(make_worker_on, cluster):
    master, node = cluster
    w = make_worker_on(master, prefix="save-deadline", save_timeout_s=TIMEOUT_S, **STAGED)
    hs = hashes("save-deadline", 4)
    with frozen(node.proc):
        t0 = time.monotonic()
        done, _ = run_step(w, StepMetadata(saves=(BlockTransfer("s", (0, 1, 2, 3), hs),),
                                           free_after_jobs=("s",)), timeout=TIMEOUT_S + 10)
        assert done == {"s"} and time.monotonic() - t0 < TIMEOUT_S + 3
        assert w.recorder.current_gauges()["threads_stuck|0|save"] == 1
        # The next save runs on the replacement thread while the stuck one waits.
    wait_until(lambda: w.save_pool.stuck == 0, 40, "the stuck save never returned")
    c = w.recorder.snapshot().data["c"]
    assert c["failures|0|save|timeout"] == 1 and c["threads_replaced|0|save"] == 1, c
    assert all(e != 1 for e in w._connected().batch_is_exist(w._keys.keys(hs, 0)))


def test_old_save_does_not_strand_a_newer_load(make_worker_on, cluster, monkeypatch):
    """A save outlives the preemption wait, the request resumes and its load finishes
    first: the load must still be reported, or the request waits forever."""
    master, node = cluster
    monkeypatch.setattr(worker_mod, "PREEMPTION_WAIT_S", 0.5)
    w = make_worker_on(master, prefix="strand")
    with frozen(node.proc):  # the put hangs on the node; a lookup of absent keys does not
        w.start_save(StepMetadata(saves=(BlockTransfer("p", (0, 1), hashes("strand", 2)),)))
        time.sleep(0.2)
        w.wait_preempted(StepMetadata(preempted=("p",)))
        assert w.ledger.in_flight("p")
        done, errors = run_step(w, StepMetadata(
            loads=(BlockTransfer("p", (5, 6), hashes("strand-absent", 2)),)), timeout=10)
        assert done == {"p"} and errors == {5, 6}
    wait_until(lambda: w.ledger.idle(), 40, "the stuck save never returned")


def test_shutdown_fails_queued_jobs_fast_and_closes_after_calls(make_worker_on, cluster):
    master, _ = cluster
    hs = stored(make_worker_on, master, "shutdown")
    w = make_worker_on(master, threads=1, prefix="shutdown", load_timeout_s=600, **STAGED)
    loads = tuple(BlockTransfer(f"q{i}", tuple(range(8)), hs) for i in range(10))
    with frozen(master.proc):
        w.start_load(StepMetadata(loads=loads))
        time.sleep(0.3)  # one job inside its call, nine queued
        t0 = time.monotonic()
        w.shutdown()
        took = time.monotonic() - t0
        _, recving = w.get_finished()
        errors = w.get_load_errors()
        client_open = w._store.client is None and any(
            t.name == "mcpool-close" and t.is_alive() for t in threading.enumerate())
    assert took < 3, f"shutdown took {took:.1f}s"
    assert recving is not None and len(recving) >= 9 and errors == set(range(8))
    assert client_open, "the client must wait for the stuck call before it closes"
    wait_until(lambda: not any(t.name == "mcpool-close" for t in
                               threading.enumerate()), 40,
               "the client never closed after the stuck call returned")


def test_abandoned_save_cleanup_is_checked_and_retried(make_worker_on, cluster):
    """A remove that keeps failing is retried, then logged and counted, never ignored.
    (A real remove fails only if the master dies between a put's end and the remove, a
    window too small to hit on purpose: this one client call is a stand-in.)"""
    master, _ = cluster
    w = make_worker_on(master, prefix="remove")

    class Client:
        calls = 0

        def batch_remove(self, keys, force):
            Client.calls += 1
            return [0 if k == "a" else -900 for k in keys]

    w._remove(Client(), ["a", "b"])
    assert Client.calls == worker_mod.REMOVE_ATTEMPTS
    assert w.recorder.snapshot().data["c"]["failures|0|save_remove|-900"] == 1
