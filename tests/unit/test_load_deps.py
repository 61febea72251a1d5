"""connector.scheduler.load_deps: who computes on blocks whose in-step load is not known good."""

from __future__ import annotations

from connector.scheduler.load_deps import REPORT_STEPS, LoadDeps


def test_a_request_on_a_loads_blocks_is_named_with_it_and_followed_in_turn():
    d = LoadDeps()
    assert d.step(["r1"], [("r1", [1, 2, 3])]) == ()  # its own load: the save guard's
    assert d.step([], [("r3", [1, 2, 7])]) == (("r3", "r1"),)
    # r5 takes r3's block 7, computed on r1's: named with r3 (whose saves the worker drops
    # when r1's are), and r4, on r1's block, with r1
    assert d.step([], [("r5", [7, 8]), ("r4", [2, 9])]) == (("r5", "r3"), ("r4", "r1"))
    d.confirmed("r1")  # every rank loaded it whole: nothing waited on anything else
    assert not d.following and d.step([], [("r6", [1, 7, 8])]) == ()


def test_the_requests_of_a_step_with_loads_wait_on_every_load_of_it():
    """At TP > 1 a failed load reaches every request of its step through the all-reduce, and
    a request of the step may take the loading request's blocks: each waits on all loads."""
    d = LoadDeps()
    d.step(["a", "b"], [("a", [1]), ("b", [2]), ("c", [3])])
    d.confirmed("a")
    assert d.step([], [("x", [3])]) == (("x", "c"),)  # c still waits on b
    d.confirmed("b")
    assert not d.following


def test_what_waits_on_a_failed_load_leaves_the_cache_with_all_its_blocks():
    """vLLM does not roll back a request scheduled on a failed load's blocks: what it
    allocates later is computed on them too, and leaves the prefix cache when it finishes."""
    d = LoadDeps()
    d.step(["r1"], [("r1", [1, 2])])
    d.step([], [("r3", [1, 5])])
    d.step([], [], grown=[("r3", [6]), ("x", [7])])  # x is not followed
    assert d.failed("r1") == {1, 2, 5, 6}
    d.step([], [], grown=[("r3", [8])])
    assert d.step([], [("r4", [5])]) == (("r4", "r3"),)
    assert d.finished("r3") == {5, 6, 8}
    assert d.finished("r4") == set()  # on r3's block only
    assert d.finished("r1") == {1, 2}
    assert not (d.following or d._waits or d._waiters or d._failed or d._done)


def test_an_owner_that_finishes_before_its_report_is_followed_until_it():
    """Aborted in the step after the failed load, before its report: its blocks stay cached
    (vLLM evicts nothing under recompute) and are still evicted when the report comes."""
    d = LoadDeps()
    d.step(["r1"], [("r1", [1])])
    d.step([], [("r3", [1, 2])])
    assert d.finished("r1") == d.finished("r3") == set()  # not reported yet
    assert d.step([], [("r9", [2])]) == (("r9", "r3"),)
    assert d.failed("r1") == {1, 2}
    assert d.finished("r9") == set()
    assert not (d.following or d._waits or d._waiters or d._failed or d._done)


def test_a_load_reported_after_its_request_finished_is_confirmed():
    """vLLM frees a finished request before it hands the connector the step's output: a
    one-token request loaded in the step is confirmed then, not followed until it ages out."""
    d = LoadDeps()
    d.step(["r1"], [("r1", [1]), ("p", [2])])
    assert d.finished("r1") == set()
    d.confirmed("r1")
    assert not (d.following or d._waits or d._waiters or d._done)


def test_a_report_that_never_comes_ages_out():
    d = LoadDeps()
    d.step(["r1"], [("r1", [1])])
    d.finished("r1")
    for _ in range(REPORT_STEPS):
        d.step([], [])
    assert d.following
    d.step([], [])
    assert not (d.following or d._waits or d._waiters or d._done)


def test_a_failed_load_names_the_blocks_to_evict_and_keeps_following_them():
    """Its blocks, and those of every owner waiting on it (its step's, and the later ones on
    its blocks), leave vLLM's prefix cache; requests already named keep their names."""
    d = LoadDeps()
    d.step(["r1"], [("r1", [1, 2]), ("p", [9])])
    d.step([], [("r3", [1, 2, 7]), ("other", [20])])
    assert d.failed("r1") == {1, 2, 7, 9}
    assert d.step([], [("r4", [7, 8])]) == (("r4", "r3"),)


def test_an_owner_without_blocks_of_its_own_ages_out_too():
    """r4 took only r1's blocks; both finish before a report that never comes, r4 a step
    later. r1 ages out first, and with it the last followed block: r4 must age out after."""
    d = LoadDeps()
    d.step(["r1"], [("r1", [1])])
    d.step([], [("r4", [1])])
    d.finished("r1")
    d.step([], [])
    d.finished("r4")
    for _ in range(REPORT_STEPS + 2):
        if not d.following:
            break
        d.step([], [])
    assert not (d.following or d._waits or d._waiters or d._done)


def test_a_failure_reported_for_a_load_no_longer_followed_keeps_nothing():
    d = LoadDeps()
    assert d.failed("gone") == set()
    assert not d._failed
