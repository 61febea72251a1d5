"""Store KV events (connector/observability/kv_events.py): assembly in vLLM's schema, one event per
logical block over TP ranks, removals only for announced blocks, bounded queues that count their
drops, and one-line errors for configurations that cannot work."""

from __future__ import annotations

import queue
import time
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import msgspec
import pytest
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from connector.config import ConfigError, load_config
from connector.observability.kv_event_settings import EventSettings, event_settings
from connector.observability.kv_events import (
    SWEEP_KEYS,
    SWEEP_KEYS_SHORT,
    LandedShards,
    StoreEventLog,
    WorkerLanded,
    external_hash,
    external_hashes,
    vllm_clears,
)
from connector.scheduler.engine_wakeup import EngineWakeup
from connector.store.master_http import UrlTooLong
from connector.worker.worker import _landed

BASE = {"master_server_address": "10.1.2.3:50051",
        "metadata_server": "http://10.1.2.3:8080/metadata"}
BS = 4
ON = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557")


def settings(**kw) -> EventSettings:
    return replace(EventSettings("STORAGE", None, 0.0, "", 100, 1000), **kw)


def request(n_blocks: int, rid: str = "r") -> SimpleNamespace:
    tokens = list(range(1000 * len(rid), 1000 * len(rid) + n_blocks * BS))
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, lora_request=None,
                           block_hashes=[f"{rid}{i}".encode().rjust(32, b"\0")
                                         for i in range(n_blocks)])


class Counts:
    def __init__(self) -> None:
        self.c: Counter = Counter()

    def __call__(self, family: str, *labels: object, n: int = 1) -> None:
        self.c[(family, *labels)] += n


def log(tp: int = 1, spec=(("full_attention", None),), wake=lambda: None,
        **kw) -> tuple[StoreEventLog, Counts]:
    counts = Counts()
    return StoreEventLog(settings(**kw), tp, BS, lambda hs, g: [h.hex() for h in hs], 1,
                         counts, spec, wake), counts


def roundtrip(events: list) -> list:
    """Through vLLM's wire format, as a ZMQ subscriber decodes it."""
    raw = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(raw).events


def per_block(events: list) -> list[tuple]:
    """(hash, parent, tokens, extra keys) of each block the BlockStored events carry, in
    order, as a router reads a run of blocks (each the child of the one before it)."""
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            parent = e.parent_block_hash
            for k, h in enumerate(e.block_hashes):
                out.append((h, parent, e.token_ids[k * e.block_size:(k + 1) * e.block_size],
                            e.extra_keys[k]))
                parent = h
    return out


def test_block_stored_in_vllms_schema():
    ev_log, counts = log()
    req = request(3)
    ev_log.planned(req, [0, 1, 2], 0)
    ev_log.landed([(0, 0, tuple(req.block_hashes))])
    events = roundtrip(ev_log.take())
    # One event for the request's run of blocks, as vLLM's own events carry a request's.
    (e,) = events
    assert isinstance(e, BlockStored) and len(e.extra_keys) == len(e.block_hashes) == 3
    assert len(set(e.block_hashes)) == 3
    assert (e.block_size, e.group_idx, e.medium, e.locality) == (BS, 0, "STORAGE", None)
    assert e.kv_cache_spec_kind == "full_attention"
    for i, (h, parent, tokens, extra) in enumerate(per_block(events)):
        # vLLM's external form (an int by default: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
        assert h == external_hash(req.block_hashes[i])
        assert parent == (external_hash(req.block_hashes[i - 1]) if i else None)
        assert tokens == req.all_token_ids[i * BS:(i + 1) * BS]
        assert extra is None
    assert counts.c[("kv_events", "stored")] == 3  # blocks announced


def test_a_run_ends_at_a_gap_or_another_request():
    """Blocks landed together make one BlockStored per run of a request's consecutive
    blocks: a block whose parent was not announced with it (a gap) starts another, and so
    does another request's."""
    ev_log, _ = log()
    a, b = request(4, "a"), request(2, "b")
    ev_log.planned(a, [0, 1, 3], 0)
    ev_log.planned(b, [0, 1], 0)
    ev_log.landed([(0, 0, (*a.block_hashes, *b.block_hashes))])
    events = roundtrip(ev_log.take())
    assert [e.block_hashes for e in events] == [
        [external_hash(h) for h in a.block_hashes[:2]], [external_hash(a.block_hashes[3])],
        [external_hash(h) for h in b.block_hashes]]
    assert events[1].parent_block_hash == external_hash(a.block_hashes[2])
    assert events[1].token_ids == a.all_token_ids[3 * BS:4 * BS]
    assert ev_log.take() == []


def test_a_jobs_blocks_out_of_their_runs_order_each_keep_their_own_parent():
    """A save job's blocks of one planned run are usually that run's blocks in order (one
    piece); ones that skip or go back are cut where a block is not the child of the one
    before, each piece with its own parent and tokens."""
    ev_log, _ = log()
    req = request(6)
    h = req.block_hashes
    ev_log.planned(req, range(6), 0)
    ev_log.landed([(0, 0, (h[0], h[1], h[4], h[5], h[2]))])
    events = roundtrip(ev_log.take())
    assert [(e.block_hashes, e.parent_block_hash) for e in events] == [
        ([external_hash(x) for x in h[:2]], None),
        ([external_hash(x) for x in h[4:6]], external_hash(h[3])),
        ([external_hash(h[2])], external_hash(h[1]))]
    assert events[1].token_ids == req.all_token_ids[4 * BS:6 * BS]
    assert ev_log.live() == [(0, x) for x in (h[0], h[1], h[4], h[5], h[2])]


@pytest.mark.parametrize("as_int", ["0", "1"])
def test_hashes_and_extra_keys_are_vllms_own(monkeypatch, as_int):
    """external_hash reads VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES once, and a request without
    LoRA, multimodal inputs or prompt embeds skips vLLM's per-block walk for its extra keys:
    both must still give what vLLM's own functions give."""
    from vllm.v1.core.kv_cache_utils import (
        generate_block_hash_extra_keys,
        maybe_convert_block_hash,
        to_event_extra_keys,
    )

    from connector.observability import kv_events

    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_int)
    kv_events._int_hashes.cache_clear()
    try:
        h = bytes(range(32))
        assert external_hash(h) == maybe_convert_block_hash(h)
        assert type(external_hash(h)) is (int if as_int == "1" else bytes)
        for hashes in ([h, h[::-1]], [h, h[:4], h[:9]]):  # one width, and several
            assert external_hashes(hashes) == [maybe_convert_block_hash(x) for x in hashes]
    finally:
        monkeypatch.undo()
        kv_events._int_hashes.cache_clear()
    lora = SimpleNamespace(lora_name="ad", lora_path="/ad", name="ad")
    for salt in (None, "s"):
        for adapter in (None, lora):
            req = SimpleNamespace(lora_request=adapter, mm_features=[], prompt_embeds=None,
                                  cache_salt=salt)
            for start in (0, BS, 2 * BS):
                want = to_event_extra_keys(
                    [generate_block_hash_extra_keys(req, start, start + BS, 0)[0]])
                got = kv_events._extra_keys(req, start, start + BS)
                assert [got] == want, (salt, adapter)  # its run's event lists one a block


def test_a_requests_saves_of_two_steps_landed_together_are_one_run():
    """A prompt computed over two steps is saved in two plans; landed in one report, its
    blocks are still one run (each the child of the one before), with the right tokens."""
    ev_log, _ = log()
    req = request(5)
    ev_log.planned(req, range(3), 0)
    ev_log.planned(req, range(3, 5), 0)
    ev_log.landed([(0, 0, tuple(req.block_hashes[3:])), (0, 0, tuple(req.block_hashes[:3]))])
    events = roundtrip(ev_log.take())
    assert len(events) == 2  # in the order reported: the later blocks' parent is not before
    ev_log, _ = log()
    ev_log.planned(req, range(3), 0)
    ev_log.planned(req, range(3, 5), 0)
    ev_log.landed([(0, 0, tuple(req.block_hashes[:3])), (0, 0, tuple(req.block_hashes[3:]))])
    (e,) = roundtrip(ev_log.take())
    assert e.block_hashes == [external_hash(h) for h in req.block_hashes]
    assert e.token_ids == req.all_token_ids and e.parent_block_hash is None


@pytest.mark.parametrize("salt,adapter", [("s", None), (None, "ad"), ("s", "ad")])
def test_a_runs_extra_keys_and_adapter_are_vllms_per_block(salt, adapter):
    """Each block of an event carries the extra keys vLLM's own event would give it (a cache
    salt only the first block of a prompt, a LoRA adapter every block), also when the run
    starts past the first block."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    lora = SimpleNamespace(lora_name=adapter, lora_path="/ad", name=adapter) if adapter else None
    req = request(4)
    req.lora_request, req.cache_salt, req.mm_features, req.prompt_embeds = lora, salt, [], None
    want = [to_event_extra_keys([generate_block_hash_extra_keys(req, i * BS, (i + 1) * BS,
                                                                0)[0]])[0] for i in range(4)]
    ev_log, _ = log()
    ev_log.loaded(req, range(1, 4), 0, time.perf_counter())
    ev_log.planned(req, [0], 0)
    ev_log.landed([(0, 0, (req.block_hashes[0],))])
    later, first = roundtrip(ev_log.take())
    assert later.extra_keys == want[1:] and first.extra_keys == want[:1]
    assert later.lora_name == first.lora_name == adapter
    assert (want[0] is not None) == bool(salt or adapter)


def test_tp2_one_event_per_block_once_every_rank_landed():
    ev_log, _ = log(tp=2)
    req = request(2)
    ev_log.planned(req, [0, 1], 0)
    # Rank 0 lands both in one step, rank 1 only block 0: block 1 is not stored yet.
    out = LandedShards([(0, 0, tuple(req.block_hashes))])
    out.add_events(LandedShards([(1, 0, (req.block_hashes[0],))]).get_all_events())
    ev_log.landed(out.get_all_events())
    assert [e.block_hashes for e in ev_log.take()] == [[external_hash(req.block_hashes[0])]]
    ev_log.landed([(0, 0, (req.block_hashes[1],))])  # a rank reporting twice is still one rank
    assert ev_log.take() == []
    ev_log.landed([(1, 0, (req.block_hashes[1],))])  # a later step: now every rank has it
    assert [e.block_hashes for e in ev_log.take()] == [[external_hash(req.block_hashes[1])]]


def test_skipped_block_is_news_only_if_not_live():
    ev_log, _ = log()
    a, b = request(2, "a"), request(2, "a")  # b repeats a's prefix: its save finds it stored
    ev_log.planned(a, [0, 1], 0)
    ev_log.landed([(0, 0, tuple(a.block_hashes))])
    assert len(per_block(ev_log.take())) == 2
    ev_log.planned(b, [0, 1], 0)
    ev_log.landed([(0, 0, tuple(b.block_hashes))])
    assert ev_log.take() == []
    # Once announced removed, a save that finds it stored again (re-written) is news.
    assert ev_log.missing([(0, a.block_hashes[0])], "lookup", time.perf_counter() + 1) == 1
    ev_log.planned(b, [0], 0)
    ev_log.landed([(0, 0, (b.block_hashes[0],))])
    assert [type(e) for e in ev_log.take()] == [BlockRemoved, BlockStored]


def test_removed_only_for_blocks_announced_before_the_query():
    ev_log, counts = log()
    req = request(2)
    ev_log.planned(req, [0], 0)
    t_query = time.perf_counter()  # a lookup probed before block 0 was announced
    ev_log.landed([(0, 0, (req.block_hashes[0],))])
    ev_log.take()
    assert ev_log.missing([(0, req.block_hashes[0])], "lookup", t_query) == 0
    assert ev_log.missing([(0, req.block_hashes[1])], "sweep", time.perf_counter()) == 0
    assert ev_log.missing([(0, req.block_hashes[0])], "sweep", time.perf_counter()) == 1
    (ev,) = roundtrip(ev_log.take())
    assert isinstance(ev, BlockRemoved) and ev.block_hashes == [external_hash(req.block_hashes[0])]
    assert (ev.medium, ev.locality, ev.group_idx) == ("STORAGE", None, 0)
    assert counts.c[("kv_events_removals", "sweep")] == 1
    assert counts.c[("kv_events", "removed")] == 1
    assert ev_log.live() == []


def test_unplanned_reports_make_no_event():
    ev_log, _ = log()
    ev_log.landed([(0, 0, (b"x" * 32,))])
    assert ev_log.take() == [] and ev_log.live() == []


def test_queue_bound_drops_and_counts_and_never_announces_a_dropped_block():
    ev_log, counts = log(queue=16, max_live=1000)
    req = request(20)
    ev_log.planned(req, range(16), 0)  # planned holds at most `queue` entries too
    ev_log.planned(req, range(16, 20), 0)
    assert counts.c[("kv_events_dropped", "stored")] == 4
    ev_log.landed([(0, 0, tuple(req.block_hashes))])
    assert len(per_block(ev_log.take())) == 16
    # A full event queue: the stored events that do not fit are dropped, not made live.
    more = request(20, "bb")
    ev_log.planned(more, range(16), 0)
    ev_log.landed([(0, 0, tuple(more.block_hashes[:16]))])
    ev_log.planned(more, range(16, 20), 0)
    ev_log.landed([(0, 0, tuple(more.block_hashes[16:]))])
    assert counts.c[("kv_events_dropped", "stored")] == 8
    assert len(per_block(ev_log.take())) == 16
    live = set(ev_log.live())
    assert all((0, h) not in live for h in more.block_hashes[16:])


def test_live_limit_withdraws_the_oldest():
    ev_log, counts = log(max_live=16, queue=100)
    req = request(20)
    ev_log.planned(req, range(20), 0)
    ev_log.landed([(0, 0, tuple(req.block_hashes))])
    events = ev_log.take()
    removals = [e for e in events if isinstance(e, BlockRemoved)]
    # One event for the trim's blocks, oldest first (an event per block cost the step more
    # than the blocks' announcement).
    assert [e.block_hashes for e in removals] == [external_hashes(req.block_hashes[:4])]
    assert len(ev_log.live()) == 16
    assert counts.c[("kv_events_removals", "live_limit")] == 4


def test_a_trim_the_full_queue_cannot_take_waits_for_the_next_take():
    """Past the live bound with the queue full, the oldest block stays live (withdrawn
    without its BlockRemoved, a router would credit it for good), and is withdrawn once vLLM
    took the events."""
    ev_log, counts = log(queue=4, max_live=2)
    req = request(4)
    ev_log.loaded(req, range(4), 0, time.perf_counter())
    assert [type(e) for e in ev_log.take()] == [BlockStored]
    assert counts.c[("kv_events_dropped", "removed")] == 1
    assert len(ev_log.live()) == 2
    removed = ev_log.take()
    assert [e.block_hashes for e in removed] == [external_hashes(req.block_hashes[:2])]
    assert all(isinstance(e, BlockRemoved) for e in removed)
    assert counts.c[("kv_events_removals", "live_limit")] == 2


def test_a_sweep_removes_a_block_any_of_whose_shards_is_gone_in_its_own_group():
    """Each block's keys are every shard's, asked per group: a block in one group missing one
    shard is removed; the same hash in another group, whole, stays."""
    counts = Counts()
    ev_log = StoreEventLog(settings(), 2, BS,
                           lambda hs, g: [f"g{g}/{h.hex()}/s{s}" for h in hs for s in (0, 1)],
                           2, counts, (("full_attention", None), ("full_attention", None)))
    req = request(3)
    for g in (0, 1):
        ev_log.loaded(req, range(3), g, time.perf_counter())
    ev_log.take()
    lost = f"g1/{req.block_hashes[1].hex()}/s1"
    asked: list[list[str]] = []

    class Master:
        def query(self, keys):
            asked.append(list(keys))
            return {k: k != lost for k in keys}

    assert ev_log.sweep(Master()) == 1
    assert set(ev_log.live()) == {(g, h) for g in (0, 1) for h in req.block_hashes} - {
        (1, req.block_hashes[1])}
    assert sorted(k for ks in asked for k in ks) == sorted(
        f"g{g}/{h.hex()}/s{s}" for g in (0, 1) for h in req.block_hashes for s in (0, 1))
    assert counts.c[("kv_events_sweep_keys",)] == 12  # every key asked, on /metrics


def test_blocks_found_gone_together_go_in_one_removal_per_group():
    """What one query finds gone is withdrawn in one `BlockRemoved` per group, each block
    once however often the query names it, oldest first; with room in the queue for only
    some, the rest stay live, the first of them counted dropped once."""
    ev_log, counts = log(spec=(("full_attention", None), ("full_attention", None)), queue=6)
    req = request(3)
    for g in (0, 1):
        ev_log.loaded(req, range(3), g, time.perf_counter())
    ev_log.take()
    hs = req.block_hashes
    gone = [(0, hs[0]), (1, hs[0]), (0, hs[1]), (0, hs[0]), (1, hs[2])]
    assert ev_log.missing(gone, "sweep", time.perf_counter()) == 4
    assert [(e.group_idx, e.block_hashes) for e in ev_log.take()] == [
        (0, external_hashes([hs[0], hs[1]])), (1, external_hashes([hs[0], hs[2]]))]
    assert counts.c[("kv_events_removals", "sweep")] == 4
    ev_log.cleared()
    ev_log.take()  # the two left, announced again
    ev_log.loaded(request(5, "x"), range(5), 0, time.perf_counter())  # 5 of the queue's 6
    left = [(0, hs[2]), (1, hs[1])]
    assert ev_log.missing(left, "lookup", time.perf_counter()) == 1  # room for one
    assert ev_log.missing(left, "lookup", time.perf_counter()) == 0
    assert counts.c[("kv_events_dropped", "removed")] == 1
    assert (1, hs[1]) in ev_log.live() and len(ev_log.live()) == 6


def test_a_sweep_asks_fewer_keys_a_request_once_a_proxy_refuses_its_urls(caplog):
    """The sweep asks SWEEP_KEYS keys a request (a block's shards together); a URL refused as
    too long (HTTP 414/431) makes it ask SWEEP_KEYS_SHORT from then on, logged once, and the
    round still asks every block; refused again at that size, the round fails."""
    ev_log = StoreEventLog(settings(queue=1000), 1, BS,
                           lambda hs, g: [f"k/{h.hex()}/s{s}" for h in hs for s in (0, 1)],
                           2, counts := Counts(), (("full_attention", None),))
    req = request(300)
    ev_log.loaded(req, range(300), 0, time.perf_counter())
    ev_log.take()
    sizes: list[int] = []

    class Proxy:
        limit = 100  # keys a request it lets through

        def query(self, keys):
            if len(keys) > self.limit:
                raise UrlTooLong(f"HTTP 414 to {len(keys)} keys")
            sizes.append(len(keys))
            return dict.fromkeys(keys, True)

    assert ev_log.sweep(Proxy()) == 0
    assert sizes == [SWEEP_KEYS_SHORT] * 12 + [600 - 12 * SWEEP_KEYS_SHORT]
    assert counts.c[("kv_events_sweep_keys",)] == 600  # the refused request is not counted
    assert len([r for r in caplog.records if "keys a request from now on" in r.getMessage()]) == 1
    sizes.clear()
    Proxy.limit = SWEEP_KEYS
    assert ev_log.sweep(Proxy()) == 0 and sizes[0] == SWEEP_KEYS_SHORT, "stays short"
    Proxy.limit = 10
    with pytest.raises(UrlTooLong):
        ev_log.sweep(Proxy())
    assert len(ev_log.live()) == 300, "a failed round removes nothing"


def test_worker_records_are_bounded_and_a_drop_counts_once_for_every_rank():
    """Past its bound a rank drops the rest of its reports. Every rank saves the same blocks
    under the same bound, and a block any rank dropped is not announced: the drop counts once
    (on rank 0), not once per rank, as vLLM sums the ranks' counters."""
    counts = Counts()
    hashes = [bytes([i]) * 32 for i in range(10)]
    for rank in (0, 1):
        w = WorkerLanded(rank, 16, counts)
        assert w.take() is None
        w.add(0, hashes)
        w.add(1, hashes)
        w.add(0, [b"late" * 8])  # no room left: dropped whole
        out = w.take()
        assert out.get_all_events() == [(rank, 0, tuple(hashes)), (rank, 1, tuple(hashes[:6]))]
        assert w.take() is None
        w.add(0, hashes[:1])  # taken: room again
        assert w.take().get_all_events() == [(rank, 0, tuple(hashes[:1]))]
    assert counts.c[("kv_events_dropped", "landed")] == 5


def test_worker_landed_needs_every_shard_of_the_rank():
    hashes = [b"a", b"b", b"c", b"d"]
    # 2 shards per block: a's found stored, b's second put failed, c's written, and d's second
    # put met -705 (another writer's put of it still in progress: not readable yet).
    exists = [1, 1, 0, 0, 0, 0, 0, 0]
    assert _landed(hashes, exists, [2, 3, 4, 5, 6, 7], [0, -200, 0, 0, 0, -705], 2) == (
        b"a", b"c")
    assert _landed(hashes, exists, [2, 3, 4, 5], [], 2) == (b"a",)  # the put never ran
    assert _landed(hashes, [], [], [], 0) == tuple(hashes)  # this rank writes no shard
    assert _landed(hashes, exists, [2, 3, 4, 5, 6, 7], [0] * 6, 2) == tuple(hashes)
    assert _landed(hashes, [1] * 8, [], [], 2) == tuple(hashes)  # all found stored


# ---- configuration ---------------------------------------------------------------------------
def cfg(**extra):
    return load_config({**BASE, **extra}, {})


def test_settings_follow_vllms_kv_events_config():
    assert event_settings(cfg(), None) is None
    assert event_settings(cfg(), KVEventsConfig()) is None
    assert event_settings(cfg(kv_events="off"), ON) is None
    assert event_settings(cfg(), KVEventsConfig(enable_kv_cache_events=True,
                                                publisher="null")) is None
    s = event_settings(cfg(), ON)  # what Dynamo's indexer takes: locality unset
    assert (s.medium, s.locality, s.sweep_s, s.master_http) == ("STORAGE", None, 5.0,
                                                               "10.1.2.3:9003")
    s = event_settings(cfg(kv_events_locality="remote", kv_events_medium="CPU",
                           kv_events_sweep_s=0, kv_events_master_http="m:1"), ON)
    assert (s.medium, s.locality, s.sweep_s, s.master_http) == ("CPU", "REMOTE", 0, "")


def test_the_startup_log_states_the_most_a_sweep_asks_of_the_master():
    """Every shard of up to kv_events_max_live blocks a round: what the master answers for
    this engine, so an operator can add up the fleet's before it runs."""
    s = event_settings(cfg(kv_events_max_live=1000, kv_events_sweep_s=2), ON)
    assert s.sweep_note(8) == ("sweep of 10.1.2.3:9003 every 2s: at most 8,000 store keys a "
                               "round (1,000 live blocks x 8 shards), 4,000 a second, asked "
                               "of the master")
    assert "(1,000 live blocks x 1 shard)" in s.sweep_note(1)
    off = event_settings(cfg(kv_events_sweep_s=0), ON)
    assert off.sweep_note(8) == "no sweep: removals from lookups"


@pytest.mark.parametrize("extra, kec, field", [
    ({"kv_events": "on"}, None, "kv_events"),
    ({"kv_events": "on"}, KVEventsConfig(publisher="zmq"), "kv_events"),
    ({"kv_events": "on"}, KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
     "--kv-events-config.publisher"),
    ({}, KVEventsConfig(enable_kv_cache_events=True, endpoint="localhost:5557"),
     "--kv-events-config.endpoint"),
])
def test_broken_combinations_name_the_field(extra, kec, field):
    with pytest.raises(ConfigError) as e:
        event_settings(cfg(**extra), kec)
    msg = str(e.value)
    assert "\n" not in msg and field in msg, msg


@pytest.mark.parametrize("key, value", [
    ("kv_events", "sometimes"), ("kv_events_locality", "nearby"), ("kv_events_medium", "a b"),
    ("kv_events_sweep_s", -1), ("kv_events_queue", 3), ("kv_events_max_live", "many"),
    ("kv_events_master_http", "http://m:9003/"), ("kv_events_master_http", "m:99999"),
    ("kv_events_master_http", "m:0"),
])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        cfg(**{key: value})
    assert key in str(e.value) and "\n" not in str(e.value)


def test_tenant_without_sweep_is_fine():
    s = event_settings(cfg(tenant_id="team-a", kv_events_sweep_s=0), ON)
    assert s is not None and s.sweep_s == 0 and s.sweep_off == ""


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_a_sweep_that_cannot_work_falls_back_to_lookups_with_the_field_named(mode):
    """An engine that served before the sweep existed (a tenant other than default) keeps
    serving with events: no sweep, removals from lookups, and a one-line reason naming the
    field (logged, and counted as kv_events_sweeps{result="off"})."""
    s = event_settings(cfg(kv_events=mode, tenant_id="team-a"), ON)
    assert s is not None and s.sweep_s == 0 and s.master_http == ""
    assert "kv_events_sweep_s" in s.sweep_off and "lookups" in s.sweep_off
    assert "\n" not in s.sweep_off


@pytest.mark.parametrize("extra, http, target", [
    ({"master_server_address": "etcd://10.0.0.1:2379"}, ":9003", "the HA leader's port 9003"),
    ({"master_server_address": "etcd://10.0.0.1:2379", "kv_events_master_http": ":9100"},
     ":9100", "the HA leader's port 9100"),
    ({"kv_events_master_http": ":9100"}, "10.1.2.3:9100", "10.1.2.3:9100"),
    ({"master_server_address": "etcd://10.0.0.1:2379", "kv_events_master_http": "m:9100"},
     "m:9100", "m:9100"),
])
def test_the_sweep_asks_the_serving_masters_host(extra, http, target):
    """HA masters (before: no sweep without an address given): the leader's host, read from
    etcd each round (tests/store/test_kv_events_store.py follows a failover); `:port` names
    the port. One master: its host."""
    s = event_settings(cfg(**extra), ON)
    assert (s.sweep_s, s.master_http, s.sweep_off, s.sweep_target) == (5.0, http, "", target)


@pytest.mark.parametrize("key", ["kv_event", "kv_events_sweep", "kv_events_endpoint"])
def test_unknown_events_key_is_one_line_naming_it(key):
    """A misspelt events key stops the engine, naming it, rather than leaving events off."""
    with pytest.raises(ConfigError) as e:
        cfg(**{key: "on"})
    msg = str(e.value)
    assert f"'{key}'" in msg and "unknown key" in msg and "\n" not in msg, msg


def test_the_ranks_records_of_one_job_are_merged_and_a_part_still_waits():
    """vLLM hands the scheduler every rank's records of a step together; the records of one
    save job are merged (a lookup per block, not per rank and block). A job one rank reported
    only in part announces that part, in one run per request."""
    ev_log, _ = log(tp=2)
    a, b = request(4), request(3, "bb")
    ev_log.planned(a, range(4), 0)
    ev_log.planned(b, range(3), 0)
    ev_log.landed([(0, 0, tuple(a.block_hashes)), (0, 0, tuple(b.block_hashes)),
                   (1, 0, tuple(a.block_hashes)), (1, 0, tuple(b.block_hashes[:2]))])
    assert [e.block_hashes for e in ev_log.take()] == [
        [external_hash(h) for h in a.block_hashes],
        [external_hash(h) for h in b.block_hashes[:2]]]
    ev_log.landed([(1, 0, (b.block_hashes[2],))])
    assert [e.block_hashes for e in ev_log.take()] == [[external_hash(b.block_hashes[2])]]


def test_a_new_save_attempt_counts_its_ranks_afresh():
    """A block whose first save landed on rank 0 only is saved again: only the new attempt's
    reports count (rank 0's shard of the first may be gone since), so rank 1 landing alone
    announces nothing."""
    ev_log, _ = log(tp=2)
    req = request(1)
    ev_log.planned(req, [0], 0)
    ev_log.landed([(0, 0, (req.block_hashes[0],))])  # rank 1's put failed
    ev_log.planned(req, [0], 0)  # the next turn saves it again
    ev_log.landed([(1, 0, (req.block_hashes[0],))])
    assert ev_log.take() == []
    ev_log.landed([(0, 0, (req.block_hashes[0],))])
    assert len(ev_log.take()) == 1


def test_a_settled_request_leaves_nothing_planned_and_no_drop_counted():
    ev_log, counts = log(tp=2, queue=16)
    req = request(4)
    ev_log.planned(req, range(4), 0)
    ev_log.landed([(0, 0, tuple(req.block_hashes))])  # rank 1 failed every put
    ev_log.settled("r")  # every rank finished its saves
    ev_log.planned(request(16, "bb"), range(16), 0)  # planned at its bound, not past it
    assert counts.c[("kv_events_dropped", "stored")] == 0
    assert ev_log.take() == []  # rank 1's shards are not in the store
    # A late report (its put outlived the save's deadline, and then stored them): every
    # shard is in the store now, so the blocks are news, once.
    ev_log.landed([(1, 0, tuple(req.block_hashes))])
    (ev,) = roundtrip(ev_log.take())
    assert ev.block_hashes == external_hashes(req.block_hashes) and ev.parent_block_hash is None
    ev_log.landed([(r, 0, tuple(req.block_hashes)) for r in (0, 1)])
    assert ev_log.take() == []


def test_blocks_a_save_stores_after_its_request_settled_are_announced():
    """A save past its deadline is finished (its request settled, its blocks back with
    vLLM) while its put goes on; what the put then stores is reported a step or more later.
    The store holds those blocks, so routers hear of them, with their own tokens and parent;
    blocks that never land age out past the queue's bound, uncounted."""
    ev_log, counts = log(queue=16)
    req = request(6)
    ev_log.planned(req, range(6), 0)
    ev_log.landed([(0, 0, tuple(req.block_hashes[:2]))])  # in time
    first = roundtrip(ev_log.take())
    ev_log.settled("r")  # its deadline passed: blocks 2 to 5 not reported
    ev_log.landed([(0, 0, tuple(req.block_hashes[2:4]))])  # the put's late report
    (late,) = roundtrip(ev_log.take())
    assert late.block_hashes == external_hashes(req.block_hashes[2:4])
    assert late.parent_block_hash == external_hash(req.block_hashes[1])
    assert late.token_ids == req.all_token_ids[2 * BS:4 * BS]
    ref, _ = log()  # blocks 0 to 3 landed together, as a router would have them
    ref.planned(req, range(4), 0)
    ref.landed([(0, 0, tuple(req.block_hashes[:4]))])
    assert per_block(first + [late]) == per_block(roundtrip(ref.take()))
    # What a late block keeps is its own stretch of the run, not the whole request's tokens.
    assert {len(run.tokens) for run in ev_log._late.values()} == {4 * BS}  # blocks 2 to 5
    for tag in ("x1", "x2"):  # 32 more blocks settle unlanded: 4 and 5 age out
        other = request(16, tag)
        ev_log.planned(other, range(16), 0)
        ev_log.settled(tag)
    ev_log.landed([(0, 0, tuple(req.block_hashes[4:]))])
    assert ev_log.take() == [] and not any(k[0] == "kv_events_dropped" for k in counts.c)


def test_a_late_block_keeps_no_more_of_its_run_once_the_rest_left_the_late_list():
    """One block of a settled save lands late and is announced; the rest of its stretch never
    lands and ages out of the late list (or is planned again). The announced block then keeps
    at most four times its live blocks' tokens, as any run once its saves settled: before,
    one late block kept its whole stretch (a long prompt's tokens) for as long as it stayed
    live."""
    for leave in ("age_out", "replanned"):
        ev_log, _ = log(queue=16)
        req = request(12)
        ev_log.planned(req, range(12), 0)
        ev_log.settled("r")  # nothing landed in time: all 12 wait in the late list
        ev_log.landed([(0, 0, (req.block_hashes[0],))])  # one lands after all
        (ev,) = ev_log.take()
        assert ev.block_hashes == external_hashes(req.block_hashes[:1])
        if leave == "age_out":
            other = request(16, "x1")  # 16 more blocks settle unlanded: the 11 age out
            ev_log.planned(other, range(16), 0)
            ev_log.settled("x1")
        else:  # a fresh save of the 11: they are planned now, not late
            ev_log.planned(req, range(1, 12), 0)
        assert not any(k in ev_log._late for k in req.block_hashes)
        (_, run), = ev_log._live.values()
        assert run.live == 1 and len(run.hashes) <= 4 * run.live, (leave, len(run.hashes))
        assert run.tokens == req.all_token_ids[:BS] and run.parent is None


def test_default_bounds_hold_two_128k_token_prompts_in_one_step():
    """At block size 16 a 128K-token prompt is 8,192 blocks. With the default bounds, two
    such hits announced in one step, and then two such saves planned and landed together,
    lose nothing: a router hears of every block."""
    st = event_settings(load_config(BASE, {}), ON)
    counts = Counts()
    ev_log = StoreEventLog(st, 1, BS, lambda hs, g: [], 1, counts,
                           (("full_attention", None),))
    hits, saves = (request(8192, rid) for rid in ("a", "b")), [request(8192, r) for r in "cd"]
    for req in hits:
        ev_log.loaded(req, range(8192), 0, time.perf_counter())
    assert len(per_block(ev_log.take())) == 2 * 8192
    for req in saves:
        ev_log.planned(req, range(8192), 0)
    for req in saves:
        ev_log.landed([(0, 0, tuple(req.block_hashes))])
    assert len(per_block(ev_log.take())) == 2 * 8192
    assert not any(k[0] == "kv_events_dropped" for k in counts.c), counts.c


def test_a_full_queue_keeps_a_removal_for_the_next_query():
    ev_log, counts = log(queue=16, max_live=1000)
    req = request(16)
    ev_log.planned(req, range(16), 0)
    ev_log.landed([(0, 0, tuple(req.block_hashes))])  # 16 blocks: the queue is full
    gone = [(0, req.block_hashes[0])]
    assert ev_log.missing(gone, "sweep", time.perf_counter()) == 0
    assert gone[0] in ev_log.live(), "a removal the queue could not take was forgotten"
    assert ev_log.missing(gone, "lookup", time.perf_counter()) == 0  # found again: held again
    assert counts.c[("kv_events_dropped", "removed")] == 1  # one block held back, once
    assert len(per_block(ev_log.take())) == 16
    assert ev_log.missing(gone, "sweep", time.perf_counter()) == 1
    assert [type(e) for e in ev_log.take()] == [BlockRemoved]


def test_loaded_blocks_are_announced_once_as_of_their_lookup():
    """An engine that loads store blocks announces them too (its view of the store), live
    from when its lookup began: a query that started before it cannot withdraw them."""
    ev_log, _ = log()
    req = request(3)
    seen = time.perf_counter()
    ev_log.loaded(req, [0, 1, 2], 0, seen)
    blocks = per_block(roundtrip(ev_log.take()))
    assert [t for _, _, t, _ in blocks] == [req.all_token_ids[i * BS:(i + 1) * BS]
                                            for i in range(3)]
    assert blocks[1][1] == external_hash(req.block_hashes[0])
    before = time.perf_counter()
    ev_log.loaded(req, [0, 1, 2], 0, time.perf_counter())  # loaded again: no news, but
    assert ev_log.take() == []                              # seen stored as of now
    assert ev_log.missing([(0, req.block_hashes[0])], "sweep", before) == 0
    assert ev_log.missing([(0, req.block_hashes[0])], "sweep", time.perf_counter()) == 1


def test_after_a_cache_reset_every_live_block_is_announced_again_a_queue_at_a_time():
    """vLLM's AllBlocksCleared makes routers drop this engine's every tier: its live store
    blocks are announced again after it, as many per step as the queue holds, and the engine
    keeps stepping (`pending`) until all went out."""
    ev_log, _ = log(queue=16, max_live=1000)
    req = request(20)
    announced = []
    for part in (range(16), range(16, 20)):
        ev_log.planned(req, part, 0)
        ev_log.landed([(0, 0, tuple(req.block_hashes[i] for i in part))])
        announced += roundtrip(ev_log.take())
    assert len(per_block(announced)) == 20
    ev_log.counted()
    assert not ev_log.pending()
    ev_log.cleared()
    assert ev_log.pending()
    first, second = per_block(roundtrip(ev_log.take())), per_block(roundtrip(ev_log.take()))
    ev_log.counted()
    assert (len(first), len(second)) == (16, 4) and not ev_log.pending()
    assert first + second == per_block([e for e in announced if isinstance(e, BlockStored)])


def test_a_run_mostly_gone_from_the_live_set_keeps_only_its_live_blocks():
    """A live block keeps its tokens as a slice of the run it was announced with. Once most
    of a run has left the live set the run is cut down to the blocks left, so that a hot
    block does not keep a long prompt's tokens; they still say the same when repeated after
    a cache reset, and the blocks loaded again around it are announced as two runs."""
    ev_log, _ = log(max_live=16, queue=100)
    a = request(16, "a")
    ev_log.loaded(a, range(16), 0, time.perf_counter())
    first = per_block(roundtrip(ev_log.take()))
    ev_log.loaded(a, [5], 0, time.perf_counter())  # block 5 is hot: last in line
    ev_log.loaded(request(15, "bb"), range(15), 0, time.perf_counter())  # a's others leave
    ev_log.take()
    runs = {id(run): run for _, run in ev_log._live.values()}
    assert sorted(len(r.hashes) for r in runs.values()) == [1, 15], "a's run kept whole"
    ev_log.cleared()
    assert first[5] in per_block(roundtrip(ev_log.take()))
    ev_log.loaded(a, range(16), 0, time.perf_counter())
    events = roundtrip(ev_log.take())
    assert [len(e.block_hashes) for e in events if isinstance(e, BlockStored)] == [5, 10]
    assert per_block(events)[-15:] == first[:5] + first[6:]


def test_a_save_that_landed_in_part_keeps_only_what_landed_once_settled():
    """A save plan whose puts mostly failed: once its request's saves settled, the block that
    landed keeps its own tokens, not its whole plan's."""
    ev_log, _ = log(tp=2)
    req = request(8)
    ev_log.planned(req, range(8), 0)
    ev_log.landed([(r, 0, (req.block_hashes[3],)) for r in (0, 1)])  # every other put failed
    first = per_block(roundtrip(ev_log.take()))
    ev_log.settled("r")
    ((_, run),) = ev_log._live.values()
    assert run.hashes == [req.block_hashes[3]] and len(run.tokens) == BS
    ev_log.cleared()
    assert per_block(roundtrip(ev_log.take())) == first


def test_a_plan_outlives_more_concurrent_saves_than_the_queue_has_blocks():
    """kv_events_queue bounds blocks; requests whose saves have not settled are bounded by the
    engine's concurrency. A plan lost while its request still saves (more saving requests than
    the queue has blocks: 16 is a valid setting) left its settled run uncut, its live block
    keeping the whole run, and its unlanded blocks planned, to be counted as dropped events
    once later plans pushed them out: a hole in the router's view that is not there."""
    ev_log, counts = log(queue=16)
    req = request(8)
    ev_log.planned(req, range(8), 0)
    ev_log.landed([(0, 0, (req.block_hashes[3],))])  # the other puts failed
    for i in range(16):  # 16 more requests save at once, and land
        other = request(1, f"c{i:02}")
        ev_log.planned(other, [0], 0)
        ev_log.landed([(0, 0, tuple(other.block_hashes))])
        ev_log.take()  # vLLM takes the events each step
    ev_log.settled("r")
    assert [run for _, run in ev_log._live.values() if run.rid == "r"][0].hashes == [
        req.block_hashes[3]]
    ev_log.planned(request(16, "next"), range(16), 0)  # planned at the bound, not past it
    assert counts.c[("kv_events_dropped", "stored")] == 0


def test_sliding_window_groups_are_not_announced():
    """Only the groups every router indexes: a sliding-window group's removals (it keeps only
    its window) would erase the full group's credit in a router that keys by hash alone."""
    ev_log, _ = log(spec=(("full_attention", None), ("sliding_window", 2 * BS)))
    req = request(3)
    ev_log.planned(req, range(3), 0)
    ev_log.planned(req, [1, 2], 1)
    ev_log.landed([(0, g, tuple(req.block_hashes)) for g in (0, 1)])
    ev_log.loaded(req, [2], 1, time.perf_counter())
    assert {e.group_idx for e in ev_log.take()} == {0}
    assert all(g == 0 for g, _ in ev_log.live())


def test_removals_wake_the_engine_and_wait_as_pending():
    wakes: list[int] = []
    ev_log, _ = log(wake=lambda: wakes.append(1))
    req = request(2)
    ev_log.planned(req, [0, 1], 0)
    ev_log.landed([(0, 0, tuple(req.block_hashes))])
    ev_log.take()
    assert ev_log.missing([(0, req.block_hashes[1])], "lookup", time.perf_counter() + 1) == 1
    assert wakes == [1] and ev_log.pending()
    assert ev_log.missing([(0, b"never" * 8)], "sweep", time.perf_counter()) == 0
    assert wakes == [1]  # nothing removed: no wake
    ev_log.take()
    assert ev_log.pending()  # the engine steps once more: its stats count what it took
    ev_log.counted()
    assert not ev_log.pending()


def test_vllm_clears_reads_the_block_pools_queued_events():
    stored = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=1,
                         lora_id=None, medium="GPU", lora_name=None)
    assert vllm_clears(SimpleNamespace(kv_event_queue=[stored, AllBlocksCleared()]))
    assert not vllm_clears(SimpleNamespace(kv_event_queue=[stored]))
    assert not vllm_clears(None) and not vllm_clears(SimpleNamespace())


class EngineCoreProc:
    """Stands for vLLM's: its input queue exists before it builds its scheduler (and so this
    connector's scheduler side)."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue = queue.Queue()
        self.wakeup = build_connector()


def build_connector() -> EngineWakeup:
    return EngineWakeup.find()


def test_wakeup_puts_vllms_sentinel_in_the_engines_input_queue():
    from vllm.v1.engine import EngineCoreRequestType

    engine = EngineCoreProc()
    assert engine.wakeup.found
    engine.wakeup.wake()
    assert engine.input_queue.get_nowait() == (EngineCoreRequestType.WAKEUP, None)
    alone = build_connector()  # no engine on the stack: nothing to wake, no error
    assert not alone.found
    alone.wake()
