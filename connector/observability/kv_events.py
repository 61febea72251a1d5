"""KV events for routers: a `BlockStored` for each block this engine wrote to the store, once
every TP rank's shards of it are there, and a `BlockRemoved` when an announced block leaves it,
in vLLM's own KV event stream (`--kv-events-config`; docs/kv-events.md).

Where each event is born:
- A worker knows which of its shards a save job wrote or found stored, but neither the block's
  tokens nor whether the other ranks' shards landed. After each step it hands the scheduler
  those blocks (`LandedShards`, vLLM's `KVConnectorKVEvents` container, which vLLM's output
  aggregator merges over the TP ranks into the step's `KVConnectorOutput`). No event yet.
- The scheduler (`StoreEventLog`) announces a block once every rank has reported it: once
  per logical block at any TP size, with the tokens and parent it planned the save with. The
  blocks announced together go out as one `BlockStored` per run of a request's consecutive
  blocks, as vLLM's own events carry a request's blocks (an event per block cost a long
  prompt more than the rest of its control path in the scheduler's step:
  docs/performance.md). A block skipped because the store held it already is news only if no
  event for it is live. vLLM takes the events each step (`take_events`).
- Removals: Mooncake 0.3.13's master accepts `--enable_kv_events` but its ZMQ publisher is not
  built into the wheel (its `/kv_events/status` says `enabled: false`; nothing is published on
  eviction or removal: tests/store/test_kv_events_store.py keeps checking). So a sweep thread
  asks the master's HTTP admin port (`/batch_query_keys`: read-only, no lease, where
  `batch_is_exist` would grant every announced block a read lease and hold off its eviction)
  which announced blocks are still stored, every `kv_events_sweep_s`; and a scheduler lookup
  that misses an announced block announces it removed too. Only blocks announced before the
  query that missed them are removed, so a block stored meanwhile is never withdrawn.

Bounded and never waited for: the event queue holds `kv_events_queue` blocks (vLLM drains it
each step), each worker as many saved blocks, the planned saves and the live set are bounded
too; what does not fit is dropped and counted (`kv_events_dropped`). Nothing here blocks a
step or a save: workers only append to a list, the sweep runs on its own thread.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from connector.observability.kv_event_settings import EventSettings
from connector.store.master_http import MasterKeys

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level

SWEEP_BATCH = 64  # blocks per /batch_query_keys request
_MASK64 = (1 << 64) - 1
# vLLM's extra keys of a block that has none (`to_event_extra_keys([None])`), shared: a
# block's are only read, into its run's event.
NO_EXTRA_KEYS = (None,)


def vllm_clears(pool: Any) -> bool:
    """Whether vLLM has queued `AllBlocksCleared` (its prefix cache was reset) for its next
    publish: the block pool's event queue (`BlockPool.kv_event_queue`, vLLM 0.32 and 0.33)
    holds it until the step's `update_from_output` takes it, after the step's metadata."""
    return any(isinstance(e, AllBlocksCleared) for e in getattr(pool, "kv_event_queue", ()))


@functools.cache
def _int_hashes() -> bool:
    """vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, read once: vLLM's `envs` reads the
    environment on every access, which cost more than all the rest of a block's event."""
    from vllm import envs

    return bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)


def external_hashes(hashes: list[bytes]) -> list[Any]:
    """Block hashes in vLLM's external form (bytes, or ints with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), as vLLM's own events carry them: vLLM's
    `maybe_convert_block_hash` of each, with its setting read once. Bytes are the list itself:
    a call per block cost a long run's event more than its tokens."""
    return [int.from_bytes(h, "big") & _MASK64 for h in hashes] if _int_hashes() else hashes


def external_hash(h: bytes) -> Any:
    """One block hash in vLLM's external form (`external_hashes`)."""
    return external_hashes([h])[0]


# ---- workers ---------------------------------------------------------------------------------
class LandedShards(KVConnectorKVEvents):
    """Worker -> scheduler, in the step's KVConnectorOutput: a (tp_rank, group, block hashes)
    record per save job, of the blocks whose shards of that rank are in the store. A record per
    job, not per block: vLLM pickles each rank's output to the engine core, and a tuple per
    block is an object per block to pickle and unpickle there. vLLM's aggregator adds every
    rank's records to the first one's container; the scheduler counts ranks per block itself
    (a rank with nothing to report sends None, so vLLM's worker count is no guide)."""

    def __init__(self, records: Iterable[tuple[int, int, tuple[bytes, ...]]] = ()) -> None:
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
    takes them. Bounded: past `cap` blocks the rest are dropped and counted (kind landed)."""

    def __init__(self, tp_rank: int, cap: int, count: Callable[..., None]) -> None:
        self._rank, self._cap, self._count = tp_rank, cap, count
        self._lock = threading.Lock()
        self._records: list[tuple[int, int, tuple[bytes, ...]]] = []
        self._blocks = 0  # the records' blocks

    def add(self, group: int, hashes: Sequence[bytes]) -> None:
        with self._lock:
            room = max(0, self._cap - self._blocks)
            if room and hashes:
                kept = tuple(hashes[:room])
                self._records.append((self._rank, group, kept))
                self._blocks += len(kept)
        if len(hashes) > room:
            self._count("kv_events_dropped", "landed", n=len(hashes) - room)

    def take(self) -> LandedShards | None:
        with self._lock:
            if not self._records:
                return None
            records, self._records, self._blocks = self._records, [], 0
        return LandedShards(records)


# ---- scheduler -------------------------------------------------------------------------------
class _Block(NamedTuple):
    """What a `BlockStored` says of a block, kept while it is announced so it can be said again
    (after vLLM's `AllBlocksCleared`): the tokens as a compact array. A tuple: made for every
    block of a save or load, where a frozen dataclass's init cost more than the rest."""

    parent: bytes | None
    token_ids: array
    extra_keys: Any
    lora_name: str | None


# The KV cache group kinds whose blocks are announced: every router indexes these. A
# sliding-window group's blocks are not: its store blocks serve only beside the full group's,
# and a router that keys a store block by hash alone would let the window's removals (it keeps
# only its window) erase the full group's credit for the same hash.
ANNOUNCED_KINDS = (None, "full_attention", "mla_attention")


class StoreEventLog:
    """The scheduler's store events: planned saves, blocks announced live, the event queue, and
    the sweep thread. Thread-safe: lookups and the sweep call in from their own threads.

    What this engine announces is its own view of the store (docs/kv-events.md, "Many engines
    on one store"): the blocks it wrote, found stored when it saved, or loaded; each is
    withdrawn once a query made after the announcement finds it gone. A router keeps each
    engine's view apart and credits a block while any engine's view holds it."""

    def __init__(self, settings: EventSettings, tp_size: int, block_size: int,
                 keys: Callable[[Sequence[bytes], int], list[str]], shards: int,
                 count: Callable[..., None],
                 spec_kinds: Sequence[tuple[str | None, int | None]] = (),
                 wake: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self._tp_size, self._block_size = tp_size, block_size
        self._keys, self._shards, self._count = keys, shards, count
        self._spec = tuple(spec_kinds)
        self._wake = wake
        self._lock = threading.Lock()
        # planned saves -> [the block, its request id, a bit per TP rank that reported it
        # landed]: a list, made per block of a save, where a class's init cost more than it
        self._planned: OrderedDict[tuple[int, bytes], list[Any]] = OrderedDict()
        self._everyone = (1 << tp_size) - 1  # the ranks bits of a block every rank reported
        # announced blocks -> (when the store was last seen holding it, what was announced)
        self._live: OrderedDict[tuple[int, bytes], tuple[float, _Block]] = OrderedDict()
        self._queue: deque[tuple[str, KVCacheEvent]] = deque()
        self._queued_blocks = 0  # blocks the queued events carry (bounded by settings.queue)
        self._repeat: deque[tuple[int, bytes]] = deque()  # live blocks to announce again
        self._uncounted = False  # events taken whose count no stats collection has shipped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sweep_failing = False

    def _announced(self, group: int) -> bool:
        kind = self._spec[group][0] if group < len(self._spec) else None
        return kind in ANNOUNCED_KINDS

    def _blocks(self, request: Any, indices: Sequence[int]) -> list[_Block]:
        """The `_Block`s of blocks `indices` of `request`: its tokens made an array once, each
        block's a slice of it."""
        if not indices:
            return []
        bs, lora = self._block_size, getattr(request, "lora_request", None)
        lo, hashes, name = min(indices) * bs, request.block_hashes, lora.name if lora else None
        tokens = array("q", request.all_token_ids[lo:(max(indices) + 1) * bs])
        plain = not _has_extra_keys(request)  # then only a cache salt, on block 0, has one
        return [_Block(hashes[i - 1] if i > 0 else None, tokens[i * bs - lo:(i + 1) * bs - lo],
                       NO_EXTRA_KEYS if plain and i else _extra_keys(request, i * bs,
                                                                     (i + 1) * bs),
                       name) for i in indices]

    # -- stored
    def planned(self, request: Any, indices: Sequence[int], group: int) -> None:
        """A save of blocks `indices` of `request` (group `group`) goes to the workers: a new
        attempt, whose ranks report afresh (an earlier attempt's ranks may have lost theirs)."""
        if not self._announced(group):
            return
        rid, hashes = request.request_id, request.block_hashes
        entries = [((group, hashes[i]), [b, rid, 0])
                   for i, b in zip(indices, self._blocks(request, indices), strict=True)]
        with self._lock:
            planned = self._planned
            for key in [key for key, _ in entries if key in planned]:
                del planned[key]  # planned again: a fresh attempt, last in line
            planned.update(entries)
            while len(planned) > self.settings.queue:
                planned.popitem(last=False)
                self._count("kv_events_dropped", "stored")

    def settled(self, req_id: str) -> None:
        """Every rank finished `req_id`'s saves: its blocks that not every rank reported were
        not stored (each failure is counted in save_error_keys), and are never announced."""
        with self._lock:
            for key in [k for k, p in self._planned.items() if p[1] == req_id]:
                del self._planned[key]

    def landed(self, records: Iterable[tuple[int, int, Sequence[bytes]]]) -> None:
        """Workers' reports, (rank, group, block hashes) each: a block whose every rank
        reported is stored. The ranks' records of one save job are merged first: every rank
        runs the same save plans, so they usually carry the same hashes, and a block then
        costs one lookup for all ranks instead of one per rank."""
        now = time.perf_counter()
        jobs: dict[tuple[int, tuple[bytes, ...]], int] = {}
        for rank, group, hashes in records:
            job = (group, tuple(hashes))
            jobs[job] = jobs.get(job, 0) | 1 << rank
        planned, everyone = self._planned, self._everyone
        with self._lock:
            stored = []
            for (group, hashes), ranks in jobs.items():
                for h in hashes:
                    key = (group, h)
                    p = planned.get(key)
                    if p is None:
                        continue  # announced already (a repeat), settled, or dropped above
                    p[2] |= ranks
                    if p[2] == everyone:
                        del planned[key]
                        stored.append((key, p[0]))
            self._announce(stored, now)

    def loaded(self, request: Any, indices: Sequence[int], group: int, seen: float) -> None:
        """This engine loads blocks `indices` of `request`, which a lookup started at `seen`
        (perf_counter) found stored: the store holds them for this engine too."""
        if not self._announced(group):
            return
        hashes = request.block_hashes
        with self._lock:
            new = [i for i in indices if (group, hashes[i]) not in self._live]
        blocks = self._blocks(request, new)  # outside the lock: the sweep thread takes it
        with self._lock:
            self._announce([((group, hashes[i]), b) for i, b in zip(new, blocks, strict=True)],
                           seen)

    def _announce(self, blocks: list[tuple[tuple[int, bytes], _Block]], seen: float) -> None:
        """(Under the lock.) The store holds `blocks`: live from `seen` on. Those not live yet
        are announced, as many as the queue has room for (the rest dropped, counted, and not
        live); each run of a request's consecutive blocks in one `BlockStored`, as vLLM's own
        events carry a request's blocks."""
        live, new = self._live, []
        for key, block in blocks:
            if key in live:  # stored again (or skipped): still live, confirmed now
                live[key] = (max(seen, live[key][0]), live[key][1])
                live.move_to_end(key)
            else:
                new.append((key, block))
        room = max(0, self.settings.queue - self._queued_blocks)
        if len(new) > room:
            self._count("kv_events_dropped", "stored", n=len(new) - room)
            del new[room:]
        live.update((key, (seen, block)) for key, block in new)
        start = 0
        for end in _run_ends(new):
            self._push("stored", self._stored_event(new[start:end]), end - start)
            start = end
        self._trim()

    def _trim(self) -> None:
        while len(self._live) > self.settings.max_live:
            (group, h), _ = self._live.popitem(last=False)
            self._count("kv_events_removals", "live_limit")
            self._push("removed", self._removed_event(group, h))

    def _stored_event(self, run: Sequence[tuple[tuple[int, bytes], _Block]]) -> BlockStored:
        """One `BlockStored` for blocks of one group, each the child of the one before."""
        group, first = run[0][0][0], run[0][1]
        kind, window = self._spec[group] if group < len(self._spec) else (None, None)
        tokens = array("q")
        for _, b in run:
            tokens.extend(b.token_ids)
        return BlockStored(
            block_hashes=external_hashes([key[1] for key, _ in run]),
            parent_block_hash=external_hash(first.parent) if first.parent is not None else None,
            token_ids=tokens.tolist(), block_size=self._block_size, lora_id=None,
            medium=self.settings.medium, lora_name=first.lora_name,
            extra_keys=[k for _, b in run for k in b.extra_keys],
            group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
            locality=self.settings.locality)

    def cleared(self) -> None:
        """vLLM is about to publish `AllBlocksCleared` for this engine (its prefix cache was
        reset), which routers apply to every tier, the store's included: announce every live
        block again after it, a queue's worth per step (`take`)."""
        with self._lock:
            self._repeat = deque(self._live)

    # -- removed
    def _removed_event(self, group: int, h: bytes) -> BlockRemoved:
        return BlockRemoved(block_hashes=[external_hash(h)], medium=self.settings.medium,
                            group_idx=group, locality=self.settings.locality)

    def missing(self, blocks: Iterable[tuple[int, bytes]], source: str, before: float) -> int:
        """Blocks a store query found gone: each one announced before `before` (the query's
        start, perf_counter) is announced removed. Returns how many. A removal the full queue
        cannot take stays live, for the next query to find again."""
        n = 0
        with self._lock:
            for key in blocks:
                seen = self._live.get(key)
                if seen is None or seen[0] >= before:
                    continue
                if not self._push("removed", self._removed_event(*key)):
                    break
                del self._live[key]
                n += 1
                self._count("kv_events_removals", source)
        if n:
            self._wake()  # an idle engine publishes them now, not at its next request
        return n

    def live(self) -> list[tuple[int, bytes]]:
        with self._lock:
            return list(self._live)

    # -- queue
    def _push(self, kind: str, ev: KVCacheEvent, blocks: int = 1) -> bool:
        """Queue an event of `blocks` blocks (under the lock); False, counted, when the queue
        (`kv_events_queue` blocks) has no room for them."""
        if self._queued_blocks + blocks > self.settings.queue:
            self._count("kv_events_dropped", kind, n=blocks)
            return False
        self._queue.append((kind, ev))
        self._queued_blocks += blocks
        return True

    def pending(self) -> bool:
        """Events wait for vLLM, or the count of events it took waits for the next step's
        stats (`has_pending_push_work`: the engine steps until both went out). vLLM collects
        a step's connector stats before it takes the step's events, so an idle engine would
        otherwise report its last events on /metrics only with its next request."""
        return bool(self._queue or self._repeat or self._uncounted)

    def counted(self) -> None:
        """The connector's stats are being collected: every event taken so far is counted."""
        self._uncounted = False

    def take(self) -> list[KVCacheEvent]:
        """The queued events, for vLLM's publisher (each step); then announcements repeated
        after a cache reset, as many as the queue holds."""
        with self._lock:
            queued, self._queue = list(self._queue), deque()
            room, self._queued_blocks = self.settings.queue - self._queued_blocks, 0
            while self._repeat and room:
                key = self._repeat.popleft()
                live = self._live.get(key)
                if live is not None:
                    queued.append(("stored", self._stored_event([(key, live[1])])))
                    room -= 1
        if not queued:
            return []
        self._uncounted = True
        for kind in ("stored", "removed"):
            n = sum(len(ev.block_hashes) for k, ev in queued if k == kind)
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
        client = MasterKeys(self.settings.master_http,
                            timeout=max(1.0, min(10.0, self.settings.sweep_s)))
        while not self._stop.wait(self.settings.sweep_s):
            try:
                self.sweep(client)
                self._count("kv_events_sweeps", "ok")
                if self._sweep_failing:
                    self._sweep_failing = False
                    logger.info("KV event sweep: the master's HTTP port answers again")
            except Exception as e:  # noqa: BLE001 - a failed round removes nothing; next one
                self._count("kv_events_sweeps", "error")
                if not self._sweep_failing:
                    self._sweep_failing = True
                    logger.warning("KV event sweep of %s failed (%s); removals wait for it "
                                   "(lookups still report them; kv_events_sweeps_total"
                                   "{result=\"error\"} counts the rounds)",
                                   self.settings.master_http, e)
        client.close()

    def sweep(self, client: MasterKeys | None = None) -> int:
        """One round over every live block, in batches; returns the blocks announced removed.
        A batch whose query fails raises (nothing is removed on a guess)."""
        own = client is None
        client = client or MasterKeys(self.settings.master_http)
        blocks, removed = self.live(), 0
        try:
            for i in range(0, len(blocks), SWEEP_BATCH):
                if self._stop.is_set():
                    break
                batch = blocks[i:i + SWEEP_BATCH]
                keys = [self._keys([h], g) for g, h in batch]
                t0 = time.perf_counter()
                present = client.query([k for ks in keys for k in ks])
                gone = [b for b, ks in zip(batch, keys, strict=True)
                        if not all(present.get(k, False) for k in ks)]
                removed += self.missing(gone, "sweep", t0)
        finally:
            if own:
                client.close()
        return removed

    def shutdown(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def _run_ends(blocks: list[tuple[tuple[int, bytes], _Block]]) -> list[int]:
    """Where each run of `blocks` ends (exclusive): a run ends where the next block is not its
    child (another group, parent, or LoRA adapter)."""
    if not blocks:
        return []
    ends = [i for i in range(1, len(blocks)) if blocks[i][0][0] != blocks[i - 1][0][0]
            or blocks[i][1].parent != blocks[i - 1][0][1]
            or blocks[i][1].lora_name != blocks[i - 1][1].lora_name]
    return [*ends, len(blocks)]


def _has_extra_keys(request: Any) -> bool:
    """Whether any block of `request` but the first may have extra hash keys (LoRA,
    multimodal input, prompt embeds; a cache salt is the first block's only)."""
    return bool(getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
                or getattr(request, "prompt_embeds", None) is not None)


def _extra_keys(request: Any, start: int, end: int) -> Any:
    """The block's extra hash keys (LoRA, cache salt, multimodal), as vLLM's events carry them.
    A request with none of their sources gives `NO_EXTRA_KEYS` for every block, known without
    vLLM's per-block walk (a 128K-token prompt has 8,192 blocks)."""
    if not (_has_extra_keys(request) or (start == 0 and getattr(request, "cache_salt", None))):
        return NO_EXTRA_KEYS
    try:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )

        keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        return to_event_extra_keys([keys])
    except Exception:  # noqa: BLE001 - a test double or another vLLM: the hash still matches
        return NO_EXTRA_KEYS
