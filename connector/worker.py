"""Worker side: moves KV blocks between this rank's cache and the Mooncake store.

- Loads: `start_load_kv` queues one job per request; a `RecvPool` of N threads (N =
  VLLM_MOONCAKE_LOAD_RECV_THREADS) runs them. A job that fails in any way reports its block
  ids as load errors *before* the request is reported finished, so vLLM recomputes them; no
  request is ever left unfinished.
- Saves: `wait_for_save` queues one job per request with new full blocks; one save thread
  writes them (skipping keys the store already holds).
- Block lifetime: blocks of a request with jobs in flight are not freed (the scheduler delays
  the free until every rank reports the request in finished_sending) and not reused after a
  preemption (`handle_preemptions` waits for the request's saves). A save still stuck after
  PREEMPTION_WAIT_S is abandoned: the engine goes on, so the blocks may be rewritten under
  it; the save then stores nothing, or removes what it stored (never a mix of two requests'
  KV under one key).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from connector.config import ConnectorConfig
from connector.events import LoadEvent, SaveEvent, Subscriber
from connector.keys import KeyBuilder
from connector.kv_regions import BlockRegions, compute_regions
from connector.metadata import BlockTransfer, StepMetadata
from connector.recv_pool import RecvPool
from connector.staging import BlockStager
from connector.stats import StatsRecorder
from connector.store import (
    ABANDONED_CODE,
    EXCEPTION_CODE,
    MASTER_DOWN_CODES,
    StoreHandle,
    error_code_label,
)

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level
PREEMPTION_WAIT_S = 60.0


def request_hash(req_id: str) -> str:
    """A short stable digest of a request id, for span attributes and logs (never labels)."""
    return hashlib.blake2b(req_id.encode(), digest_size=8).hexdigest()


class StoreDown(Exception):
    """No call was made: the store is not connected or its master is known to be down."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


@dataclass(slots=True)
class _Job:
    transfer: BlockTransfer
    t_enqueue: float
    trace_parent: Any
    ready: Any = None  # torch.cuda.Event for saves when the caches are on CUDA


class MooncakeStoreWorker:
    def __init__(self, config: ConnectorConfig, keys: KeyBuilder, tp_rank: int,
                 num_blocks: int) -> None:
        self.config = config
        self.tp_rank = tp_rank
        self._keys = keys
        self._num_blocks = num_blocks
        self._regions: BlockRegions | None = None
        # Staging buffers (None: multi-buffer transfers): one per receive thread, one for saves.
        self._load_stagers: list[BlockStager] | None = None
        self._save_stager: BlockStager | None = None
        self._kv_caches: dict[str, Any] = {}
        self._closed = False
        self._store = StoreHandle(
            config.store, config.store.global_segment_size, config.store.local_buffer_size,
            config.on_master_unreachable, config.store_timeout_s)
        # Bookkeeping shared by the model-runner thread and the job threads. The lock guards
        # only these containers and is never held across a store call.
        self._lock = threading.Condition()
        self._pending: Counter[str] = Counter()  # jobs in flight per request
        self._done_loads: set[str] = set()
        self._load_errors: set[int] = set()
        self._awaiting_free: set[str] = set()
        self._abandoned: set[str] = set()  # preempted requests whose saves outlived the wait
        self._lookup_every = (round(1 / config.master_lookup_sample_ratio)
                              if config.master_lookup_sample_ratio > 0 else 0)
        self._job_count = [0] * config.load_threads
        self.pool: RecvPool[_Job] = RecvPool(config.load_threads, self._load)
        self._save_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._save_thread = threading.Thread(target=self._save_loop, name="mcpool-save",
                                             daemon=True)
        self._save_thread.start()
        self.recorder = StatsRecorder(tp_rank, config.load_threads, self._gauges,
                                      self._master_outage)
        self.subscribers: list[Subscriber] = [self.recorder]
        if config.load_threads_auto:
            from connector.autotune import ThreadTuner

            self.subscribers.append(ThreadTuner(config.load_threads, self.pool.set_active))
        self._get_context = None
        self._info_key = f"layout_info|{tp_rank}|{keys.fingerprint}|{keys.layout.hash_algo}|"

    def add_subscriber(self, sub: Subscriber) -> None:
        self.subscribers.append(sub)
        self._get_context = getattr(sub, "get_context", self._get_context)

    # ---- registration ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._regions = compute_regions(kv_caches, self._num_blocks)
        self._kv_caches = kv_caches  # registered memory must outlive the store client
        if self._use_staging():
            size = self.config.staging_buffer_size
            self._load_stagers = [BlockStager(self._regions, self._num_blocks, size)
                                  for _ in range(self.pool.size)]
            if self.config.enable_save:
                self._save_stager = BlockStager(self._regions, self._num_blocks, size)
        self._info_key += "staged" if self._load_stagers else "multibuffer"
        logger.info("mooncake pool: %d KV regions, %d bytes per block, rank %d, %d recv "
                    "threads, %s", len(self._regions.sizes), self._regions.block_bytes,
                    self.tp_rank, self.pool.size,
                    f"staged transfers ({self._load_stagers[0].capacity} blocks per call)"
                    if self._load_stagers else "multi-buffer transfers")
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
                                and len(self._regions.sizes) > 1)

    def _stagers(self) -> list[BlockStager]:
        return [*(self._load_stagers or ()), *([self._save_stager] if self._save_stager else [])]

    def _register_buffers(self, client: Any) -> None:
        buffers = [(s.buffer.data_ptr(), s.nbytes) for s in self._stagers()]
        for ptr, size in [*self._regions.storages, *buffers]:
            rc = client.register_buffer(ptr, size)
            if rc != 0:
                logger.error("register_buffer(%#x, %d) failed with %d; loads and saves on "
                             "this rank will fail and be recomputed", ptr, size, rc)

    # ---- per step --------------------------------------------------------------------------
    def _context(self) -> Any:
        return self._get_context() if self._get_context is not None else None

    def start_load(self, meta: StepMetadata) -> None:
        now = time.perf_counter()
        ctx = self._context()
        parts = [p for t in meta.loads for p in t.split(self.config.load_split_blocks)]
        with self._lock:
            for p in parts:
                self._pending[p.req_id] += 1
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
        with self._lock:
            for t in meta.saves:
                self._pending[t.req_id] += 1
        for t in meta.saves:
            self._save_queue.put(_Job(t, now, ctx, ready))

    def note_free_after(self, meta: StepMetadata) -> None:
        if meta.free_after_jobs:
            with self._lock:
                self._awaiting_free.update(meta.free_after_jobs)

    def wait_preempted(self, meta: StepMetadata) -> None:
        """Block until no job of a preempted request can still touch its (now reusable) blocks."""
        if not meta.preempted:
            return
        deadline = time.monotonic() + PREEMPTION_WAIT_S
        with self._lock:
            while any(self._pending[r] for r in meta.preempted):
                left = deadline - time.monotonic()
                if left <= 0:
                    stuck = {r for r in meta.preempted if self._pending[r]}
                    self._abandoned |= stuck
                    logger.error("saves of %d preempted request(s) still running after %.0fs; "
                                 "their blocks are reused now, so those saves are abandoned "
                                 "(what they store is removed)", len(stuck), PREEMPTION_WAIT_S)
                    return
                self._lock.wait(left)

    def _is_abandoned(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._abandoned

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            recving, self._done_loads = self._done_loads, set()
            sending = {r for r in self._awaiting_free if not self._pending[r]}
            self._awaiting_free -= sending
        return sending or None, recving or None

    def get_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _finish(self, req_id: str, failed_blocks: list[int] | tuple[int, ...], load: bool) -> None:
        with self._lock:
            # Errors first: vLLM must see the bad blocks no later than the completion.
            self._load_errors.update(failed_blocks)
            self._pending[req_id] -= 1
            if self._pending[req_id] <= 0:
                del self._pending[req_id]  # bounded: only requests with jobs in flight
                self._abandoned.discard(req_id)
                if load:  # the last part of the request's load
                    self._done_loads.add(req_id)
            self._lock.notify_all()

    def _gauges(self) -> dict[str, int]:
        """Sampled at every stats poll; queue depth and in-flight are peaks since the last one."""
        depth, busy = self.pool.take_peaks()
        g = {f"load_queue_depth|{self.tp_rank}": depth,
             f"save_queue_depth|{self.tp_rank}": self._save_queue.qsize(),
             f"recv_threads|{self.tp_rank}": self.pool.size,
             f"recv_threads_active|{self.tp_rank}": self.pool.active,
             self._info_key: 1}
        for i, v in enumerate(busy):
            g[f"load_inflight|{self.tp_rank}|{i}"] = v
        return g

    def _master_outage(self) -> dict[str, float]:
        failovers, seconds = self._store.take_outage()
        out = {f"master_failovers|{self.tp_rank}": failovers,
               f"master_down_seconds|{self.tp_rank}": seconds}
        return {k: v for k, v in out.items() if v}

    def _publish(self, method: str, ev: Any) -> None:
        for sub in self.subscribers:
            try:
                getattr(sub, method)(ev)
            except Exception:  # observability must never break the data path
                logger.exception("subscriber %r failed", sub)

    def _connected(self) -> Any:
        """The store client, or StoreDown when there is none or the breaker is open."""
        client = self._store.ready()
        if client is None or self._regions is None:
            raise StoreDown(self._store.down_code or "unavailable")
        return client

    def _check_master(self, results: list[int]) -> None:
        down = next((r for r in results if r in MASTER_DOWN_CODES), None)
        if down is not None:
            self._store.trip(down)

    # ---- load job (runs on a receive thread) -----------------------------------------------
    def _load(self, job: _Job, thread: int) -> None:
        t = job.transfer
        t_start = time.perf_counter()
        t_prepared = t_lookup_end = t_start
        sampled = False
        code, failed, nbytes = "", list(t.block_ids), 0
        try:
            client = self._connected()
            keys = self._keys.keys(t.block_hashes, self.tp_rank)
            stager = self._load_stagers[thread] if self._load_stagers else None
            addrs = None if stager else self._regions.addresses(t.block_ids)
            t_prepared = t_lookup_end = time.perf_counter()
            self._job_count[thread] += 1
            if self._lookup_every and self._job_count[thread] % self._lookup_every == 0:
                client.batch_get_replica_desc(keys)
                t_lookup_end = time.perf_counter()
                sampled = True
            results = (stager.get(client, keys, t.block_ids) if stager
                       else client.batch_get_into_multi_buffers(keys, *addrs))
            want = self._regions.block_bytes
            if len(results) != len(keys):
                raise RuntimeError(f"store returned {len(results)} results for {len(keys)} keys")
            failed = [b for b, r in zip(t.block_ids, results, strict=True) if r != want]
            nbytes = sum(r for r in results if r > 0)
            bad = next((r for r in results if r != want), None)
            if bad is not None:
                code = error_code_label(bad) if bad < 0 else "-600"
                self._check_master(results)
        except StoreDown as e:
            code = e.code
        except Exception as e:  # preparation or transfer: report every block, recompute
            code = EXCEPTION_CODE
            logger.warning("load of %d blocks for %s failed: %r", len(t.block_ids),
                           request_hash(t.req_id), e)
        finally:
            self._finish(t.req_id, failed if code else (), load=True)
        self._publish("on_load", LoadEvent(
            thread=thread, tp_rank=self.tp_rank, trace_id=request_hash(t.req_id),
            keys=len(t.block_ids), nbytes=nbytes, failed_blocks=len(failed) if code else 0,
            code=code, t_enqueue=job.t_enqueue, t_start=t_start, t_prepared=t_prepared,
            t_lookup_end=t_lookup_end, t_end=time.perf_counter(), lookup_sampled=sampled,
            trace_parent=job.trace_parent))

    # ---- save thread -----------------------------------------------------------------------
    def _save_loop(self) -> None:
        while True:
            job = self._save_queue.get()
            if job is None:
                return
            try:
                self._save(job)
            except Exception:
                logger.exception("save job failed unexpectedly")

    def _save(self, job: _Job) -> None:
        t = job.transfer
        t_start = time.perf_counter()
        t_ready = t_exists = t_start
        code, op, stored, skipped, nbytes = "", "save", 0, 0, 0
        try:
            if job.ready is not None:
                job.ready.synchronize()
            t_ready = t_exists = time.perf_counter()
            client = self._connected()
            keys = self._keys.keys(t.block_hashes, self.tp_rank)
            exists = client.batch_is_exist(keys)
            t_exists = time.perf_counter()
            if any(e < 0 for e in exists):
                code, op = error_code_label(min(exists)), "save_exists"
                self._check_master(exists)
            new = [i for i, e in enumerate(exists) if e != 1]
            skipped = len(keys) - len(new)
            if new and self._is_abandoned(t.req_id):
                code, op = ABANDONED_CODE, "save"
            elif new:
                new_keys, new_ids = [keys[i] for i in new], [t.block_ids[i] for i in new]
                results = (
                    self._save_stager.put(client, new_keys, new_ids)
                    if self._save_stager else
                    client.batch_put_from_multi_buffers(new_keys,
                                                        *self._regions.addresses(new_ids)))
                # -705: another writer stored the same block meanwhile; that is a skip.
                skipped += sum(1 for r in results if r == -705)
                stored = sum(1 for r in results if r == 0)
                errs = [r for r in results if r < 0 and r != -705]
                if errs:
                    code, op = error_code_label(errs[0]), "save"
                    self._check_master(errs)
                if stored and self._is_abandoned(t.req_id):
                    # The blocks may have been rewritten while the put read them.
                    client.batch_remove([k for k, r in zip(new_keys, results, strict=True)
                                         if r == 0], force=True)
                    stored, code, op = 0, ABANDONED_CODE, "save"
                nbytes = stored * self._regions.block_bytes
        except StoreDown as e:
            code, op = e.code, "save"
        except Exception as e:
            code, op = EXCEPTION_CODE, "save"
            logger.warning("save for %s failed: %r", request_hash(t.req_id), e)
        finally:
            self._finish(t.req_id, (), load=False)
        self._publish("on_save", SaveEvent(
            tp_rank=self.tp_rank, trace_id=request_hash(t.req_id), keys=stored, skipped=skipped,
            nbytes=nbytes, code=code, failed_op=op, t_enqueue=job.t_enqueue, t_start=t_start,
            t_ready=t_ready, t_exists_end=t_exists, t_end=time.perf_counter(),
            trace_parent=job.trace_parent))

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.pool.close()
        self._save_queue.put(None)
        self._save_thread.join(5.0)
        for sub in self.subscribers:
            if hasattr(sub, "shutdown"):
                sub.shutdown()
        self._store.close()

