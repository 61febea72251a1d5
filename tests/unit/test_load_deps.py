"""connector.scheduler.load_deps: who computes on blocks whose in-step load is not known good."""

from __future__ import annotations

from connector.scheduler.load_deps import LoadDeps


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


def test_what_waits_on_a_failed_load_is_followed_until_it_finishes():
    d = LoadDeps()
    d.step(["r1"], [("r1", [1, 2])])
    d.step([], [("r3", [1, 5])])
    d.finished("r1")  # finished without being confirmed: its load failed
    assert d.step([], [("r4", [5])]) == (("r4", "r3"),)
    d.finished("r3")
    d.finished("r4")
    assert not d.following and not d._waits and not d._waiters


def test_a_failed_load_names_the_blocks_to_evict_and_keeps_following_them():
    """Its blocks, and those of every owner waiting on it (its step's, and the later ones on
    its blocks), leave vLLM's prefix cache; requests already named keep their names."""
    d = LoadDeps()
    d.step(["r1"], [("r1", [1, 2]), ("p", [9])])
    d.step([], [("r3", [1, 2, 7]), ("other", [20])])
    assert d.failed("r1") == {1, 2, 7, 9}
    assert d.step([], [("r4", [7, 8])]) == (("r4", "r3"),)
