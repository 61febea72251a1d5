"""The job pool on its own (no store): one shared queue, deadlines, stuck threads replaced
within a bound, writes that the watchdog never interrupts, parking, and a shutdown that fails
queued jobs at once."""

from __future__ import annotations

import threading
import time

from connector.recv_pool import RecvPool


def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list = []
        self.expired: list = []
        self.retired = 0

    def expire(self, job, reason) -> None:
        with self.lock:
            self.expired.append((job, reason))

    def retire(self) -> None:
        with self.lock:
            self.retired += 1


def test_a_job_stuck_past_its_deadline_is_reported_and_its_thread_replaced():
    rec, release = Recorder(), threading.Event()

    def handler(job, slot, ticket):
        if job == "stuck":
            release.wait()
        if ticket.finish():
            rec.done.append(job)

    pool = RecvPool(1, handler, deadline_s=0.2, on_expire=rec.expire, on_retire=rec.retire)
    pool.submit("stuck")
    wait_until(lambda: rec.expired == [("stuck", "timeout")])
    assert pool.stuck == 1 and pool.replaced == 1
    pool.submit("next")  # the slot's replacement thread serves it
    wait_until(lambda: rec.done == ["next"])
    release.set()  # the call returns: its result is dropped, its thread retires
    wait_until(lambda: pool.stuck == 0 and rec.retired == 1)
    assert rec.done == ["next"]
    pool.close(1.0)


def test_the_watchdog_never_expires_a_job_while_it_writes():
    rec, writing, release = Recorder(), threading.Event(), threading.Event()

    def handler(job, slot, ticket):
        with ticket.writing() as ok:
            assert ok
            writing.set()
            release.wait()  # a long write into memory vLLM owns
        if ticket.finish():
            rec.done.append(job)

    pool = RecvPool(1, handler, deadline_s=0.1, on_expire=rec.expire)
    pool.submit("w")
    writing.wait(2)
    time.sleep(0.4)  # well past the deadline
    assert rec.expired == [] and pool.stuck == 0
    release.set()
    wait_until(lambda: rec.done == ["w"])
    time.sleep(0.2)
    assert rec.expired == []  # finished: never reported twice
    pool.close(1.0)


def test_an_expired_job_may_not_start_writing():
    rec, results = Recorder(), []
    release = threading.Event()

    def handler(job, slot, ticket):
        release.wait()
        with ticket.writing() as ok:
            results.append(ok)

    pool = RecvPool(1, handler, deadline_s=0.1, on_expire=rec.expire)
    pool.submit("late")
    wait_until(lambda: rec.expired)
    release.set()
    wait_until(lambda: results)
    assert results == [False]
    pool.close(1.0)


def test_stuck_threads_are_bounded_by_the_pool_size():
    rec, release = Recorder(), threading.Event()

    def handler(job, slot, ticket):
        release.wait()
        ticket.finish()

    pool = RecvPool(2, handler, deadline_s=0.1, on_expire=rec.expire)
    for i in range(8):
        pool.submit(i)
    wait_until(lambda: len(rec.expired) == 8)  # every job reported, none waits on a thread
    assert pool.stuck == 2 and pool.replaced == 2  # the replacements got stuck too: no more
    assert sum(t.is_alive() for t in pool._threads) <= 2 * pool.size
    release.set()
    wait_until(lambda: pool.stuck == 0)
    pool.close(1.0)


def test_close_fails_queued_jobs_at_once_and_returns_the_stuck_threads():
    rec, release = Recorder(), threading.Event()

    def handler(job, slot, ticket):
        release.wait()

    pool = RecvPool(1, handler, on_expire=rec.expire)
    for i in range(5):
        pool.submit(i)
    time.sleep(0.1)
    t0 = time.monotonic()
    stuck = pool.close(0.2)
    assert time.monotonic() - t0 < 1.0
    assert sorted(rec.expired) == [(i, "shutdown") for i in range(1, 5)]
    assert len(stuck) == 1 and stuck[0].is_alive()
    pool.submit(9)  # after close: failed at once, never queued
    assert rec.expired[-1] == (9, "shutdown")
    release.set()
    stuck[0].join(2)
    assert not stuck[0].is_alive()
