"""Preloads: a queued request's store prefix read into host memory before vLLM schedules it,
so that its load is a memory copy when it is.

Why: vLLM asks a connector about a request only when its scheduler reaches it, and allocates
its blocks only then; under load a request waits in the queue for seconds while the receive
threads are idle. The scheduler's look-ahead lookups (`lookup_ahead`) find its prefix during
that wait and send each hit in the step metadata (`StepMetadata.preloads`); every rank reads
its own objects of it into this arena on a thread of its own (`mcpool-preload`). When the
request is scheduled, its load job claims the rows of the keys it needs and scatters them into
its blocks (`BlockStager.scatter`, under the job's touching guard, as a staged get's rows); a
job whose keys are not all in the arena, or whose preload is still running, reads the store as
it would without one. Each rank tells the scheduler which preloads it holds whole (`take_ready`,
in its `WorkerReport`): a load every rank can copy is cheap enough to run inside the step
(connector.scheduler.step_loads).

Bounds: the arena is `preload_buffer_size` bytes registered with the store, one object per row
(the staged layout, so only where staging is used). A preload that does not fit whole is
skipped. Rows are freed when the load has copied them, when the request finished, or
`PRELOAD_TTL_S` after they arrived unused. Rows a get may still write into are freed only by
the thread that made the get, once its call returned: a stuck preload keeps its rows until
then, and nothing else is given them meanwhile. Store objects never change under a key (a key
names its content), so rows read early are as good as rows read late.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from connector.worker.staging import BlockStager

PRELOAD_TTL_S = 60.0  # rows of a request never scheduled nor reported finished (leak bound)


@dataclass
class _Entry:
    rows: dict[str, int]  # key -> arena row (while pending: every key; then those read whole)
    pending: bool = True  # its get is running: the rows belong to that thread
    abandoned: bool = False  # the load came or the request finished while pending
    t_ready: float = 0.0


class PreloadArena:
    """Rows of one registered staging buffer, lent to preloads by request id. Thread-safe:
    the preload thread fills, load threads claim, the engine thread drops."""

    def __init__(self, stager: BlockStager, count: Callable[[str, int], None]) -> None:
        """`count(outcome, keys)`: the `preload_keys` counter (its outcomes: metric_catalog)."""
        self.stager = stager
        self._free = list(range(stager.capacity - 1, -1, -1))
        self._entries: dict[str, _Entry] = {}
        # Loads that came before their preloads (none starts now), with when: aged out like
        # ready preloads, since the load of a request already finished adds one for good.
        self._loading: dict[str, float] = {}
        self._ready: list[str] = []  # read whole since the last take_ready
        self._lock = threading.Lock()
        self._count = count

    @property
    def rows_in_use(self) -> int:
        return self.stager.capacity - len(self._free)

    def reserve(self, req_id: str, keys: Sequence[str]) -> list[int] | None:
        """Rows for a preload of `keys`, or None: already preloaded, or no room."""
        with self._lock:
            self._age(time.monotonic())
            if req_id in self._entries or req_id in self._loading:
                return None
            if len(keys) > len(self._free):
                room = False
            else:
                room = True
                rows = [self._free.pop() for _ in keys]
                self._entries[req_id] = _Entry(dict(zip(keys, rows, strict=True)))
        if not room:
            self._count("no_room", len(keys))
            return None
        return rows

    def filled(self, req_id: str, results: Sequence[int]) -> None:
        """The preload's get returned, with per-key `results` (short if it stopped or
        raised): rows read whole become claimable, the others are free."""
        want = self.stager.block_bytes
        with self._lock:
            e = self._entries[req_id]
            keys = list(e.rows)
            ok = {k: e.rows[k] for k, r in zip(keys, results, strict=False) if r == want}
            self._free += [row for k, row in e.rows.items() if k not in ok]
            if e.abandoned:
                del self._entries[req_id]
                self._free += ok.values()
            else:
                e.rows, e.pending, e.t_ready = ok, False, time.monotonic()
                if len(ok) == len(keys):
                    self._ready.append(req_id)
        self._count("failed", len(keys) - len(ok))
        if e.abandoned:
            self._count("unused", len(ok))

    def take_ready(self) -> list[str]:
        """Requests whose preloads were read whole since the last call."""
        with self._lock:
            ready, self._ready = self._ready, []
        return ready

    def claim(self, req_id: str, keys: Sequence[str]) -> list[int] | None:
        """The rows of every one of `keys`, taken out of the request's preload for the caller
        to copy and `give_back`; None if any is missing or the preload is still running (then
        it is abandoned: its rows are freed when its get returns, and the load reads the
        store) or has not started (then it never does)."""
        with self._lock:
            e = self._entries.get(req_id)
            if e is None:
                self._loading[req_id] = time.monotonic()
                return None
            if e.pending:
                e.abandoned = True
                return None
            if not all(k in e.rows for k in keys):
                return None
            rows = [e.rows.pop(k) for k in keys]
            if not e.rows:
                del self._entries[req_id]
        return rows

    def give_back(self, rows: Sequence[int], used: bool) -> None:
        """Rows a load claimed, after its copy (`used`) or without one (its job expired)."""
        with self._lock:
            self._free += rows
        self._count("used" if used else "unused", len(rows))

    def drop(self, req_id: str) -> None:
        """The request finished or was preempted: its unclaimed rows are free (once its get
        returned, if it is still running)."""
        with self._lock:
            unused = self._drop(req_id)
        if unused:
            self._count("unused", unused)

    def _drop(self, req_id: str) -> int:
        self._loading.pop(req_id, None)
        e = self._entries.get(req_id)
        if e is None:
            return 0
        if e.pending:
            e.abandoned = True
            return 0
        del self._entries[req_id]
        self._free += e.rows.values()
        return len(e.rows)

    def _age(self, now: float) -> None:
        """Free the rows of preloads ready for longer than PRELOAD_TTL_S, and forget loads
        that came first as long ago (caller holds the lock): a request aborted while queued
        may never be reported finished to the worker, or was before its load ran."""
        for rid in [rid for rid, t in self._loading.items() if now - t > PRELOAD_TTL_S]:
            del self._loading[rid]
        old = [rid for rid, e in self._entries.items()
               if not e.pending and now - e.t_ready > PRELOAD_TTL_S]
        unused = sum(self._drop(rid) for rid in old)
        if unused:
            self._count("unused", unused)
