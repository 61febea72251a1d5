"""The load paths under test, behind one small interface.

- `OursDriver`: the connector's own `MooncakeStoreWorker` (start_load -> RecvPool -> staged
  `batch_get_into` + scatter, or `batch_get_into_multi_buffers` with staging off), with its
  real subscribers (StatsRecorder, SpanExporter), and optionally its own long-request
  splitting (`load_split_blocks`).
- `InTreeDriver`: vLLM's in-tree receive pool from the installed wheel: N
  `KVCacheStoreRecvingThread`s sharing one `queue.Queue`, built the way the in-tree
  `MooncakeStoreWorker.register_kv_caches` builds them (same key layout, coordinator, token
  database and buffer registration), fed `ReqMeta`s like its `start_load_kv`. The receive
  path never touches `torch.cuda.Event` (only the save thread does), so it runs on CPU as is.

The single-thread reference gets are in `bench.ceiling`.

Each driver is built against one master address (direct or through the delay proxy) and
loads into caches it is given, so several drivers can share one set of KV tensors.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from bench.testbed import Source, Testbed, intree_key_prefix, open_client, our_keys
from bench.workloads import Geometry, Request
from connector.config import load_config
from connector.metadata import BlockTransfer, StepMetadata
from connector.observability.stats import parse_key
from connector.worker.worker import MooncakeStoreWorker


class Driver(Protocol):
    name: str  # "ours" | "in-tree"
    label: str  # how results name this driver
    threads: int
    split_blocks: int  # > 0: the driver splits long requests into parts of this size itself

    def submit(self, requests: Sequence[Request]) -> None: ...

    def poll(self) -> tuple[set[str], set[int]]:
        """Requests finished since the last poll, and KV blocks that failed to load."""
        ...

    def collect(self) -> None:
        """Fold the driver's own statistics into its running totals (called periodically)."""
        ...

    def take_phases(self) -> PhaseTotals | None: ...

    def close(self) -> None: ...


class PhaseTotals:
    """Where load jobs spent their time, summed from the worker's own stats snapshots."""

    FAMILIES = ("load_queue_wait_seconds", "load_prepare_seconds",
                "load_master_lookup_seconds", "load_transfer_seconds", "load_job_seconds")

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.jobs_per_thread: dict[str, int] = defaultdict(int)

    def add(self, data: dict[str, Any]) -> None:
        for key, samples in data.get("h", {}).items():
            fam, _ = parse_key(key)
            if fam.key in self.FAMILIES:
                self.sums[fam.key] += sum(samples)
                self.counts[fam.key] += len(samples)
        for key, v in data.get("c", {}).items():
            fam, labels = parse_key(key)
            if fam.key == "load_jobs":
                self.jobs_per_thread[labels["thread"]] += int(v)

    def shares(self) -> dict[str, float | None]:
        """Fraction of summed request-job time (enqueue to end) in each phase.

        The master lookup is timed only on sampled jobs (a separate replica-list RPC), so its
        total is the sampled mean times the job count; the worker already subtracts that
        estimate from the batch get to report the transfer phase. With no sampled job in the
        cell the lookup share is None and the transfer share includes the lookup.
        """
        total = self.sums["load_job_seconds"]
        jobs = self.counts["load_job_seconds"]
        if total <= 0 or jobs == 0:
            return {}
        n_lookup = self.counts["load_master_lookup_seconds"]
        lookup = self.sums["load_master_lookup_seconds"] / n_lookup * jobs if n_lookup else None
        return {
            "queue_wait": self.sums["load_queue_wait_seconds"] / total,
            "prepare": self.sums["load_prepare_seconds"] / total,
            "master_lookup": lookup / total if lookup is not None else None,
            "transfer": self.sums["load_transfer_seconds"] / total,
        }

    def service_shares(self) -> dict[str, float | None]:
        """The same phases as fractions of the threads' busy time (queue wait excluded):
        what a receive thread spends its time on."""
        s = self.shares()
        if not s or s["queue_wait"] >= 1:
            return {}
        busy = 1 - s["queue_wait"]
        return {k: (v / busy if v is not None else None) for k, v in s.items()
                if k != "queue_wait"}


class OursDriver:
    """The connector's worker, driven the way the connector drives it each engine step."""

    name = "ours"

    def __init__(self, tb: Testbed, master: str, geometry: Geometry,
                 caches: dict[str, torch.Tensor], source: Source, threads: int,
                 lookup_ratio: float, subscribers: Sequence[Any] | None = None,
                 label: str = "", split_blocks: int = 0, staging: str = "auto",
                 auto: bool = False) -> None:
        """`auto`: load_threads auto with at most `threads` threads."""
        extra = {**tb.store_fields(master), "global_segment_size": 0,
                 "local_buffer_size": "16MB", "load_threads": "auto" if auto else threads,
                 "master_lookup_sample_ratio": lookup_ratio, "enable_save": False,
                 "load_split_blocks": split_blocks, "staging": staging}
        if auto:
            extra["load_threads_max"] = threads
        cfg = load_config(extra, environ={})
        self.threads = threads
        self.split_blocks = split_blocks
        self.label = label or self.name
        self._hashes = source.hashes
        self.worker = MooncakeStoreWorker(cfg, our_keys(geometry, source.prefix), 0,
                                          geometry.num_blocks)
        self.worker.register_kv_caches(caches)
        if subscribers is not None:  # replace the default [StatsRecorder]
            self.worker.events.subscribers = []
            for sub in subscribers:
                self.worker.add_subscriber(sub)
        self._phases = PhaseTotals()

    def submit(self, requests: Sequence[Request]) -> None:
        h = self._hashes
        self.worker.start_load(StepMetadata(loads=tuple(
            BlockTransfer(r.req_id, r.dst, tuple(h[i] for i in r.src)) for r in requests)))

    def poll(self) -> tuple[set[str], set[int]]:
        _, done = self.worker.get_finished()  # completions, then failed blocks, as vLLM polls
        errors = self.worker.get_load_errors()
        return done or set(), errors

    def collect(self) -> None:
        if self.worker.recorder in self.worker.events.subscribers:
            snap = self.worker.recorder.snapshot()
            if snap is not None:
                self._phases.add(snap.data)

    def take_phases(self) -> PhaseTotals | None:
        self.collect()
        phases, self._phases = self._phases, PhaseTotals()
        return phases if phases.counts else None

    def close(self) -> None:
        self.worker.shutdown()


class _Stop:
    """Queue sentinel that ends an in-tree receive thread: its run() loop catches Exception
    only, so the SystemExit raised when the thread reads the request ends it quietly."""

    @property
    def load_spec(self) -> Any:
        raise SystemExit


class InTreeDriver:
    """vLLM's in-tree receive-thread pool, built from the installed wheel's own classes."""

    name = "in-tree"

    def __init__(self, tb: Testbed, master: str, geometry: Geometry,
                 caches: dict[str, torch.Tensor], source: Source, threads: int,
                 label: str = "") -> None:
        from mooncake.store import MooncakeDistributedStore
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
            coordinator,
            data,
            worker,
        )
        from vllm.distributed.mooncake_store import MooncakeStoreConfig, setup_mooncake_store
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheGroupSpec,
            group_kernel_blocks,
        )

        self._data = data
        self.threads = threads
        self.split_blocks = 0  # no such option in-tree: split requests are built by the bench
        self.label = label or self.name
        self._hashes = source.hashes
        self._bt = geometry.block_tokens
        self.store = MooncakeDistributedStore()
        setup_mooncake_store(self.store, MooncakeStoreConfig(
            metadata_server=tb.metadata_server, master_server_address=master,
            protocol=tb.protocol, device_name=tb.device_name, mode="standalone-store",
            global_segment_size=0, local_buffer_size=16 << 20), tb.local_hostname)
        # As MooncakeStoreWorker.register_kv_caches: blocks on dim 0, one registration per
        # storage, rank-local layout.
        meta = data.KeyMetadata(model_name=intree_key_prefix().split("@", 1)[0], tp_rank=0,
                                pcp_rank=0, dcp_rank=0, pp_rank=0)
        db = data.ChunkedTokenDatabase(meta, geometry.block_tokens)
        tensors = [group_kernel_blocks(c, geometry.num_blocks) for c in caches.values()]
        for t in tensors:
            st = t.untyped_storage()
            if self.store.register_buffer(st.data_ptr(), st.nbytes()) != 0:
                raise RuntimeError("in-tree driver: register_buffer failed")
        db.store_layout.register_kv_caches(tensors, geometry.num_blocks)
        spec = FullAttentionSpec(block_size=geometry.block_tokens,
                                 num_kv_heads=geometry.kv_heads,
                                 head_size=geometry.head_size, dtype=geometry.dtype)
        coord = coordinator.MooncakeStoreCoordinator(
            [KVCacheGroupSpec(list(caches), spec)], geometry.block_tokens,
            geometry.block_tokens)
        self.load_get_s: list[float] = []
        self._stats_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._threads = []
        for i in range(threads):
            ready = threading.Event()
            t = worker.KVCacheStoreRecvingThread(
                self.store, coord, [db], geometry.block_tokens, 0, ready,
                record_operation=self._record, request_queue=self._queue)
            t.name = f"KVCacheStoreRecvingThread-{i}"
            t.start()
            ready.wait()
            self._threads.append(t)

    def _record(self, operation: str, duration_seconds: float, **_: Any) -> None:
        # Same cost shape as the in-tree stats callback: a lock and an append per batch.
        with self._stats_lock:
            self.load_get_s.append(duration_seconds)

    def submit(self, requests: Sequence[Request]) -> None:
        d, h, bt = self._data, self._hashes, self._bt
        for r in requests:
            n = len(r.src) * bt
            self._queue.put(d.ReqMeta(
                req_id=r.req_id, token_len_chunk=n, block_ids=(list(r.dst),),
                block_hashes=[h[i] for i in r.src],
                load_spec=d.LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=n,
                                     can_load=True, token_len=n)))

    def poll(self) -> tuple[set[str], set[int]]:
        errors: set[int] = set()
        done: set[str] = set()
        for t in self._threads:  # errors first, as the in-tree get_finished does
            errors |= t.get_and_clear_block_ids_with_load_errors()
        for t in self._threads:
            done |= t.get_and_clear_finished_requests()
        return done, errors

    def collect(self) -> None:
        pass

    def take_phases(self) -> PhaseTotals | None:
        return None  # the in-tree pool only times its batch gets

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(_Stop())
        for t in self._threads:
            t.join(5)
        self.store.close()


def check_loaded(caches: dict[str, torch.Tensor], source: Source, requests: Sequence[Request]
                 ) -> int:
    """Compare the given requests' destination blocks with their source blocks; return the
    number of blocks checked (raises on a mismatch)."""
    from bench.workloads import gather_block

    layers = list(caches.values())
    n = 0
    for r in requests:
        for s, d in zip(r.src, r.dst, strict=True):
            if not torch.equal(gather_block(layers, d), source.data[s]):
                raise RuntimeError(f"{r.req_id}: KV block {d} does not match source block {s}")
            n += 1
    return n


def one_key_get_ms(tb: Testbed, master: str, source: Source, n: int = 21) -> float:
    """Median latency of a 1-key `batch_get_into` via `master`: the master RTT a load really
    sees (delay proxy, thread wake-ups on a busy CPU and one block's transfer included)."""
    import statistics

    bb = len(source.data[0])
    buf = torch.empty(bb, dtype=torch.uint8)
    client = open_client(tb, master)
    try:
        client.register_buffer(buf.data_ptr(), bb)
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            client.batch_get_into([source.our_keys[i % source.count]], [buf.data_ptr()], [bb])
            times.append((time.perf_counter() - t0) * 1e3)
        client.unregister_buffer(buf.data_ptr())
    finally:
        client.close()
    return statistics.median(times[1:])
