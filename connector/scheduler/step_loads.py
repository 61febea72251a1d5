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
is a fixed cost per load plus a cost per token block (`_Fit`: recent loads, exponentially
weighted), fitted to the workers' `LoadTimes` apart for in-step and asynchronous loads; a load
is charged the lower of the two predictions. Asynchronous loads overlap a forward pass and read
slower, so their fit is the pessimistic one: it never keeps a stale in-step fit (one slow in-step
load would otherwise switch in-step loads off for the life of the process, since no in-step load
would ever refresh it). A token block is one block of prompt tokens, whatever the number of
KV cache groups (`RankLoad.blocks`), the unit `take` is charged in.
A load its request's preload holds on every rank (connector.worker.preload) is a memory copy,
not a store read: it is charged a fit of its own, from earlier such loads (`take(copied=True)`),
so queued requests whose prefixes were read while they waited run in the step they are
scheduled in.
With no estimate yet, or for `BACKOFF_S` after a load failed, every load is asynchronous.
Only workers that report `in_step` (staged transfers: a load past its deadline can be stopped
before it writes into the cache) get in-step loads; a failed one is recomputed by vLLM like any
failed load.
"""

from __future__ import annotations

import time

from connector.observability.ttft import LoadTimes

BACKOFF_S = 10.0
_EWMA = 0.3  # weight of the newest load in a fit


class _Fit:
    """seconds = fixed + per_block * blocks, by exponentially weighted least squares over the
    loads seen (the newest weighs `_EWMA`). Both terms stay >= 0; loads all of one size give
    a per-block cost alone (exact at that size)."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, blocks: int, seconds: float) -> None:
        k = 1.0 - _EWMA
        self._w = self._w * k + 1.0
        self._x = self._x * k + blocks
        self._y = self._y * k + seconds
        self._xx = self._xx * k + blocks * blocks
        self._xy = self._xy * k + blocks * seconds

    def terms(self) -> tuple[float, float] | None:
        """(fixed, per_block), or None before the first load."""
        w, x, y = self._w, self._x, self._y
        if w == 0:
            return None
        var = w * self._xx - x * x
        if var <= 1e-9 * x * x:  # one size only: no way to tell the two terms apart
            return 0.0, (y / x if x else 0.0)
        per = (w * self._xy - x * y) / var
        fixed = (y - per * x) / w
        if per < 0:  # bigger loads were not slower: a fixed cost alone
            return y / w, 0.0
        if fixed < 0:  # through the origin
            return 0.0, self._xy / self._xx
        return fixed, per

    def cost(self, blocks: int) -> float | None:
        t = self.terms()
        return None if t is None else t[0] + t[1] * blocks


class StepLoadPolicy:
    """Scheduler side (one thread): per step, which loads go inside the step."""

    def __init__(self, budget_s: float) -> None:
        self._budget = budget_s
        self._left = budget_s
        self._fits = {True: _Fit(), False: _Fit()}  # store reads, by in-step or not
        self._copies = _Fit()  # loads copied from a preload
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
                fit = self._copies if load.preloaded else self._fits[load.in_step]
                fit.add(load.blocks, load.transfer)

    def cost(self, blocks: int, copied: bool = False) -> float | None:
        """Expected seconds of a load of `blocks` token blocks (None: no estimate yet); a
        `copied` one (from a preload) at the copies' estimate where there is one."""
        if copied and (c := self._copies.cost(blocks)) is not None:
            return c
        costs = [c for f in self._fits.values() if (c := f.cost(blocks)) is not None]
        return min(costs) if costs else None

    def take(self, blocks: int, copied: bool = False) -> bool:
        """True if a load of `blocks` fits in what is left of this step's budget (it is then
        counted against it). `copied`: every rank holds its blocks in a preload."""
        if not (self._budget and self._in_step) or time.monotonic() < self._until:
            return False
        cost = self.cost(blocks, copied)
        if cost is None or cost > self._left:
            return False
        self._left -= cost
        return True
