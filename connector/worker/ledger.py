"""Request-lifetime bookkeeping on the worker: which requests still have loads or saves that
hold their blocks, and what vLLM must be told next poll.

Loads and saves are counted apart. vLLM needs to hear that a request's *load* finished (it
waits in WAITING_FOR_REMOTE_KVS until then), and separately that its *saves* finished (its
blocks are freed only then). One shared counter would strand a request whose old save
outlives a newer load.

Shared by the model-runner thread and the job threads: the lock guards only these
containers and is never held across a store call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level


class RequestLedger:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._loads: Counter[str] = Counter()  # load jobs in flight per request
        self._saves: Counter[str] = Counter()  # save jobs in flight per request
        self._done_loads: set[str] = set()
        self._failed_loads: set[str] = set()  # of _done_loads: some block did not load
        self._load_errors: set[int] = set()
        self._awaiting_free: set[str] = set()

    # ---- submission (model-runner thread) --------------------------------------------------
    def add_loads(self, req_ids: Iterable[str]) -> None:
        with self._lock:
            self._loads.update(req_ids)

    def add_saves(self, req_ids: Iterable[str]) -> None:
        with self._lock:
            self._saves.update(req_ids)

    def free_after(self, req_ids: Iterable[str]) -> None:
        """These requests are freed once none of their jobs is in flight."""
        with self._lock:
            self._awaiting_free.update(req_ids)

    # ---- completion (job threads, or the watchdog for an expired job) ----------------------
    def finish_load(self, req_id: str, failed_blocks: Iterable[int]) -> None:
        with self._lock:
            # Errors first: vLLM must see the bad blocks no later than the completion.
            failed = set(failed_blocks)
            self._load_errors |= failed
            if failed:  # any part failing fails the request's load (failed_recving)
                self._failed_loads.add(req_id)
            self._loads[req_id] -= 1
            if self._loads[req_id] <= 0:  # the last part of the request's load
                del self._loads[req_id]
                self._done_loads.add(req_id)
            self._lock.notify_all()

    def finish_save(self, req_id: str) -> None:
        """A save lets go of the request's blocks (it ended, or was expired or dropped)."""
        with self._lock:
            self._saves[req_id] -= 1
            if self._saves[req_id] <= 0:
                del self._saves[req_id]
            self._lock.notify_all()

    # ---- what vLLM polls -------------------------------------------------------------------
    def take_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving): the requests whose blocks are
        free to go, whose loads ended, and of those the ones with a block that did not load."""
        with self._lock:
            recving, self._done_loads = self._done_loads, set()
            failed = self._failed_loads & recving
            self._failed_loads -= failed
            sending = {r for r in self._awaiting_free if not self._busy(r)}
            self._awaiting_free -= sending
        return sending, recving, failed

    def failed_of(self, req_ids: set[str]) -> set[str]:
        """Those of `req_ids` whose loads (ended) had a block that did not load."""
        with self._lock:
            return self._failed_loads & req_ids

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _busy(self, req_id: str) -> bool:
        return bool(self._loads.get(req_id) or self._saves.get(req_id))

    def in_flight(self, req_id: str) -> bool:
        with self._lock:
            return self._busy(req_id)

    def idle(self) -> bool:
        with self._lock:
            return not (self._loads or self._saves)

    def awaiting_free(self, req_id: str) -> bool:
        """The request finished: vLLM frees its blocks once its jobs let go of them."""
        with self._lock:
            return req_id in self._awaiting_free

    def wait_loaded(self, req_ids: set[str], timeout: float) -> bool:
        """Block until no load job of these requests is in flight; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: not any(self._loads.get(r) for r in req_ids),
                                       timeout)

    # ---- preemption ------------------------------------------------------------------------
    def wait_idle(self, req_ids: tuple[str, ...], timeout: float) -> set[str]:
        """Block until no job of these requests is in flight, or `timeout`; returns those
        still busy then."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while any(self._busy(r) for r in req_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    return {r for r in req_ids if self._busy(r)}
                self._lock.wait(left)
        return set()
