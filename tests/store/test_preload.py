"""Preloads (connector.worker.preload) against a real Mooncake master and store node: a queued
request's prefix read into host memory before vLLM gives it blocks, and its load then a copy
from there that needs no store call; the buffer's rows never handed on while a get may still
write into them.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from connector.metadata import BlockTransfer, Preload, StepMetadata
from devkit.local_cluster import local_pool
from devkit.processes import freeze, thaw
from tests.worker_kit import hashes, kv_caches, run_step, wait_until


@pytest.fixture(scope="module")
def own_cluster():
    """A master and store node of this module's own, to freeze (SIGSTOP)."""
    with local_pool() as pool:
        yield pool


class Seen:
    """A worker's counters summed over its stats polls, and its gauges now."""

    def __init__(self, worker) -> None:
        self.w, self.c = worker, Counter()

    def counters(self) -> Counter:
        snap = self.w.recorder.snapshot()
        self.c.update(snap.data["c"] if snap else {})
        return self.c

    def held(self) -> int:
        return self.w.recorder.current_gauges()["preload_bytes|0"]


def saved(make_worker_on, master, tag: str, n: int):
    """`n` blocks of random KV saved under `tag`: (their hashes, the source caches)."""
    src = kv_caches(seed=len(tag))
    writer = make_worker_on(master, caches=src, prefix=tag)
    hs = hashes(tag, n)
    run_step(writer, StepMetadata(saves=(BlockTransfer("w", tuple(range(n)), hs),),
                                  free_after_jobs=("w",)))
    return hs, src


def reader_of(make_worker_on, master, tag: str, **extra):
    dst = kv_caches(seed=None)
    w = make_worker_on(master, caches=dst, prefix=tag, staging="on", **extra)
    return w, dst, w._arena.stager.block_bytes * len(w._io[0].load.shards)


def preload(w, rid: str, hs) -> None:
    w.begin_step(StepMetadata(preloads=(Preload(rid, hs),)))
    wait_until(lambda: w.preload_pool.idle, 20, "the preload never ended")


def test_a_preloaded_prefix_loads_byte_exact_with_the_store_node_frozen(make_worker_on,
                                                                        own_cluster):
    """Read while the request was queued, the prefix loads with no store call: byte-exact,
    reported done and not failed, while the store node is frozen (a store read would wait
    out load_timeout_s and fail its blocks)."""
    master, node = own_cluster
    hs, src = saved(make_worker_on, master, "preload-exact", 8)
    w, dst, per_block = reader_of(make_worker_on, master, "preload-exact", load_timeout_s=3)
    seen = Seen(w)
    preload(w, "r", hs)
    assert seen.held() == 8 * per_block
    freeze(node.proc)
    try:
        done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("r", tuple(range(20, 28)),
                                                                     hs),)))
    finally:
        thaw(node.proc)
    assert done == {"r"} and errors == set()
    for name in src:
        assert torch.equal(dst[name][:, 20:28], src[name][:, 0:8])
        assert not dst[name][:, :20].any() and not dst[name][:, 28:].any()
    c = seen.counters()
    assert c["preload_keys|0|used"] == 8 * len(w._io[0].load.shards), dict(c)
    assert seen.held() == 0


def test_a_whole_preload_is_reported_once_and_its_in_step_load_copies_it(make_worker_on,
                                                                         own_cluster):
    """A preload read whole is reported to the scheduler once (take_preloads_ready), which may
    then put its load in the step: the in-step load copies it, byte-exact, with the store node
    frozen. A preload with a key the store lacks is not reported (its load reads the store)."""
    master, node = own_cluster
    hs, src = saved(make_worker_on, master, "preload-ready", 6)
    w, dst, _ = reader_of(make_worker_on, master, "preload-ready", sync_load_ms=20,
                          load_timeout_s=3)
    preload(w, "whole", hs)
    preload(w, "part", hs[:3] + hashes("preload-absent", 1))
    assert w.take_preloads_ready() == ["whole"]
    assert w.take_preloads_ready() == []
    freeze(node.proc)
    try:
        w.start_load(StepMetadata(sync_loads=(BlockTransfer("whole", tuple(range(40, 46)),
                                                            hs),)))
    finally:
        thaw(node.proc)
    assert w.get_load_errors() == set()
    for name in src:
        assert torch.equal(dst[name][:, 40:46], src[name][:, 0:6])
    load = w.take_load_times().loads["whole"]
    assert load.in_step and load.preloaded and not load.failed


def test_a_load_before_its_preload_reads_the_store_and_the_preload_never_starts(
        make_worker_on, master, store_node):
    hs, src = saved(make_worker_on, master, "preload-late", 4)
    w, dst, _ = reader_of(make_worker_on, master, "preload-late")
    seen = Seen(w)
    done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("r", (4, 5, 6, 7), hs),)))
    assert done == {"r"} and errors == set()
    preload(w, "r", hs)  # its look-ahead hit reaches the worker a step late
    assert seen.held() == 0 and not any(k.startswith("preload_keys") for k in seen.counters())
    for name in src:
        assert torch.equal(dst[name][:, 4:8], src[name][:, 0:4])


def test_a_preload_that_does_not_fit_is_skipped_and_the_load_reads_the_store(
        make_worker_on, master, store_node):
    hs, src = saved(make_worker_on, master, "preload-room", 8)
    probe, _, per_block = reader_of(make_worker_on, master, "preload-room")
    w, dst, _ = reader_of(make_worker_on, master, "preload-room",
                          preload_buffer_size=4 * per_block)
    seen = Seen(w)
    preload(w, "r", hs)
    assert seen.held() == 0 and seen.counters()["preload_keys|0|no_room"] == 8
    done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("r", tuple(range(8)), hs),)))
    assert done == {"r"} and errors == set()
    for name in src:
        assert torch.equal(dst[name][:, 0:8], src[name][:, 0:8])


def test_a_finished_request_frees_its_preload(make_worker_on, master, store_node):
    hs, _ = saved(make_worker_on, master, "preload-finished", 4)
    w, _, per_block = reader_of(make_worker_on, master, "preload-finished")
    seen = Seen(w)
    preload(w, "r", hs)
    assert seen.held() == 4 * per_block
    w.get_transfer_results({"r"})  # aborted while queued
    assert seen.held() == 0 and seen.counters()["preload_keys|0|unused"] == 4


def test_a_load_of_a_request_already_finished_is_forgotten_in_time(make_worker_on, master,
                                                                   store_node, monkeypatch):
    """A request aborted while its load was queued is reported finished to the worker before
    the load runs: the load then marks it as loaded before any preload of it (so none starts),
    and nothing cleared that mark, one per such request for the life of the process. It ages
    out like a ready preload."""
    import connector.worker.preload as preload_module

    monkeypatch.setattr(preload_module, "PRELOAD_TTL_S", 0.2)
    hs, _ = saved(make_worker_on, master, "preload-gone", 2)
    w, _, _ = reader_of(make_worker_on, master, "preload-gone")
    w.get_transfer_results({"gone"})  # finished (aborted) before its load ran
    done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("gone", (4, 5), hs),)))
    assert done == {"gone"} and not errors and "gone" in w._arena._loading
    time.sleep(0.3)
    preload(w, "next", hs)  # a preload ages the arena first
    assert "gone" not in w._arena._loading


def test_rows_a_stuck_get_may_write_stay_held_until_it_returns(make_worker_on, own_cluster):
    """The request finishes while its preload's get is stuck on a frozen store node: the rows
    that get may still write into are not freed (nor lent to another preload) until the call
    returns; then they are."""
    master, node = own_cluster
    hs, _ = saved(make_worker_on, master, "preload-stuck", 4)
    w, _, per_block = reader_of(make_worker_on, master, "preload-stuck", load_timeout_s=2)
    seen = Seen(w)
    freeze(node.proc)
    try:
        w.begin_step(StepMetadata(preloads=(Preload("r", hs),)))
        wait_until(lambda: seen.held() == 4 * per_block, 5, "the preload never started")
        w.get_transfer_results({"r"})
        assert seen.held() == 4 * per_block
        assert not w.preload_pool.idle  # the get is still out
    finally:
        thaw(node.proc)
    wait_until(lambda: seen.held() == 0, 30, "the rows were never freed")
    c = seen.counters()
    assert c["preload_keys|0|failed"] + c["preload_keys|0|unused"] == 4, dict(c)
