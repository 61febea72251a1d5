"""Which requests compute on blocks whose in-step load is not known good yet.

vLLM caches the blocks of a request loaded inside a step, and those the step computes for it,
when it allocates them. A request scheduled later can take them as a local prefix hit before
the load is known to have filled them:
- with async scheduling (vLLM's default), step N+1 is scheduled before step N's output, which
  reports its failed loads, comes back;
- under `recompute`, vLLM leaves a failed load's blocks cached until their request computes
  them again.
What such a request computes then attends to another prompt's bytes, and its saves would put
the result under keys that every engine trusts. The save guard (connector.worker.save_guard)
drops the saves of the failed step's own requests only.

The worker knows which loads failed but not which blocks a request computes on; the scheduler
knows the blocks. So the scheduler follows the blocks of every request a step with in-step
loads schedules, until each of the step's loads is reported whole by every rank
(`confirmed`), and names each request it schedules on followed blocks together with their
owners (`StepMetadata.load_deps`). Such a request is followed in turn, for the requests that
take its blocks. The worker drops the saves of a request whose owner's saves it drops. An
owner whose loads are never confirmed (one failed) is followed until it finishes. Usually the
next step's output confirms a step's loads, and then nothing is followed.

Naming ends with the owner, but vLLM's prefix cache keeps its blocks past it, and a request
it named keeps computing on them (vLLM does not roll back a request scheduled on another's
failed blocks): a request that took them after the owner finished (the same prompt again, a
conversation's next turn) was named with nobody, computed on them and saved. So the blocks of
every owner waiting on a failed load leave vLLM's prefix cache: those it has when the failure
is reported (`failed`), and those it allocates after, when it finishes (`finished`). Its
blocks are followed as they grow (`step`'s `grown`): evicting only the first would not do, as
a request that computes those again, correctly, would make the rest reachable. An owner that
finishes before its loads are reported stays followed until they are (at most
`REPORT_STEPS` steps), so that a failure reported after it still evicts its blocks.

Only models with one KV cache group load inside a step (connector.scheduler.load_failures),
so the blocks followed are group 0's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Steps a finished owner waits for the report of the loads it waited on (they come in the
# output of their own step, one or two steps later with async scheduling) before it is
# forgotten: a report that never comes must not keep it for good.
REPORT_STEPS = 16


class LoadDeps:
    def __init__(self) -> None:
        self._owner: dict[int, str] = {}  # followed block -> the request that owns it
        self._blocks: dict[str, list[int]] = {}  # owner -> its followed blocks
        self._waits: dict[str, set[str]] = {}  # owner -> in-step loads (requests) not confirmed
        self._waiters: dict[str, set[str]] = {}  # in-step load -> the owners waiting on it
        self._failed: set[str] = set()  # in-step loads reported failed, while waited on
        self._done: dict[str, int] = {}  # finished owners whose loads are not reported -> step
        self._steps = 0

    @property
    def following(self) -> bool:
        """Some request is followed: requests scheduled now are checked against its blocks,
        and each step ages out finished ones (an owner may have no block of its own, so not
        only while blocks are)."""
        return bool(self._waits)

    def step(self, loaders: Iterable[str], scheduled: Iterable[tuple[str, Sequence[int]]],
             grown: Iterable[tuple[str, Sequence[int]]] = ()) -> tuple[tuple[str, str], ...]:
        """A step whose in-step loads are those of `loaders`, scheduling `scheduled` (new or
        resumed requests, each with its group 0 block ids, in vLLM's allocation order: a
        request may take blocks of one allocated before it in the same step), and giving the
        running requests `grown` new blocks. Returns each (request, owner) where the request
        was scheduled on blocks of an owner followed."""
        self._steps += 1
        for rid in [r for r, at in self._done.items() if self._steps - at > REPORT_STEPS]:
            self._drop(rid)  # its report never came
        loads = set(loaders)
        deps: list[tuple[str, str]] = []
        for rid, ids in scheduled:
            owners: set[str] = set()
            if self._owner:
                owner = self._owner.get
                owners = {o for o in map(owner, ids) if o is not None and o != rid}
            waits = set(loads)
            for o in owners:
                waits |= self._waits[o]
                deps.append((rid, o))
            if waits:
                self._follow(rid, ids, waits)
        for rid, ids in grown:
            if rid in self._waits:
                self._follow(rid, ids, set())
        return tuple(deps)

    def _follow(self, rid: str, ids: Sequence[int], waits: set[str]) -> None:
        self._waits.setdefault(rid, set()).update(waits)
        for w in waits:
            self._waiters.setdefault(w, set()).add(rid)
        mine = self._blocks.setdefault(rid, [])
        for b in ids:
            if self._owner.setdefault(b, rid) == rid:
                mine.append(b)

    def confirmed(self, loader: str) -> None:
        """Every rank reported `loader`'s in-step load whole: what waited only on it is good."""
        for owner in self._waiters.pop(loader, ()):
            waits = self._waits.get(owner)
            if waits is not None:
                waits.discard(loader)
                if not waits:
                    self._drop(owner)

    def failed(self, loader: str) -> set[int]:
        """A rank reported `loader`'s in-step load failed: the followed blocks of it and of
        the owners waiting on it, for the caller to evict from vLLM's prefix cache. Live
        owners stay followed (requests already named keep their names; what they allocate
        later leaves the cache when they finish); finished ones are forgotten."""
        if loader in self._waiters:  # else nothing waits on it: nothing to remember
            self._failed.add(loader)
        owners = {loader, *self._waiters.get(loader, ())}
        out = {b for o in owners for b in self._blocks.get(o, ())}
        for o in owners & self._done.keys():
            self._drop(o)
        return out

    def finished(self, rid: str) -> set[int]:
        """`rid` finished: the blocks to evict from vLLM's prefix cache (all it had, if a load
        it waited on failed). One whose loads are not reported yet stays followed until they
        are."""
        waits = self._waits.get(rid)
        if not waits:
            self._drop(rid)
            return set()
        if waits & self._failed:
            out = set(self._blocks.get(rid, ()))
            self._drop(rid)
            return out
        self._done[rid] = self._steps
        return set()

    def _drop(self, rid: str) -> None:
        """`rid`'s blocks are not followed any more."""
        self._done.pop(rid, None)
        for w in self._waits.pop(rid, ()):
            waiters = self._waiters.get(w)
            if waiters is not None:
                waiters.discard(rid)
                if not waiters:
                    del self._waiters[w]
                    self._failed.discard(w)
        for b in self._blocks.pop(rid, ()):
            if self._owner.get(b) == rid:
                del self._owner[b]
