"""The worker's load and save paths against a real Mooncake master and store, without vLLM's
engine: real KV-shaped tensors on CPU, real store calls, real failures (-704, -600, a short
read, a job whose preparation raises), and preemptions while a store node of this module's
own is frozen (SIGSTOP) under a save.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import connector.worker.recv_pool as recv_pool
from connector.metadata import BlockTransfer, StepMetadata
from connector.worker.worker import SHUTDOWN_BOUND_S
from devkit.local_cluster import MooncakeMaster, StoreNode, local_pool
from devkit.processes import freeze, frozen, thaw
from tests.tracing_kit import STUCK_S, record_closes, timed_shutdown, trace_with
from tests.worker_kit import NUM_BLOCKS, hashes, kv_caches, run_step, settled_saves, wait_until


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


def test_address_cache_size_bounds_the_kept_lists_and_the_log_says_so(make_worker, caplog):
    """address_cache_size bounds the address lists a worker keeps, and its startup log says
    how many of the KV cache's blocks they cover and what would cover them all."""
    caplog.set_level(logging.INFO, logger="vllm.connector.worker.worker")
    whole = make_worker()
    row = whole._io[0].load.row_bytes
    small = make_worker(prefix="address-cache", address_cache_size=5 * row)
    plan = small._io[0].load
    assert plan.kept_units == 5 and whole._io[0].load.kept_units >= NUM_BLOCKS
    plan.addresses(list(range(NUM_BLOCKS)))
    assert len(plan._rows) == 5, "kept past address_cache_size"
    lines = [r.getMessage() for r in caplog.records if "address lists kept" in r.getMessage()]
    assert lines[0].endswith(f"kept for {NUM_BLOCKS} of {NUM_BLOCKS} blocks "
                             "(address_cache_size=64MB)")
    assert lines[1].startswith(f"KV cache group 0: address lists kept for 5 of {NUM_BLOCKS} ")
    assert lines[1].endswith("; 1MB would keep them all)")


def test_burst_spreads_over_all_threads(make_worker):
    w = make_worker(threads=4, prefix="burst")
    hs = hashes("burst", 32)
    save(w, "seed", range(32), hs)
    loads = tuple(BlockTransfer(f"r{i}", tuple(range(32)), hs) for i in range(48))
    done, errors = run_step(w, StepMetadata(loads=loads))
    assert errors == set() and len(done) == 48, w.recorder.snapshot().data["c"]
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


def test_short_read_is_labelled_as_such(make_worker):
    """A stored object smaller than a block (written by a layout with half the heads, forced
    under the same keys) arrives short: its blocks are load errors, counted as short_read, not
    as Mooncake's -600 (INVALID_PARAMS), which means something else."""
    small = make_worker(heads=1, prefix="short")
    big = make_worker(heads=2, prefix="short", **STAGED_2)
    small._keys = big._keys
    hs = hashes("short", 2)
    save(small, "seed", range(2), hs)
    before = {n: t.clone() for n, t in big._kv_caches.items()}
    done, errors = run_step(big, StepMetadata(loads=(BlockTransfer("r", (10, 11), hs),)))
    assert done == {"r"} and errors == {10, 11}
    c = big.recorder.snapshot().data["c"]
    assert c["failures|0|load|short_read"] == 1 and "failures|0|load|-600" not in c, c
    for n, t in big._kv_caches.items():
        assert torch.equal(t[:, 10:12], before[n][:, 10:12])  # nothing short copied in


def test_a_failed_existence_check_is_no_failure_when_the_put_succeeds(make_worker):
    """The existence check answers an error other than an RPC failure for some keys: they
    count as absent and are put; when the put succeeds the save did not fail. (The store never
    answers such an error on purpose; only that one call is a stand-in, the put is real.)"""
    w = make_worker(prefix="exists-error")
    real = w._store.client

    class Client:
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_is_exist(self, keys):
            return [-1] + real.batch_is_exist(keys[1:])

    w._store.client = Client()
    try:
        hs = hashes("exists-error", 3)
        save(w, "s", range(3), hs)
    finally:
        w._store.client = real
    c = w.recorder.snapshot().data["c"]
    assert c["save_keys|0"] == 3 and not any(k.startswith("failures|") for k in c), c


@pytest.fixture(scope="module")
def own_cluster():
    """A master and store node of this module's own, to freeze (SIGSTOP) without touching the
    shared ones."""
    with local_pool() as pool:
        yield pool


def in_put(w) -> bool:
    """A save is inside its zero-copy put (past its existence check)."""
    return any(t.state == recv_pool.TOUCHING for t in list(w.save_pool._current.values()))


# Zero-copy saves, as on GPUs: the put reads the KV blocks for its whole call. Mooncake's
# transfer timeout is set well past what the tests wait, so a frozen put returns only once
# the node is resumed, and then succeeds.
SAVE_TIMEOUT_S = 3.0
ZERO_COPY_SAVES = {"staging": "off", "transfer_timeout": 30, "save_timeout_s": SAVE_TIMEOUT_S}


def test_preemption_waits_for_a_put_reading_its_blocks_and_no_longer(make_worker_on,
                                                                     own_cluster):
    """A preempted request's save is inside its put (store node frozen) past save_timeout_s:
    handle_preemptions returns only once the put has returned (the node resumes 4 s in, after
    the save's deadline), never while it may still read the blocks. The blocks are then
    rewritten, as vLLM reuses them; the store holds the request's own KV."""
    master, node = own_cluster
    caches = kv_caches(seed=11)
    original = {n: t[:, 0:4].clone() for n, t in caches.items()}
    w = make_worker_on(master, caches=caches, prefix="preempt-reading", **ZERO_COPY_SAVES)
    hs = hashes("preempt-reading", 4)
    freeze(node.proc)
    resumed: list[float] = []

    def resume() -> None:
        thaw(node.proc)
        resumed.append(time.monotonic())

    timer = threading.Timer(SAVE_TIMEOUT_S + 1.0, resume)
    try:
        w.start_save(StepMetadata(saves=(BlockTransfer("p", (0, 1, 2, 3), hs),)))
        wait_until(lambda: in_put(w), 10, "the save never reached its put")
        timer.start()
        t0 = time.monotonic()
        w.wait_preempted(StepMetadata(preempted=("p",)))
        returned = time.monotonic()
    finally:
        timer.cancel()
        thaw(node.proc)
    for t in caches.values():  # the blocks go to another request
        t[:, 0:4] = -1.0
    assert resumed and returned >= resumed[0], "handle_preemptions returned before the put did"
    assert returned - t0 < SAVE_TIMEOUT_S + 1.0 + 10, "the preemption outwaited the put"
    assert not w.ledger.in_flight("p")
    wait_until(lambda: w.save_pool.idle, 30, "the put's thread never returned")
    dst = kv_caches(seed=None)
    reader = make_worker_on(master, caches=dst, prefix="preempt-reading", **STAGED_2)
    done, errors = run_step(reader, StepMetadata(loads=(BlockTransfer("r", (20, 21, 22, 23),
                                                                      hs),)))
    assert done == {"r"} and errors == set()
    for name, want in original.items():
        assert torch.equal(dst[name][:, 20:24], want)


def test_preemption_drops_a_queued_save_at_once(make_worker_on, own_cluster):
    """The save thread is stuck in another request's put (store node frozen). A preempted
    request whose save is only queued behind it must not stall the engine step: its save is
    dropped at once (it never reads the blocks) and counted as abandoned."""
    master, node = own_cluster
    w = make_worker_on(master, prefix="preempt-queued", **ZERO_COPY_SAVES)
    hs = hashes("preempt-queued", 8)
    w.recorder.snapshot()
    with frozen(node.proc):
        w.start_save(StepMetadata(saves=(BlockTransfer("a", (0, 1, 2, 3), hs[:4]),)))
        wait_until(lambda: in_put(w), 10, "the first save never reached its put")
        w.start_save(StepMetadata(saves=(BlockTransfer("b", (8, 9, 10, 11), hs[4:]),)))
        assert w.save_pool.depth() == 1
        t0 = time.monotonic()
        w.wait_preempted(StepMetadata(preempted=("b",)))
        took = time.monotonic() - t0
        # Waiting for the frozen put ahead would take its transfer_timeout (30 s).
        assert took < 5.0, f"a preemption waited {took:.2f}s for a save that was only queued"
        assert not w.ledger.in_flight("b") and w.ledger.in_flight("a")
    wait_until(lambda: w.save_pool.idle, 30, "the stuck put never returned")
    c = w.recorder.snapshot().data["c"]
    assert c.get("failures|0|save|abandoned") == 1 and c.get("save_keys|0") == 4, c
    exist = w._connected().batch_is_exist(w._keys.keys(hs, 0))
    assert exist == [1] * 4 + [0] * 4, exist  # "a" stored, "b" never put


def test_finished_request_is_not_held_by_a_save_queued_behind_a_stuck_one(make_worker_on,
                                                                         own_cluster):
    """Saves hang (store node frozen: a put has outlived save_timeout_s). A request that
    finishes with its save still queued gets its blocks back at the next poll, not when that
    save would expire: while saves hang, queued saves of finished requests are dropped."""
    master, node = own_cluster
    w = make_worker_on(master, prefix="finished-queued", **ZERO_COPY_SAVES)
    hs = hashes("finished-queued", 12)
    with frozen(node.proc):
        w.start_save(StepMetadata(saves=(BlockTransfer("a", (0, 1), hs[:2]),)))
        wait_until(lambda: w.save_pool.replaced == 1, SAVE_TIMEOUT_S + 10,
                   "the stuck put was never noticed")
        w.start_save(StepMetadata(saves=(BlockTransfer("b", (4, 5), hs[4:6]),)))
        wait_until(lambda: w.save_pool.depth() == 0, 10, "the replacement thread took no save")
        w.start_save(StepMetadata(saves=(BlockTransfer("c", (8, 9), hs[8:10]),)))
        t0 = time.monotonic()
        w.note_free_after(StepMetadata(free_after_jobs=("c",)))
        sending = None
        while not sending:
            sending, _ = w.get_finished()
            # Its save would expire at SAVE_TIMEOUT_S; the next poll comes within milliseconds.
            assert time.monotonic() - t0 < SAVE_TIMEOUT_S - 1.0, \
                "a finished request waited for its queued save"
            time.sleep(0.01)
        assert sending == {"c"}
    wait_until(lambda: w.save_pool.idle and w.save_pool.stuck == 0, 30,
               "the stuck puts never returned")
    exist = w._connected().batch_is_exist(w._keys.keys(hs, 0))
    assert exist[8:10] == [0, 0], exist  # the dropped save never ran


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


def test_staging_buffers_are_registered_before_the_first_load(make_worker):
    """Registering a buffer publishes the client's segment to the metadata server: a round trip
    that the first store hit of each thread would pay inside its deadline. The load threads'
    and the in-step thread's buffers are registered at startup, and the first loads take them
    (only the save thread makes its own)."""
    w = make_worker(prefix="warm", threads=2, **STAGED_2)
    assert w.staging_buffers == w.pool.size + 1
    hs = hashes("warm", 4)
    save(w, "w", range(4), hs)
    assert w.staging_buffers == w.pool.size + 2
    done, errors = run_step(w, StepMetadata(loads=tuple(
        BlockTransfer(f"r{i}", (10 + 2 * i, 11 + 2 * i), hs[2 * i:2 * i + 2]) for i in range(2))))
    assert done == {"r0", "r1"} and not errors
    assert w.staging_buffers == w.pool.size + 2  # no thread registered one of its own


def test_staging_buffers_registered_before_a_failed_one_are_kept(make_worker, monkeypatch):
    """The second staging buffer's registration fails at startup (a metadata server that times
    out): the one registered before it is kept for a load thread, counted, and still
    registered; the failed one is made on first use. Before, both were thrown away, the first
    left registered and counted for good."""
    import connector.store.client as store_client
    from tests.client_kit import CallRecorder

    nbytes, staged, live = STAGED_2["staging_buffer_size"], [], set()

    class FailSecondStaging(CallRecorder):
        def register_buffer(self, ptr: int, size: int) -> int:
            if size == nbytes:
                staged.append(ptr)
                if len(staged) == 2:
                    return -1
                live.add(ptr)
            return self._client.register_buffer(ptr, size)

        def unregister_buffer(self, ptr: int) -> int:
            live.discard(ptr)
            return self._client.unregister_buffer(ptr)

    real = store_client.open_store
    monkeypatch.setattr(store_client, "open_store", lambda *a: (
        lambda c, m: (FailSecondStaging(c), m))(*real(*a)))
    w = make_worker(prefix="warm-fail", threads=2, **STAGED_2)
    assert len(staged) == 2 and w.staging_buffers == 1 and live == {staged[0]}
    assert [s.buffer.data_ptr() for ss in w._spare.values() for s in ss] == [staged[0]]


def test_saves_resume_once_the_store_takes_puts_again(make_worker_on):
    """Saves fail (a master without a store node: no segment to put into), then a store node
    mounts. Saves of finished requests are dropped while saves fail, but not all of them: a
    later save must reach the store, or the dropping would never end (seen: a worker that
    stored nothing after one failed put, every later save counted as abandoned)."""
    master = MooncakeMaster().start()
    node = None
    try:
        w = make_worker_on(master, prefix="resume", staging="off")
        hs = hashes("resume", 4)
        save(w, "failed", (0, 1), hs[:2])
        assert w._saves_failing
        node = StoreNode(master, segment_size="64MB").start()
        stored = False
        for i in range(20):  # every request finishes the step its save is queued in
            save(w, f"r{i}", (2, 3), hs[2:])
            stored = w._connected().batch_is_exist(w._keys.keys(hs[2:], 0)) == [1, 1]
            if stored:
                break
        assert stored, w.recorder.snapshot().data["c"]
        assert not w._saves_failing
        # Every key offered is accounted for once: written, found stored, or lost (the failed
        # put's two, and those of each save dropped or failed before the node mounted).
        c = settled_saves(w, 2 * (i + 2))
        assert c["save_error_keys|0"] >= 2 and c["save_keys|0"] >= 1, c
    finally:
        if node is not None:
            node.stop()
        master.stop()


@pytest.mark.parametrize("fail", [False, True], ids=["collector_stuck", "shutdown_fails"])
def test_shutdown_closes_the_store_client_whatever_tracing_does(make_worker, monkeypatch, fail):
    """Tracing's shutdown waits for its collector (its exports, the SDK exporter's shutdown) or
    raises: the worker's shutdown still ends within SHUTDOWN_BOUND_S and closes the store
    client. Before, a failing one raised out of it with the client left open, and a stuck one
    held it as long as the collector (STUCK_S here)."""
    w = make_worker()
    writer = trace_with(w.add_subscriber, fail)
    closes = record_closes(w._store, monkeypatch)
    took = timed_shutdown(w.shutdown, writer)
    assert took < SHUTDOWN_BOUND_S + (STUCK_S - SHUTDOWN_BOUND_S) / 2, took
    assert len(closes) == 1
