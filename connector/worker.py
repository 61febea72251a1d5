"""Worker side: moves KV blocks between this rank's cache and the Mooncake store.

- Loads: `start_load` queues one job per request (or per part, with load_split_blocks); a
  `RecvPool` of N threads (N = VLLM_MOONCAKE_LOAD_RECV_THREADS) runs them. A job that fails in
  any way, or outlives `load_timeout_s`, reports its block ids as load errors *before* the
  request is reported finished, so vLLM recomputes them; no request is ever left unfinished.
- Saves: `start_save` queues one job per request with new full blocks; a pool of one save
  thread writes them (skipping keys the store already holds), each within `save_timeout_s`.
- What a job moves (`kv_regions.plan_group`, per KV cache group): this rank's store objects of
  each block, whole store shards or, where it holds part of a shard, its byte ranges of it
  (ranged gets). A rank holding no whole shard, or a replica of another rank's, saves nothing.
- Block lifetime (`ledger.RequestLedger`): blocks of a request with jobs in flight are not
  freed (the scheduler delays the free until every rank reports the request in
  finished_sending) and not reused after a preemption (`wait_preempted` waits for the
  request's saves). A save still stuck after PREEMPTION_WAIT_S, or past its deadline, is
  abandoned: the engine goes on, so the blocks may be rewritten under it; the save then
  stores nothing, or removes what it stored (never a mix of two requests' KV under one key).
- Memory under a stuck call: a staged load writes only into its thread's staging buffer and
  copies into the KV cache only while its ticket allows it (`recv_pool.Ticket.writing`); a
  thread stuck past the deadline is replaced together with its buffer, which is released only
  once the call returns. A multi-buffer load writes straight into the KV blocks, so its
  request is held until Mooncake's own transfer timeout ends the call (`transfer_timeout`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from connector.config import ConnectorConfig
from connector.events import LoadEvent, Publisher, SaveEvent, Subscriber
from connector.groups import ONE_FULL, GroupSpec
from connector.keys import KeyBuilder, layout_signature
from connector.kv_regions import GroupIO, ObjectPlan, plan_group
from connector.ledger import RequestLedger
from connector.metadata import BlockTransfer, StepMetadata
from connector.recv_pool import RecvPool, Ticket
from connector.sampling import LookupProbe
from connector.staging import BlockStager, ranged_get
from connector.stats import StatsRecorder, WorkerGauges, stat_key
from connector.store import (
    ABANDONED_CODE,
    EXCEPTION_CODE,
    StoreError,
    StoreHandle,
    error_code_label,
)

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level
PREEMPTION_WAIT_S = 60.0
SHUTDOWN_WAIT_S = 1.0  # for jobs inside a store call at shutdown; then the client closes later
REMOVE_ATTEMPTS = 3  # an abandoned save's cleanup is retried this often before it is counted


def request_hash(req_id: str) -> str:
    """A short stable digest of a request id, for span attributes and logs (never labels)."""
    return hashlib.blake2b(req_id.encode(), digest_size=8).hexdigest()


@dataclass(slots=True)
class _Job:
    transfer: BlockTransfer
    t_enqueue: float
    trace_parent: Any
    ready: Any = None  # torch.cuda.Event for saves when the caches are on CUDA


class MooncakeStoreWorker:
    def __init__(self, config: ConnectorConfig, keys: KeyBuilder, tp_rank: int,
                 num_blocks: int, groups: tuple[GroupSpec, ...] = ONE_FULL,
                 layout_order: tuple[int, ...] | None = None) -> None:
        self.config = config
        self.tp_rank = tp_rank
        self._keys = keys
        self._num_blocks = num_blocks
        self._groups = groups
        self._layout_order = layout_order  # a block's [H, N, C] in memory (vLLM's layout)
        self._io: tuple[GroupIO, ...] = ()  # per group: what this rank loads and saves
        self._layout_labels: tuple[tuple[str, ...], ...] = ()  # per group, for layout_keys
        self._regions: ObjectPlan | None = None  # group 0's load plan (memory, on_cuda)
        self._staged = False  # staging buffers (per thread, made on first use) or multi-buffer
        self._tls = threading.local()
        self._buffers_lock = threading.Lock()
        self.staging_buffers = 0  # live staging buffers (bounded: threads + stuck threads)
        self._kv_caches: dict[str, Any] = {}
        self._closed = False
        self._store = StoreHandle(
            config.store, config.store.global_segment_size, config.store.local_buffer_size,
            config.on_master_unreachable, config.store_timeout_s)
        self.ledger = RequestLedger()
        self._lookup_probe = LookupProbe(config.master_lookup_sample_ratio, config.load_threads)
        self.recorder = StatsRecorder(tp_rank, config.load_threads, self._gauges,
                                      self._master_outage)
        self.pool: RecvPool[_Job] = RecvPool(
            config.load_threads, self._load, active=1 if config.load_threads_auto else None,
            deadline_s=config.load_timeout_s, on_expire=self._load_expired,
            on_retire=self._release_stager,
            on_replace=lambda: self.recorder.count("threads_replaced", tp_rank, "load"))
        self.save_pool: RecvPool[_Job] = RecvPool(
            1, self._save_job, name="mcpool-save", deadline_s=config.save_timeout_s,
            on_expire=self._save_expired, on_retire=self._release_stager,
            on_replace=lambda: self.recorder.count("threads_replaced", tp_rank, "save"))
        self.events = Publisher(self.recorder)
        if config.load_threads_auto:
            from connector.autotune import ThreadTuner

            self.events.add(ThreadTuner(
                config.load_threads, self.pool.set_active,
                on_error=lambda: self.recorder.count("autotune_errors", tp_rank)))
        self._get_context = None

    def add_subscriber(self, sub: Subscriber) -> None:
        self.events.add(sub)
        self._get_context = getattr(sub, "get_context", self._get_context)

    # ---- registration ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], attn_backend: str = "") -> None:
        lay = self._keys.layout
        self._io = tuple(
            plan_group({n: kv_caches[n] for n in g.layers} if g.layers else kv_caches,
                       self._num_blocks, lay.num_kv_heads, lay.shards, lay.tp_size,
                       self.tp_rank, self._layout_order)
            for g in self._groups)
        self._keys = self._keys.with_signature(layout_signature(
            attn_backend, self._groups, [io.description for io in self._io]))
        self._layout_labels = tuple(
            ("latent" if g.latent else "kv_heads_slice" if io.load.src_offsets else "kv_heads",
             g.kind, str(lay.shards), str(lay.tp_size))
            for g, io in zip(self._groups, self._io, strict=True))
        self._regions = self._io[0].load
        self._kv_caches = kv_caches  # registered memory must outlive the store client
        self._staged = self._use_staging()
        per_call = max(1, self.config.staging_buffer_size // self._regions.block_bytes)
        logger.info("mooncake pool: %d KV regions, %d bytes per object (%s of %d per block%s)"
                    ", rank %d, %d recv threads, %s", len(self._regions.sizes),
                    self._regions.block_bytes, "slice" if self._regions.src_offsets else
                    f"{self._regions.pieces} shard(s)", lay.shards,
                    "" if self._io[0].save else "; this rank saves nothing", self.tp_rank,
                    self.pool.size, f"staged transfers ({per_call} objects per call)"
                    if self._staged else "multi-buffer transfers")
        self._store.on_connect(self._register_buffers)

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

    def _register_buffers(self, client: Any) -> None:
        for ptr, size in dict(st for io in self._io for st in io.load.storages).items():
            rc = client.register_buffer(ptr, size)
            if rc != 0:
                logger.error("register_buffer(%#x, %d) failed with %d; loads and saves on "
                             "this rank will fail and be recomputed", ptr, size, rc)

    def _stager(self, client: Any, plan: ObjectPlan) -> BlockStager | None:
        """This thread's staging buffer for `plan`, made and registered on first use. Per
        thread, not per slot: a thread stuck in a call keeps its buffer until the call
        returns, and its replacement gets a fresh one. (One per plan: a hybrid model's groups,
        or a load and a save plan that differ, each have their own.)"""
        if not self._staged:
            return None
        stagers = getattr(self._tls, "stagers", None)
        if stagers is None:
            stagers = self._tls.stagers = {}
        stager = stagers.get(id(plan))
        if stager is None:
            stager = BlockStager(plan, self._num_blocks, self.config.staging_buffer_size)
            rc = client.register_buffer(stager.buffer.data_ptr(), stager.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer of a staging buffer failed with {rc}")
            stagers[id(plan)], self._tls.client = stager, client
            with self._buffers_lock:
                self.staging_buffers += 1
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

    def start_load(self, meta: StepMetadata) -> None:
        now = time.perf_counter()
        ctx = self._context()
        parts = [p for t in meta.loads for p in t.split(self.config.load_split_blocks)]
        self.ledger.add_loads(p.req_id for p in parts)
        for p in parts:
            self.pool.submit(_Job(p, now, ctx))

    def start_save(self, meta: StepMetadata) -> None:
        if not meta.saves:
            return
        ready = None
        if self._regions is not None and self._regions.on_cuda:
            import torch  # only on CUDA caches: the CPU forward is synchronous

            ready = torch.cuda.Event()
            ready.record()
        now = time.perf_counter()
        ctx = self._context()
        self.ledger.add_saves(t.req_id for t in meta.saves)
        for t in meta.saves:
            self.save_pool.submit(_Job(t, now, ctx, ready))

    def note_free_after(self, meta: StepMetadata) -> None:
        if meta.free_after_jobs:
            self.ledger.free_after(meta.free_after_jobs)

    def wait_preempted(self, meta: StepMetadata) -> None:
        """Block until no job of a preempted request can still touch its (now reusable) blocks."""
        if not meta.preempted:
            return
        stuck = self.ledger.wait_idle(meta.preempted, PREEMPTION_WAIT_S)
        if stuck:
            logger.error("saves of %d preempted request(s) still running after %.0fs; their "
                         "blocks are reused now, so those saves are abandoned (what they store "
                         "is removed)", len(stuck), PREEMPTION_WAIT_S)

    @property
    def kv_signature(self) -> str:
        """The registered layout's signature, for the scheduler's keys (handshake)."""
        return self._keys.layout.kv_signature

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        return self.ledger.take_finished()

    def get_load_errors(self) -> set[int]:
        return self.ledger.take_load_errors()

    def _gauges(self) -> WorkerGauges:
        """Sampled at every stats poll; queue depth and in-flight are peaks since the last one."""
        depth, busy = self.pool.take_peaks()
        return WorkerGauges(
            load_queue_depth=depth, save_queue_depth=self.save_pool.depth(),
            recv_threads=self.pool.size, recv_threads_active=self.pool.active,
            load_inflight=tuple(busy),
            threads_stuck={"load": self.pool.stuck, "save": self.save_pool.stuck},
            staging_buffers=self.staging_buffers,
            layout=(self._keys.fingerprint, self._keys.layout.hash_algo,
                    "staged" if self._staged else "multibuffer") if self._regions else None)

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
        t_start = time.perf_counter()
        t_prepared = t_lookup_end = t_start
        sampled = False
        code, failed, nbytes = "", list(t.block_ids), 0
        try:
            client = self._connected()
            plan = self._io[t.group].load
            keys = self._keys.object_keys(t.block_hashes, plan.shards, t.group)
            units = plan.units(t.block_ids)
            stager = self._stager(client, plan)
            addrs = None if stager else plan.addresses(units)
            t_prepared = t_lookup_end = time.perf_counter()
            if self._lookup_probe.due(thread):
                client.batch_get_replica_desc(keys)
                t_lookup_end = time.perf_counter()
                sampled = True
            if stager:
                results = stager.get(client, keys, units, ticket.writing)
            else:  # zero-copy: the call itself writes into the KV blocks
                with ticket.writing() as ok:
                    results = ([] if not ok else
                               client.batch_get_into_multi_buffers(keys, *addrs)
                               if plan.src_offsets is None else
                               ranged_get(client, keys, *addrs, plan.src_offsets))
            want = plan.block_bytes
            if not ticket.expired and len(results) != len(keys):
                raise RuntimeError(f"store returned {len(results)} results for {len(keys)} keys")
            per = plan.pieces
            failed = sorted({t.block_ids[i // per] for i, r in enumerate(results) if r != want})
            nbytes = sum(r for r in results if r > 0)
            bad = next((r for r in results if r != want), None)
            if bad is not None:
                code = error_code_label(bad) if bad < 0 else "-600"
                self._store.check(results)
        except StoreError as e:
            code = e.code
        except Exception as e:  # preparation or transfer: report every block, recompute
            code = EXCEPTION_CODE
            logger.warning("load of %d blocks for %s failed: %r", len(t.block_ids),
                           request_hash(t.req_id), e)
        if not ticket.finish():
            return  # expired: the watchdog reported it, and nothing was copied since
        if nbytes:
            self.recorder.count("layout_keys", self.tp_rank, "load", *self._layout_labels[t.group],
                                n=sum(1 for r in results if r == want))
        self.ledger.finish_load(t.req_id, failed if code else ())
        self.events.load(LoadEvent(
            thread=thread, tp_rank=self.tp_rank, request_hash=request_hash(t.req_id),
            keys=len(t.block_ids), nbytes=nbytes, failed_blocks=len(failed) if code else 0,
            code=code, t_enqueue=job.t_enqueue, t_start=t_start, t_prepared=t_prepared,
            t_lookup_end=t_lookup_end, t_end=time.perf_counter(), lookup_sampled=sampled,
            trace_parent=job.trace_parent))

    def _load_expired(self, job: _Job, reason: str) -> None:
        """Watchdog (timeout) or shutdown: every block of the job is a load error."""
        t = job.transfer
        self.ledger.finish_load(t.req_id, t.block_ids)
        now = time.perf_counter()
        self.events.load(LoadEvent(
            thread=0, tp_rank=self.tp_rank, request_hash=request_hash(t.req_id),
            keys=len(t.block_ids), nbytes=0, failed_blocks=len(t.block_ids), code=reason,
            t_enqueue=job.t_enqueue, t_start=now, t_prepared=now, t_lookup_end=now, t_end=now,
            lookup_sampled=False, trace_parent=job.trace_parent))

    # ---- save job (runs on the save thread) ------------------------------------------------
    def _abandoned(self, req_id: str, ticket: Ticket[_Job]) -> bool:
        return ticket.expired or self.ledger.is_abandoned(req_id)

    def _save_job(self, job: _Job, _slot: int, ticket: Ticket[_Job]) -> None:
        t = job.transfer
        t_start = time.perf_counter()
        t_ready = t_exists = t_start
        code, op, stored, skipped, nbytes = "", "save", 0, 0, 0
        try:
            if job.ready is not None:
                job.ready.synchronize()
            t_ready = t_exists = time.perf_counter()
            client = self._connected()
            plan = self._io[t.group].save
            keys = self._keys.object_keys(t.block_hashes, plan.shards, t.group) if plan else []
            units = plan.units(t.block_ids) if plan else []
            exists = client.batch_is_exist(keys) if keys else []
            t_exists = time.perf_counter()
            if any(e < 0 for e in exists):
                code, op = error_code_label(min(exists)), "save_exists"
                self._store.check(exists)
            new = [i for i, e in enumerate(exists) if e != 1]
            skipped = len(keys) - len(new)
            if new and self._abandoned(t.req_id, ticket):
                code, op = ABANDONED_CODE, "save"
            elif new:
                new_keys, new_ids = [keys[i] for i in new], [units[i] for i in new]
                stager = self._stager(client, plan)
                results = (
                    stager.put(client, new_keys, new_ids, self._store.replicate)
                    if stager else
                    client.batch_put_from_multi_buffers(
                        new_keys, *plan.addresses(new_ids), self._store.replicate))
                # -705: another writer stored the same block meanwhile; that is a skip.
                skipped += sum(1 for r in results if r == -705)
                stored = sum(1 for r in results if r == 0)
                errs = [r for r in results if r < 0 and r != -705]
                if errs:
                    code, op = error_code_label(errs[0]), "save"
                    self._store.check(errs)
                if stored and self._abandoned(t.req_id, ticket):
                    # The blocks may have been rewritten while the put read them.
                    self._remove(client, [k for k, r in zip(new_keys, results, strict=True)
                                          if r == 0])
                    stored, code, op = 0, ABANDONED_CODE, "save"
                nbytes = stored * plan.block_bytes
                if stored:
                    self.recorder.count("layout_keys", self.tp_rank, "save",
                                        *self._layout_labels[t.group], n=stored)
        except StoreError as e:
            code, op = e.code, "save"
        except Exception as e:
            code, op = EXCEPTION_CODE, "save"
            logger.warning("save for %s failed: %r", request_hash(t.req_id), e)
        if not ticket.finish():
            return  # expired: the watchdog already reported it and released its blocks
        self.ledger.finish_save(t.req_id)
        self.events.save(SaveEvent(
            tp_rank=self.tp_rank, request_hash=request_hash(t.req_id), keys=stored, skipped=skipped,
            nbytes=nbytes, code=code, failed_op=op, t_enqueue=job.t_enqueue, t_start=t_start,
            t_ready=t_ready, t_exists_end=t_exists, t_end=time.perf_counter(),
            trace_parent=job.trace_parent))

    def _remove(self, client: Any, keys: list[str]) -> None:
        """Remove an abandoned save's keys, retrying; what still cannot be removed is logged
        and counted (failures{op="save_remove"}): it holds KV that may be mixed."""
        left, rc = keys, 0
        for attempt in range(REMOVE_ATTEMPTS):
            results = client.batch_remove(left, force=True)
            left = [k for k, r in zip(left, results, strict=True) if r not in (0, -704)]
            if not left:
                return
            rc = next(r for r in results if r not in (0, -704))
            time.sleep(0.05 * (attempt + 1))
        logger.error("%d key(s) of an abandoned save could not be removed (last code %d); "
                     "they may hold KV rewritten mid-put: %s", len(left), rc, left[:4])
        self.recorder.count("failures", self.tp_rank, "save_remove", error_code_label(rc),
                            n=len(left))

    def _save_expired(self, job: _Job, reason: str) -> None:
        """A save past its deadline (or queued at shutdown): its request's blocks are released
        now, so a put still running for it is abandoned and removes what it stored."""
        t = job.transfer
        self.ledger.finish_save(t.req_id)
        now = time.perf_counter()
        self.events.save(SaveEvent(
            tp_rank=self.tp_rank, request_hash=request_hash(t.req_id), keys=0, skipped=0, nbytes=0,
            code=reason, failed_op="save", t_enqueue=job.t_enqueue, t_start=now, t_ready=now,
            t_exists_end=now, t_end=now, trace_parent=job.trace_parent))

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Fail queued jobs fast, stop the threads, and close the store client only once no
        thread can still be inside a call on it."""
        if self._closed:
            return
        self._closed = True
        stuck = self.pool.close(SHUTDOWN_WAIT_S) + self.save_pool.close(SHUTDOWN_WAIT_S)
        for sub in self.events.subscribers:
            if hasattr(sub, "shutdown"):
                sub.shutdown()
        self._store.close([t.join for t in stuck])
