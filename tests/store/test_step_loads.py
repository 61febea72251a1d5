"""The worker's side of the two TTFT levers (connector.scheduler.step_loads), against a real master
and store node: an in-step load is in place when `start_load` returns and is never reported as an
asynchronous completion; its failed blocks are known in the same step; on a frozen store node the
step waits no longer than the in-step deadline and nothing lands in the cache afterwards;
asynchronous loads are queued before the forward (`begin_step`) once, and not where vLLM zeroes new
blocks first. Every load is timed for the scheduler (`take_load_times`)."""

from __future__ import annotations

import time

import pytest
import torch

from connector.config import load_config
from connector.metadata import BlockTransfer, StepMetadata
from connector.store.keys import KeyBuilder, Layout
from connector.worker.worker import MooncakeStoreWorker, step_deadline_s
from tests.store import test_deadlines
from tests.store.test_deadlines import STAGED, frozen, stored, wait_until
from tests.worker_kit import LAYERS, NUM_BLOCKS, hashes, kv_caches, run_step

SYNC = {**STAGED, "sync_load_ms": 20}
cluster = test_deadlines.cluster  # a master and store node of this module's own (frozen here)


def in_step(req_id: str, block_ids: range, hs) -> StepMetadata:
    return StepMetadata(sync_loads=(BlockTransfer(req_id, tuple(block_ids), hs),))


def test_in_step_load_is_in_place_when_start_load_returns(make_worker_on, cluster):
    master, _ = cluster
    hs = stored(make_worker_on, master, "instep-ok")
    dst = kv_caches(seed=None)
    w = make_worker_on(master, caches=dst, prefix="instep-ok", threads=2, **SYNC)
    w.begin_step(in_step("r", range(20, 28), hs))
    w.start_load(in_step("r", range(20, 28), hs))
    src = kv_caches(seed=5)
    for name in src:  # no polling: the step's forward reads these blocks right away
        assert torch.equal(dst[name][:, 20:28], src[name][:, 0:8])
    assert w.get_load_errors() == set()
    assert w.get_finished() == (None, None)  # vLLM runs the request already: not news to it
    times = w.take_load_times()
    load = times.loads["r"]
    assert times.in_step and load.in_step and load.blocks == 8 and not load.failed
    assert load.transfer > 0
    # Its job ran on the in-step thread, labelled after the pool's threads.
    c = w.recorder.snapshot().data["c"]
    assert c[f"load_jobs|0|{w.pool.size}|ok"] == 1


def test_in_step_load_reports_failed_blocks_in_the_same_step(make_worker_on, cluster):
    master, _ = cluster
    hs = stored(make_worker_on, master, "instep-missing", n=4)
    w = make_worker_on(master, prefix="instep-missing", **SYNC)
    keys = (hs[0], hs[1], hashes("absent", 1)[0], hs[3])
    w.start_load(in_step("r", range(30, 34), keys))
    assert w.get_load_errors() == {32}
    assert w.get_finished() == (None, None)
    assert w.take_load_times().loads["r"].failed


def test_in_step_load_on_a_frozen_node_is_bounded_and_never_written(make_worker_on, cluster):
    master, node = cluster
    hs = stored(make_worker_on, master, "instep-frozen")
    dst = kv_caches(seed=None)
    w = make_worker_on(master, caches=dst, prefix="instep-frozen", **SYNC)
    deadline = step_deadline_s(w.config)
    with frozen(node.proc):
        t0 = time.monotonic()
        w.start_load(in_step("r", range(40, 48), hs))
        took = time.monotonic() - t0
        errors = w.get_load_errors()
        # Its call still hangs on the frozen node. The thread is stuck once the call itself
        # outlives the deadline, counted from when the thread took the job (on a busy host, a
        # little after the step queued it): kept frozen until then, it is replaced.
        wait_until(lambda: w.step_pool.replaced == 1, 10,
                   "the in-step thread stuck on the frozen node was never replaced")
    assert errors == set(range(40, 48))  # all recomputed by vLLM
    assert deadline <= took < deadline + 2, f"the step waited {took:.2f}s ({deadline}s)"
    assert w.get_finished() == (None, None)
    wait_until(lambda: w.step_pool.stuck == 0, 40, "the stuck in-step call never returned")
    wait_until(lambda: w.staging_buffers <= w.pool.size + 1, 5, "staging buffers leaked")
    assert not any(t[:, 40:48].any() for t in dst.values()), "a stuck load wrote into the cache"
    c = w.recorder.snapshot().data["c"]
    assert c["failures|0|load|timeout"] == 1 and c["threads_replaced|0|load"] == 1


def worker(master, zeroes_blocks: bool) -> MooncakeStoreWorker:
    cfg = load_config(master.store_config(global_segment_size=0, local_buffer_size="32MB",
                                          load_threads=1, **STAGED), environ={})
    w = MooncakeStoreWorker(cfg, KeyBuilder("early", Layout("unit-model", "bfloat16", 32, 2, 32,
                                                            LAYERS, 1)), 0, NUM_BLOCKS,
                            zeroes_blocks=zeroes_blocks)
    w.register_kv_caches(kv_caches())
    return w


@pytest.mark.parametrize("zeroes_blocks", [False, True])
def test_async_loads_are_queued_before_the_forward_once(make_worker_on, cluster, zeroes_blocks):
    master, _ = cluster
    hs = stored(make_worker_on, master, "early")
    w = worker(master, zeroes_blocks)
    try:
        meta = StepMetadata(loads=(BlockTransfer("r", tuple(range(8)), hs),))
        w.begin_step(meta)
        # Queued before the forward, unless vLLM zeroes new blocks at the step's start.
        assert w.ledger.in_flight("r") is not zeroes_blocks
        done, errors = run_step(w, meta)  # start_load, after the forward, then polls
        assert done == {"r"} and errors == set()
        assert sum(w.pool.jobs_done) == 1  # one job, not two
        load = w.take_load_times().loads["r"]
        assert not load.in_step and load.blocks == 8 and load.report >= 0
    finally:
        w.shutdown()
