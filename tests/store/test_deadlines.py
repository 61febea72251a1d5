"""No request hangs on a frozen peer, and no transfer touches memory vLLM got back.

A frozen store node or master (SIGSTOP: TCP stays open, nothing answers) holds a Mooncake call
until Mooncake's own timeout. Against a real master and store node of this module's own:
loads past `load_timeout_s` are reported as load errors (vLLM recomputes), attributed to the
thread that ran them, and their KV blocks stay untouched even after the stuck calls return;
stuck threads are replaced with bounded, counted buffers; a zero-copy get holds its blocks
until its call returns, which `load_timeout_s` bounds by default; a save past `save_timeout_s`
never hands back blocks its put may still read, what it stores is the request's own KV, and
what its put stored after the deadline is counted stored, not lost;
a save whose existence check hit an RPC failure makes no put; shutdown fails queued jobs fast.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_events import BlockStored

from connector.metadata import BlockTransfer, StepMetadata
from connector.observability.events import LoadEvent, Subscriber
from connector.observability.kv_event_settings import EventSettings
from connector.observability.kv_events import StoreEventLog, WorkerLanded, external_hashes
from connector.store.client import TIMEOUT_ENV
from connector.worker import recv_pool
from connector.worker.worker import SHUTDOWN_BOUND_S
from devkit.processes import freeze, frozen, thaw
from tests.worker_kit import hashes, kv_caches, run_step, wait_until

TIMEOUT_S = 1.0
STAGED = {"staging": "on", "staging_buffer_size": 2 * 16 * 1024}  # 2 blocks per call
ZERO_COPY = {"staging": "off"}
BLOCK = 32  # tokens per block of worker_kit's caches


@pytest.fixture(scope="module")
def cluster():
    from devkit.local_cluster import local_pool

    with local_pool() as pool:
        yield pool


def stored(make_worker_on, master, prefix: str, n: int = 8):
    """A worker that saved n blocks of seed 5 (on the store node), and their hashes."""
    w = make_worker_on(master, caches=kv_caches(seed=5), prefix=prefix, **STAGED)
    hs = hashes(prefix, n)
    run_step(w, StepMetadata(saves=(BlockTransfer("seed", tuple(range(n)), hs),),
                             free_after_jobs=("seed",)))
    # Mooncake's call timeouts are process-wide, set by the first worker that sets them: the
    # test's own workers decide them, not this one (it has made its calls).
    for var in TIMEOUT_ENV:
        os.environ.pop(var, None)
    return hs


def counters(w) -> dict:
    return w.recorder.snapshot().data["c"]


@pytest.mark.parametrize("which", ["node", "master"])
def test_loads_past_deadline_are_recomputed_and_never_written(make_worker_on, cluster, which):
    master, node = cluster
    prefix = f"deadline-{which}"
    hs = stored(make_worker_on, master, prefix)
    dst = kv_caches(seed=None)
    # Mooncake's timeout well past the deadline: the calls stay stuck while the test looks.
    w = make_worker_on(master, threads=2, caches=dst, prefix=prefix, load_timeout_s=TIMEOUT_S,
                       transfer_timeout=20, **STAGED)
    loads = tuple(BlockTransfer(f"r{i}", tuple(range(10 + 8 * (i % 4), 18 + 8 * (i % 4))), hs)
                  for i in range(6))
    with frozen((node if which == "node" else master).proc):
        t0 = time.monotonic()
        done, errors = run_step(w, StepMetadata(loads=loads), timeout=TIMEOUT_S + 10)
        took = time.monotonic() - t0
        # Both running calls outlive their own bound while the peer stays frozen.
        wait_until(lambda: w.pool.stuck == 2, 10, "the stuck calls were never noticed")
        g = w.recorder.current_gauges()
    assert done == {t.req_id for t in loads}
    assert errors == {b for t in loads for b in t.block_ids}  # all recomputed
    assert took < TIMEOUT_S + 3, f"burst took {took:.1f}s with load_timeout_s={TIMEOUT_S}"
    # Both running jobs' threads were stuck and replaced; never more than the pool size.
    assert g["threads_stuck|0|load"] == w.pool.size
    assert g["staging_buffers|0"] <= 2 * w.pool.size
    # The stuck calls return after SIGCONT: their threads exit, their buffers are released,
    # and nothing they fetched lands in blocks that vLLM got back.
    wait_until(lambda: w.pool.stuck == 0, 40, "stuck threads never returned")
    wait_until(lambda: w.staging_buffers <= w.pool.size, 5, "staging buffers leaked")
    assert not any(t[:, 10:42].any() for t in dst.values()), "a stuck load wrote into the cache"
    c = counters(w)
    assert c["failures|0|load|timeout"] == 6 and c["threads_replaced|0|load"] == 2, c
    # Each expired job is counted where it was: one running on each thread, four that no
    # thread ever took (not all on thread 0).
    assert (c["load_jobs|0|0|error"], c["load_jobs|0|1|error"],
            c["load_jobs|0|queued|error"]) == (1, 1, 4), c
    # After the freeze the same loads hit again, byte-exact.
    done, errors = run_step(w, StepMetadata(loads=loads[:1]), timeout=30)
    assert done == {"r0"} and errors == set()
    src = kv_caches(seed=5)
    for name in src:
        assert torch.equal(dst[name][:, 10:18], src[name][:, 0:8])


def test_zero_copy_load_holds_its_blocks_until_the_call_returns(make_worker_on, cluster):
    """Multi-buffer gets write straight into the KV blocks: such a job is never expired while
    its call runs, so no late write can land in blocks vLLM reuses; Mooncake's transfer
    timeout (here 3 s, past the 1 s deadline) is what bounds it. One block (4 regions): the
    TCP transport applies the timeout per group of slices, so more would take a multiple."""
    master, node = cluster
    hs = stored(make_worker_on, master, "zerocopy")
    dst = kv_caches(seed=None)
    w = make_worker_on(master, threads=1, caches=dst, prefix="zerocopy", load_timeout_s=TIMEOUT_S,
                       transfer_timeout=3, **ZERO_COPY)
    with frozen(node.proc):
        t0 = time.monotonic()
        w.start_load(StepMetadata(loads=(BlockTransfer("z", (3,), hs[:1]),)))
        # Past the deadline: the call outlived the bound (its thread is replaced), and the
        # request is still held, since the call may still write.
        wait_until(lambda: w.pool.replaced == 1, 10, "the stuck call was never noticed")
        assert w.get_finished() == (None, None)
        wait_until(lambda: w.ledger.idle(), 10, "the zero-copy load outlived its transfer timeout")
        took = time.monotonic() - t0
    assert w.get_finished()[1] == {"z"} and w.get_load_errors() == {3}
    assert 2.5 < took < 3 + 3, f"held {took:.1f}s with transfer_timeout=3"
    assert not any(t[:, 3].any() for t in dst.values())


def test_zero_copy_load_deadline_defaults_to_load_timeout(make_worker_on, cluster):
    """Without transfer_timeout a zero-copy get on a frozen node ran into Mooncake's 30 s; with
    staging off it now defaults to load_timeout_s, so the request is recomputed about then."""
    master, node = cluster
    hs = stored(make_worker_on, master, "zerocopy-default")
    w = make_worker_on(master, threads=1, caches=kv_caches(seed=None), prefix="zerocopy-default",
                       load_timeout_s=TIMEOUT_S, **ZERO_COPY)
    with frozen(node.proc):
        t0 = time.monotonic()
        done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("z", (3,), hs[:1]),)),
                                timeout=20)
        took = time.monotonic() - t0
    assert done == {"z"} and errors == {3}
    assert took < TIMEOUT_S + 4, f"a zero-copy get took {took:.1f}s with load_timeout_s=1"


@pytest.mark.parametrize("mode", ["zero_copy", "staged_two_calls"])
def test_save_past_deadline_never_releases_blocks_its_put_reads(make_worker_on, cluster, mode):
    """The put of a save is frozen past save_timeout_s. Its request's blocks must not go back
    to vLLM (finished_sending) while the put may still read them: a zero-copy put reads them
    for its whole call; a staged put reads only its staging buffer (here 4 blocks in two
    buffer-fulls of 2), so that save lets go of them at its deadline, during its first put,
    and never gathers the second buffer-full. When they do go back, this test rewrites them,
    as vLLM would reuse them; the store must hold only the request's own KV, byte-exact."""
    master, node = cluster
    prefix = f"save-deadline-{mode}"
    caches = kv_caches(seed=7)
    original = {n: t[:, 0:4].clone() for n, t in caches.items()}
    cfg = ZERO_COPY if mode == "zero_copy" else STAGED
    w = make_worker_on(master, caches=caches, prefix=prefix, save_timeout_s=TIMEOUT_S,
                       transfer_timeout=20, **cfg)
    hs = hashes(prefix, 4)
    reported: list[float] = []

    def poll() -> None:
        sending, _ = w.get_finished()
        if sending and "s" in sending:
            reported.append(time.monotonic())
            for t in caches.values():  # vLLM reuses the blocks for another request
                t[:, 0:4] = -1.0

    with frozen(node.proc):
        w.note_free_after(StepMetadata(free_after_jobs=("s",)))
        t_save = time.monotonic()
        w.start_save(StepMetadata(saves=(BlockTransfer("s", (0, 1, 2, 3), hs),)))
        # The put outlives save_timeout_s (its thread is replaced for it): past the deadline.
        t_deadline = t_save + TIMEOUT_S
        while w.save_pool.replaced == 0 or time.monotonic() < t_deadline + 0.5:
            poll()
            assert time.monotonic() < t_deadline + 10, "the stuck put was never noticed"
            time.sleep(0.01)
        if mode == "zero_copy":
            assert not reported, "blocks went back to vLLM while the put may still read them"
        else:  # released at the deadline, within a watchdog tick or two
            assert reported and reported[0] - t_save < TIMEOUT_S + 0.5, reported
    resumed = time.monotonic()
    wait_until(lambda: poll() or reported, 30, "the request never finished after the freeze")
    if mode == "zero_copy":
        assert reported[0] >= resumed
    wait_until(lambda: w.ledger.idle() and w.save_pool.stuck == 0, 30, "the put never returned")
    # Staged: the first buffer-full was put from the staging buffer; the second was never
    # gathered (the blocks were vLLM's again by then).
    stored_n = 4 if mode == "zero_copy" else 2
    # What the put stored after the deadline is counted stored, the rest lost (timeout).
    c = counters(w)
    assert (c["save_keys|0"], c["save_error_keys|0"]) == (stored_n, 4 - stored_n), c
    assert c.get("failures|0|save|timeout", 0) == (0 if stored_n == 4 else 1), c
    dst = kv_caches(seed=None)
    reader = make_worker_on(master, caches=dst, prefix=prefix, **STAGED)
    done, errors = run_step(reader, StepMetadata(loads=(BlockTransfer("r", (20, 21, 22, 23),
                                                                      hs),)))
    assert done == {"r"} and errors == set(range(20 + stored_n, 24)), errors
    for name, want in original.items():
        assert torch.equal(dst[name][:, 20:20 + stored_n], want[:, :stored_n]), \
            "the store holds rewritten blocks"


def test_staged_save_of_three_buffers_lets_a_preemption_go_at_once(make_worker_on, cluster):
    """A staged save of three buffer-fulls on a frozen store node, then a preemption of its
    request. The save reads the blocks only while it gathers a buffer-full (memory speed), so
    handle_preemptions waits for no store call: it returns at once, the save never gathers
    again, and the store holds only what was gathered before (byte-exact). Before, one
    reading() spanned the first gather to the last, and the preemption waited for two frozen
    puts (Mooncake's 30 s each by default)."""
    master, node = cluster
    prefix = "preempt-staged-3"
    caches = kv_caches(seed=13)
    original = {n: t[:, 0:6].clone() for n, t in caches.items()}
    w = make_worker_on(master, caches=caches, prefix=prefix, transfer_timeout=20, **STAGED)
    hs = hashes(prefix, 6)
    w.recorder.snapshot()
    freeze(node.proc)
    try:
        w.start_save(StepMetadata(saves=(BlockTransfer("p", tuple(range(6)), hs),)))
        # In its first put: running, not touching, a while after it started.
        wait_until(lambda: any(t.state == recv_pool.RUNNING and time.monotonic() - t.started > 0.3
                               for t in list(w.save_pool._current.values())), 10,
                   "the save never reached its first put")
        t0 = time.monotonic()
        w.wait_preempted(StepMetadata(preempted=("p",)))
        took = time.monotonic() - t0
        for t in caches.values():  # the blocks go to another request
            t[:, 0:6] = -1.0
        print(f"handle_preemptions took {took:.3f}s")
        # A frozen put takes transfer_timeout (20 s); memory speed, even on a busy host, < 5 s.
        assert took < 5.0, f"the preemption waited {took:.2f}s for a staged put"
        assert not w.ledger.in_flight("p")
    finally:
        thaw(node.proc)
    wait_until(lambda: w.save_pool.idle, 40, "the frozen put never returned")
    c = w.recorder.snapshot().data["c"]
    # The first buffer-full's put landed (after the preemption): stored, the rest lost.
    assert c.get("failures|0|save|abandoned") == 1, c
    assert (c["save_keys|0"], c["save_error_keys|0"]) == (2, 4), c
    dst = kv_caches(seed=None)
    reader = make_worker_on(master, caches=dst, prefix=prefix, **STAGED)
    done, errors = run_step(reader, StepMetadata(loads=(BlockTransfer("r", tuple(range(30, 36)),
                                                                      hs),)))
    print("blocks not stored:", sorted(errors))
    assert done == {"r"} and errors == set(range(32, 36)), errors  # the first buffer-full only
    for name, want in original.items():
        assert torch.equal(dst[name][:, 30:32], want[:, 0:2])


class Loads(Subscriber):
    def __init__(self) -> None:
        self.events: list[LoadEvent] = []

    def on_load(self, ev: LoadEvent) -> None:
        self.events.append(ev)


def test_load_keys_count_the_store_keys_loaded(make_worker_on, cluster):
    """load_keys counts store objects read whole: 5 of a job's 8 blocks are stored, so 5 keys
    (not 8); a job that expires loads none."""
    master, node = cluster
    hs = stored(make_worker_on, master, "load-keys", n=5)
    w = make_worker_on(master, threads=1, caches=kv_caches(seed=None), prefix="load-keys",
                       load_timeout_s=TIMEOUT_S, transfer_timeout=20, **STAGED)
    w.recorder.snapshot()
    missing = hashes("load-keys-absent", 3)
    done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("a", tuple(range(8)),
                                                                 hs + missing),)))
    assert errors == {5, 6, 7}
    c = counters(w)
    assert c["load_keys|0|0"] == 5, c
    with frozen(node.proc):
        done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("b", tuple(range(5)),
                                                                     hs),)), timeout=10)
    assert errors == set(range(5))
    c = counters(w)
    assert c.get("failures|0|load|timeout") == 1 and c.get("load_keys|0|0", 0) == 0, c


def test_a_load_expired_while_running_records_its_real_queue_wait(make_worker_on, cluster):
    """A job taken at once and stuck in its call until its deadline waited in the queue for
    no time: its queue wait (the histogram, and what the thread tuner reads as backlog) must
    not be its whole deadline."""
    master, node = cluster
    hs = stored(make_worker_on, master, "expired-wait")
    w = make_worker_on(master, threads=1, caches=kv_caches(seed=None), prefix="expired-wait",
                       load_timeout_s=TIMEOUT_S, transfer_timeout=20, **STAGED)
    seen = Loads()
    w.add_subscriber(seen)
    w.recorder.snapshot()
    with frozen(node.proc):
        done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("x", tuple(range(8)),
                                                                     hs),)), timeout=10)
    assert errors == set(range(8))
    ev = seen.events[-1]
    wait, service = ev.t_start - ev.t_enqueue, ev.t_end - ev.t_start
    print(f"queue wait {wait:.3f}s, service {service:.3f}s, code {ev.code}")
    assert ev.code == "timeout" and ev.thread == 0
    assert wait < TIMEOUT_S / 2 and service > TIMEOUT_S / 2, (wait, service)
    waits = counters_h(w)["load_queue_wait_seconds|0|0"]
    assert max(waits) < TIMEOUT_S / 2, waits


def counters_h(w) -> dict:
    return w.recorder.snapshot().data["h"]


def test_a_failure_after_the_transfer_still_ends_the_load(make_worker_on, cluster, monkeypatch):
    """Something raises between the job's finish and the ledger's (here the layout counter):
    the request's load count must still come down, or vLLM waits for it forever."""
    master, _ = cluster
    hs = stored(make_worker_on, master, "finish-raises")
    w = make_worker_on(master, threads=1, caches=kv_caches(seed=None), prefix="finish-raises",
                       **STAGED)
    real = w.recorder.count

    def count(family, *labels, n=1):
        if family == "layout_keys":
            raise RuntimeError("injected")
        real(family, *labels, n=n)

    monkeypatch.setattr(w.recorder, "count", count)
    done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("f", tuple(range(8)), hs),)),
                            timeout=10)
    assert done == {"f"} and errors == set()
    assert not w.ledger.in_flight("f")


def test_the_in_step_thread_is_in_the_inflight_and_queue_gauges(make_worker_on, cluster):
    """An in-step load runs on a thread of its own (thread=load_threads in its counters): its
    gauges say so too, while it is stuck in a call on a frozen node."""
    master, node = cluster
    hs = stored(make_worker_on, master, "instep-gauge")
    w = make_worker_on(master, threads=2, caches=kv_caches(seed=None), prefix="instep-gauge",
                       sync_load_ms=200, transfer_timeout=20, **STAGED)  # in-step deadline 2 s
    w.recorder.current_gauges()
    seen: list[dict] = []
    with frozen(node.proc):
        step = threading.Thread(target=w.start_load, args=(StepMetadata(sync_loads=(
            BlockTransfer("s", tuple(range(8)), hs),)),), daemon=True)
        step.start()
        wait_until(lambda: seen.append(w.recorder.current_gauges()) or
                   seen[-1].get("load_inflight|0|2") == 1, 10,
                   f"the in-step thread never showed as busy: {seen[-1:]}")
        step.join(10)
    assert not step.is_alive()
    assert seen[-1]["load_inflight|0|0"] == 0 and seen[-1]["load_inflight|0|1"] == 0
    w.get_finished()
    assert w.get_load_errors() == set(range(8))


def test_shutdown_lets_queued_saves_finish(make_worker_on, cluster):
    """Saves still queued when the engine stops are written within the shutdown's bound
    (not failed at once): nothing is lost on a healthy store."""
    master, _ = cluster
    w = make_worker_on(master, prefix="shutdown-drain", **STAGED)
    hs = hashes("shutdown-drain", 16)
    w.start_save(StepMetadata(saves=tuple(BlockTransfer(f"s{i}", (2 * i, 2 * i + 1),
                                                        hs[2 * i:2 * i + 2]) for i in range(8))))
    t0 = time.monotonic()
    w.shutdown()
    took = time.monotonic() - t0
    c = counters(w)
    print(f"shutdown took {took:.2f}s: {c}")
    assert took <= SHUTDOWN_BOUND_S + 1.0
    assert c.get("save_keys|0", 0) + c.get("save_skipped_keys|0", 0) == 16, c
    assert c.get("save_error_keys|0", 0) == 0, c


def test_shutdown_counts_and_logs_the_saves_it_loses(make_worker_on, cluster, caplog):
    """On a frozen store node queued saves cannot finish: shutdown still ends within its
    bound, and every key it did not save is counted (save_error_keys) and logged, those of
    the save still in its put too."""
    master, node = cluster
    w = make_worker_on(master, prefix="shutdown-lost", transfer_timeout=20, **STAGED)
    hs = hashes("shutdown-lost", 8)
    caplog.set_level(logging.WARNING, logger="vllm.connector.worker.worker")
    with frozen(node.proc):
        w.start_save(StepMetadata(saves=tuple(BlockTransfer(f"l{i}", (2 * i, 2 * i + 1),
                                                            hs[2 * i:2 * i + 2])
                                              for i in range(4))))
        wait_until(lambda: w.save_pool.inflight[0], 10, "no save started")
        t0 = time.monotonic()
        w.shutdown()
        took = time.monotonic() - t0
    c = counters(w)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shutdown:")]
    print(f"shutdown took {took:.2f}s: {c} {lines}")
    assert took <= SHUTDOWN_BOUND_S + 1.0
    # Three saves still queued, and the one in its put (the process may exit before it
    # returns): every key counted lost.
    assert c.get("failures|0|save|shutdown") == 4 and c.get("save_error_keys|0") == 8, c
    assert lines and lines[0].startswith("shutdown: 6 store keys"), lines
    assert "nor 2 of saves still in a store call" in lines[0], lines


def expired_in_its_put(make_worker_on, master, prefix: str, transfer_timeout: float,
                       on_landed=None, blocks: int = 4):
    """A staged save of `blocks` (two buffer-fulls by default) on a frozen store node (the
    caller's), past its deadline while its thread is in its first put: its request released,
    its report waiting for the put. The worker, and a function that adds up its counters from
    then on."""
    w = make_worker_on(master, caches=kv_caches(seed=7), prefix=prefix, save_timeout_s=TIMEOUT_S,
                       transfer_timeout=transfer_timeout, **STAGED)
    w.on_landed = on_landed
    w.recorder.snapshot()
    total: dict = {}

    def counted() -> dict:
        snap = w.recorder.snapshot()
        for k, v in (snap.data["c"].items() if snap else ()):
            total[k] = total.get(k, 0) + v
        return total

    w.note_free_after(StepMetadata(free_after_jobs=("s",)))
    w.start_save(StepMetadata(saves=(BlockTransfer("s", tuple(range(blocks)),
                                                   hashes(prefix, blocks)),)))
    wait_until(lambda: "s" in (w.get_finished()[0] or ()), 10, "the save was never released")
    assert w.save_pool.expired == 1 and w.save_pool.inflight[0] + w.save_pool.stuck, \
        "the save is not in its put past its deadline"
    return w, counted


def test_a_save_past_its_deadline_whose_put_then_fails_counts_as_a_timeout(make_worker_on,
                                                                          cluster):
    """Its put fails (Mooncake's transfer timeout) after the save's deadline: the save is a
    timeout, as docs/reliability-bounds.md says, every key lost, reported once."""
    master, node = cluster
    with frozen(node.proc):
        w, counted = expired_in_its_put(make_worker_on, master, "late-fails", 2)
        wait_until(lambda: w.save_pool.idle and w.save_pool.stuck == 0, 30,
                   "the put never failed")
    c = counted()
    assert (c.get("save_keys|0", 0), c["save_error_keys|0"]) == (0, 4), c
    assert [k for k in c if k.startswith("failures|")] == ["failures|0|save|timeout"], c
    assert c["failures|0|save|timeout"] == 1, c


@pytest.mark.parametrize("blocks", [4, 2])
def test_blocks_a_save_stores_past_its_deadline_are_announced_to_routers(make_worker_on,
                                                                        cluster, blocks):
    """With store KV events on, a staged save past its deadline lets its request go (the
    scheduler settles its saves) while its put goes on; the put then stores the first
    buffer-full. Those blocks are in the store and a router must hear of them: before, the
    late report found nothing planned and they were never announced. The rest, if any (4
    blocks are two buffer-fulls), never landed and is never announced. A save whose late put
    stored every key ends the worker's saves-failing state (in which queued saves of finished
    requests are dropped); before, only a later save did."""
    master, node = cluster
    counts: Counter = Counter()

    def count(family: str, *labels: object, n: int = 1) -> None:
        counts[(family, *labels)] += n

    landed = WorkerLanded(0, 1000, count)
    log = StoreEventLog(EventSettings("STORAGE", None, 0.0, "", 1000, 1000), 1, BLOCK,
                        lambda hs, g: [h.hex() for h in hs], 1, count)
    prefix = f"late-lands-{blocks}"
    hs = hashes(prefix, blocks)
    req = SimpleNamespace(request_id="s", block_hashes=list(hs), lora_request=None,
                          all_token_ids=list(range(blocks * BLOCK)))
    log.planned(req, range(blocks), 0)  # the scheduler's plan of the save
    with frozen(node.proc):
        w, counted = expired_in_its_put(make_worker_on, master, prefix, 20, landed.add, blocks)
        log.settled("s")  # the engine's next step: the request's saves finished
        assert landed.take() is None and log.take() == [] and w._saves_failing
    wait_until(lambda: w.save_pool.idle and w.save_pool.stuck == 0, 30, "the put never returned")
    c = counted()
    assert (c["save_keys|0"], c.get("save_error_keys|0", 0)) == (2, blocks - 2), c
    assert w._saves_failing == (blocks > 2)
    log.landed(landed.take().get_all_events())  # a later step's output
    (event,) = log.take()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == external_hashes(hs[:2]) and event.parent_block_hash is None
    assert event.token_ids == req.all_token_ids[:2 * BLOCK]
    assert not any(k[0] == "kv_events_dropped" for k in counts)


def test_shutdown_counts_a_save_past_its_deadline_still_in_its_put(make_worker_on, cluster,
                                                                  caplog):
    """The engine stops while a save past its deadline is still in its put: the process may
    exit before the put returns, so shutdown counts its keys lost (timeout) and logs them;
    the put returning afterwards counts nothing more."""
    master, node = cluster
    caplog.set_level(logging.WARNING, logger="vllm.connector.worker.worker")
    with frozen(node.proc):
        w, counted = expired_in_its_put(make_worker_on, master, "late-shutdown", 20)
        assert counted().get("save_error_keys|0", 0) == 0, "reported before its put returned"
        w.shutdown()
        c = dict(counted())
    assert (c["save_error_keys|0"], c["failures|0|save|timeout"]) == (4, 1), c
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shutdown:")]
    assert lines and "nor 4 of saves still in a store call" in lines[0], lines
    wait_until(lambda: w.save_pool.stuck == 0, 40, "the put never returned")
    report = ("save_keys|0", "save_error_keys|0", "failures|0|save|timeout")
    assert [counted().get(k, 0) for k in report] == [c.get(k, 0) for k in report], \
        "the put's return reported the save again"


def test_save_after_an_rpc_failure_makes_no_put(make_worker_on, cluster):
    """The existence check of a save fails with an RPC timeout (master frozen): the breaker
    opens and the save stops there. It must not go on to put (that would wait out another
    RPC while the master is down), and it is counted once, as a save_exists failure."""
    master, _ = cluster
    w = make_worker_on(master, prefix="exists-rpc", transfer_timeout=2)  # RPCs: 2 s
    hs = hashes("exists-rpc", 4)
    with frozen(master.proc):
        w.start_save(StepMetadata(saves=(BlockTransfer("s", (0, 1, 2, 3), hs),)))
        wait_until(lambda: w._store.down_code, 20, "the existence check never failed")
    # The master answers again at once: a put made now would succeed.
    wait_until(lambda: w.ledger.idle() and w.save_pool.depth() == 0
               and not w.save_pool.inflight[0], 20, "the save never ended")
    c = counters(w)
    assert c.get("save_keys|0", 0) == 0, c
    failures = {k: v for k, v in c.items() if k.startswith("failures|")}
    assert list(failures.values()) == [1], failures
    assert next(iter(failures)) in ("failures|0|save_exists|-900",
                                    "failures|0|save_exists|-901"), failures
    wait_until(lambda: not w._store.down_code, 20, "the breaker never closed")
    assert all(e == 0 for e in w._connected().batch_is_exist(w._keys.keys(hs, 0))), \
        "the save put after the master failed"


def test_old_save_does_not_strand_a_newer_load(make_worker_on, cluster):
    """A request's save is stuck in its put while a load of the same request finishes: the
    load must still be reported, or the request waits forever."""
    master, node = cluster
    w = make_worker_on(master, prefix="strand", transfer_timeout=20, **ZERO_COPY)
    with frozen(node.proc):  # the put hangs on the node; a lookup of absent keys does not
        w.start_save(StepMetadata(saves=(BlockTransfer("p", (0, 1), hashes("strand", 2)),)))
        wait_until(lambda: w.save_pool.inflight[0], 10, "the save never started")
        done, errors = run_step(w, StepMetadata(
            loads=(BlockTransfer("p", (5, 6), hashes("strand-absent", 2)),)), timeout=10)
        assert done == {"p"} and errors == {5, 6}
        assert w.ledger.in_flight("p")  # the save still holds its blocks
    wait_until(lambda: w.ledger.idle(), 40, "the stuck save never returned")


def test_shutdown_fails_queued_jobs_fast_and_closes_after_calls(make_worker_on, cluster):
    master, _ = cluster
    hs = stored(make_worker_on, master, "shutdown")
    w = make_worker_on(master, threads=1, prefix="shutdown", load_timeout_s=600, **STAGED)
    loads = tuple(BlockTransfer(f"q{i}", tuple(range(8)), hs) for i in range(10))
    with frozen(master.proc):
        w.start_load(StepMetadata(loads=loads))
        wait_until(lambda: w.pool.inflight[0] and w.pool.depth() == 9, 10,
                   "one job inside its call, nine queued")
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


@pytest.mark.parametrize("mode", ["zero_copy", "staged"])
def test_a_fenced_load_writes_no_block_before_the_work_queued_ahead_of_it(make_worker_on,
                                                                          cluster, mode,
                                                                          monkeypatch):
    """Where vLLM hands a load a block freed by a request that the step still on the GPU
    writes (a producer under async scheduling: no deferred frees), or zeroes new blocks on the
    GPU before the step's loads start, the load waits for the work queued before it (a CUDA
    event recorded when it is queued) before it writes a block.
    A GPU path: the CUDA event is a stand-in that completes when the test says so."""
    import dataclasses

    master, _ = cluster
    hs = stored(make_worker_on, master, f"fence-{mode}", n=4)
    dst = kv_caches(seed=None)
    w = make_worker_on(master, caches=dst, prefix=f"fence-{mode}",
                       **(ZERO_COPY if mode == "zero_copy" else STAGED))
    w._regions = dataclasses.replace(w._regions, on_cuda=True)  # as on a GPU
    w.fence_loads = True
    gpu_done = threading.Event()

    class Event:  # torch.cuda.Event's part the worker uses
        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            assert gpu_done.wait(20), "the fence never completed"

    monkeypatch.setattr(torch.cuda, "Event", Event)
    w.start_load(StepMetadata(loads=(BlockTransfer("f", (10, 11, 12, 13), hs),)))
    time.sleep(1.0)  # the gets are done long before; the writes must wait
    assert all(not t[:, 10:14].any() for t in dst.values()), "a block written before the fence"
    assert not (w.get_finished()[1] or set())
    gpu_done.set()
    done: set[str] = set()
    wait_until(lambda: done.update(w.get_finished()[1] or ()) or "f" in done, 20,
               "the load never finished after the fence")
    want = kv_caches(seed=5)
    assert all(torch.equal(dst[n][:, 10:14], want[n][:, :4]) for n in dst), "wrong blocks"
    w.fence_loads = False  # unfenced, the same load needs no event
    assert w._load_fence() is None
    w._zeroes_blocks = True  # vLLM zeroes new blocks on the GPU before the step's loads
    assert isinstance(w._load_fence(), Event)
