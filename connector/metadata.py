"""What the scheduler tells the workers each step. Picklable, immutable copies only: with TP=1
the worker shares these objects with the scheduler by reference, and with async scheduling the
scheduler keeps mutating its own lists while worker threads read these.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to move between the KV cache and the store.

    `block_hashes[i]` names the store objects whose bytes belong in KV block `block_ids[i]`
    of KV cache group `group` (hybrid models have one block table per group).
    """

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    group: int = 0

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.block_hashes):
            raise ValueError(
                f"{self.req_id}: {len(self.block_ids)} block ids but "
                f"{len(self.block_hashes)} hashes"
            )

    def split(self, max_blocks: int) -> list[BlockTransfer]:
        """Parts of at most max_blocks blocks (0: no split), so several receive threads can
        share one long request."""
        n = len(self.block_ids)
        if max_blocks <= 0 or n <= max_blocks:
            return [self]
        return [BlockTransfer(self.req_id, self.block_ids[i:i + max_blocks],
                              self.block_hashes[i:i + max_blocks], self.group)
                for i in range(0, n, max_blocks)]


@dataclass(frozen=True)
class Preload:
    """A queued request's store prefix (group 0's full blocks from its first), found by a
    look-ahead lookup before vLLM scheduled it: each rank may read its objects into host
    memory meanwhile (connector.worker.preload)."""

    req_id: str
    block_hashes: tuple[bytes, ...]


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One scheduler step's instructions for every worker rank."""

    loads: tuple[BlockTransfer, ...] = ()
    # Loads this step's forward waits for (their requests are scheduled in it: step_loads).
    sync_loads: tuple[BlockTransfer, ...] = ()
    saves: tuple[BlockTransfer, ...] = ()
    # Requests whose blocks vLLM keeps until every rank reports them in finished_sending,
    # because a save or a load for them may still touch their blocks.
    free_after_jobs: tuple[str, ...] = ()
    # Requests preempted this step: their blocks may be reused by this step's forward, so
    # handle_preemptions waits for their in-flight saves first.
    preempted: tuple[str, ...] = ()
    # With sync_loads: every request this step schedules; if an in-step load fails, none of
    # them saves again (connector.worker.save_guard).
    in_step_peers: tuple[str, ...] = ()
    # (request, owner): a request scheduled on blocks of another whose in-step load, or a
    # load it computed on, is not known good yet; if the worker dropped the owner's saves,
    # it drops the request's too (connector.scheduler.load_deps).
    load_deps: tuple[tuple[str, str], ...] = ()
    # The scheduler does not know the workers' KV layout yet: each worker answers with a
    # WorkerReport in this step's output.
    need_layout: bool = False
    # Look-ahead hits of requests still queued: read them into host memory now.
    preloads: tuple[Preload, ...] = ()


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler after a step: the KV layout signature each TP rank registered (while
    the scheduler asks for it, so its lookups use the workers' store keys), the step's
    finished loads, timed (`connector.observability.ttft.LoadTimes`), and the requests whose
    preloads were read whole since the last report, with how many ranks read them.

    The layout travels as worker metadata rather than handshake metadata: vLLM's MultiConnector
    hands the scheduler only the first non-None handshake of its members, but forwards each
    member's worker metadata to that member, in any position."""

    layout: dict[int, str]  # tp rank -> kv_signature; empty once the scheduler has it
    load_times: Any = None  # LoadTimes or None
    preloaded: dict[str, int] = field(default_factory=dict)  # req_id -> ranks
    # tp rank -> not settled (scheduler.gauge_refresh), from the ranks whose state changed
    unsettled: dict[int, bool] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, WorkerReport):
            return self
        times = other.load_times if self.load_times is None else \
            self.load_times if other.load_times is None else \
            self.load_times.aggregate(other.load_times)
        return WorkerReport({**self.layout, **other.layout}, times,
                            dict(Counter(self.preloaded) + Counter(other.preloaded)),
                            {**self.unsettled, **other.unsettled})
