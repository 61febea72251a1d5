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
import itertools
import logging
import operator
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)

from connector.observability.kv_event_settings import EventSettings
from connector.store.master_http import MasterKeys, UrlTooLong

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level

# Keys per /batch_query_keys request of the removal sweep: about 28 KB of URL. Fewer, larger
# requests cost the scheduler's process less CPU (http.client's work is per request); a
# proxy that refuses such URLs (HTTP 414 or 431) gets SWEEP_KEYS_SHORT (about 5 KB) from
# then on.
SWEEP_KEYS, SWEEP_KEYS_SHORT = 256, 48
_MASK64 = (1 << 64) - 1


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
    `maybe_convert_block_hash` of each (the low 64 bits, big-endian), with its setting read
    once. Bytes are the list itself: a call per block cost a long run's event more than its
    tokens. Hashes of one width of 8 bytes or more (vLLM's are 32) are converted together:
    a third of a conversion per hash at 8,192 blocks."""
    if not _int_hashes():
        return hashes
    width = len(hashes[0]) if hashes else 0
    if width < 8 or len(set(map(len, hashes))) > 1:
        return [int.from_bytes(h, "big") & _MASK64 for h in hashes]
    rows = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(len(hashes), width)
    return np.ascontiguousarray(rows[:, width - 8:]).view(">u8").ravel().tolist()


def external_hash(h: bytes) -> Any:
    """One block hash in vLLM's external form (`external_hashes`), without the arrays that
    pay only over many: an event's parent is one block."""
    return int.from_bytes(h[-8:], "big") if _int_hashes() else h


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
    takes them. Bounded: past `cap` blocks the rest are dropped and counted (kind landed), by
    rank 0 only: every rank saves the same blocks under the same bound, and a block any rank
    dropped is not announced, so vLLM's sum over the ranks would count each loss per rank."""

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
        if len(hashes) > room and self._rank == 0:
            self._count("kv_events_dropped", "landed", n=len(hashes) - room)

    def take(self) -> LandedShards | None:
        with self._lock:
            if not self._records:
                return None
            records, self._records, self._blocks = self._records, [], 0
        return LandedShards(records)


# ---- scheduler -------------------------------------------------------------------------------
class _Run:
    """Consecutive blocks of one request in one group, as a `BlockStored` says them: their
    hashes, the parent of the first, their tokens and extra keys, each a slice taken once.
    Every block of a save or load refers to its run by position, so a block costs a reference,
    not objects of its own (a 128K-token prompt has 8,192 blocks; and objects that hold others
    are what the garbage collector walks). `live` counts the live blocks that refer to it: a
    run most of whose blocks left the live set is cut down to those left
    (`StoreEventLog._cut`), so what a live block keeps stays bounded."""

    __slots__ = ("group", "rid", "hashes", "parent", "tokens", "extra_keys", "lora_name",
                 "live", "_positions")

    def __init__(self, group: int, rid: str, hashes: list[bytes], parent: bytes | None,
                 tokens: list[int], extra_keys: list[Any], lora_name: str | None) -> None:
        self.group, self.rid, self.hashes, self.parent = group, rid, hashes, parent
        self.tokens, self.extra_keys, self.lora_name = tokens, extra_keys, lora_name
        self.live = 0
        self._positions: dict[bytes, int] | None = None

    def part(self, lo: int, hi: int, block_size: int) -> _Run:
        """Its blocks `lo` to `hi` (positions) as a run of their own."""
        return _Run(self.group, self.rid, self.hashes[lo:hi], self.parent_of(lo),
                    self.tokens[lo * block_size:hi * block_size], self.extra_keys[lo:hi],
                    self.lora_name)

    def parent_of(self, i: int) -> bytes | None:
        return self.hashes[i - 1] if i else self.parent

    def index(self) -> dict[bytes, int]:
        """Each block's position in the run, by hash (made on first use: by a save whose
        blocks came back out of the run's order, and a repeat after a cache reset)."""
        if self._positions is None:
            self._positions = dict(zip(self.hashes, range(len(self.hashes)), strict=True))
        return self._positions


# Blocks `start` to `end` (positions) of a run. Blocks move between the steps as pieces, not
# one by one: a long prompt is a piece or a few, and what is done per block (its key, its
# entry in the planned saves and the live set) is done by C loops over a piece's hashes.
Piece = tuple[_Run, int, int]


# A block's key in the planned saves and the live set: group 0's (a model with one KV cache
# group: nearly every model) is its hash itself, another group's `(group, hash)`. Group 0 makes
# no object per block: for a long prompt the tuples, and the collections their allocations
# set off, were much of a load's events (docs/performance.md).
Key = bytes | tuple[int, bytes]


def _keys(group: int, hashes: Iterable[bytes]) -> list[Key]:
    """The keys of blocks `hashes` of group `group`."""
    return list(hashes) if group == 0 else list(zip(itertools.repeat(group), hashes))


def _key(group: int, h: bytes) -> Key:
    return h if group == 0 else (group, h)


def _block(key: Key) -> tuple[int, bytes]:
    """A key's block: (group, hash)."""
    return (0, key) if isinstance(key, bytes) else key


def _runs_of(request: Any, indices: Sequence[int], group: int, block_size: int
             ) -> list[Piece]:
    """Blocks `indices` (ascending) of `request`: a run per stretch of consecutive indices,
    so that a run holds no block it was not made for, each whole as a piece."""
    hashes, tokens = request.block_hashes, request.all_token_ids
    lora = getattr(request, "lora_request", None)
    name, rid = (lora.name if lora else None), request.request_id
    plain = not _has_extra_keys(request)  # then only a cache salt, on block 0, has any
    pieces: list[Piece] = []
    for lo, hi in _stretches(indices):
        extra: list[Any] = [None] * (hi - lo) if plain else [
            _extra_keys(request, i * block_size, (i + 1) * block_size) for i in range(lo, hi)]
        if plain and lo == 0:
            extra[0] = _extra_keys(request, 0, block_size)
        pieces.append((_Run(group, rid, hashes[lo:hi], hashes[lo - 1] if lo else None,
                            tokens[lo * block_size:hi * block_size], extra, name), 0, hi - lo))
    return pieces


def _pieces_of(runs: Sequence[_Run], positions: Sequence[int]) -> list[Piece]:
    """Blocks given one by one (each its run and its position there) as pieces: one per
    stretch of consecutive positions of one run."""
    out: list[Piece] = []
    for run, i in zip(runs, positions, strict=True):
        if out and out[-1][0] is run and out[-1][2] == i:
            out[-1] = (run, out[-1][1], i + 1)
        else:
            out.append((run, i, i + 1))
    return out


def _job_pieces(hashes: Sequence[bytes], runs: Sequence[_Run | None]) -> list[Piece]:
    """A save job's blocks that landed (`runs`: each one's planned run, None for one not
    planned) as pieces. A job saves a stretch of a plan, so a stretch of blocks of one run is
    usually that run's blocks in order: one slice compare then, not a lookup per block."""
    n = len(runs)
    if not n:
        return []
    cuts = [0, *itertools.compress(range(1, n), map(operator.is_not, runs[1:], runs)), n]
    out: list[Piece] = []
    for a, b in itertools.pairwise(cuts):
        run = runs[a]
        if run is None:
            continue
        p = 0 if run.hashes[0] == hashes[a] else run.index()[hashes[a]]
        if run.hashes[p:p + b - a] == list(hashes[a:b]):
            out.append((run, p, p + b - a))
        else:
            index = run.index()
            out += _pieces_of([run] * (b - a), [index[h] for h in hashes[a:b]])
    return out


def _stretches(indices: Sequence[int]) -> list[tuple[int, int]]:
    """`(first, end)` of each stretch of consecutive values of `indices` (ascending)."""
    n = len(indices)
    if n == 0:
        return []
    if indices[-1] - indices[0] == n - 1:  # ascending and distinct: a gap would widen it
        return [(indices[0], indices[-1] + 1)]
    cuts = [0, *(k for k in range(1, n) if indices[k] != indices[k - 1] + 1), n]
    return [(indices[a], indices[b - 1] + 1) for a, b in itertools.pairwise(cuts)]


# The KV cache group kinds whose blocks are announced: every router indexes these. A
# sliding-window group's blocks are not: its store blocks serve only beside the full group's,
# and a router that keys a store block by hash alone would let the window's removals (it keeps
# only its window) erase the full group's credit for the same hash.
ANNOUNCED_KINDS = (None, "full_attention", "mla_attention")
# Requests whose save plans are kept until they settle. Every request settles (its saves
# report done, or it finishes while loading): the bound only catches one that never would.
# Not kv_events_queue, which counts blocks: at a small setting more requests save at once
# than it has blocks, and a live plan lost then left its run uncut when it settled, and its
# unlanded blocks planned, later counted as dropped events. Far above any engine's running
# requests (vLLM's max_num_seqs) plus those finishing their saves.
MAX_PLANS = 16_384


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
                 wake: Callable[[], None] = lambda: None,
                 where: Callable[[], str] | None = None) -> None:
        self.settings = settings
        # the sweep's address, asked each round (`sweep_address`: an HA leader moves); None:
        # settings.master_http (not a lambda over self: a log in a cycle waits for the collector)
        self._where = where
        self._tp_size, self._block_size = tp_size, block_size
        self._keys, self._shards, self._count = keys, shards, count
        self._spec = tuple(spec_kinds)
        self._wake = wake
        self._lock = threading.Lock()
        # planned saves -> the block's run; and of those some TP ranks reported landed but not
        # all, a bit per rank that did
        self._planned: OrderedDict[Key, _Run] = OrderedDict()
        self._ranks: dict[Key, int] = {}
        self._plans: dict[str, list[_Run]] = {}  # each request's planned runs, until settled
        # settled saves' blocks not reported landed by every rank: a save past its deadline is
        # settled (its blocks went back to vLLM) while its put may still store them, and its
        # ranks' reports come after. Kept, oldest out first, so such a block is announced
        # when they do (its rank bits stay in `_ranks`); one that never lands ages out.
        self._late: OrderedDict[Key, _Run] = OrderedDict()
        self._everyone = (1 << tp_size) - 1  # the ranks bits of a block every rank reported
        # announced blocks -> (when the store was last seen holding it, the run it was
        # announced from: one tuple per run announced together, shared by its blocks)
        self._live: OrderedDict[Key, tuple[float, _Run]] = OrderedDict()
        self._queue: deque[tuple[str, KVCacheEvent]] = deque()
        self._queued_blocks = 0  # blocks the queued events carry (bounded by settings.queue)
        self._repeat: deque[Key] = deque()  # live blocks to announce again
        self._uncounted = False  # events taken whose count no stats collection has shipped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sweep_failing = False
        self._sweep_keys = SWEEP_KEYS
        self._withdrawn = False  # this engine stopped using the store (`withdraw_all`)
        self._held: set[Key] = set()  # live blocks whose removal waits for room

    def _address(self) -> str:
        return self._where() if self._where is not None else self.settings.master_http

    def _announced(self, group: int) -> bool:
        kind = self._spec[group][0] if group < len(self._spec) else None
        return kind in ANNOUNCED_KINDS

    # -- stored
    def planned(self, request: Any, indices: Sequence[int], group: int) -> None:
        """A save of blocks `indices` (ascending) of `request` (group `group`) goes to the
        workers: a new attempt, whose ranks report afresh (an earlier attempt's ranks may have
        lost theirs)."""
        if not self._announced(group) or not indices:
            return
        runs = [run for run, _, _ in _runs_of(request, indices, group, self._block_size)]
        with self._lock:
            planned, ranks, late = self._planned, self._ranks, self._late
            left: dict[_Run, None] = {}  # late parts some of whose blocks left the late list
            for run in runs:
                keys = _keys(group, run.hashes)
                for key in list(filter(planned.__contains__, keys)):
                    del planned[key]  # planned again: a fresh attempt, last in line
                    ranks.pop(key, None)
                if late:
                    for key in list(filter(late.__contains__, keys)):
                        left[late.pop(key)] = None
                        ranks.pop(key, None)
                for key in keys:  # faster than OrderedDict.update
                    planned[key] = run
            self._cut_late(left)
            self._plans.setdefault(request.request_id, []).extend(runs)
            while len(self._plans) > MAX_PLANS:  # requests that never settled
                self._plans.pop(next(iter(self._plans)))
            while len(planned) > self.settings.queue:
                key, _ = planned.popitem(last=False)
                ranks.pop(key, None)
                self._count("kv_events_dropped", "stored")

    def settled(self, req_id: str) -> None:
        """Every rank finished `req_id`'s saves: its blocks that not every rank reported are
        not stored yet. Most never will be (each failure is counted in save_error_keys), but
        a save that ran past its deadline is finished while its put goes on, and what that
        put stores is reported later: those blocks wait in `_late` for their reports."""
        with self._lock:
            planned, late = self._planned, self._late
            for run in self._plans.pop(req_id, ()):
                keys = _keys(run.group, run.hashes)
                mine = map(operator.is_, map(planned.get, keys), itertools.repeat(run))
                left = list(itertools.compress(range(len(keys)), mine))
                for lo, hi in _stretches(left):  # each its own part: what a late block keeps
                    part = run if hi - lo == len(keys) else run.part(lo, hi, self._block_size)
                    for key in keys[lo:hi]:
                        del planned[key]
                        late.pop(key, None)
                        late[key] = part
                self._cut(run)  # some of it landed at most: what did is all it keeps
            gone: dict[_Run, None] = {}
            while len(late) > self.settings.queue:  # never landed: not news, not counted
                key, part = late.popitem(last=False)
                self._ranks.pop(key, None)
                gone[part] = None
            self._cut_late(gone)

    def _cut_late(self, parts: Iterable[_Run]) -> None:
        """(Under the lock.) Late parts some of whose blocks left the late list unlanded (aged
        out, or planned again): one with blocks announced meanwhile is cut down to what is
        live (`_cut`), or a block that landed late would keep its whole stretch's tokens."""
        for part in parts:
            if part.live:
                self._cut(part)

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
        planned, partial, everyone = self._planned, self._ranks, self._everyone
        pieces: list[Piece] = []
        landed: list[Key] = []  # their blocks' keys, in order
        with self._lock:
            late = self._late
            for (group, hashes), ranks in jobs.items():
                keys = _keys(group, hashes)
                # A block neither planned nor late was announced already (a repeat) or dropped.
                if ranks == everyone:  # every rank's report came in this step: all landed
                    got = list(map(planned.pop, keys, itertools.repeat(None)))
                    if late and None in got:
                        got = [run if run is not None else late.pop(key, None)
                               for key, run in zip(keys, got, strict=True)]
                    if partial:
                        for key in keys:
                            partial.pop(key, None)
                    pieces += _job_pieces(hashes, got)
                    landed += itertools.compress(keys, map(operator.is_not, got,
                                                           itertools.repeat(None)))
                    continue
                runs: list[_Run] = []
                positions: list[int] = []
                for key, h in zip(keys, hashes, strict=True):
                    waits = planned
                    run = planned.pop(key, None)
                    if run is None and late:
                        waits, run = late, late.pop(key, None)
                    if run is None:
                        continue
                    bits = ranks | partial.pop(key, 0)
                    if bits != everyone:  # some ranks still to report: back in line, last
                        waits[key], partial[key] = run, bits
                        continue
                    runs.append(run)
                    positions.append(run.index()[h])
                    landed.append(key)
                pieces += _pieces_of(runs, positions)
            self._announce(pieces, landed, now)

    def loaded(self, request: Any, indices: Sequence[int], group: int, seen: float) -> None:
        """This engine loads blocks `indices` (ascending) of `request`, which a lookup started
        at `seen` (perf_counter) found stored: the store holds them for this engine too (news
        for those not live, and a later sighting of those that are)."""
        if not self._announced(group):
            return
        keys = _keys(group, map(request.block_hashes.__getitem__, indices))
        with self._lock:
            held = list(map(self._live.__contains__, keys))
            if any(held):
                self._confirm(list(itertools.compress(keys, held)), seen)
                indices = list(itertools.compress(indices, map(operator.not_, held)))
                keys = list(itertools.compress(keys, map(operator.not_, held)))
        pieces = _runs_of(request, indices, group, self._block_size)  # outside the lock:
        with self._lock:                                               # the sweep takes it
            self._announce(pieces, keys, seen)

    def _announce(self, pieces: Sequence[Piece], keys: Sequence[Key],
                  seen: float) -> None:
        """(Under the lock.) The store holds blocks `pieces` (`keys`: theirs, in order, made
        once per block by the caller): live from `seen` on. Those not
        live yet are announced, as many as the queue has room for (the rest dropped, counted,
        and not live); each run of them, every block the child of the one before, in one
        `BlockStored`, as vLLM's own events carry a request's blocks. A live block is stored
        again (or was skipped): still live, confirmed now."""
        live, room = self._live, max(0, self.settings.queue - self._queued_blocks)
        again: list[Key] = []
        kept: list[Piece] = []
        short: dict[_Run, None] = {}  # runs whose blocks did not all fit
        dropped = at = 0
        for run, a, b in pieces:
            mine, at = keys[at:at + b - a], at + b - a
            held = list(map(live.__contains__, mine))
            spans = [(0, b - a)]
            if any(held):
                again += itertools.compress(mine, held)
                spans = _stretches(list(itertools.compress(range(b - a),
                                                           map(operator.not_, held))))
            entry = (seen, run)  # one per piece, shared by its blocks
            for lo, hi in spans:
                n = min(hi - lo, room)
                if n < hi - lo:
                    dropped += hi - lo - n
                    short[run] = None
                if n:
                    room -= n
                    run.live += n
                    for key in mine[lo:lo + n]:  # faster than OrderedDict.update
                        live[key] = entry
                    kept.append((run, a + lo, a + lo + n))
        if dropped:
            self._count("kv_events_dropped", "stored", n=dropped)
        self._confirm(again, seen)
        for event in _event_runs(kept):
            self._push("stored", self._stored_event(event), sum(e - s for _, s, e in event))
        for r in short:
            self._cut(r)
        self._trim()

    def _confirm(self, keys: Iterable[Key], seen: float) -> None:
        """(Under the lock.) Live blocks the store was seen holding at `seen`: live from then
        on at least, and last in line for the live bound."""
        live = self._live
        for key in keys:
            was = live.get(key)
            if was is None:
                continue
            if seen > was[0]:
                live[key] = (seen, was[1])
            live.move_to_end(key)

    def _unlive(self, keys: Sequence[Key]) -> None:
        """(Under the lock.) Live blocks `keys` (distinct) leave the live set. Each run they
        referred to is cut once after (`_cut`), not at every block: past the live bound each
        block announced withdraws an old one, and a call per block cost a long prompt's
        announcement into a full live set more than the announcement itself."""
        runs = Counter(map(operator.itemgetter(1), map(self._live.pop, keys)))
        for run, n in runs.items():
            run.live -= n
            self._cut(run)
        if self._held:
            self._held.difference_update(keys)

    def _cut(self, run: _Run) -> None:
        """(Under the lock.) A run under a quarter of whose blocks are live is cut down to
        stretches of those: a run is kept whole only while most of it is live, or a hot block
        would keep a long prompt's tokens. Asked when a block leaves the live set, when blocks
        of the run did not fit in the queue, and when a request's saves settled (the blocks
        that never landed are then known)."""
        if run.live * 4 >= len(run.hashes) or run.live <= 0:  # whole, or none to keep
            return
        live, keys = self._live, _keys(run.group, run.hashes)
        kept = [i for i, key in enumerate(keys)
                if (was := live.get(key)) is not None and was[1] is run]
        for lo, hi in _stretches(kept):
            part = run.part(lo, hi, self._block_size)
            part.live = hi - lo
            for key in keys[lo:hi]:
                live[key] = (live[key][0], part)
        run.live = 0  # no live block refers to it now (a save of it may land later)

    def _trim(self) -> None:
        """(Under the lock.) Past `kv_events_max_live` (every block, once withdrawn), the
        oldest live blocks are announced removed. One whose removal the full queue cannot take
        stays live (a router would otherwise credit it for good): the next `take` makes room
        and trims again."""
        limit, source = (0, "reset") if self._withdrawn else (self.settings.max_live,
                                                              "live_limit")
        excess = len(self._live) - limit
        if excess > 0:
            self._remove(list(itertools.islice(self._live, excess)), source)

    def withdraw_all(self, routers_cleared: bool) -> None:
        """This engine stopped using the store (its connector cache was reset): no planned
        save is announced, nothing is announced again after vLLM's `AllBlocksCleared`, and
        the live blocks leave: silently where vLLM's `AllBlocksCleared` for this reset is
        queued (`routers_cleared`: routers empty every tier of the engine on it, and a removal
        after it would name a block they no longer hold), else each announced removed, as
        many as the queue takes now and the rest at the next `take`s. With
        `routers_cleared`, the queued events go too: vLLM publishes them after its
        `AllBlocksCleared`, so an announcement among them would credit this engine with a
        block it never withdraws."""
        with self._lock:
            self._withdrawn = True
            self._planned.clear()
            self._late.clear()
            self._ranks.clear()
            self._plans.clear()
            self._repeat.clear()
            if routers_cleared:
                self._queue.clear()
                self._queued_blocks = 0
                self._drop_live()
                return
            self._trim()
        self._wake()  # an idle engine publishes them now

    def _drop_live(self) -> None:
        """(Under the lock.) Every live block leaves the live set, unannounced."""
        self._unlive(list(self._live))

    def _stored_event(self, pieces: Sequence[tuple[_Run, int, int]]) -> BlockStored:
        """One `BlockStored` for blocks of one group, each the child of the one before: the
        `[start, end)` positions of each run in `pieces`, in order."""
        first, start, _ = pieces[0]
        group, bs = first.group, self._block_size
        kind, window = self._spec[group] if group < len(self._spec) else (None, None)
        if len(pieces) == 1 and pieces[0][1:] == (0, len(first.hashes)):  # a whole run, as
            hashes, tokens, extra = first.hashes, first.tokens, first.extra_keys  # it is
        elif len(pieces) == 1:
            run, a, b = pieces[0]
            hashes, tokens, extra = run.hashes[a:b], run.tokens[a * bs:b * bs], \
                run.extra_keys[a:b]
        else:
            hashes, tokens, extra = [], [], []
            for run, a, b in pieces:
                hashes += run.hashes[a:b]
                tokens += run.tokens[a * bs:b * bs]
                extra += run.extra_keys[a:b]
        parent = first.parent_of(start)
        return BlockStored(
            block_hashes=external_hashes(hashes),
            parent_block_hash=external_hash(parent) if parent is not None else None,
            token_ids=tokens, block_size=bs, lora_id=None, medium=self.settings.medium,
            lora_name=first.lora_name, extra_keys=extra, group_idx=group,
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window,
            locality=self.settings.locality)

    def cleared(self) -> None:
        """vLLM is about to publish `AllBlocksCleared` for this engine (its prefix cache was
        reset), which routers apply to every tier, the store's included: announce every live
        block again after it, a queue's worth per step (`take`)."""
        with self._lock:
            if self._withdrawn:  # being withdrawn: routers just dropped them all
                self._drop_live()
                return
            self._repeat = deque(self._live)

    # -- removed
    def _remove(self, keys: Sequence[Key], source: str) -> int:
        """(Under the lock.) Live blocks `keys` (distinct, in order) leave the live set,
        announced removed, as many as the queue has room for; returns how many. The rest stay
        live, for a later query or `take` to try again; the first of them is counted (kind
        removed) the first time only, not at every try. One `BlockRemoved` per group carries
        them all: an event per block made a trim of a long prompt's blocks past the live
        bound cost tens of milliseconds in the scheduler's step, mostly the collector's walks
        over the objects it made."""
        n = min(len(keys), max(0, self.settings.queue - self._queued_blocks))
        if n < len(keys) and keys[n] not in self._held:
            self._held.add(keys[n])
            self._count("kv_events_dropped", "removed")
        if not n:
            return 0
        taken = keys[:n]
        groups: dict[int, list[bytes]] = {}
        if all(map(bytes.__instancecheck__, taken)):  # group 0 only: nearly every model
            groups[0] = list(taken)
        else:
            for group, h in map(_block, taken):
                groups.setdefault(group, []).append(h)
        for group, hashes in groups.items():
            self._push("removed", BlockRemoved(
                block_hashes=external_hashes(hashes), medium=self.settings.medium,
                group_idx=group, locality=self.settings.locality), len(hashes))
        self._unlive(taken)
        self._count("kv_events_removals", source, n=n)
        return n

    def missing(self, blocks: Iterable[tuple[int, bytes]], source: str, before: float) -> int:
        """Blocks a store query found gone: each one announced before `before` (the query's
        start, perf_counter) is announced removed. Returns how many. A removal the full queue
        cannot take stays live, for the next query to find again."""
        return self._missing(itertools.starmap(_key, blocks), source, before)

    def _missing(self, keys: Iterable[Key], source: str, before: float) -> int:
        """`missing`, of blocks given by their keys."""
        with self._lock:
            live = self._live
            gone = [key for key in dict.fromkeys(keys)
                    if (seen := live.get(key)) is not None and seen[0] < before]
            n = self._remove(gone, source) if gone else 0
        if n:
            self._wake()  # an idle engine publishes them now, not at its next request
        return n

    def live(self) -> list[tuple[int, bytes]]:
        """The live blocks, (group, hash) each, oldest first."""
        with self._lock:
            return list(map(_block, self._live))

    # -- queue
    def _push(self, kind: str, ev: KVCacheEvent, blocks: int = 1) -> bool:
        """Queue an event of `blocks` blocks (under the lock); False when the queue
        (`kv_events_queue` blocks) has no room for them (a `BlockStored` is then dropped and
        counted here; a removal waits: `_remove`)."""
        if self._queued_blocks + blocks > self.settings.queue:
            if kind == "stored":
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
            keys: list[Key] = []
            runs: list[_Run] = []
            while self._repeat and len(keys) < room:
                key = self._repeat.popleft()
                live = self._live.get(key)
                if live is not None:
                    keys.append(key)
                    runs.append(live[1])
            positions = [run.index()[_block(key)[1]]
                         for run, key in zip(runs, keys, strict=True)]
            queued += [("stored", self._stored_event(p))
                       for p in _event_runs(_pieces_of(runs, positions))]
            self._trim()  # what a full queue held back, for the next take
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
        client: MasterKeys | None = None
        while not self._stop.wait(self.settings.sweep_s):
            t0 = time.perf_counter()
            try:
                where = self._address()
                if client is None or client.address != where:
                    if client is not None:
                        client.close()
                    client = MasterKeys(where, timeout=max(1.0, min(10.0, self.settings.sweep_s)))
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
                                   self.settings.sweep_target, e)
            finally:
                self._count("kv_events_sweep_seconds", n=time.perf_counter() - t0)
        if client is not None:
            client.close()

    def sweep(self, client: MasterKeys | None = None) -> int:
        """One round over every live block, in batches; returns the blocks announced removed.
        A batch whose query fails raises (nothing is removed on a guess)."""
        own = client is None
        client = client or MasterKeys(self._address())
        with self._lock:
            blocks = list(self._live)
        removed = i = 0
        try:
            while i < len(blocks) and not self._stop.is_set():
                batch = blocks[i:i + max(1, self._sweep_keys // self._shards)]
                keys = self._batch_keys(batch)
                t0 = time.perf_counter()
                flat = [k for ks in keys for k in ks]
                try:
                    present = client.query(flat)
                except UrlTooLong as e:
                    if self._sweep_keys == SWEEP_KEYS_SHORT:
                        raise
                    self._sweep_keys = SWEEP_KEYS_SHORT
                    logger.warning("KV event sweep: %s; asking %d keys a request from now on",
                                   e, SWEEP_KEYS_SHORT)
                    continue
                self._count("kv_events_sweep_keys", n=len(flat))
                gone = [b for b, ks in zip(batch, keys, strict=True)
                        if not all(present.get(k, False) for k in ks)]
                removed += self._missing(gone, "sweep", t0)
                i += len(batch)
        finally:
            if own:
                client.close()
        return removed

    def _batch_keys(self, batch: Sequence[Key]) -> list[list[str]]:
        """Each block's store keys (every shard's), one key-builder call per group."""
        n, out = self._shards, [[] for _ in batch]
        groups: dict[int, list[int]] = {}
        for j, key in enumerate(batch):  # no tuple made per block of group 0 (`Key`)
            groups.setdefault(0 if isinstance(key, bytes) else key[0], []).append(j)
        for g, at in groups.items():
            flat = self._keys([batch[j][1] if g else batch[j] for j in at], g)
            for k, j in enumerate(at):
                out[j] = flat[k * n:(k + 1) * n]
        return out

    def shutdown(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def _event_runs(pieces: Sequence[Piece]) -> list[list[Piece]]:
    """Pieces (in order) cut where the next block is not the child of the one before (another
    group, parent, or LoRA adapter): one list per `BlockStored`, a piece of one list joined
    to the one before where it goes on where that one ended."""
    events: list[list[Piece]] = []
    for run, a, b in pieces:
        if events:
            last, la, lb = events[-1][-1]
            if run is last and a == lb:  # the same stretch: a request's next block
                events[-1][-1] = (run, la, b)
                continue
            if (run.group == last.group and run.lora_name == last.lora_name
                    and run.parent_of(a) == last.hashes[lb - 1]):
                events[-1].append((run, a, b))
                continue
        events.append([(run, a, b)])
    return events


def _has_extra_keys(request: Any) -> bool:
    """Whether any block of `request` but the first may have extra hash keys (LoRA,
    multimodal input, prompt embeds; a cache salt is the first block's only)."""
    return bool(getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
                or getattr(request, "prompt_embeds", None) is not None)


def _extra_keys(request: Any, start: int, end: int) -> Any:
    """The block's extra hash keys (LoRA, cache salt, multimodal), as vLLM's events carry them.
    A request with none of their sources gives None for every block, known without
    vLLM's per-block walk (a 128K-token prompt has 8,192 blocks)."""
    if not (_has_extra_keys(request) or (start == 0 and getattr(request, "cache_salt", None))):
        return None
    try:
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            to_event_extra_keys,
        )

        keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        return to_event_extra_keys([keys])[0]
    except Exception:  # noqa: BLE001 - a test double or another vLLM: the hash still matches
        return None
