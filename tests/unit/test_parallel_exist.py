"""A long prompt's existence check in parts asked at once: the same answers in the keys' order,
the parts really concurrent, and no return while a part is still inside the client."""

from __future__ import annotations

import threading

import pytest

from connector.scheduler.parallel_exist import MAX_PARTS, MIN_PART, ParallelExist


def answers(keys: list[str]) -> list[int]:
    return [int(k) % 3 == 0 for k in keys]


def test_short_checks_are_one_call_and_long_ones_are_parts_in_order():
    sizes: list[int] = []

    def exist(keys: list[str]) -> list[int]:
        sizes.append(len(keys))
        return answers(keys)

    split = ParallelExist(exist)
    try:
        for n, parts in ((10, 1), (2 * MIN_PART - 1, 1), (2 * MIN_PART, 2), (3 * MIN_PART + 7, 3),
                         (50 * MIN_PART + 3, MAX_PARTS)):
            sizes.clear()
            keys = [str(i) for i in range(n)]
            assert split(keys) == answers(keys)
            assert len(sizes) == parts and sum(sizes) == n and max(sizes) - min(sizes) <= parts
    finally:
        split.shutdown()


def test_parts_are_asked_at_once():
    """Every part waits for all the others to have started: asked one after another, the
    barrier breaks instead."""
    meet = threading.Barrier(MAX_PARTS, timeout=10)

    def exist(keys: list[str]) -> list[int]:
        meet.wait()
        return answers(keys)

    split = ParallelExist(exist)
    try:
        keys = [str(i) for i in range(MAX_PARTS * MIN_PART)]
        assert split(keys) == answers(keys)
    finally:
        split.shutdown()


def test_a_failed_part_raises_only_once_every_part_has_returned():
    """The first part fails at once; the call still waits for the part held inside the client
    (a scheduler closes its client once its lookups are done), then raises the failure."""
    release, inside, finished = threading.Event(), threading.Event(), threading.Event()

    def exist(keys: list[str]) -> list[int]:
        if keys[0] == "0":
            raise RuntimeError("master gone")
        inside.set()
        release.wait(10)
        finished.set()
        return answers(keys)

    split = ParallelExist(exist)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            split([str(i) for i in range(2 * MIN_PART)])
        except RuntimeError as e:
            outcome.append(e)

    caller = threading.Thread(target=call)
    try:
        caller.start()
        assert inside.wait(10), "the second part never ran"
        caller.join(0.2)
        assert caller.is_alive(), "returned while a part was still inside the client"
        release.set()
        caller.join(10)
        assert finished.is_set() and [str(e) for e in outcome] == ["master gone"]
    finally:
        release.set()
        split.shutdown()


@pytest.mark.parametrize("failing", [1, 2])
def test_a_later_part_that_fails_fails_the_check(failing: int):
    def exist(keys: list[str]) -> list[int]:
        if keys[0] == str(failing * MIN_PART):
            raise RuntimeError(f"part {failing}")
        return answers(keys)

    split = ParallelExist(exist)
    try:
        with pytest.raises(RuntimeError, match=f"part {failing}"):
            split([str(i) for i in range(3 * MIN_PART)])
    finally:
        split.shutdown()
