"""Worker side: moves KV blocks between this rank's cache and the Mooncake store.

- Loads: `start_load` queues one job per request (or per part, with load_split_blocks); a `RecvPool`
  of N threads (N = VLLM_MOONCAKE_LOAD_RECV_THREADS) runs them. A job that fails in any way, or
  outlives `load_timeout_s`, reports its block ids as load errors *before* the request is reported
  finished, so vLLM recomputes them; no request is ever left unfinished. On host-memory caches
  `begin_step` queues them before the step's forward. Loads the scheduler put inside the step
  (`connector.scheduler.step_loads`) run on a pool of one thread of their own, with a short
  deadline, and `start_load` returns once they are done or expired.
- Saves: `start_save` queues one job per request with new full blocks; a pool of one save
  thread writes them (skipping keys the store already holds), each within `save_timeout_s`.
- What a job moves (`kv_regions.plan_group`, per KV cache group): this rank's store objects of
  each block, whole store shards or, where it holds part of a shard, its byte ranges of it
  (ranged gets). A rank holding no whole shard, or a replica of another rank's, saves nothing.
- Block lifetime (`ledger.RequestLedger`): a request's blocks go back to vLLM (finished_sending
  for a finished request, `handle_preemptions` returning for a preempted one) only once no
  job of it can still read or write them. A job touches vLLM's memory only inside
  `recv_pool.Ticket.touching()`, which nothing expires and which refuses past the job's
  deadline: a zero-copy get or put for its whole call, a staged save for each gather (its puts
  read only the staging buffer), a staged load for each scatter. A save holds its blocks until
  it ends (so finished_sending means stored), but one past its deadline, or of a preempted
  request, that is not reading them is expired at once and never reads them again. A zero-copy
  call cannot be cut short, so its blocks are held until it returns: bounded by Mooncake's own
  timeouts (`transfer_timeout`; by default `load_timeout_s`). See docs/reliability-bounds.md.
- Memory under a stuck call: a staged load copies into the KV cache only from its thread's
  staging buffer; a thread whose call outlives the deadline is replaced together with its
  buffer, which is released only once the call returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from itertools import compress
from typing import Any

from connector.config import ConnectorConfig
from connector.metadata import BlockTransfer, Preload, StepMetadata
from connector.observability.events import (
    SHUTDOWN_S,
    LoadEvent,
    Publisher,
    SaveEvent,
    Subscriber,
    request_hash,
)
from connector.observability.sampling import LookupProbe
from connector.observability.stats import StatsRecorder, WorkerGauges, stat_key
from connector.observability.ttft import LoadClock, LoadTimes
from connector.store.client import (
    ABANDONED_CODE,
    EXCEPTION_CODE,
    MASTER_DOWN_CODES,
    SHORT_READ_CODE,
    StoreError,
    error_code_label,
)
from connector.store.groups import ONE_FULL, GroupSpec
from connector.store.keys import KeyBuilder, layout_signature
from connector.store.process_client import worker_store
from connector.worker.kv_regions import GroupIO, ObjectPlan, plan_group
from connector.worker.ledger import RequestLedger
from connector.worker.preload import PreloadArena
from connector.worker.rank_agreement import AnyRank, lone_rank
from connector.worker.recv_pool import SHUTDOWN, TIMEOUT, RecvPool, Ticket, inherited_cpus
from connector.worker.save_guard import UNSAFE_CODE, SaveGuard
from connector.worker.staging import BlockStager, ranged_get

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level
PREEMPTION_LOG_S = 5.0  # a preemption still waiting for a call that reads its blocks says so
_DIRECT_IO = 4096  # the disk tier stages each object DirectIO-aligned, plus two pages
SHUTDOWN_WAIT_S = 1.0  # for jobs inside a store call at shutdown; then the client closes later
# At shutdown queued saves go on for this long (then they are counted as lost): with the pools
# closed side by side, then the subscribers (tracing's last export, events.SHUTDOWN_S),
# shutdown takes SHUTDOWN_SAVE_DRAIN_S + SHUTDOWN_WAIT_S + SHUTDOWN_S at most.
SHUTDOWN_SAVE_DRAIN_S = 2.0
SHUTDOWN_BOUND_S = SHUTDOWN_SAVE_DRAIN_S + SHUTDOWN_WAIT_S + SHUTDOWN_S


def shutdown_timeout_warning(vllm_config: Any, saves: bool) -> str | None:
    """vLLM (0.32) gives EngineCore `--shutdown-timeout` seconds after SIGTERM, then kills it
    and its workers; at 0, its default, right away (v1/utils.py::shutdown: terminate, then a
    kill past a deadline of 0 s). The connector's shutdown may start, but is cut short: saves
    still queued are lost, uncounted (an idle engine's stop at 0 was seen to log its account of
    0 keys before the kill, so that a stop logged it is no proof the timeout is long enough).
    The one-line warning for an engine that saves under such a timeout, or None."""
    timeout = getattr(vllm_config, "shutdown_timeout", None)
    if not saves or timeout is None or timeout > SHUTDOWN_BOUND_S:
        return None
    when = "at once" if not timeout else f"{timeout} s after it"
    return (f"vLLM's --shutdown-timeout is {timeout} s: at SIGTERM vLLM kills EngineCore "
            f"{when}, which can cut the connector's shutdown (up to {SHUTDOWN_BOUND_S:.0f} s) "
            "short and lose the saves still queued; start vllm serve with --shutdown-timeout 30 "
            "(the chart's deploymentDefaults.shutdownTimeout), and a termination grace period "
            "above it")


def disk_staged_bytes(block_bytes: int) -> int:
    """What one block takes in the disk-tier owner's staging buffer (Mooncake aligns each
    object for DirectIO; the same estimate as the in-tree connector's)."""
    return -(-block_bytes // _DIRECT_IO) * _DIRECT_IO + 2 * _DIRECT_IO


def replica_tier(replicas: Any) -> str:
    """The tier a get reads a key from: memory when any replica is in memory (Mooncake serves
    those first), disk when only disk replicas exist, unknown when the master named none."""
    kinds = [(r.is_memory_replica(), r.is_disk_replica() or r.is_local_disk_replica())
             for r in replicas or ()]
    if any(m for m, _ in kinds):
        return "memory"
    return "disk" if any(d for _, d in kinds) else "unknown"


@dataclass(slots=True)
class _Job:
    transfer: BlockTransfer
    t_enqueue: float
    trace_parent: Any
    # A torch.cuda.Event (caches on CUDA): a save reads its blocks once the forward that
    # wrote them is done; a fenced load writes its blocks once the work queued before it is
    # done (`MooncakeStoreWorker.fence_loads`).
    ready: Any = None
    released: bool = False  # a save: its blocks are no longer needed (guarded by _release_lock)
    t_started: float = 0.0  # when a thread took it (perf_counter; 0: never)
    # A save expired while its thread ran it: the expiry's reason or the thread's account,
    # whichever came first, then REPORTED (guarded by _release_lock; `_late_save`).
    late: SaveEvent | str | object | None = None


REPORTED = object()  # `_Job.late` of a save whose late report went out


Touching = Callable[[], AbstractContextManager[bool]]  # `Ticket.touching`


def _after(ready: Any, touching: Touching) -> Touching:
    """`touching`, entered only once `ready` (a CUDA event; None: at once) has completed."""
    if ready is None:
        return touching

    def fenced() -> AbstractContextManager[bool]:
        ready.synchronize()
        return touching()

    return fenced


def step_deadline_s(config: ConnectorConfig) -> float:
    """Deadline of an in-step load: ten times the step budget and 1 s at least (a host short
    of CPU makes a load several times slower than the estimate said; expiring it would waste
    its transfer and a recompute), load_timeout_s at most. Past it the store is in trouble,
    and the step has waited once: loads stay asynchronous for step_loads.BACKOFF_S."""
    return min(config.load_timeout_s, max(1.0, 10 * config.sync_load_ms / 1e3))


def _landed(hashes: Sequence[bytes], exists: Sequence[int], new: Sequence[int],
            results: Sequence[int], per: int) -> tuple[bytes, ...]:
    """The blocks whose `per` keys (block-major) were all found stored or written; every
    block when this rank writes no shard. Not one whose put met -705 (another writer's put of
    the key still in progress): it is not readable yet, and that writer announces it."""
    if not per or results.count(0) == len(new) == len(exists) - exists.count(1):
        return tuple(hashes)  # every key was found or written: no walk over them
    ok = list(map((1).__eq__, exists))
    for i, r in zip(new, results, strict=False):  # results is short when the put never ran
        ok[i] = r == 0
    blocks = ok if per == 1 else map(all, zip(*[iter(ok)] * per, strict=True))
    return tuple(compress(hashes, blocks))


class MooncakeStoreWorker:
    def __init__(self, config: ConnectorConfig, keys: KeyBuilder, tp_rank: int,
                 num_blocks: int, kv_on_host: bool = True, zeroes_blocks: bool = False,
                 groups: tuple[GroupSpec, ...] = ONE_FULL,
                 layout_order: tuple[int, ...] | None = None) -> None:
        """`zeroes_blocks`: vLLM zeroes newly allocated blocks at the start of a step (its
        KV cache config's needs_kv_cache_zeroing), so no load may start before that.
        `groups`: the KV cache groups (vLLM's kv_cache_config); `layout_order`: a block's
        [H, N, C] in memory (`kv_regions.interior_order` of vLLM's KV cache layout)."""
        self.config = config
        self.tp_rank = tp_rank
        self._keys = keys
        self._num_blocks = num_blocks
        self._groups = groups
        self._layout_order = layout_order  # a block's [H, N, C] in memory (vLLM's layout)
        self._io: tuple[GroupIO, ...] = ()  # per group: what this rank loads and saves
        self._layout_labels: tuple[tuple[str, ...], ...] = ()  # per group, for layout_keys
        self._regions: ObjectPlan | None = None  # group 0's load plan (memory, on_cuda)
        self._staged = False  # staging buffers (per thread, see _stager) or multi-buffer
        self._spare: dict[int, list[BlockStager]] = {}  # per plan: registered, not yet taken
        self._disk_chunk = 0  # with a disk tier: most blocks per get call (see _disk_chunk_blocks)
        self._tls = threading.local()
        self._buffers_lock = threading.Lock()
        self.staging_buffers = 0  # live staging buffers (bounded: threads + stuck threads)
        self._kv_caches: dict[str, Any] = {}
        self._closed = False
        store_cfg = config.store
        if store_cfg.transfer_timeout is None:
            # A zero-copy call touches the KV blocks for its whole duration, so only Mooncake's
            # own timeout can bound it; a staged one holds its thread (and a staged save's put,
            # the save and a shutdown) as long: make it the load deadline rather than 30 s.
            store_cfg = replace(store_cfg, transfer_timeout=config.load_timeout_s)
        self._store = worker_store(
            config.store, store_cfg, store_cfg.global_segment_size, store_cfg.local_buffer_size,
            config.on_master_unreachable, config.store_timeout_s,
            on_probe_error=lambda: self.recorder.count("master_probe_errors", tp_rank))
        self.ledger = RequestLedger()
        self._release_lock = threading.Lock()
        self._saves_failing = False  # the last save ended in a store error
        self._shutdown_lost = 0  # store keys of saves failed at shutdown (logged there)
        # In-step loads (connector.scheduler.step_loads) run on a thread of their own, labelled
        # thread=load_threads, whose deadline bounds how long a step waits for them.
        self._step_thread = config.load_threads
        self._lookup_probe = LookupProbe(config.master_lookup_sample_ratio, config.load_threads + 1)
        self.recorder = StatsRecorder(tp_rank, config.load_threads + 1, self._gauges,
                                      self._master_outage)
        self._cpus = inherited_cpus()  # where the pools' threads, started now, may run
        self.pool: RecvPool[_Job] = RecvPool(
            config.load_threads, self._load, active=1 if config.load_threads_auto else None,
            deadline_s=config.load_timeout_s, on_expire=self._load_expired,
            on_retire=self._release_stager,
            on_replace=lambda: self.recorder.count("threads_replaced", tp_rank, "load"))
        self.save_pool: RecvPool[_Job] = RecvPool(
            1, self._save_job, name="mcpool-save", deadline_s=config.save_timeout_s,
            on_expire=self._save_expired, on_retire=self._release_stager,
            on_replace=lambda: self.recorder.count("threads_replaced", tp_rank, "save"))
        self.step_pool: RecvPool[_Job] | None = RecvPool(
            1, lambda job, _slot, ticket: self._load(job, self._step_thread, ticket),
            name="mcpool-step", deadline_s=step_deadline_s(config),
            on_expire=lambda job, reason, slot: self._load_expired(
                job, reason, None if slot is None else self._step_thread),
            on_retire=self._release_stager,
            on_replace=lambda: self.recorder.count("threads_replaced", tp_rank, "load"),
        ) if config.sync_load_ms > 0 else None
        self._in_step: set[str] = set()  # in-step loads: never reported in finished_recving
        # Queued requests' prefixes in host memory (preload), once the layout says staging.
        self._arena: PreloadArena | None = None
        self.preload_pool: RecvPool[Preload] | None = None
        self.save_guard = SaveGuard()  # no save of a request a failed in-step load may taint
        # Whether any TP rank's in-step load failed this step (rank_agreement): the connector
        # sets vLLM's TP group at TP > 1.
        self.any_rank: AnyRank = lone_rank
        self._early_start = config.load_early_start and not zeroes_blocks
        self._zeroes_blocks = zeroes_blocks
        self._early_meta: StepMetadata | None = None  # whose async loads begin_step queued
        self.load_clock = LoadClock()  # where a store hit's TTFT goes (ttft)
        self.events = Publisher(self.recorder, self.load_clock)
        if config.load_threads_auto:
            from connector.worker.autotune import ThreadTuner

            self.events.add(ThreadTuner(
                config.load_threads, self.pool.set_active,
                on_error=lambda: self.recorder.count("autotune_errors", tp_rank)))
        self._get_context = None
        # KV events (observability.kv_events.WorkerLanded.add): (group, hashes) of a save
        # job's blocks whose shards of this rank are in the store, before its request is released.
        self.on_landed: Callable[[int, tuple[bytes, ...]], None] | None = None
        # Loads wait for the GPU work queued before them (`_load_fence`); the connector sets it
        # where vLLM hands a freed block to a load while a step in flight may still write it.
        self.fence_loads = False

    def add_subscriber(self, sub: Subscriber) -> None:
        self.events.add(sub)
        self._get_context = getattr(sub, "get_context", self._get_context)

    # ---- registration ----------------------------------------------------------------------
    def _log_address_cache(self, group: int, plan: ObjectPlan) -> None:
        """How many of the KV cache's blocks keep their address lists (the rest have theirs
        made on every use), and what would keep them all."""
        units = self._num_blocks * plan.pieces
        kept = min(units, plan.kept_units)
        whole = -(-units * plan.row_bytes // 2**20)  # MB, rounded up
        logger.info("KV cache group %d: address lists kept for %d of %d blocks "
                    "(address_cache_size=%gMB%s)", group, kept // plan.pieces, self._num_blocks,
                    plan.cache_bytes / 2**20,
                    f"; {whole}MB would keep them all" if kept < units else "")

    def register_kv_caches(self, kv_caches: dict[str, Any], attn_backend: str = "") -> None:
        lay = self._keys.layout
        self._io = tuple(
            plan_group({n: kv_caches[n] for n in g.layers} if g.layers else kv_caches,
                       self._num_blocks, lay.num_kv_heads, lay.shards, lay.tp_size,
                       self.tp_rank, self._layout_order, self.config.address_cache_size)
            for g in self._groups)
        for g, io in enumerate(self._io):
            self._log_address_cache(g, io.load)
        self._keys = self._keys.with_signature(layout_signature(
            attn_backend, self._groups, [io.description for io in self._io]))
        self._layout_labels = tuple(
            ("latent" if g.latent else "kv_heads_slice" if io.load.src_offsets else "kv_heads",
             g.kind, str(lay.shards), str(lay.tp_size))
            for g, io in zip(self._groups, self._io, strict=True))
        self._regions = self._io[0].load
        self._kv_caches = kv_caches  # registered memory must outlive the store client
        self._staged = self._use_staging()
        self._disk_chunk = self._disk_chunk_blocks()
        self.load_clock.in_step = self.step_pool is not None and self._staged
        self._early_start = self._early_start and not self._regions.on_cuda
        self._make_arena()
        per_call = max(1, self.config.staging_buffer_size // self._regions.block_bytes)
        logger.info("mooncake pool: %d KV regions, %d bytes per object (%s of %d per block%s)"
                    ", rank %d, %d recv threads on %s, %s", len(self._regions.sizes),
                    self._regions.block_bytes, "slice" if self._regions.src_offsets else
                    f"{self._regions.pieces} shard(s)", lay.shards,
                    "" if self._io[0].save else "; this rank saves nothing", self.tp_rank,
                    self.pool.size, self._cpus, f"staged transfers ({per_call} objects per call)"
                    if self._staged else "multi-buffer transfers")
        self._store.on_connect(self._register_buffers)

    def _make_arena(self) -> None:
        """The preload arena and its thread: where transfers are staged (an arena row is a
        staged object) for a model of one KV cache group (the scheduler sends only those
        preloads), and the buffer holds one object at least."""
        plan = self._regions
        if not (self._staged and len(self._groups) == 1 and self.config.enable_load
                and self.config.lookup_ahead > 0
                and self.config.preload_buffer_size >= plan.block_bytes):
            return
        rank = self.tp_rank
        self._arena = PreloadArena(
            BlockStager(plan, self._num_blocks, self.config.preload_buffer_size),
            lambda outcome, n: self.recorder.count("preload_keys", rank, outcome, n=n))
        self.preload_pool = RecvPool(1, self._preload, name="mcpool-preload",
                                     deadline_s=self.config.load_timeout_s)

    def _use_staging(self) -> bool:
        mode = self.config.staging
        if mode == "on" and self._regions.on_cuda:
            raise ValueError("kv_connector_extra_config.staging: 'on' needs the KV caches in "
                             "host memory, these are on CUDA; use 'auto' or 'off'")
        # auto: only where it pays, i.e. host memory over tcp and several regions per block
        # (a single-region block is already one contiguous slice: staging would add a copy).
        return mode == "on" or (mode == "auto" and not self._regions.on_cuda
                                and self.config.store.protocol == "tcp"
                                and any(len(io.load.sizes) > 1 for io in self._io))

    def _disk_chunk_blocks(self) -> int:
        """With a disk tier, the most objects one get may ask for (0: no limit): the store node
        reads disk objects into its staging buffer (disk_staging_buffer_size) before sending
        them, and a get that does not fit fails whole with -10 BUFFER_OVERFLOW. The buffer is
        shared by every get in flight, and this engine has as many as its readers: the load
        threads and the in-step thread, on every TP rank. So each get asks for its share of
        the usable bytes (one object at least: one that fits the whole buffer alone still
        loads, the concurrent ones may then fail and be recomputed). A job's gets run one
        after another, as the in-tree connector's sub-batches do."""
        if not self.config.enable_offload:
            return 0
        budget = int(self.config.disk_staging_buffer_size * self.config.disk_staging_usable_ratio)
        biggest = disk_staged_bytes(max(io.load.block_bytes for io in self._io))  # one object
        if budget < biggest:
            raise ValueError(
                f"kv_connector_extra_config.disk_staging_buffer_size: {budget} usable bytes "
                f"hold no store object of {biggest} bytes; raise it (and the store "
                "nodes' MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES) or disk_staging_usable_ratio")
        readers = (self.pool.size + (self.step_pool is not None)) * self._keys.layout.tp_size
        return max(1, budget // readers // biggest)

    def _register_buffers(self, client: Any) -> None:
        for ptr, size in dict(st for io in self._io for st in io.load.storages).items():
            rc = client.register_buffer(ptr, size)
            if rc != 0:
                logger.error("register_buffer(%#x, %d) failed with %d; loads and saves on "
                             "this rank will fail and be recomputed", ptr, size, rc)
        if self._arena is not None:
            buf = self._arena.stager.buffer
            rc = client.register_buffer(buf.data_ptr(), self._arena.stager.nbytes)
            if rc != 0:
                logger.error("register_buffer of the preload buffer failed with %d; preloads "
                             "will fail and their requests load when scheduled", rc)
        if self._staged:
            self._warm_stagers(client)

    def _warm_stagers(self, client: Any) -> None:
        """Register, at startup, the staging buffers of the load threads taking jobs now and
        of the in-step thread: registering one publishes this client's segment to the
        metadata server, a round trip the first store hit of each thread would otherwise pay
        inside its deadline (seen on a loaded host: the metadata server's replies timing out
        failed each thread's first load). One that fails is logged and made on first use;
        those registered before it are kept (registered and counted: thrown away, they would
        stay both)."""
        threads = self.pool.active + (self.step_pool is not None)
        plans = {id(io.load): io.load for io in self._io}
        try:
            for key, plan in plans.items():
                spare = self._spare[key] = []
                for _ in range(threads):
                    spare.append(self._new_stager(client, plan))
        except RuntimeError as e:
            logger.warning("%s at startup: made on first use instead", e)

    def _new_stager(self, client: Any, plan: ObjectPlan) -> BlockStager:
        stager = BlockStager(plan, self._num_blocks, self.config.staging_buffer_size)
        rc = client.register_buffer(stager.buffer.data_ptr(), stager.nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer of a staging buffer failed with {rc}")
        with self._buffers_lock:
            self.staging_buffers += 1
        return stager

    def _stager(self, client: Any, plan: ObjectPlan, load: bool = True) -> BlockStager | None:
        """This thread's staging buffer for `plan`: for a load, one registered at startup if
        one is left, else (and for a save) made and registered now. Per thread, not per slot:
        a thread stuck in a call keeps its buffer until the call returns, and its replacement
        gets a fresh one. (One per plan: a hybrid model's groups, or a load and a save plan
        that differ, each have their own.)"""
        if not self._staged:
            return None
        stagers = getattr(self._tls, "stagers", None)
        if stagers is None:
            stagers = self._tls.stagers = {}
        stager = stagers.get(id(plan))
        if stager is None:
            with self._buffers_lock:
                spare = self._spare.get(id(plan)) if load else None
                stager = spare.pop() if spare else None
            if stager is None:
                stager = self._new_stager(client, plan)
            stagers[id(plan)], self._tls.client = stager, client
        return stager

    def _release_stager(self) -> None:
        """A retired thread's call has returned: its buffers can be unregistered and freed."""
        stagers = getattr(self._tls, "stagers", None) or {}
        for stager in stagers.values():
            self._tls.client.unregister_buffer(stager.buffer.data_ptr())
            with self._buffers_lock:
                self.staging_buffers -= 1
        self._tls.stagers, self._tls.client = {}, None

    # ---- per step --------------------------------------------------------------------------
    def _context(self) -> Any:
        return self._get_context() if self._get_context is not None else None

    def begin_step(self, meta: StepMetadata) -> None:
        """The step's metadata, before its forward pass. On host-memory KV caches the forward
        runs on this thread and `start_load` comes after it, so asynchronous loads are queued
        here instead (`load_early_start`), unless vLLM zeroes new blocks first."""
        now = time.perf_counter()
        self.load_clock.received((t.req_id for t in (*meta.loads, *meta.sync_loads)), now)
        if self.preload_pool is not None:
            for p in meta.preloads:
                self.preload_pool.submit(p)
        if self._early_start and meta.loads:
            self._queue_loads(meta.loads, self.pool, now)
            self._early_meta = meta

    def start_load(self, meta: StepMetadata) -> None:
        if meta.loads and self._early_meta is not meta:
            self._queue_loads(meta.loads, self.pool, time.perf_counter())
        self._early_meta = None
        if meta.sync_loads:
            self._load_in_step(meta.sync_loads, meta.in_step_peers)

    def _queue_loads(self, transfers: Sequence[BlockTransfer], pool: RecvPool[_Job],
                     now: float) -> set[str]:
        ctx, ready = self._context(), self._load_fence()
        split = self.config.load_split_blocks if pool is self.pool else 0
        parts = [p for t in transfers for p in t.split(split)]
        self.ledger.add_loads(p.req_id for p in parts)
        self.load_clock.queued(Counter(p.req_id for p in parts), now)
        for p in parts:
            pool.submit(_Job(p, now, ctx, ready))
        return {p.req_id for p in parts}

    def _load_fence(self) -> Any:
        """A CUDA event after the GPU work queued so far, which loads wait for before they
        write a block; None where loads need none. vLLM holds a freed block back for a step
        while batches overlap (async scheduling) only for a KV consumer: elsewhere a block
        freed by a request that the step still on the GPU writes can go straight to a load,
        whose write would then race that step's (vllm/v1/core/sched/scheduler.py,
        defer_block_free). And where vLLM zeroes new blocks, it queues the zeroing on the
        GPU before the step's loads start: a load's write that landed first would be zeroed."""
        if not (self.fence_loads or self._zeroes_blocks) or self._regions is None \
                or not self._regions.on_cuda:
            return None
        import torch

        ready = torch.cuda.Event()
        ready.record()
        return ready

    def _load_in_step(self, transfers: Sequence[BlockTransfer], peers: Sequence[str]) -> None:
        """Loads of requests this step's forward computes: the step waits for them. A load
        still running at the in-step deadline is expired: its blocks become load errors, which
        vLLM reads in this step's output, discarding what the step computed from them and
        recomputing them; an expired staged load copies nothing more into the cache. The wait
        ends only once no job can still copy (the watchdog lets a copy under way finish)."""
        ids = {t.req_id for t in transfers}
        self._in_step |= ids
        failed: set[str] = set(ids)  # unless the wait below says otherwise
        try:
            self._queue_loads(transfers, self.step_pool or self.pool, time.perf_counter())
            while not self.ledger.wait_loaded(ids, step_deadline_s(self.config) + 1.0):
                logger.warning("an in-step load is still running past its deadline (a copy "
                               "into the KV cache under way?); the step waits for it")
            failed = self.ledger.failed_of(ids)
        finally:
            # This step's forward may read blocks a load did not fill, on this rank or, through
            # the TP all-reduce, on another: every rank taints the step (rank_agreement).
            if self.any_rank(bool(failed)):
                self.save_guard.load_failed(peers, failed)
        self.load_clock.reported(ids, time.perf_counter(), in_step=True)

    def start_save(self, meta: StepMetadata) -> None:
        self.save_guard.depends(meta.load_deps)
        saves, unsafe = self.save_guard.split(meta.saves)
        now = time.perf_counter()
        for t in unsafe:
            self._save_lost(t, UNSAFE_CODE, now, None)
        if not saves:
            return
        ready = None
        if self._regions is not None and self._regions.on_cuda:
            import torch  # only on CUDA caches: the CPU forward is synchronous

            ready = torch.cuda.Event()
            ready.record()
        ctx = self._context()
        self.ledger.add_saves(t.req_id for t in saves)
        for t in saves:
            self.save_pool.submit(_Job(t, now, ctx, ready))

    def note_free_after(self, meta: StepMetadata) -> None:
        if meta.free_after_jobs:
            self.ledger.free_after(meta.free_after_jobs)

    def wait_preempted(self, meta: StepMetadata) -> None:
        """Return once no job of a preempted request can still touch its (now reusable) blocks.

        Runs on the model-runner thread before the forward pass, so it waits only for calls
        that are reading or writing the blocks right now: saves not yet reading them are
        dropped at once (the scheduler saves the request again from its new blocks when it
        resumes), and one inside such a call is expired as it returns. So the wait is one
        call at most: a staged gather (memory speed), or a zero-copy put, bounded by
        Mooncake's transfer timeout (`load_timeout_s` by default; docs/reliability-bounds.md
        §1). It never hands back blocks a call may still touch."""
        if not meta.preempted:
            return
        ids = set(meta.preempted)
        self.save_pool.drop(lambda j: j.transfer.req_id in ids and not j.released,
                            ABANDONED_CODE)
        t0 = time.monotonic()
        while busy := self.ledger.wait_idle(meta.preempted, PREEMPTION_LOG_S):
            logger.warning("handle_preemptions: a store call still touches the blocks of %d "
                           "preempted request(s) after %.0fs; the step waits for it (Mooncake's "
                           "transfer timeout bounds it)", len(busy), time.monotonic() - t0)

    @property
    def kv_signature(self) -> str:
        """The registered layout's signature, for the scheduler's keys (handshake)."""
        return self._keys.layout.kv_signature

    def get_transfer_results(self, finished_req_ids: set[str] = frozenset()
                             ) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) for vLLM's poll: failed_recving
        holds the requests of finished_recving with a block that did not load (every failure
        also reports its block ids, in get_load_errors, no later than this poll)."""
        if self._saves_failing or self.save_pool.stalled:
            # A finished request would hold its blocks until its queued saves expire; while
            # saves fail or hang, drop the ones that have not started instead. While they only
            # fail, the oldest goes on: the save that succeeds again ends the dropping.
            self.save_pool.drop(lambda j: self.ledger.awaiting_free(j.transfer.req_id),
                                ABANDONED_CODE, running=False,
                                spare=0 if self.save_pool.stalled else 1)
        self.save_guard.finished(finished_req_ids)
        if self._arena is not None:
            for rid in finished_req_ids:
                self._arena.drop(rid)
        sending, recving, failed = self.ledger.take_finished()
        if recving:
            in_step = recving & self._in_step  # their requests run already: not vLLM's news
            self._in_step -= in_step
            recving -= in_step
            failed -= in_step
            if recving:
                self.load_clock.reported(recving, time.perf_counter())
        return sending, recving, failed

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's older two-set poll (finished_sending, finished_recving), None for empty."""
        sending, recving, _ = self.get_transfer_results()
        return sending or None, recving or None

    def take_load_times(self) -> LoadTimes | None:
        """This step's finished loads, timed, for the scheduler (build_connector_worker_meta)."""
        return self.load_clock.take()

    def take_preloads_ready(self) -> list[str]:
        """Requests whose preloads this rank read whole since the last call (for the
        scheduler's in-step loads: connector.scheduler.step_loads)."""
        return self._arena.take_ready() if self._arena is not None else []

    def get_load_errors(self) -> set[int]:
        return self.ledger.take_load_errors()

    def _gauges(self) -> WorkerGauges:
        """Sampled at every stats poll; queue depth and in-flight are peaks since the last one."""
        depth, busy = self.pool.take_peaks()
        if self.step_pool is not None:  # the in-step thread, labelled thread=load_threads
            step_depth, step_busy = self.step_pool.take_peaks()
            depth, busy = depth + step_depth, busy + step_busy
        return WorkerGauges(
            load_queue_depth=depth, save_queue_depth=self.save_pool.depth(),
            recv_threads=self.pool.size, recv_threads_active=self.pool.active,
            load_inflight=tuple(busy),
            threads_stuck={"load": self.pool.stuck + (self.step_pool.stuck if self.step_pool
                                                      else 0),
                           "save": self.save_pool.stuck},
            staging_buffers=self.staging_buffers,
            preload_bytes=self._arena.rows_in_use * self._arena.stager.block_bytes
            if self._arena is not None else 0,
            layout=(self._keys.fingerprint, self._keys.layout.hash_algo,
                    "staged" if self._staged else "multibuffer") if self._regions else None)

    def settled(self) -> bool:
        """Nothing on /metrics that an idle engine would leave stale: no job queued or running
        in any pool (a retired thread's call included), no preload rows held, the master
        answering. While not, the scheduler steps an idle engine now and then so the gauges
        follow (connector.scheduler.gauge_refresh)."""
        pools = (self.pool, self.save_pool, self.step_pool, self.preload_pool)
        return (all(p is None or p.idle for p in pools)
                and (self._arena is None or not self._arena.rows_in_use)
                and self._store.ready() is not None)

    def _master_outage(self) -> dict[str, float]:
        failovers, seconds = self._store.take_outage()
        out = {stat_key("master_failovers", self.tp_rank): failovers,
               stat_key("master_down_seconds", self.tp_rank): seconds}
        return {k: v for k, v in out.items() if v}

    def _connected(self) -> Any:
        """The store client, or StoreError when there is none or the breaker is open."""
        if self._regions is None:
            raise StoreError("unavailable")
        return self._store.require()

    # ---- load job (runs on a receive thread) -----------------------------------------------
    def _load(self, job: _Job, thread: int, ticket: Ticket[_Job]) -> None:
        t = job.transfer
        t_start = job.t_started = time.perf_counter()
        t_prepared = t_lookup_end = t_start
        sampled = False
        code, failed, nbytes = "", list(t.block_ids), 0
        results: list[int] = []
        preloaded = None
        want, per = 0, 1
        key_tiers, tiers = None, None
        touching = _after(job.ready, ticket.touching)
        try:
            plan = self._io[t.group].load
            keys = self._keys.object_keys(t.block_hashes, plan.shards, t.group)
            units = plan.units(t.block_ids)
            preloaded = self._from_arena(t, keys, units, touching)
            if preloaded is not None:
                results = preloaded
            else:
                client = self._connected()
                stager = self._stager(client, plan)
                addrs = None if stager else plan.addresses(units)
                t_prepared = t_lookup_end = time.perf_counter()
                if self.config.tier_metrics or self._lookup_probe.due(thread):
                    descriptors = client.batch_get_replica_desc(keys)
                    t_lookup_end = time.perf_counter()
                    sampled = True
                    if self.config.tier_metrics:
                        key_tiers = [replica_tier(descriptors.get(k)) for k in keys]
                if stager:
                    results = stager.get(client, keys, units, touching, self._disk_chunk,
                                         ticket.alive)
                else:  # zero-copy: the call itself writes into the KV blocks
                    results = self._get_multi_buffers(client, keys, addrs, plan, touching)
            want, per = plan.block_bytes, plan.pieces
            if not ticket.expired and len(results) != len(keys):
                raise RuntimeError(f"store returned {len(results)} results for {len(keys)} keys")
            failed = sorted({t.block_ids[i // per] for i, r in enumerate(results) if r != want})
            nbytes = sum(r for r in results if r > 0) if preloaded is None else 0
            if key_tiers is not None:
                tiers = self._served_by_tier(key_tiers, results, want, per, t.group)
            bad = next((r for r in results if r != want), None)
            if bad is not None:
                code = error_code_label(bad) if bad < 0 else SHORT_READ_CODE
                self._store.check(results)
        except StoreError as e:
            code = e.code
        except Exception as e:  # preparation or transfer: report every block, recompute
            code = EXCEPTION_CODE
            logger.warning("load of %d blocks for %s failed: %r", len(t.block_ids),
                           request_hash(t.req_id), e)
        if not ticket.finish():
            return  # expired: the watchdog reported it, and nothing was copied since
        # Store keys read whole, of the blocks loaded (a failed block's other shards are
        # recomputed with it).
        loaded = (len(t.block_ids) - len(failed) if code else len(t.block_ids)) * per \
            if len(results) == len(t.block_ids) * per else 0
        try:
            if loaded:
                self.recorder.count("layout_keys", self.tp_rank, "load",
                                    *self._layout_labels[t.group], n=loaded)
        finally:  # whatever fails here, the request's load count must come down
            self.ledger.finish_load(t.req_id, failed if code else ())
        self.events.load(LoadEvent(
            thread=thread, tp_rank=self.tp_rank, request_hash=request_hash(t.req_id),
            keys=len(t.block_ids), nbytes=nbytes, failed_blocks=len(failed) if code else 0,
            code=code, t_enqueue=job.t_enqueue, t_start=t_start, t_prepared=t_prepared,
            t_lookup_end=t_lookup_end, t_end=time.perf_counter(), lookup_sampled=sampled,
            trace_parent=job.trace_parent, tiers=tiers, loaded_keys=loaded, group=t.group,
            preloaded=preloaded is not None, phases=preloaded is None))

    def _from_arena(self, t: BlockTransfer, keys: list[str], units: list[int],
                    touching: Touching) -> list[int] | None:
        """Per-key results of copying the job's objects from its request's preload into its
        blocks (no store call); None when the preload does not hold them all (the job reads
        the store), [] when the job expired before the copy."""
        if self._arena is None or t.group != 0:
            return None
        rows = self._arena.claim(t.req_id, keys)
        if rows is None:
            return None
        copied = False
        try:
            with touching() as ok:
                if ok:
                    self._arena.stager.scatter(units, rows)
                    copied = True
        finally:
            self._arena.give_back(rows, copied)
        return [self._arena.stager.block_bytes] * len(keys) if copied else []

    def _preload(self, job: Preload, _slot: int, ticket: Ticket[Preload]) -> None:
        """Read a queued request's objects of this rank into the preload arena (runs on
        mcpool-preload); its rows are the arena's again only once the calls returned."""
        arena = self._arena
        plan = self._io[0].load
        keys = self._keys.object_keys(job.block_hashes, plan.shards)
        rows = arena.reserve(job.req_id, keys)
        if rows is None:
            return
        results: list[int] = []
        try:
            client = self._connected()
            step = self._disk_chunk or len(keys)  # a disk tier's share per get, as a load's
            for i in range(0, len(keys), step):
                if i and not ticket.alive():
                    break
                results += arena.stager.fetch(client, keys[i:i + step], rows[i:i + step])
        except Exception as e:  # its load reads the store when the request is scheduled
            logger.debug("preload of %d objects for %s failed: %r", len(keys),
                         request_hash(job.req_id), e)
        finally:
            arena.filled(job.req_id, results)

    def _get_multi_buffers(self, client: Any, keys: list[str], addrs: Any, plan: ObjectPlan,
                           touching: Touching) -> list[int]:
        """Multi-buffer (or, for a slice of each object, ranged) gets straight into the KV
        blocks: one call, or with a disk tier calls of at most _disk_chunk objects; each
        writes only while the ticket allows it."""
        step = self._disk_chunk or len(keys)
        results: list[int] = []
        for i in range(0, len(keys), step):
            part = [a[i:i + step] for a in addrs]
            with touching() as ok:
                if not ok:
                    return results
                results += (client.batch_get_into_multi_buffers(keys[i:i + step], *part)
                            if plan.src_offsets is None else
                            ranged_get(client, keys[i:i + step], *part, plan.src_offsets))
        return results

    def _served_by_tier(self, key_tiers: list[str], results: list[int], want: int, per: int,
                        group: int) -> dict[str, tuple[int, int]]:
        """(prompt tokens, bytes) of the blocks loaded whole (all `per` objects of each) from
        each tier, named by the tier of a block's first object. Tokens count in group 0 only:
        another group's blocks cover the same prompt tokens."""
        out: dict[str, tuple[int, int]] = {}
        block = self._keys.layout.block_size if group == 0 else 0
        for i in range(0, len(results), per):
            if all(r == want for r in results[i:i + per]):
                tokens, nbytes = out.get(key_tiers[i], (0, 0))
                out[key_tiers[i]] = (tokens + block, nbytes + want * per)
        return out

    def _load_expired(self, job: _Job, reason: str, slot: int | None) -> None:
        """Watchdog (timeout) or shutdown: every block of the job is a load error. `slot` is
        the thread that ran it (None: it expired in the queue)."""
        t = job.transfer
        self.ledger.finish_load(t.req_id, t.block_ids)
        now = time.perf_counter()
        # A job expired while running waited in the queue only until its thread took it.
        start = job.t_started if slot is not None and job.t_started else now
        self.events.load(LoadEvent(
            thread=slot, tp_rank=self.tp_rank, request_hash=request_hash(t.req_id),
            keys=len(t.block_ids), nbytes=0, failed_blocks=len(t.block_ids), code=reason,
            t_enqueue=job.t_enqueue, t_start=start, t_prepared=start, t_lookup_end=start,
            t_end=now, lookup_sampled=False, trace_parent=job.trace_parent, group=t.group,
            phases=False))

    # ---- save job (runs on the save thread) ------------------------------------------------
    def _release(self, job: _Job) -> None:
        """The save lets go of its request's blocks: it ended, or it was expired or dropped
        while not reading them (a put from the staging buffer may still be running). Once per
        job, whoever gets here first."""
        with self._release_lock:
            if job.released:
                return
            job.released = True
        self.ledger.finish_save(job.transfer.req_id)

    def _offered_keys(self, t: BlockTransfer) -> int:
        """Store keys a save of `t` writes or finds stored when it succeeds: what a failed or
        dropped one loses (save_error_keys)."""
        plan = self._io[t.group].save
        return len(t.block_hashes) * len(plan.shards) if plan else 0

    def _save_job(self, job: _Job, _slot: int, ticket: Ticket[_Job]) -> None:
        t = job.transfer
        t_start = time.perf_counter()
        t_ready = t_exists = t_start
        code, op, stored, skipped, nbytes = "", "save", 0, 0, 0
        landed: tuple[bytes, ...] = ()
        try:
            if job.ready is not None:
                job.ready.synchronize()
            t_ready = t_exists = time.perf_counter()
            client = self._connected()
            plan = self._io[t.group].save
            keys = self._keys.object_keys(t.block_hashes, plan.shards, t.group) if plan else []
            units = plan.units(t.block_ids) if plan else []
            op = "save_exists"
            exists = client.batch_is_exist(keys) if keys else []
            t_exists = time.perf_counter()
            down = next((e for e in exists if e in MASTER_DOWN_CODES), None)
            if down is not None:  # the breaker opens; a put now would only wait for it too
                self._store.check(exists)
                raise StoreError(error_code_label(down))
            op = "save"
            # Any other failed check counts as absent: the put tells whether the store works.
            new = [i for i, e in enumerate(exists) if e != 1]
            skipped = len(keys) - len(new)
            if new:
                new_keys, new_ids = [keys[i] for i in new], [units[i] for i in new]
                stager = self._stager(client, plan, load=False)
                if stager:  # reads the blocks from the first gather to the last
                    results = stager.put(client, new_keys, new_ids, ticket.touching,
                                         self._store.replicate)
                else:  # zero-copy: the put reads the blocks for its whole call
                    with ticket.touching() as ok:
                        results = client.batch_put_from_multi_buffers(
                            new_keys, *plan.addresses(new_ids),
                            self._store.replicate) if ok else []
                # -705: another writer stored the same block meanwhile; that is a skip.
                skipped += sum(1 for r in results if r == -705)
                stored = sum(1 for r in results if r == 0)
                errs = [r for r in results if r < 0 and r != -705]
                if errs:
                    code = error_code_label(errs[0])
                    self._store.check(errs)
                nbytes = stored * plan.block_bytes
                if stored:
                    self.recorder.count("layout_keys", self.tp_rank, "save",
                                        *self._layout_labels[t.group], n=stored)
            if self.on_landed is not None:  # KV events on
                landed = _landed(t.block_hashes, exists, new, results if new else [],
                                 len(plan.shards) if plan else 0)
        except StoreError as e:
            code = e.code
        except Exception as e:
            code, op = EXCEPTION_CODE, "save"
            logger.warning("save for %s failed: %r", request_hash(t.req_id), e)
        if landed and self.on_landed is not None:  # before the request can be reported done
            try:
                self.on_landed(t.group, landed)
            except Exception:  # events must never keep a job from releasing its blocks
                logger.exception("KV events: recording saved blocks failed")
        self._release(job)
        event = SaveEvent(
            tp_rank=self.tp_rank, request_hash=request_hash(t.req_id), keys=stored, skipped=skipped,
            failed_keys=max(0, self._offered_keys(t) - stored - skipped), nbytes=nbytes,
            code=code, failed_op=op, t_enqueue=job.t_enqueue, t_start=t_start, t_ready=t_ready,
            t_exists_end=t_exists, t_end=time.perf_counter(), trace_parent=job.trace_parent)
        if not ticket.finish():  # expired or dropped meanwhile (it never read released blocks)
            self._late_save(job, event)
            return
        with self._release_lock:
            counted, job.late = job.late is REPORTED, REPORTED
        if counted:
            return  # shutdown counted it lost while its call was out
        self._saves_failing = bool(code)
        self.events.save(event)

    def _save_expired(self, job: _Job, reason: str, slot: int | None) -> None:
        """A save past its deadline, dropped (preempted, or queued while saves fail) or queued
        at shutdown: never inside `touching()`, so it has read its blocks already or never
        will; they are released now."""
        self._release(job)
        if reason == TIMEOUT:
            self._saves_failing = True
        if slot is not None:  # running (not at shutdown): its put may still land
            self._late_save(job, reason)
            return
        if reason == SHUTDOWN:  # still queued: counted in the shutdown line's first number
            self._shutdown_lost += self._offered_keys(job.transfer)
        self._save_lost(job.transfer, reason, job.t_enqueue, job.trace_parent)

    def _late_save(self, job: _Job, got: SaveEvent | str) -> None:
        """A save expired (or dropped) while its thread ran it: `got` is the expiry's reason
        (from `_save_expired`) or the thread's account of what its calls stored (once they
        returned). Whichever comes second reports the save, once: the keys its put stored
        after the deadline are stored (save_keys), not lost, and those it did not store are
        lost with the expiry's reason (the put's own failure code, if any, is in the
        warning it logged). The report waits for the call, which Mooncake's timeouts bound
        (docs/reliability-bounds.md); one still out at shutdown is reported lost then
        (`_settle_saves_in_calls`)."""
        with self._release_lock:
            first = job.late
            job.late = got if first is None else REPORTED
        if first is None or first is REPORTED:
            return
        event, reason = (got, first) if isinstance(got, SaveEvent) else (first, got)
        if event.failed_keys:
            event = replace(event, code=reason, failed_op="save")
        elif not event.code:  # its put stored every key after all: the store takes saves
            self._saves_failing = False
        self.events.save(event)

    def _settle_saves_in_calls(self) -> int:
        """At shutdown, once the pools gave their calls `SHUTDOWN_WAIT_S`: saves whose calls
        have not returned are reported lost, as the process may exit before they do; those
        past their deadline with their expiry's reason (`late`), the others as "shutdown" (one
        whose expiry is not reported yet included). One whose thread gave its account already
        is its expiry's to report. Their threads, and expiries, report nothing more
        (`REPORTED`). Returns their keys."""
        running = self.save_pool.running()  # expired ones included: their threads are out
        with self._release_lock:
            lost = [(job, SHUTDOWN if job.late is None else job.late) for job in running
                    if job.late is None or isinstance(job.late, str)]
            for job, _ in lost:
                job.late = REPORTED
        for job, reason in lost:
            self._save_lost(job.transfer, reason, job.t_enqueue, job.trace_parent)
        return sum(self._offered_keys(job.transfer) for job, _ in lost)

    def _save_lost(self, t: BlockTransfer, reason: str, t_enqueue: float, trace: Any) -> None:
        """A save that wrote nothing: every key it offered is lost (save_error_keys)."""
        now = time.perf_counter()
        self.events.save(SaveEvent(
            tp_rank=self.tp_rank, request_hash=request_hash(t.req_id), keys=0, skipped=0,
            failed_keys=self._offered_keys(t), nbytes=0, code=reason, failed_op="save",
            t_enqueue=t_enqueue, t_start=now, t_ready=now, t_exists_end=now, t_end=now,
            trace_parent=trace, ran=False))

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the pools side by side: queued saves go on for up to SHUTDOWN_SAVE_DRAIN_S,
        queued loads fail fast (vLLM is stopping), and what is left is counted as lost
        (save_error_keys, code "shutdown", and one log line). Then the subscribers stop
        (tracing's last export, SHUTDOWN_S at most; its error never keeps the client open), and
        the store client closes once no thread can still be inside a call on it. Takes
        SHUTDOWN_BOUND_S at most."""
        if self._closed:
            return
        self._closed = True
        t0 = time.monotonic()
        closes = [(self.pool, SHUTDOWN_WAIT_S, 0.0),
                  (self.save_pool, SHUTDOWN_WAIT_S, SHUTDOWN_SAVE_DRAIN_S)]
        if self.step_pool is not None:
            closes.append((self.step_pool, SHUTDOWN_WAIT_S, 0.0))
        if self.preload_pool is not None:
            closes.append((self.preload_pool, SHUTDOWN_WAIT_S, 0.0))
        stuck: list[threading.Thread] = []

        def close(pool: RecvPool[_Job], wait: float, drain: float) -> None:
            stuck.extend(pool.close(wait, drain))

        closers = [threading.Thread(target=close, args=c, name="mcpool-shutdown", daemon=True)
                   for c in closes]
        for t in closers:
            t.start()
        for t in closers:
            t.join()
        in_calls = self._settle_saves_in_calls()
        # The time is in the line so that a stop can be checked against SHUTDOWN_BOUND_S
        # (tests/e2e/test_graceful_stop.py reads it from the engine's log).
        took = time.monotonic() - t0
        if self._shutdown_lost or stuck or in_calls:
            logger.warning("shutdown: %d store keys of saves still queued after %.0fs were not "
                           "saved, nor %d of saves still in a store call (counted in "
                           "save_error_keys); %d threads still inside a store call; took %.2fs",
                           self._shutdown_lost, SHUTDOWN_SAVE_DRAIN_S, in_calls, len(stuck),
                           took)
        else:
            logger.info("shutdown: 0 store keys lost, every queued save was written; took %.2fs",
                        took)
        try:
            self.events.shutdown()  # tracing's last export: SHUTDOWN_S at most
        finally:
            self._store.close([t.join for t in stuck])
