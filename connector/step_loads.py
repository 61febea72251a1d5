"""Which store loads the engine step waits for, instead of loading them asynchronously.

vLLM lets a connector load a request's prefix two ways:
- asynchronously: the request waits in WAITING_FOR_REMOTE_KVS; its load is reported done at the
  end of some engine step, and its prefill is scheduled in the step after that. That costs the
  request at least one whole extra step beyond the transfer, however short the transfer;
- synchronously: the request is scheduled at once; the worker loads before the step's forward,
  and the forward waits for it. That costs the transfer alone, but every request in the step
  waits for it too.

So a load the scheduler expects to finish within the step budget (`sync_load_ms`, shared by
every load of the step) runs inside the step, and longer ones stay asynchronous. The estimate
is the workers' recent transfer time per block (from their `LoadTimes`) of in-step loads, or of
asynchronous ones until there is none (those overlap a forward pass, so they read slower);
with no estimate yet, or for `BACKOFF_S` after a load failed, every load is asynchronous.
Only workers that report `in_step` (staged transfers: a load past its deadline can be stopped
before it writes into the cache) get in-step loads; a failed one is recomputed by vLLM like any
failed load.
"""

from __future__ import annotations

import time

from connector.ttft import LoadTimes

BACKOFF_S = 10.0
_EWMA = 0.3


class StepLoadPolicy:
    """Scheduler side (one thread): per step, which loads go inside the step."""

    def __init__(self, budget_s: float) -> None:
        self._budget = budget_s
        self._left = budget_s
        self._per_block: dict[bool, float] = {}  # seconds per block, by in-step or not
        self._in_step = False  # every worker can load inside a step
        self._until = 0.0  # no in-step loads before this (after a failure)

    def new_step(self) -> None:
        self._left = self._budget

    def observe(self, times: LoadTimes) -> None:
        """The workers' account of finished loads."""
        self._in_step = times.in_step
        for load in times.loads.values():
            if load.failed:
                self._until = time.monotonic() + BACKOFF_S
            elif load.blocks:
                per = load.transfer / load.blocks
                prev = self._per_block.get(load.in_step)
                self._per_block[load.in_step] = per if prev is None else \
                    prev + _EWMA * (per - prev)

    def take(self, blocks: int) -> bool:
        """True if a load of `blocks` fits in what is left of this step's budget (it is then
        counted against it)."""
        per_block = self._per_block.get(True, self._per_block.get(False))
        if not (self._budget and self._in_step and per_block is not None) \
                or time.monotonic() < self._until:
            return False
        cost = blocks * per_block
        if cost > self._left:
            return False
        self._left -= cost
        return True
