"""Scheduler side: prefix lookup in the store, and which blocks each step loads and saves.

Lookups run on a small executor with the scheduler's own store client (no segment), or the
worker's where it runs in this process (connector.store.process_client), so the engine loop
never waits on the master for more than `lookup_wait_ms`; until the answer is in,
`get_num_new_matched_tokens` returns None and vLLM retries the request next step. A lookup that
errors or exceeds `lookup_timeout_s` is a miss, never an exception in the engine.

A lookup starts when its request arrives (`prefetch`), so its answer is usually in before
vLLM reaches the request in its waiting queue; its `lookup_timeout_s` counts from when vLLM
first asks about the request. Counted from arrival, a burst of arrivals that queued lookups
behind each other made the later ones start past their deadline, skip their store call and
answer "timeout": requests whose prefix was stored were recomputed. Look-ahead is bounded:
at most `lookup_ahead` lookups of requests vLLM has not asked about yet, the next arrivals
starting theirs in arrival order as those are asked about or finish. Unbounded, a flood of
arrivals queued every lookup on the executor, so a request vLLM asked about out of arrival
order (a priority, a long queue) waited behind all of them, past its deadline; and the master
answered, and leased blocks, for requests minutes from being scheduled. A look-ahead hit is
sent to the workers once (`StepMetadata.preloads`), which read the prefix into host memory
while the request waits (`connector.worker.preload`). An answer stands for
`lookup_answer_ttl_s`, the master's lease on what it found: vLLM asking about a request later
than that (a long queue), or again (not admitted), starts a fresh lookup, unless the prefix
is in host memory already.

Against a master that is slow but answers, dead lookups must not pile up ahead of live ones: a
lookup that times out is cancelled if it has not started, one that starts past its deadline
makes no store call, and a running one stops before its next window (a store call in flight
cannot be cancelled; Mooncake's RPC timeout bounds it). So the executor holds at most the
lookups of requests still waiting in vLLM, each costing at most one call past its deadline,
and `shutdown()` closes the client only after every call still running has returned.

KV cache groups (`connector.store.groups`): a prefix is a hit only as far as every group can restore
it (every store shard of each block a group needs); each group loads and saves with its own
block table, a sliding-window group only the window blocks. vLLM frees a sliding-window block
as soon as the request moves past it, while a save may still read it, so the blocks a save
takes from such a group are pinned in vLLM's block pool (`touch`) until the request's saves are
done (reported in finished_sending) or it is preempted (the worker then waits for its saves
before the next forward), including by vLLM's reset of running requests, which needs every block
free before the next step tells of the preemption (`bind_block_pool`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from connector.config import ConnectorConfig
from connector.metadata import BlockTransfer, Preload, StepMetadata, WorkerReport
from connector.observability.events import LookupEvent, Publisher
from connector.observability.stats import StatsRecorder
from connector.observability.ttft import LoadTimes, RequestClock
from connector.scheduler.gauge_refresh import GaugeRefresh
from connector.scheduler.load_deps import LoadDeps
from connector.scheduler.load_failures import in_step_allowed
from connector.scheduler.prefix_probe import Late, PrefixProbe
from connector.scheduler.step_loads import StepLoadPolicy
from connector.store.client import (
    EXCEPTION_CODE,
    StoreError,
    error_code_label,
)
from connector.store.groups import FULL, ONE_FULL, GroupSpec
from connector.store.keys import KeyBuilder
from connector.store.process_client import scheduler_store

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level
LOOKUP_CLIENT_BUFFER = 16 * 2**20


@dataclass
class _Tracked:
    """Save cursor of a running request."""

    request: Any
    saved_upto: int  # tokens whose blocks are in the store (or being written)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group


@dataclass
class _Deadline:
    """When a lookup must stop making store calls (perf_counter); inf until vLLM asks."""

    at: float = math.inf


@dataclass
class _Lookup:
    future: cf.Future
    deadline: _Deadline  # lookup_timeout_s from when vLLM first asks; inf until then


class MooncakeStoreScheduler:
    def __init__(self, config: ConnectorConfig, keys: KeyBuilder, block_size: int,
                 groups: tuple[GroupSpec, ...] = ONE_FULL,
                 retention: int | None = 0, wake: Callable[[], None] = lambda: None) -> None:
        self.config = config
        self._keys = keys
        self._tp_size = keys.layout.tp_size
        self._shards = keys.layout.shards
        self._groups = groups
        self._retention = retention  # vLLM's prefix_cache_retention_interval
        self._block_size = block_size
        lay = keys.layout
        # A rank can write an object only if it holds all of its heads (store_tp_size >= the
        # TP size); an engine that cannot is a reader of that layout.
        self._save = config.enable_save and lay.shards >= min(lay.tp_size, lay.num_kv_heads)
        self._pool: Any = None  # vLLM's BlockPool, for pins
        self._pins: dict[str, list[int]] = {}
        # The worker's handle where it runs in this process (connector.store.process_client)
        self._store = scheduler_store(config.store, 0, LOOKUP_CLIENT_BUFFER,
                                      config.on_master_unreachable, config.store_timeout_s,
                                      on_probe_error=lambda: self.recorder.count(
                                          "master_probe_errors", 0))
        self._executor = cf.ThreadPoolExecutor(2, thread_name_prefix="mcpool-lookup")
        self._closed = False  # shut down (once: a shared client counts its users' closes)
        self.gauges = GaugeRefresh(wake)  # idle steps while a worker's gauges move
        self._lookups: dict[str, _Lookup] = {}
        # Lookups started before vLLM asked (lookup_ahead): their prefixes' hashes.
        self._ahead: dict[str, tuple[bytes, ...]] = {}
        # Host-memory preloads of their hits (connector.worker.preload), each sent once:
        # req_id -> the ranks that reported it read whole (all of them: its load is a copy).
        self._preload = (config.preload_buffer_size > 0 and len(groups) == 1
                         and groups[0].kind == FULL)
        self._preloaded: dict[str, int] = {}
        self._arrived: OrderedDict[str, Any] = OrderedDict()  # arrivals waiting for a turn
        self._abandoned: list[cf.Future] = []  # timed out or finished while running
        # req_id -> (block-aligned tokens found in the store, the request's num_preemptions
        # then: an answer from before a preemption is not the next admission's)
        self._hits: dict[str, tuple[int, int]] = {}
        self._seen: dict[str, float] = {}  # req_id -> when its lookup answered (perf_counter)
        self._tracked: dict[str, _Tracked] = {}
        self._admitted: set[str] = set()  # requests allocated since the last step's metadata
        self._loads: list[BlockTransfer] = []
        self._sync_loads: list[BlockTransfer] = []  # loads the step waits for (step_loads)
        self._sync: dict[str, bool] = {}  # req_id -> its load goes inside the step
        # requests computing on blocks whose in-step load is not known good (load_deps)
        self._load_deps = LoadDeps()
        self._loading: set[str] = set()
        self._saved: set[str] = set()
        self._free_after: list[str] = []
        self.recorder = StatsRecorder()
        self.events = Publisher(self.recorder)
        # where a store hit's TTFT goes
        self.clock = RequestClock(self.events, self._tp_size, self.recorder.count)
        # No in-step loads where a failed one could not be reported (load_failures).
        self._step_loads = StepLoadPolicy(
            config.sync_load_ms / 1e3 if in_step_allowed(groups) else 0.0)
        # vLLM asks about every waiting request in one step: the wait for lookups is a budget
        # per step (reset in build_connector_meta), not per request.
        self._step_budget_s = config.lookup_wait_ms / 1e3
        self.step_waited_s = 0.0
        # Lookups wait for the layout the workers registered (their WorkerReport), at most
        # lookup_timeout_s from the first request; after that they are misses until it comes.
        self._keys_ready = False
        self._signatures: dict[int, str] = {}
        self._layout_wait_since: float | None = None
        self._layout_late = False
        # Store KV events (observability.kv_events.StoreEventLog), set by the connector when on.
        self.kv_events: Any = None

    @property
    def saves(self) -> bool:
        """Whether this engine stores blocks (enable_save, and a layout its ranks can write)."""
        return self._save

    def add_subscriber(self, sub: Any) -> None:
        self.events.add(sub)

    def add_layout(self, signatures: dict[int, str]) -> None:
        """Key lookups by the KV layout the workers registered, once every rank reported."""
        self._signatures.update(signatures)
        if self._keys_ready or len(self._signatures) < self._tp_size:
            return
        distinct = set(self._signatures.values())
        if len(distinct) != 1:
            logger.error("the TP ranks registered different KV layouts %s; blocks cannot be "
                         "keyed safely, so this engine never loads from or saves to the store",
                         sorted(distinct))
            self._store_off()
            self._keys_ready = True
            return
        self._keys = self._keys.with_signature(distinct.pop())
        self._keys_ready = True
        logger.info("store keys: layout fingerprint %s", self._keys.fingerprint)

    def _layout_pending(self) -> bool:
        """True while a lookup should wait for the workers' layout (bounded)."""
        if self._keys_ready:
            return False
        now = time.perf_counter()
        if self._layout_wait_since is None:
            self._layout_wait_since = now
        if now - self._layout_wait_since < self.config.lookup_timeout_s:
            return True
        if not self._layout_late:
            self._layout_late = True  # log once
            logger.warning("no KV layout from the workers after lookup_timeout_s=%.1fs; "
                           "lookups are misses until it arrives", self.config.lookup_timeout_s)
        return False

    # ---- lookup ----------------------------------------------------------------------------
    def _lookup_range(self, request: Any) -> int:
        """Blocks worth looking up: full blocks, leaving at least one token to compute."""
        return (request.num_tokens - 1) // self._block_size

    def prefetch(self, request: Any) -> None:
        """Start the lookup when the request arrives, so the scheduler rarely has to wait; or,
        with `lookup_ahead` lookups of requests vLLM has not asked about running or answered,
        once its turn comes."""
        if self.config.enable_load and self._keys_ready and self._lookup_range(request) > 0:
            self.clock.arrived(request.request_id, getattr(request, "trace_headers", None))
            self._arrived[request.request_id] = request
            self._look_ahead()
            if request.request_id in self._arrived:
                self.recorder.count("lookups_deferred")

    def _look_ahead(self) -> None:
        """Start the lookups of the earliest arrivals while fewer than `lookup_ahead` lookups
        wait for vLLM to ask."""
        while self._arrived and len(self._ahead) < self.config.lookup_ahead:
            rid, request = self._arrived.popitem(last=False)
            hashes = tuple(request.block_hashes[:self._lookup_range(request)])
            if self._submit(rid, hashes):
                self._ahead[rid] = hashes

    def _asked(self, rid: str) -> None:
        """vLLM reached `rid`, or it finished: it no longer waits for, or holds, a turn."""
        self._arrived.pop(rid, None)
        if self._ahead.pop(rid, None) is not None:
            self._look_ahead()

    def _preloads(self) -> tuple[Preload, ...]:
        """The hits of look-ahead lookups answered since the last step: the workers may read
        those prefixes into host memory while their requests wait."""
        if not self._preload:
            return ()
        out = []
        for rid, hashes in self._ahead.items():
            lk = self._lookups.get(rid)
            if rid in self._preloaded or lk is None or not lk.future.done():
                continue
            self._preloaded[rid] = 0
            if lk.future.exception() is None:
                blocks = lk.future.result()[0] // self._block_size
                if blocks:
                    out.append(Preload(rid, hashes[:blocks]))
        return tuple(out)

    def _submit(self, rid: str, hashes: Sequence[bytes]) -> _Lookup | None:
        lk = self._lookups.get(rid)
        if lk is None and self._store.ready() is not None:
            deadline = _Deadline()
            lk = self._lookups[rid] = _Lookup(self._executor.submit(
                self._lookup, tuple(hashes), deadline), deadline)
        return lk

    def _drop(self, lk: _Lookup) -> None:
        """Give a lookup up: cancelled if it has not started, else kept for `shutdown()`
        until its store call returns (it stops at its next window). The keys it asked still
        count once it ends: `lookup_keys` is what the master answered, used or not."""
        lk.deadline.at = 0.0
        if lk.future.cancel():
            return
        lk.future.add_done_callback(self._count_dropped_keys)
        if not lk.future.done():
            self._abandoned = [f for f in self._abandoned if not f.done()] + [lk.future]

    def _abandon(self, rid: str) -> None:
        """`rid` finished, or the store was turned off, before its lookup's answer was used:
        give the lookup up and count it in `lookups` as abandoned. Without this a look-ahead
        lookup of a request that left the queue unasked (a client abort) was never counted,
        so `lookups` missed master traffic that `lookup_keys` showed; with it every lookup
        started counts once, by how it ended."""
        lk = self._lookups.pop(rid, None)
        if lk is not None:
            self.recorder.count("lookups", "abandoned")
            self._drop(lk)

    def _count_dropped_keys(self, future: cf.Future) -> None:
        """Done callback of a lookup that started (one cancelled first asked nothing)."""
        if future.exception() is None:
            self.recorder.count("lookup_keys", n=future.result()[1].keys)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self.config.enable_load:
            return 0, False
        self._asked(request.request_id)
        if not self._keys_ready:
            return (None, False) if self._layout_pending() else (0, False)
        max_blocks = self._lookup_range(request)
        if max_blocks * self._block_size <= num_computed_tokens:
            return 0, False
        rid = request.request_id
        preemptions = getattr(request, "num_preemptions", 0)
        found = self._hits.get(rid)
        if found is not None and found[1] != preemptions:
            # Preempted since: by vLLM's reset_prefix_cache(reset_running_requests), outside
            # a step, so no metadata told of it before this admission. A fresh one.
            self._forget(rid)
            found = None
        elif found is not None and self._aged(rid, self._seen.get(rid, math.inf)):
            # vLLM asks again past the answer's lease: a fresh lookup (not after a failed
            # load: its "nothing more" has no `_seen`, and never ages)
            del self._hits[rid]
            found = None
        if found is None:
            self._expire(rid)
            hit = self._poll_lookup(rid, request.block_hashes[:max_blocks])
            if hit is None:
                return None, False
            self._hits[rid] = (hit, preemptions)
        else:
            hit = found[0]
        ext = hit - num_computed_tokens
        if ext <= 0:
            return 0, False
        self._sync[rid] = sync = self._step_loads.take(
            ext // self._block_size, self._preloaded.get(rid, 0) >= self._tp_size)
        return ext, not sync

    def _aged(self, rid: str, answered: float) -> bool:
        """Whether an answer of `answered` (perf_counter) is past `lookup_answer_ttl_s`: the
        master's lease on what it found may have ended, so it may be evicted. A prefix every
        rank read into host memory (preload) does not age: its load copies from there."""
        ttl = self.config.lookup_answer_ttl_s
        return (ttl > 0 and time.perf_counter() - answered > ttl
                and self._preloaded.get(rid, 0) < self._tp_size)

    def _expire(self, rid: str) -> None:
        """A look-ahead lookup answered past `lookup_answer_ttl_s` before vLLM asked (a long
        queue): abandoned (its answer is not used), so the ask that follows starts a fresh
        one. Its old answer would load what may be gone (a failed load recomputes the whole
        prefix), or miss what was stored since."""
        lk = self._lookups.get(rid)
        if lk is None or not lk.future.done() or lk.future.cancelled() \
                or lk.future.exception() is not None:
            return
        if self._aged(rid, lk.future.result()[1].t_end):
            self._abandon(rid)

    def _poll_lookup(self, rid: str, hashes: Sequence[bytes]) -> int | None:
        lk = self._submit(rid, hashes)
        if lk is None:
            self.events.lookup(LookupEvent(
                "error", 0, 0, len(hashes) * self._block_size, 0.0,
                self._store.down_code or "unavailable"))
            return 0
        t0 = time.perf_counter()
        if lk.deadline.at == math.inf:  # vLLM reached the request: its lookup gets a deadline
            lk.deadline.at = t0 + self.config.lookup_timeout_s
        read = True  # the lookup's outcome is used here: it ends
        try:
            wait = max(0.0, self._step_budget_s - self.step_waited_s)
            hit_tokens, event = lk.future.result(timeout=wait)
            self.events.lookup(event)  # counted when used, so a timed-out one counts once
            self.clock.answered(rid, event.t_end)
            # The store held the hit by the time the lookup answered: not dated from when it
            # was queued, or a query that missed a block in between withdraws what it found.
            self._seen[rid] = event.t_end
            return hit_tokens
        except cf.TimeoutError:
            now = time.perf_counter()
            if now < lk.deadline.at:
                # Still running, or answered just after the wait gave up: kept for the next
                # ask either way, so an answer is never thrown away and asked for again.
                read = False
                return None
            waited = now - lk.deadline.at + self.config.lookup_timeout_s  # since vLLM asked
            self._drop(lk)  # and out of _lookups below, as a read one
            self.events.lookup(LookupEvent("timeout", 0, 0, len(hashes) * self._block_size,
                                                waited))
            logger.warning("store lookup exceeded lookup_timeout_s=%.3fs; treating as a miss",
                           self.config.lookup_timeout_s)
            return 0
        finally:
            self.step_waited_s += time.perf_counter() - t0
            if read:
                self._lookups.pop(rid, None)

    def _lookup(self, hashes: tuple[bytes, ...], deadline: _Deadline
                ) -> tuple[int, LookupEvent]:
        """Longest prefix every group can restore, in tokens, and its event. Runs on the
        lookup executor (`PrefixProbe`: its windows and round trips). Past `deadline.at`
        (set once vLLM asks) it makes no further store call: a timeout, with the prefix that
        what was already probed proves."""
        t0 = time.perf_counter()
        probe = PrefixProbe(hashes, self._groups, self._shards, self._block_size,
                            self._keys.all_shard_keys, self._exist)
        found, code, late = 0, "", False
        try:
            found = probe.run(deadline)
        except Late:
            late, found = True, probe.proven()
        except Exception as e:  # noqa: BLE001 - any failure is a miss, counted by code
            code = e.code if isinstance(e, StoreError) else EXCEPTION_CODE
            logger.warning("store lookup failed (%s); treating as a miss", e)
            found = 0
        if self.kv_events is not None:  # an announced block a probe missed is gone
            self.kv_events.missing(probe.gone(), "lookup", t0)
        hit_tokens = found * self._block_size
        result = "error" if code else "timeout" if late else ("hit" if found else "miss")
        t_end = time.perf_counter()
        return hit_tokens, LookupEvent(result, probe.keys_asked, hit_tokens,
                                       (len(hashes) - found) * self._block_size,
                                       t_end - t0, code, t_end)

    def _exist(self, keys: list[str]) -> list[int]:
        """The store's batch existence check; a store error code raises (and may open the
        breaker)."""
        res = self._store.require().batch_is_exist(keys)
        if min(res, default=0) < 0:
            self._store.check(res)
            raise StoreError(error_code_label(min(res)))
        return res

    # ---- allocation and per-step metadata --------------------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        rid = request.request_id
        self._admitted.add(rid)
        hit = self._hits.get(rid, (0, 0))[0]
        if num_external_tokens > 0 and rid not in self._loading:
            first, last = (hit - num_external_tokens) // self._block_size, hit // self._block_size
            sync = self._sync.pop(rid, False)  # done before this step's forward
            self._preloaded.pop(rid, None)  # its load takes the rows
            for g, (spec, ids) in enumerate(zip(self._groups, blocks.get_block_ids(),
                                                strict=True)):
                # A sliding-window group gets blocks only for the window before the hit.
                sel, t_ids, t_hashes = self._pick(
                    ids, request.block_hashes,
                    range(max(first, spec.first_needed(last, self._block_size)), last))
                if sel:
                    (self._sync_loads if sync else self._loads).append(BlockTransfer(
                        rid, t_ids, t_hashes, g))
                    if self.kv_events is not None:  # the store holds them for this engine too
                        self.kv_events.loaded(request, sel, g, self._seen.get(rid, 0.0))
            if not sync:
                self._loading.add(rid)
        if self._save and rid not in self._tracked:
            self._tracked[rid] = _Tracked(request, saved_upto=hit)

    def build_connector_meta(self, so: Any) -> StepMetadata:
        saves: list[BlockTransfer] = []
        preempted = tuple(so.preempted_req_ids or ())
        cached = so.scheduled_cached_reqs
        # vLLM also preempts outside a step (reset_prefix_cache with reset_running_requests)
        # and admits those requests again in the next one, which lists them as preempted: the
        # state that admission made (lookup, allocation; its load may be asynchronous) is
        # theirs now.
        for rid in preempted:
            self._unpin(rid)  # handle_preemptions waits for its saves before the next forward
            self.clock.forget(rid)
            if rid not in self._admitted:
                self._forget(rid)
        self._admitted.clear()
        for new in so.scheduled_new_reqs:
            tr = self._tracked.get(new.req_id)
            if tr is not None:
                self._scheduled(tr, new.block_ids, new.num_computed_tokens)
                self._plan_save(tr, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id],
                                saves)
        for i, rid in enumerate(cached.req_ids):
            tr = self._tracked.get(rid)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                self._scheduled(tr, new_ids or (), cached.num_computed_tokens[i])
            elif new_ids is not None:
                for have, ids in zip(tr.block_ids, new_ids, strict=True):
                    have.extend(ids)
            self._plan_save(tr, cached.num_computed_tokens[i] + so.num_scheduled_tokens[rid],
                            saves)
        self.step_waited_s = 0.0  # a new step: a new lookup-wait budget
        self.gauges.stepped()
        now = time.perf_counter()
        self.clock.scheduled((new.req_id for new in so.scheduled_new_reqs), now)
        for mode, loads in (("async", self._loads), ("sync", self._sync_loads)):
            for t in loads:
                self.clock.sent(t.req_id, mode, len(t.block_ids), now)
        self._step_loads.new_step()
        deps = self._step_load_deps(so) if self._sync_loads or self._load_deps.following \
            else ()
        meta = StepMetadata(loads=tuple(self._loads), sync_loads=tuple(self._sync_loads),
                            saves=tuple(saves), free_after_jobs=tuple(self._free_after),
                            preempted=preempted, need_layout=not self._keys_ready,
                            in_step_peers=tuple(so.num_scheduled_tokens)
                            if self._sync_loads else (), preloads=self._preloads(),
                            load_deps=deps)
        self._loads.clear()
        self._sync_loads.clear()
        self._free_after.clear()
        return meta

    def _step_load_deps(self, so: Any) -> tuple[tuple[str, str], ...]:
        """The step's requests on blocks whose in-step load is not known good (load_deps):
        the new and resumed ones with their group 0 blocks, the running ones with the blocks
        they got this step."""
        scheduled = [(new.req_id, new.block_ids[0] if new.block_ids else ())
                     for new in so.scheduled_new_reqs]
        grown = []
        cached = so.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid in cached.resumed_req_ids:
                scheduled.append((rid, ids[0] if ids else ()))
            elif ids:
                grown.append((rid, ids[0]))
        return self._load_deps.step((t.req_id for t in self._sync_loads), scheduled, grown)

    def _forget(self, rid: str) -> None:
        """A request's admission (preempted or finished): its lookup's answer and save
        cursor."""
        self._tracked.pop(rid, None)
        self._hits.pop(rid, None)
        self._seen.pop(rid, None)

    def _scheduled(self, tr: _Tracked, block_ids: Sequence[Sequence[int]], computed: int
                   ) -> None:
        """A request scheduled new or resumed, on blocks `block_ids` from `computed` tokens. A
        load that failed past a valid prefix, or a preemption, left it to recompute from
        there: what it computes goes to the store again (blocks it still holds are skipped)."""
        tr.block_ids = [list(ids) for ids in block_ids]
        bs = self._block_size
        tr.saved_upto = min(tr.saved_upto, computed // bs * bs)

    def _plan_save(self, tr: _Tracked, computed: int, saves: list[BlockTransfer]) -> None:
        req = tr.request
        limit = computed if self.config.save_decode_tokens else min(computed,
                                                                   req.num_prompt_tokens)
        bs = self._block_size
        first = tr.saved_upto // bs
        full = min([limit // bs, len(req.block_hashes), *map(len, tr.block_ids)])
        if full <= first:
            return
        for g, (spec, ids) in enumerate(zip(self._groups, tr.block_ids, strict=True)):
            keep = spec.save_mask(first, full, req.num_prompt_tokens, bs, self._retention)
            sel, t_ids, t_hashes = self._pick(ids, req.block_hashes, range(first, full),
                                              None if all(keep) else keep)
            if not sel:
                continue
            if spec.kind != FULL:
                self._pin(req.request_id, [ids[i] for i in sel])
            if self.kv_events is not None:
                self.kv_events.planned(req, sel, g)
            saves.append(BlockTransfer(req.request_id, t_ids, t_hashes, g))
            self._saved.add(req.request_id)
        tr.saved_upto = full * bs

    def _pick(self, ids: Sequence[int], hashes: Sequence[bytes], blocks: range,
              keep: Sequence[bool] | None = None
              ) -> tuple[Sequence[int], tuple[int, ...], tuple[bytes, ...]]:
        """The blocks of `blocks` a transfer moves (those `keep` marks, or all; never vLLM's
        null block, which pads the blocks a sliding-window group freed), with their block ids
        and hashes. Where it moves them all, as full attention does, it slices: a 128K-token
        prompt's plan then costs no Python per block."""
        null = self._null
        if keep is None and null not in ids[blocks.start:blocks.stop]:
            return (blocks, tuple(ids[blocks.start:blocks.stop]),
                    tuple(hashes[blocks.start:blocks.stop]))
        sel = [i for i, k in zip(blocks, keep or repeat(True), strict=keep is not None)
               if k and ids[i] != null]
        return sel, tuple(map(ids.__getitem__, sel)), tuple(map(hashes.__getitem__, sel))

    # ---- pins of sliding-window blocks under saves ----------------------------------------
    def bind_block_pool(self, pool: Any) -> None:
        self._pool = pool
        # vLLM's reset_prefix_cache(reset_running_requests=True) (pause_generation with
        # clear_cache, mode "keep") preempts every running request outside a step, then fails
        # (raising) unless every block is free: the pins of those requests go first.
        reset = pool.reset_prefix_cache

        def reset_prefix_cache() -> bool:
            self._unpin_preempted()
            return reset()

        pool.reset_prefix_cache = reset_prefix_cache

    @property
    def block_pool(self) -> Any:
        """vLLM's block pool (None until vLLM binds it)."""
        return self._pool

    @property
    def _null(self) -> int:
        """vLLM's null block (padding for blocks a sliding-window group has freed)."""
        return self._pool.null_block.block_id if self._pool is not None else 0

    def _pin(self, rid: str, block_ids: list[int]) -> None:
        if self._pool is None:
            return
        self._pool.touch([self._pool.blocks[b] for b in block_ids])
        self._pins.setdefault(rid, []).extend(block_ids)

    def _unpin_preempted(self) -> None:
        """Release the pins of requests vLLM preempted since the last step. As for any
        preemption, the next step lists them and the worker waits for their saves before its
        forward, so no new owner writes their blocks under a save."""
        from vllm.v1.request import RequestStatus

        for rid in [r for r in self._pins if (tr := self._tracked.get(r)) is not None
                    and tr.request.status == RequestStatus.PREEMPTED]:
            self._unpin(rid)

    def _unpin(self, rid: str) -> None:
        ids = self._pins.pop(rid, None)
        if ids:
            self._pool.free_blocks(self._pool.blocks[b] for b in reversed(ids))

    # ---- completion ------------------------------------------------------------------------
    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_sending or ():
            self._unpin(rid)  # every rank finished the request's saves
        self.clock.seen_done(output.finished_recving or (), time.perf_counter())
        times = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(times, WorkerReport):
            if times.layout:
                self.add_layout(times.layout)
            for rid, ranks in times.preloaded.items():
                if rid in self._preloaded:  # else finished, or its load was planned
                    self._preloaded[rid] += ranks
            self.gauges.report(times.unsettled)
            times = times.load_times
        if isinstance(times, LoadTimes):
            self._step_loads.observe(times)
            self.clock.worker_times(times)
            for rid, load in times.loads.items():
                if not load.in_step:
                    continue
                if load.failed:  # what was computed on its blocks leaves the prefix cache
                    self._evict(self._load_deps.failed(rid))
                elif load.ranks >= self._tp_size:
                    self._load_deps.confirmed(rid)
        for rid in output.finished_recving or ():
            if rid not in self._loading:
                continue  # another MultiConnector member's load: this one's hit stands
            self._loading.discard(rid)
            # A request comes back to the lookup only if its load failed and vLLM recomputes
            # it: answer "nothing more in the store" so it is never re-loaded in a loop.
            if rid in self._hits:
                self._hits[rid] = (0, self._hits[rid][1])
                # and it stands: aged into a fresh lookup (a load fails at load_timeout_s,
                # past lookup_answer_ttl_s), a store that fails every load would have each
                # request load, fail and load again
                self._seen.pop(rid, None)

    def _evict(self, block_ids: set[int]) -> None:
        """Blocks computed on a failed in-step load leave vLLM's prefix cache (load_deps), as
        vLLM evicts a failed load's own under its `fail` policy."""
        if block_ids and self._pool is not None:
            self._pool.evict_blocks(block_ids)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        """Hold the blocks while a job may still touch them.

        A request still loading is freed by vLLM when its load completes (finished_recving);
        one with saves is freed once every rank reports it in finished_sending.
        """
        rid = request.request_id
        self._asked(rid)
        self._preloaded.pop(rid, None)
        self._evict(self._load_deps.finished(rid))
        self._forget(rid)
        self._sync.pop(rid, None)
        self.clock.forget(rid)
        self._abandon(rid)
        if rid in self._loading:  # vLLM frees it when the load ends: no finished_sending
            if rid in self._saved:  # saves of its run before a preemption, ended by then
                self._saved.discard(rid)
                if self.kv_events is not None:
                    self.kv_events.settled(rid)
            return True, None
        if rid in self._saved:
            self._saved.discard(rid)
            self._free_after.append(rid)
            return True, None
        return False, None

    def _store_off(self) -> None:
        """No more lookups, loads or saves for this engine (whether it saves was decided at
        start, from the config as it was then)."""
        self.config = dataclasses.replace(self.config, enable_load=False, enable_save=False)
        self._save = False

    def forget_store(self, routers_cleared: bool) -> bool:
        """vLLM reset its connector cache (`reset_prefix_cache(reset_connector=True)`, which
        `pause_generation(clear_cache=True)` does around a weight update). The store's blocks
        may have been computed with other weights, and what this engine would write may not be
        what the engines sharing its keys expect; the store is shared, so it is not wiped.
        This engine stops loading from and saving to it until it restarts, and withdraws its
        store KV events (`routers_cleared`: vLLM's `AllBlocksCleared` for this reset is
        queued). True: no stored KV reaches this engine any more."""
        if self.config.enable_load or self._save:
            logger.warning(
                "connector cache reset: this engine no longer loads from or saves to the "
                "Mooncake store until it restarts (blocks there may be another weight "
                "version's, and the store is shared, so nothing was removed from it); after a "
                "weight update, restart with a cache_prefix of the new weights' own")
        self._store_off()
        self._tracked.clear()  # no further saves; those in flight still hold their blocks
        self._arrived.clear()
        self._ahead.clear()
        for rid in list(self._lookups):
            self._abandon(rid)
        if self.kv_events is not None:
            self.kv_events.withdraw_all(routers_cleared)
        return True

    def shutdown(self, timeout: float = 2.0) -> None:
        """Cancel queued lookups; close the client once no lookup can still be inside a call
        on it, including those given up on (at once if the running ones end within
        `timeout`, else in the background). Subscribers (tracing) stop first, within
        events.SHUTDOWN_S."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.gauges.shutdown()
        running = [f for f in (*(lk.future for lk in self._lookups.values()), *self._abandoned)
                   if not f.done()]
        _, stuck = cf.wait(running, timeout=timeout)
        try:
            self.events.shutdown()  # the request spans not exported yet: SHUTDOWN_S at most
        finally:
            self._store.close([lambda f=f: cf.wait([f]) for f in stuck])
