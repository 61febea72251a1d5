"""The job pool on its own (no store): one shared queue, deadlines, stuck threads replaced
within a bound, memory accesses that nothing interrupts, drops, parking, and a shutdown that
fails queued jobs at once. Timing is awaited as conditions; the few waits on the clock itself
are relative to a job's own deadline, which is what they test.

A job that must run is submitted with a far deadline (`submit_unhurried`), and one that must
go past its deadline while it runs has it moved from its handler (`deadline_from_start`): with
the pool's own deadline (its bound, 50-200 ms here) counted from submission, a pool thread not
scheduled for that long on a busy host (CI: 2 cores, 4 test workers) found the job expired in
the queue, and the test failed on correct code."""

from __future__ import annotations

import threading
import time

import connector.worker.recv_pool as recv_pool
from connector.worker.recv_pool import RecvPool


def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def submit_unhurried(pool: RecvPool, job, deadline_s: float = 10.0) -> None:
    """Submit `job` with its deadline `deadline_s` away instead of the pool's bound (a watchdog
    tick that reads the bound meanwhile retires nothing: the next one does)."""
    bound, pool._deadline_s = pool._deadline_s, deadline_s
    try:
        pool.submit(job)
    finally:
        pool._deadline_s = bound


def deadline_from_start(ticket, seconds: float) -> None:
    """From a handler: the job's deadline `seconds` after its thread took it, however long it
    waited in the queue."""
    with ticket._lock:
        ticket.deadline = ticket.started + seconds


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list = []
        self.expired: list = []  # (job, reason)
        self.slots: dict = {}  # job -> the slot it was reported with
        self.retired = 0

    def expire(self, job, reason, slot) -> None:
        with self.lock:
            self.expired.append((job, reason))
            self.slots[job] = slot

    def retire(self) -> None:
        with self.lock:
            self.retired += 1


def test_a_job_stuck_past_its_deadline_is_reported_and_its_thread_replaced():
    """The stuck job's deadline counts from its start (the bound, as for a job taken at once),
    and the next one has a deadline it cannot miss: with 0.2 s from submission, a replacement
    thread not scheduled within 0.2 s let it expire, and the test failed on correct code."""
    rec, release = Recorder(), threading.Event()

    def handler(job, slot, ticket):
        if job == "stuck":
            deadline_from_start(ticket, 0.2)
            release.wait()
        if ticket.finish():
            rec.done.append(job)

    pool = RecvPool(1, handler, deadline_s=0.2, on_expire=rec.expire, on_retire=rec.retire)
    submit_unhurried(pool, "stuck")
    wait_until(lambda: rec.expired == [("stuck", "timeout")] and pool.replaced == 1)
    assert pool.stuck == 1 and rec.slots["stuck"] == 0  # reported as thread 0's job
    submit_unhurried(pool, "next")  # the slot's replacement thread serves it
    wait_until(lambda: rec.done == ["next"])
    release.set()  # the call returns: its result is dropped, its thread retires
    wait_until(lambda: pool.stuck == 0 and rec.retired == 1)
    assert rec.done == ["next"]
    pool.close(1.0)


def test_a_call_stuck_at_its_expiry_is_retired_even_if_the_expiry_ends_it():
    """The tick that expires a running job finds its call past the bound: the thread is stuck
    and replaced, though whoever the expiry wakes ends the call at once (an in-step load's
    step returns, and a test thaws the store node it froze). Here on_expire returns only once
    the call has returned; decided after the callbacks, the retirement never happened.

    A deadline counts from submission and the bound from the moment a thread took the job, so
    a tick can fall between the two; the handler moves its deadline to just past its own
    bound, so that one tick finds both (as it does whenever the job started at once)."""
    rec, release, replaced = Recorder(), threading.Event(), []

    def handler(job, slot, ticket):
        with ticket._lock:
            ticket.deadline = ticket.started + 1.0 + 1e-6
        release.wait()
        ticket.finish()

    def on_expire(job, reason, slot):
        rec.expire(job, reason, slot)
        release.set()
        wait_until(lambda: pool.idle, 2.0)  # the call returned and its thread let go of it

    pool = RecvPool(1, handler, deadline_s=1.0, on_expire=on_expire,
                    on_replace=lambda: replaced.append(1))
    submit_unhurried(pool, "stuck")  # its handler sets its deadline
    wait_until(lambda: rec.expired == [("stuck", "timeout")])
    wait_until(lambda: replaced == [1], 2.0)
    assert pool.replaced == 1
    wait_until(lambda: pool.stuck == 0)  # the retired thread exited with its call
    pool.close(1.0)


def test_nothing_expires_a_job_while_it_touches_vllm_memory():
    """The job passes its deadline inside its call, and finishes there: on a slow host, a
    thread that reached touching() past a deadline counted from submission was refused, and a
    tick between the block's exit and finish() (rightly) expired the job."""
    rec, touching, release = Recorder(), threading.Event(), threading.Event()

    def handler(job, slot, ticket):
        with ticket.touching() as ok:
            assert ok
            with ticket._lock:
                ticket.deadline = time.monotonic()  # past its deadline from here on
            touching.set()
            release.wait()  # a long zero-copy call into memory vLLM owns
            if ticket.finish():
                rec.done.append(job)

    pool = RecvPool(1, handler, deadline_s=0.1, on_expire=rec.expire)
    submit_unhurried(pool, "w")
    assert touching.wait(2)
    # Past the bound the thread counts as stuck and is replaced, and the job (past its
    # deadline since before then) is still not expired, nor dropped.
    wait_until(lambda: pool.replaced == 1)
    assert rec.expired == [] and pool.stalled
    release.set()
    wait_until(lambda: rec.done == ["w"] and not pool._live)  # the watchdog let go of it
    assert rec.expired == []  # finished: never reported
    pool.close(1.0)


def test_a_chain_of_touching_calls_stops_at_the_deadline():
    """A chunked zero-copy get (or a save of several buffer-fulls) enters touching() once per
    call: no call may start past the job's deadline, so the job ends within its deadline plus
    the one call under way then, reported once as a timeout. The deadline counts from the
    first call's start: from submission, a thread not scheduled for 0.35 s started none."""
    rec, starts, deadlines = Recorder(), [], []

    def handler(job, slot, ticket):
        for _ in range(20):
            with ticket.touching() as ok:
                if not ok:
                    break
                if not deadlines:
                    with ticket._lock:
                        ticket.deadline = time.monotonic() + 0.35
                    deadlines.append(ticket.deadline)
                starts.append(time.monotonic())
                time.sleep(0.1)  # one store call into vLLM's memory
        if ticket.finish():
            rec.done.append(job)

    pool = RecvPool(1, handler, deadline_s=0.35, on_expire=rec.expire)
    submit_unhurried(pool, "chunked")
    wait_until(lambda: rec.expired or rec.done, 10)
    wait_until(lambda: pool.idle)  # the handler returned (retired or not: inflight may lag)
    print(f"{len(starts)} calls, the last started {starts[-1] - deadlines[0]:+.3f}s "
          "from the deadline")
    assert rec.done == [] and rec.expired == [("chunked", "timeout")]
    assert all(t < deadlines[0] for t in starts), "a touching call started past the deadline"
    # At least one call ran, and the chain stopped before its 20 calls: the bound that matters
    # (no call started past the deadline) is the assert above; this one says the chain was cut.
    assert 1 <= len(starts) < 20
    pool.close(1.0)


def test_a_job_dropped_while_touching_is_expired_as_the_call_returns():
    """A preemption drops a save inside its gather (touching): it is not expired during the
    call, but as the call returns, so it never starts another one (its next buffer-full)."""
    rec, in_touch, release, touched = Recorder(), threading.Event(), threading.Event(), []

    def handler(job, slot, ticket):
        with ticket.touching() as ok:
            in_touch.set()
            release.wait()
        with ticket.touching() as ok:
            touched.append(ok)
        ticket.finish()

    pool = RecvPool(1, handler, on_expire=rec.expire)
    pool.submit("save")
    assert in_touch.wait(2)
    assert pool.drop(lambda job: True, "abandoned") == 0  # touching: not now
    assert rec.expired == []
    release.set()
    wait_until(lambda: touched)
    assert rec.expired == [("save", "abandoned")] and rec.slots["save"] == 0
    assert touched == [False]
    pool.close(1.0)


def test_the_watchdog_survives_a_failing_replacement_and_a_raising_callback(monkeypatch):
    """Starting a stuck thread's replacement raises once (no thread can start), and on_replace
    raises: the watchdog goes on (retrying the replacement next tick), and later jobs still
    expire at their deadlines (an in-step load's wait depends on it)."""
    rec, release = Recorder(), threading.Event()

    def handler(job, slot, ticket):
        if job == "stuck":
            deadline_from_start(ticket, 0.2)  # ahead of later's in the watchdog's order
            release.wait()
        ticket.finish()

    def bad_replace():
        raise RuntimeError("on_replace failed")

    pool = RecvPool(2, handler, deadline_s=0.2, on_expire=rec.expire, on_replace=bad_replace)
    real_spawn, fails = pool._spawn, []

    def spawn(slot):
        if not fails:
            fails.append(slot)
            raise RuntimeError("can't start new thread")
        real_spawn(slot)

    monkeypatch.setattr(pool, "_spawn", spawn)
    submit_unhurried(pool, "stuck")  # expired in the queue, it would leave no thread stuck
    # Failed once, then replaced; and expired (its handler ran: the swap below is not its).
    wait_until(lambda: fails and pool.replaced == 1 and rec.expired == [("stuck", "timeout")])
    pool.set_active(1)  # the next job goes to slot 0, whose thread is the replacement

    release2 = threading.Event()

    def stuck_again(job, slot, ticket):
        release2.wait()
        ticket.finish()

    pool._handler = stuck_again
    pool.submit("later")
    wait_until(lambda: ("later", "timeout") in rec.expired)
    assert pool._watchdog.is_alive()
    release.set()
    release2.set()
    pool.close(1.0)


def test_close_with_drain_runs_the_queued_jobs_within_the_drain():
    rec, ran = Recorder(), []

    def handler(job, slot, ticket):
        time.sleep(0.02)
        ran.append(job)
        ticket.finish()

    pool = RecvPool(1, handler, deadline_s=30, on_expire=rec.expire)
    for i in range(5):
        pool.submit(i)
    pool.close(1.0, drain=10.0)
    assert ran == list(range(5)) and rec.expired == []

    release = threading.Event()
    blocked = RecvPool(1, lambda job, slot, ticket: release.wait(), on_expire=rec.expire)
    for i in range(3):
        blocked.submit(i)
    wait_until(lambda: blocked.inflight[0] == 1)
    t0 = time.monotonic()
    stuck = blocked.close(0.1, drain=0.3)  # the drain is bounded: then queued jobs fail
    took = time.monotonic() - t0
    assert 0.3 <= took < 2.0, took
    assert sorted(rec.expired) == [(1, "shutdown"), (2, "shutdown")] and len(stuck) == 1
    release.set()


def test_an_expired_job_may_not_start_touching():
    rec, results = Recorder(), []
    release = threading.Event()

    def handler(job, slot, ticket):
        deadline_from_start(ticket, 0.1)  # expired in the queue, it would never run
        release.wait()
        with ticket.touching() as ok:
            results.append(ok)

    pool = RecvPool(1, handler, deadline_s=0.1, on_expire=rec.expire)
    submit_unhurried(pool, "late")
    wait_until(lambda: rec.expired)
    release.set()
    wait_until(lambda: results)
    assert results == [False]
    pool.close(1.0)


def test_a_queued_job_past_its_deadline_never_starts(monkeypatch):
    """The thread frees up after the queued job's deadline but before the watchdog looks:
    the job is expired, not run (it would be expired while running, and its thread taken
    for a stuck one)."""
    monkeypatch.setattr(recv_pool, "WATCHDOG_TICK_S", 3600.0)  # the watchdog never looks
    rec, started, release = Recorder(), [], threading.Event()

    def handler(job, slot, ticket):
        started.append(job)
        if job == "first":
            release.wait()
        ticket.finish()

    pool = RecvPool(1, handler, deadline_s=0.2, on_expire=rec.expire)
    submit_unhurried(pool, "first")  # taken late, it must still start
    pool.submit("queued")
    wait_until(lambda: started == ["first"])
    queued_deadline = pool._jobs[0].deadline
    wait_until(lambda: time.monotonic() > queued_deadline)
    release.set()
    wait_until(lambda: rec.expired == [("queued", "timeout")])
    assert started == ["first"] and rec.slots["queued"] is None
    pool.close(1.0)


def test_a_thread_is_stuck_only_when_its_own_call_outlives_the_bound():
    """A job dequeued just before its deadline runs past it: it is expired (the request goes
    on), but its thread's call is short, so the thread is healthy: not retired, not replaced.

    "second" waits half the bound in the queue and runs the other half: each margin (first's
    call, second's start before its deadline, second's call) is half the bound, 1.5 s. With
    0.3 s of margin, a thread not scheduled for that long retired one of them."""
    rec, release_first, release_second = Recorder(), threading.Event(), threading.Event()
    finished = []

    def handler(job, slot, ticket):
        (release_first if job == "first" else release_second).wait()
        finished.append((job, ticket.finish()))

    deadline_s = 3.0
    pool = RecvPool(1, handler, deadline_s=deadline_s, on_expire=rec.expire)
    pool.submit("first")
    pool.submit("second")
    second = pool._jobs[0]
    wait_until(lambda: time.monotonic() > second.deadline - deadline_s / 2)
    release_first.set()  # "second" starts half the bound before its deadline
    wait_until(lambda: rec.expired == [("second", "timeout")])
    release_second.set()  # its call took half the bound + a tick: inside the bound
    wait_until(lambda: len(finished) == 2)
    assert finished == [("first", True), ("second", False)]
    assert pool.replaced == 0 and pool.stuck == 0 and rec.slots["second"] == 0
    pool.close(1.0)


def test_stuck_threads_are_bounded_and_the_queue_holds_no_expired_tickets():
    """Jobs 0-3 must run (expired in the queue, they would leave no thread stuck): deadlines
    from their start; 4-7 are never taken, and expire at the pool's."""
    rec, release = Recorder(), threading.Event()

    def handler(job, slot, ticket):
        deadline_from_start(ticket, 0.1)
        release.wait()
        ticket.finish()

    pool = RecvPool(2, handler, deadline_s=0.1, on_expire=rec.expire)
    submit_unhurried(pool, 0)
    submit_unhurried(pool, 1)
    wait_until(lambda: pool.stuck == 2 and pool.replaced == 2)
    submit_unhurried(pool, 2)
    submit_unhurried(pool, 3)  # the replacements take these and get stuck too: no more ones
    wait_until(lambda: pool.inflight == [1, 1])
    for i in range(4, 8):
        pool.submit(i)
    wait_until(lambda: len(rec.expired) == 8)  # every job reported, none waits on a thread
    assert pool.replaced == 2 and pool.stalled
    # Every slot is stuck, so no thread pops the queue; the expired tickets must not stay in
    # it (nor count as its depth). They never ran on a thread.
    assert pool.depth() == 0 and not pool._jobs
    assert sorted(j for j, s in rec.slots.items() if s is None) == list(range(4, 8))
    assert sum(t.is_alive() for t in pool._threads) <= 2 * pool.size
    release.set()
    wait_until(lambda: pool.stuck == 0)
    pool.close(1.0)


def test_a_call_held_while_the_stuck_budget_was_full_is_retired_once_room_frees():
    """A slot's thread hangs and is replaced; the replacement hangs too while the first still
    holds the budget (one stuck thread per slot). Once the first call returns, the second is
    retired and replaced as well: its slot serves the queue again without waiting for it.

    Every job must run: a and b have their deadlines from their start, just past the bound
    (so the tick that expires b has found its call past the bound), "next" a far one."""
    rec, gates = Recorder(), {j: threading.Event() for j in ("a", "b")}

    def handler(job, slot, ticket):
        if job in gates:
            deadline_from_start(ticket, 0.2 + 1e-6)
            gates[job].wait()
        if ticket.finish():
            rec.done.append(job)

    pool = RecvPool(1, handler, deadline_s=0.2, on_expire=rec.expire)
    try:
        submit_unhurried(pool, "a")
        wait_until(lambda: pool.replaced == 1)  # a's thread retired
        submit_unhurried(pool, "b")  # the replacement takes it and hangs: the budget is full
        wait_until(lambda: ("b", "timeout") in rec.expired)
        assert pool.replaced == 1 and pool.stuck == 1
        gates["a"].set()  # the first stuck call returns: room for one more
        wait_until(lambda: pool.replaced == 2)
        submit_unhurried(pool, "next")
        wait_until(lambda: rec.done == ["next"])  # served while b's call still hangs
    finally:
        for g in gates.values():
            g.set()
        pool.close(1.0)


def test_retired_threads_are_forgotten():
    """Many stuck-and-replaced cycles: the pool keeps no list of dead threads. Each job's
    deadline counts from its start: from submission (50 ms), a fresh thread not scheduled in
    time let it expire in the queue, and no thread was stuck."""
    rec, gates = Recorder(), [threading.Event() for _ in range(20)]

    def handler(job, slot, ticket):
        deadline_from_start(ticket, 0.05)
        gates[job].wait()
        ticket.finish()

    pool = RecvPool(1, handler, deadline_s=0.05, on_expire=rec.expire)
    for i in range(20):
        submit_unhurried(pool, i)
        wait_until(lambda i=i: pool.replaced == i + 1)  # job i's thread was retired
        gates[i].set()
        wait_until(lambda: pool.stuck == 0)
    assert len(pool._threads) <= 2, len(pool._threads)
    pool.close(1.0)


def test_drop_expires_queued_and_running_jobs_but_not_one_touching_memory():
    """A running job is reported with the slot that ran it: either thread may take the first
    job (slot 0's was taken for granted, and slot 1's thread came first on a busy host)."""
    rec, in_touch, in_call, release = (Recorder(), threading.Event(), threading.Event(),
                                       threading.Event())
    touched, ran_on = [], {}

    def handler(job, slot, ticket):
        ran_on[job] = slot
        if job == "touching":
            with ticket.touching() as ok:
                in_touch.set()
                release.wait()
        else:  # "running": inside a call that does not touch vLLM's memory yet
            in_call.set()
            release.wait()
            with ticket.touching() as ok:
                touched.append(ok)
        ticket.finish()

    pool = RecvPool(2, handler, on_expire=rec.expire)
    pool.submit("touching")
    assert in_touch.wait(2)
    pool.submit("running")
    assert in_call.wait(2)
    pool.submit("queued")
    assert pool.drop(lambda job: True, "abandoned", running=False) == 1
    assert rec.expired == [("queued", "abandoned")] and pool.depth() == 0
    assert pool.drop(lambda job: True, "abandoned") == 1
    assert rec.expired[-1] == ("running", "abandoned")
    assert rec.slots["running"] == ran_on["running"] != ran_on["touching"]
    release.set()
    wait_until(lambda: touched)
    assert touched == [False]  # dropped: it may no longer touch the memory
    # The one touching memory was marked: expired as its call returned.
    wait_until(lambda: ("touching", "abandoned") in rec.expired)
    pool.close(1.0)


def test_close_fails_queued_jobs_at_once_and_returns_the_stuck_threads():
    rec, release = Recorder(), threading.Event()

    def handler(job, slot, ticket):
        release.wait()

    pool = RecvPool(1, handler, on_expire=rec.expire)
    for i in range(5):
        pool.submit(i)
    wait_until(lambda: pool.inflight[0] == 1 and pool.depth() == 4)
    t0 = time.monotonic()
    stuck = pool.close(0.2)
    assert time.monotonic() - t0 < 2.0  # 0.2 s of join: 1.8 s for a busy host
    assert sorted(rec.expired) == [(i, "shutdown") for i in range(1, 5)]
    assert len(stuck) == 1 and stuck[0].is_alive()
    pool.submit(9)  # after close: failed at once, never queued
    assert rec.expired[-1] == (9, "shutdown")
    release.set()
    stuck[0].join(2)
    assert not stuck[0].is_alive()


def test_close_returns_every_thread_inside_a_call_and_starts_none_while_draining():
    """A call stuck past the bound while the pool drains at shutdown: no fresh thread takes
    the queued job (it fails: its deadline passes in the drain), and every thread still inside
    a call is among those close() returns (the caller closes the store client only once they
    have returned). The bound (1 s) leaves the test 0.9 s to begin closing before the call is
    found stuck: with 0.2 s, a test thread not scheduled for 0.1 s saw it replaced."""
    rec, release = Recorder(), threading.Event()
    inside: set[threading.Thread] = set()

    def handler(job, slot, ticket):
        inside.add(threading.current_thread())
        release.wait()

    pool = RecvPool(1, handler, deadline_s=1.0, on_expire=rec.expire)
    pool.submit(0)
    wait_until(lambda: pool.inflight[0] == 1)
    time.sleep(0.1)
    pool.submit(1)  # queued, within its deadline when the stuck thread is retired
    busy = pool.close(0.1, drain=2.0)  # both deadlines pass in the drain
    try:
        assert inside <= set(busy), (inside, busy)
        assert len(inside) == 1 and pool.replaced == 0
        assert [j for j, _ in rec.expired] == [0, 1]
    finally:
        release.set()


def test_inherited_cpus_names_the_binding_a_pool_thread_would_get():
    """A thread pinned to one CPU (as vLLM's OpenMP binding pins a rank's main thread)
    reports that CPU, and a pool it starts runs its threads there; CPUs in a row are a range
    (this project's hosts have 2 cores at least)."""
    import os

    from connector.worker.recv_pool import inherited_cpus

    seen: dict[str, object] = {}

    def pinned(cpus: set[int], name: str) -> None:
        os.sched_setaffinity(0, cpus)
        seen[name] = inherited_cpus()
        if name == "one":
            pool = RecvPool(1, lambda job, slot, ticket: seen.setdefault(
                "pool", os.sched_getaffinity(0)))
            pool.submit(1)
            wait_until(lambda: "pool" in seen)
            pool.close()

    for cpus, name in (({0}, "one"), ({0, 1}, "two")):
        t = threading.Thread(target=pinned, args=(cpus, name))
        t.start()
        t.join()
    assert seen["one"] == f"CPUs 0 of {os.cpu_count()}"
    assert seen["pool"] == {0}
    assert seen["two"] == f"CPUs 0-1 of {os.cpu_count()}"


def test_a_thread_retired_before_its_job_began_leaves_no_call_in_flight(monkeypatch):
    """A thread stalled between taking a job and calling its handler, past the bound, is
    retired; its slot's in-flight gauge is cleared then. Set after that, by the thread once it
    ran on, it stayed at 1 for good (the retired thread never clears it)."""
    took = RecvPool._next

    def stalled(self, slot):
        ticket, late = took(self, slot)
        if ticket is not None and ticket.job == "stalled":
            wait_until(lambda: self.replaced == 1)  # the watchdog retired this thread
        return ticket, late

    monkeypatch.setattr(RecvPool, "_next", stalled)
    done = []
    pool = RecvPool(1, lambda job, slot, ticket: ticket.finish() and done.append(job),
                    deadline_s=0.1)
    pool.submit("stalled")
    wait_until(lambda: pool.stuck == 0 and pool.replaced == 1)  # it ran on, then exited
    assert pool.inflight == [0]
    pool.close(1.0)


def test_a_peak_reached_while_peaks_are_taken_is_not_lost():
    """take_peaks reads the peak and resets it while job threads and submitters raise it: a
    submit landing between the read and the reset was lost (the burst never reached the
    queue-depth gauge). Pinned here: the submit is made while take_peaks is inside depth(),
    from another thread given 0.5 s (with the pool's lock held by take_peaks it waits, and
    lands after the reset). Its job runs before the next take, so only the peak can show it."""
    release = threading.Event()
    pool = RecvPool(1, lambda job, slot, ticket: job == "a" and release.wait())
    try:
        pool.submit("a")
        wait_until(lambda: pool.inflight[0] == 1)  # "a" holds the only thread: "b" queues
        pool.take_peaks()
        depth, submitter = pool.depth, threading.Thread(target=pool.submit, args=("b",))

        def racing_depth() -> int:
            n = depth()
            submitter.start()
            submitter.join(0.5)
            return n

        pool.depth = racing_depth
        assert pool.take_peaks()[0] == 0  # taken before "b" (or, racing, with it lost)
        del pool.depth
        submitter.join()
        release.set()
        wait_until(lambda: pool.idle)
        assert pool.take_peaks() == (1, [1])  # "b" queued behind "a", then ran
    finally:
        release.set()
        pool.close(1.0)
