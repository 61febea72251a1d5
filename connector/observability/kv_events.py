"""KV events for routers: a `BlockStored` for each block this engine wrote to the store, once
every TP rank's shards of it are there, and a `BlockRemoved` when an announced block leaves it,
in vLLM's own KV event stream (`--kv-events-config`; docs/kv-events.md).

Where each event is born:
- A worker knows which of its shards a save job wrote or found stored, but neither the block's
  tokens nor whether the other ranks' shards landed. After each step it hands the scheduler
  those blocks (`LandedShards`, vLLM's `KVConnectorKVEvents` container, which vLLM's output
  aggregator merges over the TP ranks into the step's `KVConnectorOutput`). No event yet.
- The scheduler (`StoreEventLog`) makes the `BlockStored` once every rank has reported the
  block: one event per logical block at any TP size, with the tokens and parent it planned the
  save with. A block skipped because the store held it already is news only if no event for it
  is live. vLLM takes the events each step (`take_events`).
- Removals: Mooncake 0.3.13's master accepts `--enable_kv_events` but its ZMQ publisher is not
  built into the wheel (its `/kv_events/status` says `enabled: false`; nothing is published on
  eviction or removal: tests/store/test_kv_events_store.py keeps checking). So a sweep thread
  asks the master's HTTP admin port (`/batch_query_keys`: read-only, no lease, where
  `batch_is_exist` would grant every announced block a read lease and hold off its eviction)
  which announced blocks are still stored, every `kv_events_sweep_s`; and a scheduler lookup
  that misses an announced block announces it removed too. Only blocks announced before the
  query that missed them are removed, so a block stored meanwhile is never withdrawn.

Bounded and never waited for: the event queue holds `kv_events_queue` events (vLLM drains it
each step), each worker as many saved blocks, the planned saves and the live set are bounded
too; what does not fit is dropped and counted (`kv_events_dropped`). Nothing here blocks a
step or a save: workers only append to a deque, the sweep runs on its own thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
import urllib.request
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from connector.config import EXTRA, ConfigError, ConnectorConfig

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level

MASTER_HTTP_PORT = 9003  # Mooncake's default --metrics_port (its HTTP admin server)
SWEEP_BATCH = 64  # blocks per /batch_query_keys request
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class EventSettings:
    """What the store's events say and how they are gathered (validated)."""

    medium: str
    locality: str | None
    sweep_s: float  # 0: no sweep
    master_http: str  # host:port of the master's HTTP admin port ("" without a sweep)
    queue: int
    max_live: int


def event_settings(config: ConnectorConfig, kv_events_config: Any) -> EventSettings | None:
    """The events this engine publishes (None: none), from the connector's keys and vLLM's
    `--kv-events-config`. A combination that cannot work is a ConfigError naming the field."""
    mode = config.kv_events
    vllm_on = bool(kv_events_config and kv_events_config.enable_kv_cache_events)
    publisher = getattr(kv_events_config, "publisher", None) if vllm_on else None
    if mode == "off" or (mode == "auto" and (not vllm_on or publisher == "null")):
        return None
    if not vllm_on:
        raise ConfigError(
            f"{EXTRA}.kv_events: 'on', but --kv-events-config does not enable vLLM's KV "
            "events; add --kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": "
            "\"zmq\", \"endpoint\": \"tcp://*:5557\"}' or set kv_events to auto or off")
    if publisher == "null":
        raise ConfigError(
            "--kv-events-config.publisher: 'null' discards every event, so kv_events: 'on' "
            "reaches no router; set \"publisher\": \"zmq\" or kv_events to auto or off")
    for name in ("endpoint", "replay_endpoint"):
        ep = getattr(kv_events_config, name, None)
        if publisher == "zmq" and ep is not None and not str(ep).startswith(_ENDPOINT_SCHEMES):
            raise ConfigError(
                f"--kv-events-config.{name}: {ep!r} is not a ZMQ endpoint; use "
                "tcp://*:5557 (or ipc://...)")
    sweep_s, http = config.kv_events_sweep_s, config.kv_events_master_http
    if sweep_s > 0 and config.store.tenant_id != "default":
        raise ConfigError(
            f"{EXTRA}.kv_events_sweep_s: the master's HTTP key query sees only the default "
            f"tenant, not tenant_id {config.store.tenant_id!r}; set kv_events_sweep_s to 0 "
            "(removals then come from lookups only)")
    if sweep_s > 0 and not http:
        if config.store.ha:
            raise ConfigError(
                f"{EXTRA}.kv_events_master_http: an HA master group has no fixed admin "
                "address; set it to the masters' service host:port of --metrics_port, or "
                "kv_events_sweep_s to 0")
        http = f"{config.store.master_server_address.rsplit(':', 1)[0]}:{MASTER_HTTP_PORT}"
    locality = None if config.kv_events_locality == "none" else config.kv_events_locality.upper()
    return EventSettings(config.kv_events_medium, locality, sweep_s, http if sweep_s else "",
                         config.kv_events_queue, config.kv_events_max_live)


def external_hash(h: bytes) -> Any:
    """A block hash in vLLM's external form (bytes, or an int with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), as vLLM's own events carry it."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(h)


# ---- workers ---------------------------------------------------------------------------------
class LandedShards(KVConnectorKVEvents):
    """Worker -> scheduler, in the step's KVConnectorOutput: (tp_rank, group, block hash) of
    each block whose shards of that rank are in the store. vLLM's aggregator adds every rank's
    records to the first one's container; the scheduler counts ranks per block itself (a rank
    with nothing to report sends None, so vLLM's worker count is no guide)."""

    def __init__(self, records: Iterable[tuple[int, int, bytes]] = ()) -> None:
        self._records = list(records)
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._records.extend(events)

    def aggregate(self) -> LandedShards:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._records)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._records.clear()

    def __repr__(self) -> str:
        return f"<LandedShards records={len(self._records)} workers={self._workers}>"


class WorkerLanded:
    """A worker's saved blocks, from its save jobs (`MooncakeStoreWorker.on_landed`, called
    on the save thread before the job's request can be reported done) until the step's output
    takes them. Bounded: past `cap` records the rest are dropped and counted (kind landed)."""

    def __init__(self, tp_rank: int, cap: int, count: Callable[..., None]) -> None:
        self._rank, self._cap, self._count = tp_rank, cap, count
        self._lock = threading.Lock()
        self._records: deque[tuple[int, int, bytes]] = deque()

    def add(self, group: int, hashes: Sequence[bytes]) -> None:
        with self._lock:
            room = max(0, self._cap - len(self._records))
            self._records.extend((self._rank, group, h) for h in hashes[:room])
        if len(hashes) > room:
            self._count("kv_events_dropped", "landed", n=len(hashes) - room)

    def take(self) -> LandedShards | None:
        with self._lock:
            if not self._records:
                return None
            records, self._records = list(self._records), deque()
        return LandedShards(records)


# ---- scheduler -------------------------------------------------------------------------------
@dataclass
class _Planned:
    parent: bytes | None
    token_ids: list[int]
    extra_keys: Any
    lora_name: str | None
    ranks: set[int]


class StoreEventLog:
    """The scheduler's store events: planned saves, blocks announced live, the event queue, and
    the sweep thread. Thread-safe: lookups and the sweep call in from their own threads."""

    def __init__(self, settings: EventSettings, tp_size: int, block_size: int,
                 keys: Callable[[Sequence[bytes], int], list[str]], shards: int,
                 count: Callable[..., None],
                 spec_kinds: Sequence[tuple[str | None, int | None]] = ()) -> None:
        self.settings = settings
        self._tp_size, self._block_size = tp_size, block_size
        self._keys, self._shards, self._count = keys, shards, count
        self._spec = tuple(spec_kinds)
        self._lock = threading.Lock()
        self._planned: OrderedDict[tuple[int, bytes], _Planned] = OrderedDict()
        self._live: OrderedDict[tuple[int, bytes], float] = OrderedDict()  # -> announced at
        self._queue: deque[tuple[str, KVCacheEvent]] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sweep_failing = False

    # -- stored
    def planned(self, request: Any, indices: Sequence[int], group: int) -> None:
        """A save of blocks `indices` of `request` (group `group`) goes to the workers."""
        hashes, bs = request.block_hashes, self._block_size
        lora = getattr(request, "lora_request", None)
        entries = []
        for i in indices:
            entries.append(((group, hashes[i]), _Planned(
                hashes[i - 1] if i > 0 else None, list(request.all_token_ids[i * bs:(i + 1) * bs]),
                _extra_keys(request, i * bs, (i + 1) * bs), lora.name if lora else None,
                set())))
        with self._lock:
            for key, p in entries:
                if key in self._planned:
                    self._planned.move_to_end(key)
                    continue
                self._planned[key] = p
            while len(self._planned) > self.settings.queue:
                self._planned.popitem(last=False)
                self._count("kv_events_dropped", "stored")

    def landed(self, records: Iterable[tuple[int, int, bytes]]) -> None:
        """Workers' reports: a block whose every rank reported is stored."""
        now = time.perf_counter()
        with self._lock:
            for rank, group, h in records:
                key = (group, h)
                p = self._planned.get(key)
                if p is None:
                    continue  # announced already (a repeat), or dropped above
                p.ranks.add(rank)
                if len(p.ranks) < self._tp_size:
                    continue
                del self._planned[key]
                if key in self._live:  # stored again (or skipped): still live, confirmed now
                    self._live[key] = now
                    self._live.move_to_end(key)
                    continue
                if self._push("stored", self._stored_event(group, h, p)):
                    self._live[key] = now
            while len(self._live) > self.settings.max_live:
                (group, h), _ = self._live.popitem(last=False)
                self._count("kv_events_removals", "live_limit")
                self._push("removed", self._removed_event(group, h))

    def _stored_event(self, group: int, h: bytes, p: _Planned) -> BlockStored:
        kind, window = self._spec[group] if group < len(self._spec) else (None, None)
        return BlockStored(
            block_hashes=[external_hash(h)],
            parent_block_hash=external_hash(p.parent) if p.parent is not None else None,
            token_ids=p.token_ids, block_size=self._block_size, lora_id=None,
            medium=self.settings.medium, lora_name=p.lora_name, extra_keys=p.extra_keys,
            group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
            locality=self.settings.locality)

    # -- removed
    def _removed_event(self, group: int, h: bytes) -> BlockRemoved:
        return BlockRemoved(block_hashes=[external_hash(h)], medium=self.settings.medium,
                            group_idx=group, locality=self.settings.locality)

    def missing(self, blocks: Iterable[tuple[int, bytes]], source: str, before: float) -> int:
        """Blocks a store query found gone: each one announced before `before` (the query's
        start, perf_counter) is announced removed. Returns how many."""
        n = 0
        with self._lock:
            for key in blocks:
                t = self._live.get(key)
                if t is None or t >= before:
                    continue
                del self._live[key]
                n += 1
                self._count("kv_events_removals", source)
                self._push("removed", self._removed_event(*key))
        return n

    def live(self) -> list[tuple[int, bytes]]:
        with self._lock:
            return list(self._live)

    # -- queue
    def _push(self, kind: str, ev: KVCacheEvent) -> bool:
        """Queue an event (under the lock); False, counted, when the queue is full."""
        if len(self._queue) >= self.settings.queue:
            self._count("kv_events_dropped", kind)
            return False
        self._queue.append((kind, ev))
        return True

    def take(self) -> list[KVCacheEvent]:
        """The queued events, for vLLM's publisher (each step)."""
        with self._lock:
            if not self._queue:
                return []
            queued, self._queue = list(self._queue), deque()
        for kind in ("stored", "removed"):
            n = sum(1 for k, _ in queued if k == kind)
            if n:
                self._count("kv_events", kind, n=n)
        return [ev for _, ev in queued]

    # -- sweep
    def start(self) -> None:
        if self.settings.sweep_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._sweep_loop, name="mcpool-kv-sweep",
                                            daemon=True)
            self._thread.start()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.settings.sweep_s):
            try:
                self.sweep()
                if self._sweep_failing:
                    self._sweep_failing = False
                    logger.info("KV event sweep: the master's HTTP port answers again")
            except Exception as e:  # noqa: BLE001 - a failed round removes nothing; next one
                if not self._sweep_failing:
                    self._sweep_failing = True
                    logger.warning("KV event sweep of %s failed (%s); removals wait for it "
                                   "(lookups still report them)", self.settings.master_http, e)

    def sweep(self) -> int:
        """One round over every live block, in batches; returns the blocks announced removed.
        A batch whose query fails raises (nothing is removed on a guess)."""
        blocks, removed = self.live(), 0
        for i in range(0, len(blocks), SWEEP_BATCH):
            if self._stop.is_set():
                break
            batch = blocks[i:i + SWEEP_BATCH]
            keys = [self._keys([h], g) for g, h in batch]
            t0 = time.perf_counter()
            present = query_keys(self.settings.master_http, [k for ks in keys for k in ks],
                                 timeout=max(1.0, min(10.0, self.settings.sweep_s)))
            gone = [b for b, ks in zip(batch, keys, strict=True)
                    if not all(present.get(k, False) for k in ks)]
            removed += self.missing(gone, "sweep", t0)
        return removed

    def shutdown(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def query_keys(master_http: str, keys: Sequence[str], timeout: float = 5.0) -> dict[str, bool]:
    """Which keys the master holds a complete replica of (memory or disk), from its HTTP admin
    port's /batch_query_keys (grants no lease). Raises on any failure."""
    url = (f"http://{master_http}/batch_query_keys?keys="
           + urllib.parse.quote(",".join(keys), safe=""))
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - operator's address
        body = json.loads(r.read())
    if not body.get("success"):
        raise RuntimeError(f"batch_query_keys answered {str(body)[:200]}")
    data = body.get("data") or {}
    return {k: bool(v.get("ok") and (v.get("values") or v.get("disk_values")
                                     or v.get("local_disk_values")))
            for k, v in data.items()}


def _extra_keys(request: Any, start: int, end: int) -> Any:
    """The block's extra hash keys (LoRA, cache salt, multimodal), as vLLM's events carry them."""
    try:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )

        keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        return to_event_extra_keys([keys])
    except Exception:  # noqa: BLE001 - a test double or another vLLM: the hash still matches
        return None
