"""Store KV events (connector/observability/kv_events.py): assembly in vLLM's schema, one event per
logical block over TP ranks, removals only for announced blocks, bounded queues that count their
drops, and one-line errors for configurations that cannot work."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import msgspec
import pytest
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from connector.config import ConfigError, load_config
from connector.observability.kv_events import (
    EventSettings,
    LandedShards,
    StoreEventLog,
    WorkerLanded,
    event_settings,
    external_hash,
)
from connector.worker.worker import _landed

BASE = {"master_server_address": "10.1.2.3:50051",
        "metadata_server": "http://10.1.2.3:8080/metadata"}
BS = 4
ON = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557")


def settings(**kw) -> EventSettings:
    return replace(EventSettings("STORAGE", "REMOTE", 0.0, "", 100, 1000), **kw)


def request(n_blocks: int, rid: str = "r") -> SimpleNamespace:
    tokens = list(range(1000 * len(rid), 1000 * len(rid) + n_blocks * BS))
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, lora_request=None,
                           block_hashes=[f"{rid}{i}".encode().ljust(32, b"\0")
                                         for i in range(n_blocks)])


class Counts:
    def __init__(self) -> None:
        self.c: Counter = Counter()

    def __call__(self, family: str, *labels: object, n: int = 1) -> None:
        self.c[(family, *labels)] += n


def log(tp: int = 1, **kw) -> tuple[StoreEventLog, Counts]:
    counts = Counts()
    return StoreEventLog(settings(**kw), tp, BS, lambda hs, g: [h.hex() for h in hs], 1,
                         counts, (("full_attention", None),)), counts


def roundtrip(events: list) -> list:
    """Through vLLM's wire format, as a ZMQ subscriber decodes it."""
    raw = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(raw).events


def test_block_stored_in_vllms_schema():
    ev_log, counts = log()
    req = request(3)
    ev_log.planned(req, [0, 1, 2], 0)
    ev_log.landed([(0, 0, h) for h in req.block_hashes])
    events = roundtrip(ev_log.take())
    assert [type(e) for e in events] == [BlockStored] * 3
    for i, e in enumerate(events):
        # vLLM's external form (an int by default: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
        assert e.block_hashes == [external_hash(req.block_hashes[i])]
        assert e.parent_block_hash == (external_hash(req.block_hashes[i - 1]) if i else None)
        assert e.token_ids == req.all_token_ids[i * BS:(i + 1) * BS]
        assert (e.block_size, e.group_idx, e.medium, e.locality) == (BS, 0, "STORAGE", "REMOTE")
        assert e.kv_cache_spec_kind == "full_attention"
    assert counts.c[("kv_events", "stored")] == 3
    assert ev_log.take() == []


def test_tp2_one_event_per_block_once_every_rank_landed():
    ev_log, _ = log(tp=2)
    req = request(2)
    ev_log.planned(req, [0, 1], 0)
    # Rank 0 lands both in one step, rank 1 only block 0: block 1 is not stored yet.
    out = LandedShards([(0, 0, h) for h in req.block_hashes])
    out.add_events(LandedShards([(1, 0, req.block_hashes[0])]).get_all_events())
    ev_log.landed(out.get_all_events())
    assert [e.block_hashes for e in ev_log.take()] == [[external_hash(req.block_hashes[0])]]
    ev_log.landed([(0, 0, req.block_hashes[1])])  # a rank reporting twice is still one rank
    assert ev_log.take() == []
    ev_log.landed([(1, 0, req.block_hashes[1])])  # a later step: now every rank has it
    assert [e.block_hashes for e in ev_log.take()] == [[external_hash(req.block_hashes[1])]]


def test_skipped_block_is_news_only_if_not_live():
    ev_log, _ = log()
    a, b = request(2, "a"), request(2, "a")  # b repeats a's prefix: its save finds it stored
    ev_log.planned(a, [0, 1], 0)
    ev_log.landed([(0, 0, h) for h in a.block_hashes])
    assert len(ev_log.take()) == 2
    ev_log.planned(b, [0, 1], 0)
    ev_log.landed([(0, 0, h) for h in b.block_hashes])
    assert ev_log.take() == []
    # Once announced removed, a save that finds it stored again (re-written) is news.
    assert ev_log.missing([(0, a.block_hashes[0])], "lookup", time.perf_counter() + 1) == 1
    ev_log.planned(b, [0], 0)
    ev_log.landed([(0, 0, b.block_hashes[0])])
    assert [type(e) for e in ev_log.take()] == [BlockRemoved, BlockStored]


def test_removed_only_for_blocks_announced_before_the_query():
    ev_log, counts = log()
    req = request(2)
    ev_log.planned(req, [0], 0)
    t_query = time.perf_counter()  # a lookup probed before block 0 was announced
    ev_log.landed([(0, 0, req.block_hashes[0])])
    ev_log.take()
    assert ev_log.missing([(0, req.block_hashes[0])], "lookup", t_query) == 0
    assert ev_log.missing([(0, req.block_hashes[1])], "sweep", time.perf_counter()) == 0
    assert ev_log.missing([(0, req.block_hashes[0])], "sweep", time.perf_counter()) == 1
    (ev,) = roundtrip(ev_log.take())
    assert isinstance(ev, BlockRemoved) and ev.block_hashes == [external_hash(req.block_hashes[0])]
    assert (ev.medium, ev.locality, ev.group_idx) == ("STORAGE", "REMOTE", 0)
    assert counts.c[("kv_events_removals", "sweep")] == 1
    assert counts.c[("kv_events", "removed")] == 1
    assert ev_log.live() == []


def test_unplanned_reports_make_no_event():
    ev_log, _ = log()
    ev_log.landed([(0, 0, b"x" * 32)])
    assert ev_log.take() == [] and ev_log.live() == []


def test_queue_bound_drops_and_counts_and_never_announces_a_dropped_block():
    ev_log, counts = log(queue=16, max_live=1000)
    req = request(20)
    ev_log.planned(req, range(16), 0)  # planned holds at most `queue` entries too
    ev_log.planned(req, range(16, 20), 0)
    assert counts.c[("kv_events_dropped", "stored")] == 4
    ev_log.landed([(0, 0, h) for h in req.block_hashes])
    assert len(ev_log.take()) == 16
    # A full event queue: the stored events that do not fit are dropped, not made live.
    more = request(20, "bb")
    ev_log.planned(more, range(16), 0)
    ev_log.landed([(0, 0, h) for h in more.block_hashes[:16]])
    ev_log.planned(more, range(16, 20), 0)
    ev_log.landed([(0, 0, h) for h in more.block_hashes[16:]])
    assert counts.c[("kv_events_dropped", "stored")] == 8
    assert len(ev_log.take()) == 16
    live = set(ev_log.live())
    assert all((0, h) not in live for h in more.block_hashes[16:])


def test_live_limit_withdraws_the_oldest():
    ev_log, counts = log(max_live=16, queue=100)
    req = request(20)
    ev_log.planned(req, range(20), 0)
    ev_log.landed([(0, 0, h) for h in req.block_hashes])
    events = ev_log.take()
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert removed == [external_hash(h) for h in req.block_hashes[:4]]
    assert len(ev_log.live()) == 16
    assert counts.c[("kv_events_removals", "live_limit")] == 4


def test_worker_records_are_bounded():
    counts = Counts()
    w = WorkerLanded(1, 16, counts)
    assert w.take() is None
    w.add(0, [bytes([i]) * 32 for i in range(10)])
    w.add(1, [bytes([i]) * 32 for i in range(10)])
    out = w.take()
    assert len(out.get_all_events()) == 16 and out.get_all_events()[0] == (1, 0, bytes(32))
    assert counts.c[("kv_events_dropped", "landed")] == 4
    assert w.take() is None


def test_worker_landed_needs_every_shard_of_the_rank():
    hashes = [b"a", b"b", b"c"]
    # 2 shards per block: a's found stored, b's second put failed, c's written (-705 too).
    exists = [1, 1, 0, 0, 0, 0]
    assert _landed(hashes, exists, [2, 3, 4, 5], [0, -200, 0, -705], 2) == (b"a", b"c")
    assert _landed(hashes, exists, [2, 3, 4, 5], [], 2) == (b"a",)  # the put never ran
    assert _landed(hashes, [], [], [], 0) == tuple(hashes)  # this rank writes no shard


# ---- configuration ---------------------------------------------------------------------------
def cfg(**extra):
    return load_config({**BASE, **extra}, {})


def test_settings_follow_vllms_kv_events_config():
    assert event_settings(cfg(), None) is None
    assert event_settings(cfg(), KVEventsConfig()) is None
    assert event_settings(cfg(kv_events="off"), ON) is None
    assert event_settings(cfg(), KVEventsConfig(enable_kv_cache_events=True,
                                                publisher="null")) is None
    s = event_settings(cfg(), ON)
    assert (s.medium, s.locality, s.sweep_s, s.master_http) == ("STORAGE", "REMOTE", 5.0,
                                                               "10.1.2.3:9003")
    s = event_settings(cfg(kv_events_locality="none", kv_events_medium="CPU",
                           kv_events_sweep_s=0, kv_events_master_http="m:1"), ON)
    assert (s.medium, s.locality, s.sweep_s, s.master_http) == ("CPU", None, 0, "")


@pytest.mark.parametrize("extra, kec, field", [
    ({"kv_events": "on"}, None, "kv_events"),
    ({"kv_events": "on"}, KVEventsConfig(publisher="zmq"), "kv_events"),
    ({"kv_events": "on"}, KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
     "--kv-events-config.publisher"),
    ({}, KVEventsConfig(enable_kv_cache_events=True, endpoint="localhost:5557"),
     "--kv-events-config.endpoint"),
    ({"tenant_id": "team-a"}, ON, "kv_events_sweep_s"),
    ({"master_server_address": "etcd://10.0.0.1:2379"}, ON, "kv_events_master_http"),
])
def test_broken_combinations_name_the_field(extra, kec, field):
    with pytest.raises(ConfigError) as e:
        event_settings(cfg(**extra), kec)
    msg = str(e.value)
    assert "\n" not in msg and field in msg, msg


@pytest.mark.parametrize("key, value", [
    ("kv_events", "sometimes"), ("kv_events_locality", "nearby"), ("kv_events_medium", "a b"),
    ("kv_events_sweep_s", -1), ("kv_events_queue", 3), ("kv_events_max_live", "many"),
    ("kv_events_master_http", "http://m:9003/"),
])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        cfg(**{key: value})
    assert key in str(e.value) and "\n" not in str(e.value)


def test_tenant_without_sweep_is_fine():
    s = event_settings(cfg(tenant_id="team-a", kv_events_sweep_s=0), ON)
    assert s is not None and s.sweep_s == 0


@pytest.mark.parametrize("key", ["kv_event", "kv_events_sweep", "kv_events_endpoint"])
def test_unknown_events_key_is_one_line_naming_it(key):
    """A misspelt events key stops the engine, naming it, rather than leaving events off."""
    with pytest.raises(ConfigError) as e:
        cfg(**{key: "on"})
    msg = str(e.value)
    assert f"'{key}'" in msg and "unknown key" in msg and "\n" not in msg, msg
