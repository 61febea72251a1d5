"""The worker's load and save paths against a real Mooncake master and store, without vLLM's
engine: real KV-shaped tensors on CPU, real store calls, real failures (-704, -600, a job whose
preparation raises).
"""

from __future__ import annotations

import pytest
import torch

from connector.metadata import BlockTransfer, StepMetadata
from tests.worker_kit import hashes, kv_caches, run_step


@pytest.fixture
def make_worker(make_worker_on, master, store_node):
    return lambda **kw: make_worker_on(master, **kw)

def save(worker, req_id, block_ids, hs):
    run_step(worker, StepMetadata(saves=(BlockTransfer(req_id, tuple(block_ids), hs),),
                                  free_after_jobs=(req_id,)))


# Writer and reader transfer modes: staged (a contiguous buffer per thread, 2 blocks per call
# here so jobs span several calls) or multi-buffer; a block stored by either loads in the other.
STAGED_2 = {"staging": "on", "staging_buffer_size": 2 * 16 * 1024}
MODES = {"staged": STAGED_2, "multibuf": {"staging": "off"}}


@pytest.mark.parametrize("write_mode,read_mode", [("staged", "staged"), ("multibuf", "staged"),
                                                  ("staged", "multibuf")])
def test_saved_blocks_load_back_byte_exact(make_worker, write_mode, read_mode):
    src = kv_caches(seed=1)
    prefix = f"exact-{write_mode}-{read_mode}"
    writer = make_worker(caches=src, prefix=prefix, **MODES[write_mode])
    hs = hashes("exact", 8)
    save(writer, "w", range(8), hs)
    dst = kv_caches(seed=None)
    reader = make_worker(caches=dst, prefix=prefix, **MODES[read_mode])
    done, errors = run_step(reader, StepMetadata(
        loads=(BlockTransfer("r", tuple(range(20, 28)), hs),)))
    assert done == {"r"} and errors == set()
    for name in src:
        assert torch.equal(dst[name][:, 20:28], src[name][:, 0:8])
        assert not dst[name][:, 0:8].any()  # nothing written outside the target blocks


def test_burst_spreads_over_all_threads(make_worker):
    w = make_worker(threads=4, prefix="burst")
    hs = hashes("burst", 32)
    save(w, "seed", range(32), hs)
    loads = tuple(BlockTransfer(f"r{i}", tuple(range(32)), hs) for i in range(48))
    done, errors = run_step(w, StepMetadata(loads=loads))
    assert errors == set() and len(done) == 48
    assert all(n > 0 for n in w.pool.jobs_done), w.pool.jobs_done
    stats = w.recorder.snapshot().data
    for t in range(4):
        assert stats["c"][f"load_jobs|0|{t}|ok"] > 0
        assert stats["c"][f"load_bytes|0|{t}"] > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_missing_key_reports_exactly_its_blocks(make_worker, mode):
    caches = kv_caches(seed=2)
    w = make_worker(prefix=f"missing-{mode}", caches=caches, **MODES[mode])
    hs = hashes("missing", 6)
    save(w, "seed", (0, 1, 3, 4, 5), hs[:2] + hs[3:])  # block 2's key is never stored
    block_ids = (40, 41, 42, 43, 44, 45)
    stored = (hs[0], hs[1], hashes("absent", 1)[0], hs[3], hs[4], hs[5])
    before = {n: t.clone() for n, t in caches.items()}
    done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("r", block_ids, stored),)))
    assert done == {"r"}
    assert errors == {42}
    assert w.recorder.snapshot().data["c"]["failures|0|load|-704"] == 1
    transfer = "staged" if mode == "staged" else "multibuffer"
    assert any(k.startswith("layout_info|") and k.endswith(f"|{transfer}")
               for k in w.recorder.current_gauges())
    for n, t in caches.items():  # the blocks that arrived are in place, block 42 untouched
        assert torch.equal(t[:, [40, 41, 43, 44, 45]], before[n][:, [0, 1, 3, 4, 5]])
        assert torch.equal(t[:, 42], before[n][:, 42])


def test_too_small_buffer_reports_its_blocks(make_worker):
    big = make_worker(heads=2, prefix="small")
    small = make_worker(heads=1, prefix="small")
    # The layout fingerprint keeps the two apart; force a collision: the big worker writes
    # its double-size blocks under the small one's keys.
    big._keys = small._keys
    hs = hashes("small", 4)
    save(big, "seed", range(4), hs)
    done, errors = run_step(small, StepMetadata(
        loads=(BlockTransfer("r", (10, 11, 12, 13), hs),)))
    assert done == {"r"} and errors == {10, 11, 12, 13}
    assert small.recorder.snapshot().data["c"]["failures|0|load|-600"] == 1


def test_preparation_error_reports_every_block_and_finishes(make_worker):
    w = make_worker(prefix="prep")
    bad = BlockTransfer("bad", (5, 6, 7), ("not", "bytes", "hashes"))  # .hex() raises
    hs = hashes("prep", 2)
    save(w, "seed", range(2), hs)
    good = BlockTransfer("good", (8, 9), hs)
    done, errors = run_step(w, StepMetadata(loads=(bad, good)))
    assert done == {"bad", "good"}
    assert errors == {5, 6, 7}
    # The thread that hit the exception keeps serving the queue.
    done, errors = run_step(w, StepMetadata(loads=tuple(
        BlockTransfer(f"again{i}", (8, 9), hs) for i in range(8))))
    assert len(done) == 8 and errors == set()


def test_saves_skip_keys_already_stored(make_worker):
    w = make_worker(prefix="dedup")
    hs = hashes("dedup", 5)
    save(w, "a", range(3), hs[:3])
    w.recorder.snapshot()
    save(w, "b", range(5), hs)
    c = w.recorder.snapshot().data["c"]
    assert c["save_skipped_keys|0"] == 3 and c["save_keys|0"] == 2


def test_preemption_waits_for_inflight_saves(make_worker):
    w = make_worker(prefix="preempt")
    hs = hashes("preempt", 48)
    meta = StepMetadata(saves=(BlockTransfer("p", tuple(range(48)), hs),))
    w.start_save(meta)
    w.wait_preempted(StepMetadata(preempted=("p",)))
    assert w.ledger.idle()  # the save finished before the blocks could be reused


@pytest.fixture(scope="module")
def own_cluster():
    """A master and store node of this module's own, to freeze (SIGSTOP) without touching the
    shared ones."""
    from devkit.local_cluster import MooncakeMaster, StoreNode

    master = MooncakeMaster().start()
    node = StoreNode(master, segment_size="64MB").start()
    yield master, node
    node.stop()
    master.stop()


@pytest.mark.parametrize("frozen", ["node", "master"])
def test_save_stuck_past_preemption_wait_is_abandoned(make_worker_on, own_cluster, monkeypatch,
                                                      frozen):
    """The engine cannot wait forever for a preempted request's save: past the wait it reuses
    the blocks, so the save may read another request's KV. Stuck in its put (store node
    frozen), the save removes what it stored once the put returns; stuck before it (master
    frozen in the exists check), it never puts. Either way no key is left holding it."""
    import os
    import signal
    import time

    import connector.worker as worker_mod

    master, node = own_cluster
    monkeypatch.setattr(worker_mod, "PREEMPTION_WAIT_S", 0.5)
    w = make_worker_on(master, prefix=f"abandon-{frozen}")
    hs = hashes(f"abandon-{frozen}", 4)
    pid = (node if frozen == "node" else master).proc.pid
    w.recorder.snapshot()
    os.kill(pid, signal.SIGSTOP)
    try:
        w.start_save(StepMetadata(saves=(BlockTransfer("p", (0, 1, 2, 3), hs),)))
        time.sleep(0.2)
        t0 = time.monotonic()
        w.wait_preempted(StepMetadata(preempted=("p",)))
        assert time.monotonic() - t0 < 5 and w.ledger.in_flight("p")  # gave up; still stuck
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while not w.ledger.idle():
        assert time.monotonic() < deadline, "the save never returned"
        time.sleep(0.05)
    c = w.recorder.snapshot().data["c"]
    assert c.get("failures|0|save|abandoned") == 1, c
    assert c.get("save_keys|0", 0) == 0
    assert all(e != 1 for e in w._connected().batch_is_exist(w._keys.keys(hs, 0)))
    assert not w.ledger.is_abandoned("p")  # forgotten once its last job ended


def test_long_request_split_across_threads(make_worker):
    src = kv_caches(seed=3)
    writer = make_worker(caches=src, prefix="split")
    hs = hashes("split", 48)
    save(writer, "w", range(48), hs)
    dst = kv_caches(seed=None)
    reader = make_worker(caches=dst, prefix="split", threads=4, load_split_blocks=6)
    missing = hs[:20] + hashes("gone", 1) + hs[21:48]  # block 20 is in the 4th part
    done, errors = run_step(reader, StepMetadata(
        loads=(BlockTransfer("long", tuple(range(48)), missing),)))
    assert done == {"long"} and errors == {20}
    assert sum(reader.pool.jobs_done) == 8 and sum(n > 0 for n in reader.pool.jobs_done) >= 2
    for name in src:
        assert torch.equal(dst[name][:, :20], src[name][:, :20])
        assert torch.equal(dst[name][:, 21:48], src[name][:, 21:48])
