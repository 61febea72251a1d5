"""Store KV events against a real master and store node: what Mooncake 0.3.13's master itself
publishes (nothing: hence the sweep), and removals found by the sweep of the master's HTTP
admin port and by scheduler lookups, after real removals and evictions."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput

from connector.config import load_config
from connector.metadata import BlockTransfer, StepMetadata
from connector.observability.kv_event_settings import EventSettings
from connector.observability.kv_events import (
    SWEEP_KEYS,
    StoreEventLog,
    WorkerLanded,
    external_hash,
)
from connector.scheduler.scheduler import MooncakeStoreScheduler
from connector.store.keys import KeyBuilder, Layout
from connector.store.master_http import query_keys, quote
from connector.worker.worker import MooncakeStoreWorker
from devkit.local_cluster import HOST, free_port, local_pool
from tests.worker_kit import LAYERS, NUM_BLOCKS, hashes, kv_caches, run_step

BS = 32
OBJ = 2**20  # one store object (one block, one shard) of 1 MB
BUF = np.ones(OBJ, dtype=np.uint8)  # the source of every put (registered with each client)
SIGNATURE = "CPU_ATTN;[2,B,2,32,32]o[0,1,2,3,4]bfloat16x2"
# A short lease: a block read or written a moment ago can be removed or evicted soon after.
LEASE = ("--default_kv_lease_ttl=200",)


class Counts(Counter):
    def __call__(self, family: str, *labels: object, n: int = 1) -> None:
        self[(family, *labels)] += n


def client_on(master):
    from mooncake.store import MooncakeDistributedStore

    c = MooncakeDistributedStore()
    assert c.setup(HOST, master.metadata_server, 0, 64 * 2**20, "tcp", "", master.address) == 0
    assert c.register_buffer(BUF.ctypes.data, BUF.nbytes) == 0
    return c


def put(client, keys: list[str]) -> list[int]:
    return [client.put_from(k, BUF.ctypes.data, OBJ) for k in keys]


def fill(client, tag: str, done: Callable[[], object], what: str) -> list[int]:
    """Write 1 MB objects `tag-<i>` past the 16 MB store, 8 at a time, until `done()`: Mooncake
    evicts on its own thread, after puts found the memory full (those fail). Bounded by 30 s
    and by 16 times the capacity in puts that succeeded: puts a full store refuses fail at
    once, so a bound on all puts was spent before the eviction thread ran on a busy host. A
    batch refused whole waits 50 ms for that thread. Returns each put's result, in order."""
    results: list[int] = []
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline and results.count(0) < 16 * 16, (
            f"the fault did not land: {what} after {len(results)} 1 MB puts into 16 MB "
            f"(results {dict(Counter(results))})")
        batch = put(client, [f"{tag}-{len(results) + i}" for i in range(8)])
        results += batch
        if 0 not in batch:
            time.sleep(0.05)
    return results


def master_counter(master, name: str) -> float:
    for line in master.metrics_text().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def request(tag: str, n: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=tag, block_hashes=list(hashes(tag, n)),
                           all_token_ids=list(range(n * BS)), lora_request=None,
                           num_tokens=n * BS + 1, num_prompt_tokens=n * BS + 1)


def scheduler_on(master, **extra) -> MooncakeStoreScheduler:
    cfg = load_config(master.store_config(**extra), environ={})
    keys = KeyBuilder("kvev", Layout("m", "bfloat16", BS, 2, 32, 2, 1))
    s = MooncakeStoreScheduler(cfg, keys, BS)
    s.add_layout({0: SIGNATURE})
    return s


def event_log(sched, master, sweep_s: float = 0.0) -> tuple[StoreEventLog, Counts]:
    counts = Counts()
    st = EventSettings("STORAGE", "REMOTE", sweep_s, f"{HOST}:{master.metrics_port}", 1000, 1000)
    log = StoreEventLog(st, 1, BS, lambda hs, g: sched._keys.all_shard_keys(hs, g), 1, counts)
    sched.kv_events = log
    return log, counts


def announce(log: StoreEventLog, client, sched, req) -> list[str]:
    """Write a request's blocks to the store and announce them, as a save would."""
    keys = sched._keys.all_shard_keys(req.block_hashes, 0)
    assert put(client, keys) == [0] * len(keys)
    log.planned(req, range(len(req.block_hashes)), 0)
    log.landed([(0, 0, tuple(req.block_hashes))])
    (ev,) = log.take()  # the request's blocks: one run
    assert ev.block_hashes == [external_hash(h) for h in req.block_hashes]
    return keys


def evicted(master, survivors: dict[str, bytes]) -> set:
    """External hashes of the blocks (key -> hash) the master no longer holds."""
    present = query_keys(f"{HOST}:{master.metrics_port}", list(survivors))
    return {external_hash(h) for k, h in survivors.items() if not present[k]}


def removed_hashes(events) -> set:
    return {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}


@contextlib.contextmanager
def engine_side(sweep_s: float = 0.0, **pool) -> Iterator[tuple]:
    """(master, a plain client, a scheduler, its event log, its counts) on a store of its own;
    the log and scheduler shut down after."""
    with local_pool("16MB", **pool) as (master, _node):
        client = client_on(master)
        sched = scheduler_on(master)
        log, counts = event_log(sched, master, sweep_s)
        try:
            yield master, client, sched, log, counts
        finally:
            log.shutdown()
            sched.shutdown()


def ask(sched: MooncakeStoreScheduler, req) -> tuple:
    """vLLM's ask, again each step while the lookup runs (bounded)."""
    deadline = time.monotonic() + 10
    while (hit := sched.get_num_new_matched_tokens(req, 0))[0] is None:
        assert time.monotonic() < deadline, "lookup never resolved"
    return hit


def new_step(req, ids: list[int], preempted: frozenset = frozenset()) -> SimpleNamespace:
    """A scheduler output: `req` scheduled new on blocks `ids` (none if only preempting)."""
    new = [SimpleNamespace(req_id=req.request_id, block_ids=(ids,), num_computed_tokens=0)]
    return SimpleNamespace(
        preempted_req_ids=set(preempted), scheduled_new_reqs=[] if preempted else new,
        num_scheduled_tokens={} if preempted else {req.request_id: req.num_tokens},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]))


def blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def test_master_publishes_no_kv_events():
    """Mooncake 0.3.13's master takes --enable_kv_events but publishes nothing, on eviction
    or removal: if a later wheel does, this fails and the master's own events can replace the
    sweep (connector/observability/kv_events.py)."""
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with local_pool("16MB", extra_args=(*LEASE, "--enable_kv_events=true",
                                            f"--kv_events_bind_endpoint=tcp://{HOST}:{port}",
                                            )) as (master, _node):
            sub.connect(f"tcp://{HOST}:{port}")
            time.sleep(0.5)  # a SUB misses what is sent before it is connected
            client = client_on(master)
            # Write past the 16 MB until the master evicts.
            results = fill(client, "kvev-master",
                           lambda: master_counter(master, "master_evicted_key_count"),
                           "nothing evicted")
            evicted_keys = master_counter(master, "master_evicted_key_count")
            last = max(i for i, r in enumerate(results) if r == 0)  # the newest: not evicted
            time.sleep(0.3)  # its put's lease (200 ms) ends, or the remove is refused (-706)
            assert client.remove(f"kvev-master-{last}") == 0
            got = []
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                if sub.poll(100):
                    got.append(sub.recv_multipart())
            with urllib.request.urlopen(f"http://{HOST}:{master.metrics_port}/kv_events/status",
                                        timeout=5) as r:
                status = json.loads(r.read())
            # Nothing listens on the endpoint the master was told to bind: this process can.
            probe = ctx.socket(zmq.PUB)
            try:
                probe.bind(f"tcp://{HOST}:{port}")
                bound_by_master = False
            except zmq.ZMQError:
                bound_by_master = True
            finally:
                probe.close(0)
            print(f"evicted {evicted_keys:.0f} keys, removed 1; ZMQ messages {len(got)}; "
                  f"endpoint bound by the master: {bound_by_master}; /kv_events/status {status}")
            assert got == [] and status["enabled"] is False and status["published_events"] == 0
            assert not bound_by_master
    finally:
        sub.close(0)
        ctx.term()


def test_query_keys_grants_no_lease():
    """The sweep's query leaves a block evictable; batch_is_exist would lease it (-706 on a
    remove right after), holding off the store's eviction of every block a sweep looks at."""
    with local_pool("16MB", extra_args=LEASE) as (master, _node):
        client = client_on(master)
        assert put(client, ["kvev-a", "kvev-b"]) == [0, 0]
        time.sleep(0.4)  # the put's lease ends
        assert query_keys(f"{HOST}:{master.metrics_port}", ["kvev-a", "kvev-b", "kvev-c"]) == \
            {"kvev-a": True, "kvev-b": True, "kvev-c": False}
        assert client.remove("kvev-a") == 0
        assert client.batch_is_exist(["kvev-b"]) == [1]
        assert client.remove("kvev-b") == -706  # OBJECT_HAS_LEASE


def test_the_master_answers_a_query_of_sweep_keys_real_keys():
    """The sweep asks SWEEP_KEYS keys a request: the admin port takes that URL (about 28 KB
    of store keys) and answers every key."""
    with local_pool("16MB") as (master, _node):
        client = client_on(master)
        keys = [f"mcpool/Llama-3.1-70B-Instruct/0123456789abcdef/g0s0of1/{i:064x}"
                for i in range(SWEEP_KEYS)]
        assert put(client, keys[:3]) == [0, 0, 0]
        url_bytes = len(quote(",".join(keys)))
        assert url_bytes > 25_000, url_bytes
        assert query_keys(f"{HOST}:{master.metrics_port}", keys) == {
            k: i < 3 for i, k in enumerate(keys)}


def test_sweep_announces_removed_and_evicted_blocks_only():
    with engine_side(extra_args=LEASE) as (master, client, sched, log, counts):
        req = request("sweep", 8)
        keys = announce(log, client, sched, req)
        time.sleep(0.4)
        assert log.sweep() == 0 and log.take() == []  # all there: nothing to say
        for k in keys[:2]:
            assert client.remove(k) == 0
        assert log.sweep() == 2
        assert removed_hashes(log.take()) == {external_hash(h) for h in req.block_hashes[:2]}
        # Eviction: write past the store's capacity until the master has evicted some
        # announced block (the store's own answer, not a fixed number of puts).
        survivors = dict(zip(keys[2:], req.block_hashes[2:], strict=True))
        found: list[set] = []
        results = fill(client, "kvev-filler",
                       lambda: found.append(evicted(master, survivors)) or found[-1],
                       "no announced block evicted")
        before, written = found[-1], len(results)
        gone = log.sweep()
        events = log.take()
        after = evicted(master, survivors)  # the store may evict more meanwhile
        print(f"{written} filler puts (results {dict(Counter(results))}); master evicted "
              f"{master_counter(master, 'master_evicted_key_count'):.0f} keys; announced "
              f"blocks missing before the sweep {len(before)}, after {len(after)}; sweep "
              f"removed {gone} of 6; events {len(events)}")
        assert all(isinstance(e, BlockRemoved) for e in events)
        # Every block gone before the sweep is announced removed, and only blocks gone.
        assert before <= removed_hashes(events) <= after
        assert gone == sum(len(e.block_hashes) for e in events) == len(removed_hashes(events))
        assert len(log.live()) == 6 - gone
        assert counts[("kv_events_removals", "sweep")] == 2 + gone


def test_sweep_thread_and_lookup_find_removals():
    with engine_side(sweep_s=0.2, extra_args=LEASE) as (_master, client, sched, log, counts):
        # A lookup that misses an announced block announces it removed (no sweep yet).
        req = request("lookup", 4)
        keys = announce(log, client, sched, req)
        time.sleep(0.4)
        assert client.remove(keys[2]) == 0
        assert ask(sched, req) == (2 * BS, True)
        assert removed_hashes(log.take()) == {external_hash(req.block_hashes[2])}
        assert counts[("kv_events_removals", "lookup")] == 1
        # The sweep thread finds the next removal by itself.
        log.start()
        time.sleep(0.4)  # the lookup's read lease ends (-706 otherwise, seen)
        assert client.remove(keys[0]) == 0
        got: list = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = log.take()
            time.sleep(0.05)
        print(f"sweep thread events: {got}")
        assert removed_hashes(got) == {external_hash(req.block_hashes[0])}
        assert not any(isinstance(e, BlockStored) for e in got)
        # Its rounds are counted with their length and the keys they asked the master.
        assert counts[("kv_events_sweeps", "ok")] >= 1
        assert counts[("kv_events_sweep_seconds",)] > 0
        assert counts[("kv_events_sweep_keys",)] >= 3  # the three live blocks, once


def test_a_load_is_dated_from_its_lookups_answer_not_from_when_it_was_queued():
    """A lookup queued at S runs late and finds the prompt's blocks stored, after another
    query, started at t0 > S, missed one (another engine stored it again meanwhile): that
    query's removal must not withdraw a block this engine saw stored after it, and loads.
    Dated from when the lookup was queued (S < t0), it was withdrawn."""
    with engine_side() as (_master, client, sched, log, _):
        first = request("dated", 2)
        announce(log, client, sched, first)
        again = SimpleNamespace(**{**vars(first), "request_id": "again"})
        gate, exist = threading.Event(), sched._exist
        sched._exist = lambda keys: (gate.wait(10), exist(keys))[1]
        assert sched.get_num_new_matched_tokens(again, 0) == (None, False)  # queued at S
        t0 = time.perf_counter()  # the other query starts, and will miss a block
        gate.set()
        assert ask(sched, again) == (2 * BS, True)
        sched.update_state_after_alloc(again, blocks([1, 2, 3]), 2 * BS)
        assert log.missing([(0, first.block_hashes[0])], "sweep", t0) == 0
        assert (0, first.block_hashes[0]) in log.live()


def test_a_request_finished_while_loading_after_a_preemption_settles_its_saves():
    """A request computed (its saves planned), preempted, admitted again with a load from the
    store, and aborted during that load: vLLM frees it when the load ends, with no
    finished_sending, so its planned saves settle when it finishes. Before, its plans (the
    prompt's tokens) were kept until `kv_events_queue` newer requests pushed them out."""
    with engine_side() as (_master, client, sched, log, _):
        req = request("reload", 2)
        assert ask(sched, req) == (0, False)  # a lookup past the step's wait budget: None first
        sched.update_state_after_alloc(req, blocks([1, 2, 3]), 0)
        assert sched.build_connector_meta(new_step(req, [1, 2, 3])).saves
        assert "reload" in log._plans
        sched.build_connector_meta(new_step(req, [], preempted=frozenset({"reload"})))
        assert put(client, sched._keys.all_shard_keys(req.block_hashes, 0)) == [0, 0]
        assert ask(sched, req) == (2 * BS, True)
        sched.update_state_after_alloc(req, blocks([4, 5, 6]), 2 * BS)
        assert sched.request_finished(req, [4, 5, 6]) == (True, None)  # held: loading
        assert "reload" not in log._plans


@pytest.mark.parametrize("routers_cleared", [False, True])
def test_a_connector_cache_reset_stops_the_store_and_withdraws_every_block(routers_cleared):
    """vLLM's connector cache reset (as around a weight update): the engine stops looking up
    and saving (the store's blocks may be another weight version's; shared, it is not wiped)
    and withdraws every block it announced: each announced removed, or, where vLLM's
    AllBlocksCleared for the reset is queued, dropped silently (a removal after it would name
    a block routers no longer hold). None is announced again after an AllBlocksCleared, nor
    one whose announcement was still queued (vLLM publishes the connector's events after its
    own: before, such a block was credited to the engine until it restarted)."""
    with engine_side() as (_master, client, sched, log, counts):
        req = request(f"reset-{routers_cleared}", 3)
        keys = announce(log, client, sched, req)
        queued = request(f"queued-{routers_cleared}", 2)  # landed, its event not taken yet
        assert put(client, sched._keys.all_shard_keys(queued.block_hashes, 0)) == [0, 0]
        log.planned(queued, range(2), 0)
        log.landed([(0, 0, tuple(queued.block_hashes))])
        assert sched.forget_store(routers_cleared) is True
        events = log.take()
        both = {external_hash(h) for h in req.block_hashes + queued.block_hashes}
        assert removed_hashes(events) == (set() if routers_cleared else both)
        stored = [(e.block_hashes, e.parent_block_hash) for e in events
                  if isinstance(e, BlockStored)]
        assert stored == ([] if routers_cleared else
                          [([external_hash(h) for h in queued.block_hashes], None)])
        want = set() if routers_cleared else both
        assert counts[("kv_events_removals", "reset")] == len(want) and not log.live()
        log.cleared()  # vLLM's own prefix cache reset: nothing to announce again
        assert log.take() == []
        # No lookup of a prompt the store holds, and no save of one computed.
        calls = []
        sched._exist = lambda keys: calls.append(keys) or [1] * len(keys)
        again = SimpleNamespace(**{**vars(req), "request_id": "again"})
        assert sched.get_num_new_matched_tokens(again, 0) == (0, False) and not calls
        sched.update_state_after_alloc(again, blocks([1, 2, 3, 4]), 0)
        assert not sched.build_connector_meta(new_step(again, [1, 2, 3, 4])).saves
        assert client.batch_is_exist(keys) == [1, 1, 1]  # the shared store kept them


def test_a_failed_sweep_removes_nothing():
    """A master admin port that does not answer: the round raises and removes nothing."""
    with engine_side(extra_args=LEASE) as (_master, client, sched, log, _):
        announce(log, client, sched, request("down", 3))
        log.settings = EventSettings("STORAGE", "REMOTE", 1, f"{HOST}:{free_port()}",
                                     1000, 1000)
        with pytest.raises(OSError):
            log.sweep()
        assert len(log.live()) == 3 and log.take() == []


def test_tp2_ranks_announce_each_block_once_both_shards_landed():
    """Two TP=2 worker ranks (store_tp_size 2: each writes its own shard of every block) save
    into a real store; their reports, merged by vLLM's own KVOutputAggregator as the engine
    merges its workers' step outputs, announce each logical block once (in a BlockStored of
    the blocks that landed together), and only once both ranks' shards are in the store.
    (An e2e TP=2 engine costs a start of its own on the CI's CPUs; the engine's half of this
    path, TP=1, runs in tests/e2e/test_kv_events.py.)"""
    with local_pool("64MB", extra_args=LEASE) as (master, _node):
        layout = Layout("kvev-tp2", "bfloat16", BS, 2, 32, LAYERS, 2, store_tp_size=2)
        cfg = load_config(master.store_config(global_segment_size=0,
                                              local_buffer_size="16MB"), environ={})
        counts = Counts()
        ranks, landed = [], []
        for r in (0, 1):
            w = MooncakeStoreWorker(cfg, KeyBuilder("kvev-tp2", layout), r, NUM_BLOCKS)
            w.register_kv_caches(kv_caches(heads=1, seed=r))  # this rank's one KV head
            landed.append(WorkerLanded(r, 1000, counts))
            w.on_landed = landed[r].add
            ranks.append(w)
        try:
            keys = ranks[0]._keys  # with the signature of the registered caches, as the engine's
            st = EventSettings("STORAGE", "REMOTE", 0, "", 1000, 1000)
            log = StoreEventLog(st, 2, BS, lambda hs, g: keys.all_shard_keys(hs, g), 2, counts)
            req = request("tp2", 6)
            hs = tuple(req.block_hashes)
            log.planned(req, range(6), 0)
            aggregator = KVOutputAggregator(expected_finished_count=2)

            def step(saves: dict[int, range]) -> list:
                """One engine step: each rank saves its blocks, then vLLM merges the ranks'
                outputs (None from a rank with nothing to report) for the scheduler."""
                for r, blocks in saves.items():
                    run_step(ranks[r], StepMetadata(saves=(BlockTransfer(
                        f"tp2-{r}", tuple(blocks), hs[blocks.start:blocks.stop], 0),),
                        free_after_jobs=(f"tp2-{r}",)))
                outputs = [SimpleNamespace(kv_connector_output=KVConnectorOutput(
                    kv_cache_events=landed[r].take())) for r in (0, 1)]
                merged = aggregator.aggregate(outputs).kv_connector_output.kv_cache_events
                if merged is not None:
                    log.landed(merged.get_all_events())
                return log.take()

            def both_shards_stored(blocks: range) -> bool:
                ks = keys.all_shard_keys(hs[blocks.start:blocks.stop], 0)
                assert len(ks) == 2 * len(blocks)
                return all(query_keys(f"{HOST}:{master.metrics_port}", ks).values())

            # Rank 0 writes its shard of all six blocks, rank 1 of the first three only.
            first = step({0: range(6), 1: range(3)})
            assert both_shards_stored(range(3)) and not both_shards_stored(range(3, 6))
            assert [e.block_hashes for e in first] == [[external_hash(h) for h in hs[:3]]]
            # A step later rank 1 writes the rest: now those are announced, once each.
            second = step({1: range(3, 6)})
            assert both_shards_stored(range(6))
            assert [e.block_hashes for e in second] == [[external_hash(h) for h in hs[3:]]]
            assert all(isinstance(e, BlockStored) for e in first + second)
            assert [e.parent_block_hash for e in first + second] == [None, external_hash(hs[2])]
            # Both ranks save all six again (found stored, skipped): still live, no news.
            log.planned(req, range(6), 0)
            assert step({0: range(6), 1: range(6)}) == []
            print(f"TP=2: {len(first)} + {len(second)} BlockStored (runs) for 6 blocks of 2 "
                  "shards")
            assert counts[("kv_events", "stored")] == 6
            assert len(log.live()) == 6 and not any(k[0] == "kv_events_dropped" for k in counts)
        finally:
            for w in ranks:
                w.shutdown()


def test_with_ha_masters_the_sweep_asks_the_leader_etcd_names_through_a_failover(ha_etcd):
    """HA masters on two hosts (127.0.0.1 and 127.0.0.2), one admin port number: the sweep
    (`kv_events_master_http: ":port"`) asks the leader etcd names, each round, and after the
    leader is killed asks the new one. The standby answers the query with 503, so a round
    asking it would fail. Before, an HA group had no sweep (or one pointed at a service of
    both masters)."""
    import uuid

    from connector.observability.kv_event_settings import event_settings, sweep_address
    from connector.store.master_http import query_keys
    from devkit.ha_cluster import HaCluster, HaMaster

    etcd, port, cid = ha_etcd[0], free_port(), f"sweep-{uuid.uuid4().hex[:8]}"
    cluster = HaCluster(etcd=etcd, cluster_id=cid, segment_size="64MB", supervise=False,
                        masters=[HaMaster(host=h, metrics_port=port, etcd_endpoints=etcd.endpoint,
                                          cluster_id=cid) for h in ("127.0.0.1", "127.0.0.2")])
    cluster.start()
    log = None
    try:
        address = f"etcd://{etcd.endpoint}"
        cfg = load_config({"master_server_address": address, "metadata_server": address,
                           "cluster_id": cid, "kv_events": "on", "kv_events_sweep_s": 0.3,
                           "kv_events_master_http": f":{port}"}, {})
        st = event_settings(cfg, SimpleNamespace(enable_kv_cache_events=True, publisher="zmq",
                                                 endpoint="tcp://*:5557", replay_endpoint=None))
        keys = KeyBuilder("kvev-ha", Layout("m", "bfloat16", BS, 2, 32, 2, 1))
        keys = keys.with_signature(SIGNATURE)
        log = StoreEventLog(st, 1, BS, lambda hs, g: keys.all_shard_keys(hs, g), 1, Counts(),
                            where=sweep_address(st, cfg.store, 2.0))
        log.start()

        def announced_then_removed(req) -> None:
            """Announced as stored (never written: the leader holds none of it), then removed
            by a sweep round within 30 s."""
            log.planned(req, range(len(req.block_hashes)), 0)
            log.landed([(0, 0, tuple(req.block_hashes))])
            want, got = {external_hash(h) for h in req.block_hashes}, set()
            deadline = time.monotonic() + 30
            while not want <= got:
                assert time.monotonic() < deadline, f"not removed: {len(want - got)} blocks"
                got |= removed_hashes(log.take())
                time.sleep(0.1)

        old = cluster.leader()
        announced_then_removed(request("ha-before", 3))
        with pytest.raises(Exception, match="503"):  # what a round asking the standby gets
            query_keys(f"{cluster.standby().host}:{port}", ["k"])
        old.kill()
        new = cluster.wait_serving(60, exclude=old)
        assert new.host != old.host
        announced_then_removed(request("ha-after", 3))
    finally:
        if log is not None:
            log.shutdown()
        cluster.stop()
