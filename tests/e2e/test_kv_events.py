"""Store KV events for routers with two real `vllm serve` engines (float32) on one store, and a
ZMQ subscriber that decodes with vLLM's own `KVEventBatch` and keeps each engine's view apart,
as a router does (docs/kv-events.md, "Many engines on one store").

One small store (a 16 MB store node segment, leases of 0.5 s) and two engine starts in all:
- A writes a few prompts: a `BlockStored` for every block saved, with its tokens and parent.
- B writes prompts of its own, then takes no request. A writes several times the store's
  capacity: `BlockRemoved` events arrive from A, each for a block announced before, and A's
  live set stays within the capacity plus one round's blocks; the store evicts B's blocks
  too, and B's removals reach the router while B is idle (the connector wakes vLLM's engine
  loop: vLLM takes a connector's events only in an engine step).
- Once A stops too, the union of the two engines' live sets holds exactly the blocks the
  master holds, every block either engine wrote checked, with no event dropped on either.
- B then misses a block announced removed, loads a prompt A announced live (and announces
  its blocks: B can load them too), and announces each block it writes once.
- B's prefix cache is reset: vLLM's `AllBlocksCleared` empties a router's view of B, and B
  announces its store blocks again right after it.
- B's connector cache is reset (`reset_external=true`, as around a weight update): B stops
  using the store, and announces none of its blocks again.
Both store two objects per block (store_tp_size 2), so one block is announced once for two
writes; two TP ranks' reports merged into one announcement per block are tested against a real store
with two worker ranks (tests/store/test_kv_events_store.py) and on the TP=2 engines of
tests/e2e/test_cross_tp.py. The subscriber (tests/e2e/kv_events_kit.py) binds before the
engines start (vLLM's publisher connects to a `tcp://host:port` endpoint). Every wait is on
events or counters, bounded (a hang detector, far past the sweep's bound), and says what it saw.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from connector.observability.kv_events import external_hash
from connector.store.master_http import query_keys
from devkit.local_cluster import HOST, local_pool
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.conftest import block_hashes, engine_extra, layout_fingerprint, store_keys
from tests.e2e.kv_events_kit import Subscriber, Topic, blocks_of, poked
from tests.e2e.store_kit import wait_for_saves

pytestmark = pytest.mark.side_by_side

SEGMENT = "16MB"  # 4MB aborts mooncake_client (exit -6, seen)
# Leases of 0.5 s instead of Mooncake's 5 s (as tests/e2e/test_disk_tier.py): a block written
# or looked up a moment ago becomes evictable soon, so writing past the capacity evicts the
# oldest blocks instead of failing puts until every recent lease has run out.
LEASE = ("--default_kv_lease_ttl=500",)
SWEEP_S = 0.5
PREFIX = "kv-events"
PROMPT_BLOCKS = 8
ROUND_PROMPTS = 8
ROUNDS = 24  # 24 x 8 x 8 = 1536 blocks, three times the 512 the 16 MB segment holds
IDLE_WAIT_S = 60.0  # no request to either engine meanwhile; the bound is a sweep or two
P = "vllm:mooncake_pool_"


def prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts that share nothing (so no block is found stored), of PROMPT_BLOCKS full blocks."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE + 5)]
            for _ in range(n)]


FIRST = prompts(1, 4)  # A's
B_PROMPTS = prompts(2, 2)
CHURN = [prompts(100 + r, ROUND_PROMPTS) for r in range(ROUNDS)]  # A's, past the capacity


@pytest.fixture(scope="module")
def pool():
    with local_pool(SEGMENT, extra_args=LEASE) as (master, _node):
        yield master


def engine(model: str, master, sub: Subscriber, topic: str) -> VllmServer:
    extra = engine_extra(master, cache_prefix=PREFIX, store_tp_size=2, kv_events="on",
                         kv_events_sweep_s=SWEEP_S,
                         kv_events_master_http=f"{HOST}:{master.metrics_port}",
                         load_timeout_s=60.0)
    return VllmServer(model, connector_kv_config(extra),
                      extra_args=sub.engine_args(topic)).start(timeout=600)


@pytest.fixture(scope="module")
def a(tiny_model, pool, sub):
    server = engine(tiny_model, pool, sub, "a")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def b(tiny_model, pool, sub):
    server = engine(tiny_model, pool, sub, "b")
    yield server
    server.stop()


def counter(server: VllmServer, family: str, **labels: str) -> float:
    return metric_sum(server.metrics(), f"{P}{family}_total", **labels)


def requests_served(server: VllmServer) -> float:
    return metric_sum(server.metrics(), "vllm:request_success_total")


def capacity_blocks(master, server: VllmServer) -> int:
    """Blocks the store can hold at most: its mounted bytes over a block's two objects (the
    bytes per object from the engine's own save counters)."""
    m = server.metrics()
    per_key = metric_sum(m, f"{P}save_bytes_total") / metric_sum(m, f"{P}save_keys_total")
    total = next(float(line.split()[-1]) for line in master.metrics_text().splitlines()
                 if line.startswith("master_total_capacity_bytes "))
    return int(total // (2 * per_key))


def held(master, server: VllmServer, sent: list[list[int]]) -> dict[object, bool]:
    """For every block of `sent` (by its hash as the events carry it): whether the master
    holds both of its objects, asked as the sweep asks (no lease taken)."""
    fp = layout_fingerprint(server)
    blocks = [(h, keys) for p in sent for h, keys in zip(
        block_hashes(p), zip(*(store_keys(server, PREFIX, p, 0, s, 2, fp) for s in (0, 1)),
                             strict=True), strict=True)]
    out: dict[object, bool] = {}
    for i in range(0, len(blocks), 64):
        batch = blocks[i:i + 64]
        present = query_keys(f"{HOST}:{master.metrics_port}",
                             [k for _, keys in batch for k in keys])
        out |= {external_hash(h): all(present.get(k, False) for k in keys)
                for h, keys in batch}
    return out


def test_stored_events_cover_every_saved_block(a, sub):
    for p in FIRST:
        a.complete(p)
    want = blocks_of(FIRST)
    wait_for_saves(a, 2 * len(want))
    assert counter(a, "save_error_keys") == 0  # the store is far from full yet
    t = sub.wait("a", lambda t: len(t.stored) >= len(want), "a BlockStored per saved block", a)
    time.sleep(2 * SWEEP_S)  # nothing more, nothing removed
    poked(a)
    t = sub.view("a")
    print(f"stored {len(t.stored)} for {len(want)} blocks in {t.events} BlockStored; vLLM's "
          f"own events {t.other_media}")
    assert sorted(tuple(e.token_ids) for e in t.stored) == sorted(want)
    assert t.events < len(t.stored)  # runs of a request's blocks, as vLLM's own events
    assert t.removed == [] and t.violations == []
    by_tokens = {tuple(e.token_ids): e for e in t.stored}
    for p in FIRST:
        chain = [by_tokens[blk] for blk in blocks_of([p])]
        assert chain[0].parent_block_hash is None
        for prev, ev in zip(chain, chain[1:], strict=False):
            assert ev.parent_block_hash == prev.block_hashes[0]
        for ev in chain:
            assert len(ev.block_hashes) == 1 and ev.block_size == BLOCK_SIZE
            # locality unset: Dynamo's indexer drops any other but LOCAL (docs/kv-events.md)
            assert (ev.medium, ev.locality, ev.group_idx) == ("STORAGE", None, 0)
    assert counter(a, "kv_events", kind="stored", medium="STORAGE", locality="none") == len(want)
    assert counter(a, "kv_events_dropped") == 0


def test_an_idle_engine_publishes_what_the_store_lost(a, b, sub, pool):
    for p in B_PROMPTS:
        b.complete(p)
    mine = blocks_of(B_PROMPTS)
    wait_for_saves(b, 2 * len(mine))
    sub.wait("b", lambda t: len(t.live) == len(mine), "B's blocks announced", b)
    b_served = requests_served(b)  # from here on B takes no request

    cap = capacity_blocks(pool, a)
    round_blocks = ROUND_PROMPTS * PROMPT_BLOCKS
    sent = list(FIRST)
    for r, batch in enumerate(CHURN):
        for p in batch:
            a.complete(p)
        sent += batch
        wait_for_saves(a, 2 * len(blocks_of(sent)))
        # Once the saves settled, a sweep brings A's live set within what the store holds.
        t = sub.wait("a", lambda t: len(t.live) <= cap, f"round {r}: live set within {cap}", a)
        print(f"round {r}: stored {len(t.stored)}, removed {len(t.removed)}, live "
              f"{len(t.live)}, max live {t.max_live} (capacity {cap} blocks)")

    # Neither engine takes a request from here: the union of their views converges on what
    # the store holds, by the removals their sweeps find while they are idle.
    a_served, everything = requests_served(a), sent + B_PROMPTS
    began, seen = time.monotonic(), {}

    def union() -> set:
        return {h for topic in ("a", "b") for _, h in sub.view(topic).live}

    while True:
        seen = held(pool, a, everything)
        stored = {h for h, there in seen.items() if there}
        if union() == stored:
            break
        assert time.monotonic() - began < IDLE_WAIT_S, (
            f"the engines' views never matched the store while idle: announced live but gone "
            f"{len(union() - stored)}, held but not live {len(stored - union())}")
        time.sleep(1.0)
    converged = time.monotonic() - began
    ta, tb = sub.view("a"), sub.view("b")
    print(f"idle engines: views matched the store {converged:.1f}s after A's last request; "
          f"A live {len(ta.live)}, B live {len(tb.live)} of {len(mine)}, store holds "
          f"{len(stored)} of {len(seen)} blocks written")
    assert requests_served(b) == b_served and requests_served(a) == a_served
    assert len(tb.removed) > 0, "the store evicted none of B's blocks: nothing was tested"
    for t in (ta, tb):
        assert t.violations == [], t.violations[:5]  # every removal names an announced block
    assert len(ta.removed) > 0 and len(blocks_of(sent)) >= 3 * cap
    # Between two sweeps A's live set can exceed the store's capacity by at most the blocks
    # written since the previous one caught up: one round's (the stated slack).
    assert ta.max_live <= cap + round_blocks, (ta.max_live, cap, round_blocks)
    written, failed = counter(a, "save_keys"), counter(a, "save_error_keys")
    # A block is announced once both its objects are in: written keys are 2 per announced block,
    # plus at most one per block whose other object failed.
    assert 2 * len(ta.stored) <= written <= 2 * len(ta.stored) + failed, (len(ta.stored),
                                                                          written, failed)
    assert {tuple(e.token_ids) for e in ta.stored} <= set(blocks_of(sent))
    for server, t in ((a, ta), (b, tb)):
        # /metrics counts them too: an idle engine steps once more to report what it published
        deadline = time.monotonic() + 30
        while counter(server, "kv_events", kind="removed") != len(t.removed):
            assert time.monotonic() < deadline, (counter(server, "kv_events", kind="removed"),
                                                 len(t.removed))
            time.sleep(0.2)
        assert counter(server, "kv_events_removals", source="sweep") + \
            counter(server, "kv_events_removals", source="lookup") == len(t.removed)
        assert counter(server, "kv_events_dropped") == 0
        assert counter(server, "kv_events_sweeps", result="ok") > 0
        assert counter(server, "kv_events_sweeps", result="error") == 0
        assert counter(server, "kv_events_sweep_keys") > 0  # what its sweeps asked the master
        assert counter(server, "kv_events_sweep_seconds") > 0  # and how long they took
        # and its startup log said the most they may ask
        assert "store keys a round" in Path(server.log_path).read_text(errors="replace")


def test_b_misses_removed_blocks_loads_live_ones_and_announces_each_block_once(a, b, sub):
    t = sub.view("a")
    token_of = {e.block_hashes[0]: tuple(e.token_ids) for e in t.stored}
    live_tokens = {token_of[h] for _, h in t.live}
    removed = {token_of[h] for e in t.removed for h in e.block_hashes} - live_tokens
    gone = next((p for p in FIRST if blocks_of([p])[0] in removed), None)
    assert gone is not None, f"no first block of the first prompts announced removed ({t})"
    # The newest prompt whose blocks are all live (the store evicts the oldest first).
    kept = next((p for p in reversed(CHURN[-1]) if set(blocks_of([p])) <= live_tokens), None)
    assert kept is not None, "no prompt of the last round is live"
    a.stop()  # nothing writes from here until B serves

    def hit_tokens(p: list[int]) -> float:
        before = counter(b, "lookup_hit_tokens")
        b.complete(p)
        poked(b)
        return counter(b, "lookup_hit_tokens") - before

    # Announced live by A: found whole (all but the block of the last token, which vLLM
    # computes), loaded, and now announced by B too. Announced removed (its first block): a
    # miss.
    assert hit_tokens(kept) == (len(kept) - 1) // BLOCK_SIZE * BLOCK_SIZE
    loaded = set(blocks_of([kept]))
    sub.wait("b", lambda t: loaded <= {tuple(e.token_ids) for e in t.stored},
             "B announces the blocks it loaded", b)
    assert hit_tokens(gone) == 0
    wait_for_saves(b, 2 * len(blocks_of([gone, *B_PROMPTS])))
    # Each block B writes is two objects (store_tp_size 2) and one BlockStored.
    new = prompts(999, 2)
    want = set(blocks_of(new))
    keys0, failed0 = counter(b, "save_keys"), counter(b, "save_error_keys")
    for p in new:
        b.complete(p)
    wait_for_saves(b, 2 * len(blocks_of([gone, *B_PROMPTS, *new])))
    failed = counter(b, "save_error_keys") - failed0

    def announced(t: Topic) -> int:
        return sum(tuple(e.token_ids) in want for e in t.stored)

    # Every new block announced, but those with a failed object (none expected).
    t2 = sub.wait("b", lambda t: announced(t) >= len(want) - failed,
                  f"a BlockStored for each of the {len(want)} new blocks", b)
    mine = [e for e in t2.stored if tuple(e.token_ids) in want]
    wrote = counter(b, "save_keys") - keys0
    print(f"B: {len(mine)} BlockStored for {len(want)} new blocks; keys written {wrote:.0f}, "
          f"failed {failed:.0f}")
    assert len({e.block_hashes[0] for e in mine}) == len(mine) <= len(want)
    assert 2 * len(mine) <= wrote <= 2 * len(mine) + failed
    assert t2.violations == [], t2.violations[:5]
    assert counter(b, "kv_events_dropped") == 0


def test_a_cache_reset_keeps_the_store_blocks_credited(b, sub):
    """vLLM's AllBlocksCleared on a prefix cache reset empties every tier of B in a router
    (Dynamo and llm-d both): B announces the store blocks it still holds right after it."""
    before = sub.view("b")
    assert len(before.live) >= PROMPT_BLOCKS, "B holds no store block: nothing to check"
    b.reset_prefix_cache()
    t = sub.wait("b", lambda t: len(t.clears) > len(before.clears) and t.live == before.live,
                 "AllBlocksCleared, then B's store blocks announced again", b)
    print(f"after the reset: {len(t.live)} store blocks live again for B")
    assert t.violations == [], t.violations[:5]


def test_a_connector_cache_reset_withdraws_b_from_the_store(b, sub):
    """`POST /reset_prefix_cache?reset_external=true`, vLLM's connector cache reset (which
    `pause_generation(clear_cache=True)` does around a weight update): the store's blocks may
    be another weight version's, and it is shared, so it is not wiped; B stops using it until
    it restarts. Its router view is empty after vLLM's AllBlocksCleared and B announces no
    store block again; a new prompt is looked up and saved before the reset, not after."""
    fresh = prompts(3, 2)
    lookups = counter(b, "lookups")
    b.complete(fresh[0])
    assert counter(b, "lookups") > lookups, "a new prompt was not looked up before the reset"
    before = sub.view("b")
    assert before.live, "B holds no store block: nothing to withdraw"
    deadline = time.monotonic() + 60
    while not b.post("/reset_prefix_cache?reset_external=true")["success"]:
        assert time.monotonic() < deadline, b.log_tail(20)
        time.sleep(0.1)
    t = sub.wait("b", lambda t: len(t.clears) > len(before.clears) and not t.live,
                 "AllBlocksCleared, B's store blocks not announced again", b)
    lookups, saved = counter(b, "lookups"), counter(b, "save_keys")
    b.complete(fresh[1])
    b.complete(fresh[1])  # the second would load what the first saved
    after = sub.view("b")
    assert counter(b, "lookups") == lookups and counter(b, "save_keys") == saved
    assert not after.live and after.events == t.events and after.violations == []
    assert "no longer loads from or saves to the Mooncake store" in b.log_tail(400)
