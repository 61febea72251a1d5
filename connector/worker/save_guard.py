"""No block computed on, or copied from, a failed in-step load reaches the store.

An in-step load fills a request's first blocks inside the step whose forward computes the
rest of its prompt. When it fails, vLLM discards that request's output and recomputes, but:
- the step's saves were planned before the forward (from the hit), and the forward ran on the
  blocks the load never filled: those saves would put bytes computed on garbage under keys every
  engine trusts;
- vLLM caches a synchronously loaded request's blocks when it allocates them and, under
  `recompute`, does not evict them when the load fails, so another request of the same step may
  take them as a local prefix hit and compute, then save, its own blocks on them. Its KV stays
  wrong for its whole life (later chunks attend to it).
- at TP > 1 the failing rank's unfilled heads reach every rank's hidden states through the
  attention output's all-reduce, so the other ranks' KV of that step is computed on them too.
So once an in-step load fails on any TP rank (the ranks agree: `rank_agreement`), every
request scheduled in that step (`in_step_peers`) is tainted on every rank: none of its saves
is made, then or later, until vLLM reports it finished. Loads are what is rare here, and a
dropped save costs only a future hit.
A request of a later step can take those blocks as a local prefix hit too (with async
scheduling that step is scheduled before the failure is known; under `recompute` vLLM keeps
them cached until they are computed again): the scheduler names it with the request whose
blocks it took (`load_deps`, connector.scheduler.load_deps), and it is tainted with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from connector.metadata import BlockTransfer

UNSAFE_CODE = "unsafe"  # failures_total code of a save not made: its blocks may be wrong


class SaveGuard:
    """Model-runner thread only (the step's load wait, start_save, vLLM's poll)."""

    def __init__(self) -> None:
        self._tainted: set[str] = set()

    def load_failed(self, peers: Iterable[str], failed: Iterable[str]) -> None:
        """In-step loads of `failed` failed in a step that scheduled `peers`."""
        self._tainted.update(peers)
        self._tainted.update(failed)

    def depends(self, deps: Iterable[tuple[str, str]]) -> None:
        """(request, owner) each: the request computes on blocks of the owner, so it is
        tainted if the owner is (in order: an owner may be named earlier in the same step)."""
        for req, owner in deps:
            if owner in self._tainted:
                self._tainted.add(req)

    def split(self, saves: Sequence[BlockTransfer]
              ) -> tuple[list[BlockTransfer], list[BlockTransfer]]:
        """(saves to make, saves of tainted requests)."""
        if not self._tainted:
            return list(saves), []
        ok = [t for t in saves if t.req_id not in self._tainted]
        return ok, [t for t in saves if t.req_id in self._tainted]

    def finished(self, req_ids: Iterable[str]) -> None:
        """These requests are gone: their ids may not come back."""
        if self._tainted:
            self._tainted.difference_update(req_ids)
