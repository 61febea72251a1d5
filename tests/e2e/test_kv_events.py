"""Store KV events for routers with real `vllm serve` engines (float32) and a ZMQ subscriber
that decodes with vLLM's own `KVEventBatch`, as a router would (docs/kv-events.md).

One small store (a 16 MB store node segment, leases of 0.5 s) and two engine starts in all: an
engine writes a few prompts (every block saved gets its `BlockStored`), then several times the
store's capacity (`BlockRemoved` arrive, each for a block announced before, and the live set a
subscriber keeps stays within the capacity plus one round's blocks); a fresh engine then misses
a block announced removed, finds one announced live, and announces each block it writes once.
Both store two objects per block (store_tp_size 2), so one block is announced once for two
writes; two TP ranks' reports merged into one event per block are tested against a real store
with two worker ranks (tests/store/test_kv_events_store.py) and on the TP=2 engines of
tests/e2e/test_cross_tp.py, so this file starts no TP=2 engine of its own. The subscriber
(tests/e2e/kv_events_kit.py) binds before the engines start (vLLM's publisher connects to a
`tcp://host:port` endpoint); each engine publishes under its own topic. Every wait is on
events or counters, bounded, and says what it saw.
"""

from __future__ import annotations

import random
import time

import pytest

from devkit.local_cluster import HOST, local_pool
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.conftest import engine_extra
from tests.e2e.kv_events_kit import Subscriber, Topic, blocks_of, poked
from tests.e2e.store_kit import wait_for_saves

pytestmark = pytest.mark.side_by_side

SEGMENT = "16MB"  # 4MB aborts mooncake_client (exit -6, seen)
# Leases of 0.5 s instead of Mooncake's 5 s (as tests/e2e/test_disk_tier.py): a block written
# or looked up a moment ago becomes evictable soon, so writing past the capacity evicts the
# oldest blocks instead of failing puts until every recent lease has run out.
LEASE = ("--default_kv_lease_ttl=500",)
SWEEP_S = 0.5
PROMPT_BLOCKS = 8
ROUND_PROMPTS = 8
ROUNDS = 24  # 24 x 8 x 8 = 1536 blocks, three times the 512 the 16 MB segment holds
P = "vllm:mooncake_pool_"


def prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts that share nothing (so no block is found stored), of PROMPT_BLOCKS full blocks."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE + 5)]
            for _ in range(n)]


@pytest.fixture(scope="module")
def pool():
    with local_pool(SEGMENT, extra_args=LEASE) as (master, _node):
        yield master


def engine(model: str, master, sub: Subscriber, topic: str) -> VllmServer:
    extra = engine_extra(master, cache_prefix="kv-events", store_tp_size=2, kv_events="on",
                         kv_events_sweep_s=SWEEP_S,
                         kv_events_master_http=f"{HOST}:{master.metrics_port}",
                         load_timeout_s=60.0)
    return VllmServer(model, connector_kv_config(extra),
                      extra_args=sub.engine_args(topic)).start(timeout=600)


@pytest.fixture(scope="module")
def tp1(tiny_model, pool, sub):
    server = engine(tiny_model, pool, sub, "tp1")
    yield server
    server.stop()


def counter(server: VllmServer, family: str, **labels: str) -> float:
    return metric_sum(server.metrics(), f"{P}{family}_total", **labels)


def capacity_blocks(master, server: VllmServer) -> int:
    """Blocks the store can hold at most: its mounted bytes over a block's two objects (the
    bytes per object from the engine's own save counters)."""
    m = server.metrics()
    per_key = metric_sum(m, f"{P}save_bytes_total") / metric_sum(m, f"{P}save_keys_total")
    total = next(float(line.split()[-1]) for line in master.metrics_text().splitlines()
                 if line.startswith("master_total_capacity_bytes "))
    return int(total // (2 * per_key))


FIRST = prompts(1, 4)


def test_stored_events_cover_every_saved_block(tp1, sub):
    for p in FIRST:
        tp1.complete(p)
    want = blocks_of(FIRST)
    wait_for_saves(tp1, 2 * len(want))
    assert counter(tp1, "save_error_keys") == 0  # the store is far from full yet
    t = sub.wait("tp1", lambda t: len(t.stored) >= len(want), "a BlockStored per saved block",
                 tp1)
    time.sleep(2 * SWEEP_S)  # nothing more, nothing removed
    poked(tp1)
    t = sub.view("tp1")
    print(f"stored {len(t.stored)} for {len(want)} blocks; vLLM's own events {t.other_media}")
    assert sorted(tuple(e.token_ids) for e in t.stored) == sorted(want)
    assert t.removed == [] and t.violations == []
    by_tokens = {tuple(e.token_ids): e for e in t.stored}
    for p in FIRST:
        chain = [by_tokens[b] for b in blocks_of([p])]
        assert chain[0].parent_block_hash is None
        for prev, ev in zip(chain, chain[1:], strict=False):
            assert ev.parent_block_hash == prev.block_hashes[0]
        for ev in chain:
            assert len(ev.block_hashes) == 1 and ev.block_size == BLOCK_SIZE
            assert (ev.medium, ev.locality, ev.group_idx) == ("STORAGE", "REMOTE", 0)
    assert counter(tp1, "kv_events", kind="stored") == len(want)
    assert counter(tp1, "kv_events_dropped") == 0


def test_removals_follow_evictions_and_the_live_set_stays_bounded(tp1, sub, pool):
    cap = capacity_blocks(pool, tp1)
    round_blocks = ROUND_PROMPTS * PROMPT_BLOCKS
    sent = list(FIRST)
    for r in range(ROUNDS):
        batch = prompts(100 + r, ROUND_PROMPTS)
        for p in batch:
            tp1.complete(p)
        sent += batch
        wait_for_saves(tp1, 2 * len(blocks_of(sent)))
        # Once the saves settled, a sweep brings the live set within what the store holds.
        t = sub.wait("tp1", lambda t: len(t.live) <= cap, f"round {r}: live set within {cap}",
                     tp1)
        print(f"round {r}: stored {len(t.stored)}, removed {len(t.removed)}, live "
              f"{len(t.live)}, max live {t.max_live} (capacity {cap} blocks)")
    time.sleep(3 * SWEEP_S)  # a sweep after the last put: the live set is exact now
    poked(tp1)
    t = sub.view("tp1")
    assert t.violations == [], t.violations[:5]  # every removal names an announced block
    assert len(t.removed) > 0 and len(blocks_of(sent)) >= 3 * cap
    # Between two sweeps the live set can exceed the store's capacity by at most the blocks
    # written since the previous one caught up: one round's (the stated slack).
    assert t.max_live <= cap + round_blocks, (t.max_live, cap, round_blocks)
    written = counter(tp1, "save_keys")
    failed = counter(tp1, "save_error_keys")
    # A block is announced once both its objects are in: written keys are 2 per announced block,
    # plus at most one per block whose other object failed.
    assert 2 * len(t.stored) <= written <= 2 * len(t.stored) + failed, (len(t.stored), written,
                                                                        failed)
    assert {tuple(e.token_ids) for e in t.stored} <= set(blocks_of(sent))
    assert counter(tp1, "kv_events", kind="removed") == len(t.removed)
    assert counter(tp1, "kv_events_removals", source="sweep") + \
        counter(tp1, "kv_events_removals", source="lookup") == len(t.removed)
    assert counter(tp1, "kv_events_dropped") == 0


def test_fresh_engine_misses_removed_blocks_and_announces_each_block_once(
        tiny_model, tp1, sub, pool):
    t = sub.view("tp1")
    token_of = {e.block_hashes[0]: tuple(e.token_ids) for e in t.stored}
    live_tokens = {token_of[h] for _, h in t.live}
    removed = {token_of[h] for e in t.removed for h in e.block_hashes} - live_tokens
    gone = next((p for p in FIRST if blocks_of([p])[0] in removed), None)
    assert gone is not None, f"no first block of the first prompts announced removed ({t})"
    # The newest prompt whose blocks are all live (the store evicts the oldest first).
    last_round = prompts(100 + ROUNDS - 1, ROUND_PROMPTS)
    kept = next((p for p in reversed(last_round) if set(blocks_of([p])) <= live_tokens), None)
    assert kept is not None, "no prompt of the last round is live"
    tp1.stop()  # nothing writes from here until the fresh engine serves
    fresh = engine(tiny_model, pool, sub, "fresh")
    try:
        def hit_tokens(p: list[int]) -> float:
            before = counter(fresh, "lookup_hit_tokens")
            fresh.complete(p)
            poked(fresh)
            return counter(fresh, "lookup_hit_tokens") - before

        # Announced live: found whole (all but the block of the last token, which vLLM
        # computes). Announced removed (its first block): a miss.
        assert hit_tokens(kept) == (len(kept) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert hit_tokens(gone) == 0
        wait_for_saves(fresh, 2 * len(blocks_of([gone])))
        # Each block this engine writes is two objects (store_tp_size 2) and one BlockStored.
        new = prompts(999, 2)
        want = set(blocks_of(new))
        keys0, failed0 = counter(fresh, "save_keys"), counter(fresh, "save_error_keys")
        for p in new:
            fresh.complete(p)
        wait_for_saves(fresh, 2 * len(blocks_of([gone, *new])))
        failed = counter(fresh, "save_error_keys") - failed0

        def announced(t: Topic) -> int:
            return sum(tuple(e.token_ids) in want for e in t.stored)

        # Every new block announced, but those with a failed object (none expected).
        t2 = sub.wait("fresh", lambda t: announced(t) >= len(want) - failed,
                      f"a BlockStored for each of the {len(want)} new blocks", fresh)
        mine = [e for e in t2.stored if tuple(e.token_ids) in want]
        wrote = counter(fresh, "save_keys") - keys0
        print(f"fresh engine: {len(mine)} BlockStored for {len(want)} new blocks; keys written "
              f"{wrote:.0f}, failed {failed:.0f}")
        assert len({e.block_hashes[0] for e in mine}) == len(mine) <= len(want)
        assert 2 * len(mine) <= wrote <= 2 * len(mine) + failed
        assert t2.violations == [], t2.violations[:5]
        assert counter(fresh, "kv_events_dropped") == 0
    finally:
        fresh.stop()
