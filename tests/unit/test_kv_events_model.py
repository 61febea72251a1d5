"""Store KV events against a model, over random sequences of what the scheduler and workers
do in two KV cache groups holding the same hashes (plans, partial and repeated reports from
two TP ranks, loads, removals, settled requests, cache resets, the queue and live bounds hit):
every announced block says the truth about itself (its parent and tokens), a block is live
exactly while the model says so, a run's count of live blocks is right, a reset repeats every
live block as it was first said, and once every request's saves settled no run keeps more
than four times its live blocks. Seeded, so a failure replays."""

from __future__ import annotations

import hashlib
import random
import time
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from connector.observability.kv_events import StoreEventLog, external_hash
from tests.unit.test_kv_events import BS, Counts, settings

TP = 2


def requests(rng: random.Random) -> list[SimpleNamespace]:
    """Prompts that share prefixes (a few trunks, each request one of them plus a tail), so
    one block is planned, landed and loaded through several requests."""
    trunks = [[rng.randrange(1000, 2000) for _ in range(BS * rng.randrange(1, 6))]
              for _ in range(3)]
    out = []
    for n in range(8):
        tokens = rng.choice(trunks) + [rng.randrange(1000, 2000)
                                       for _ in range(BS * rng.randrange(1, 8))]
        hashes, parent = [], b""
        for i in range(len(tokens) // BS):
            parent = hashlib.sha256(parent + repr(tokens[i * BS:(i + 1) * BS]).encode()).digest()
            hashes.append(parent)
        out.append(SimpleNamespace(request_id=f"r{n}", all_token_ids=tokens, lora_request=None,
                                   block_hashes=hashes))
    return out


def truth(reqs: list[SimpleNamespace]) -> dict:
    """External hash -> (external parent hash, tokens), for every block of every request."""
    out = {}
    for r in reqs:
        for i, h in enumerate(r.block_hashes):
            out[external_hash(h)] = (external_hash(r.block_hashes[i - 1]) if i else None,
                                     r.all_token_ids[i * BS:(i + 1) * BS])
    return out


def said(events: list) -> list[tuple]:
    """(hash, parent, tokens) of each block the BlockStored events carry."""
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            parent = e.parent_block_hash
            for k, h in enumerate(e.block_hashes):
                out.append((h, parent, e.token_ids[k * BS:(k + 1) * BS]))
                parent = h
    return out


def said_live(events: list) -> set:
    """(group, hash) of each block the BlockStored events carry."""
    return {(e.group_idx, h) for e in events if isinstance(e, BlockStored)
            for h in e.block_hashes}


def check(ev_log: StoreEventLog, events: list, blocks: dict, live: set) -> None:
    for h, parent, tokens in said(events):
        assert blocks[h] == (parent, tokens), "a block announced with another's parent or tokens"
    for e in events:
        if isinstance(e, BlockStored):
            live.update((e.group_idx, h) for h in e.block_hashes)
        elif isinstance(e, BlockRemoved):
            live.difference_update((e.group_idx, h) for h in e.block_hashes)
    # Removals queued for the next take (a trim the full queue held back) are gone already.
    queued = {(e.group_idx, h) for kind, e in ev_log._queue if kind == "removed"
              for h in e.block_hashes}
    assert {(g, external_hash(h)) for g, h in ev_log.live()} | queued == live, \
        "live set off the events"
    refs: dict[int, int] = {}
    for (_, h), (_, run) in zip(ev_log.live(), ev_log._live.values(), strict=True):
        assert run.hashes[run.index()[h]] == h
        refs[id(run)] = refs.get(id(run), 0) + 1
    for _, run in ev_log._live.values():
        assert run.live == refs[id(run)], "a run's count of live blocks is off"
    assert set(ev_log._ranks) <= set(ev_log._planned) | set(ev_log._late), \
        "ranks kept for a block neither planned nor late"


@pytest.mark.parametrize("seed", range(40))
def test_random_histories_keep_every_event_true(seed):
    rng = random.Random(seed)
    reqs = requests(rng)
    blocks = truth(reqs)
    ev_log = StoreEventLog(settings(queue=rng.choice([8, 24, 1000]),
                                    max_live=rng.choice([6, 20, 1000])),
                           TP, BS, lambda hs, g: [], 1, Counts(),
                           (("full_attention", None), ("full_attention", None)))
    live: set = set()
    for _ in range(60):
        req = rng.choice(reqs)
        n = len(req.block_hashes)
        lo = rng.randrange(n)
        span = range(lo, rng.randrange(lo, n) + 1)
        op, g = rng.randrange(7), rng.choice([0, 0, 1])  # two groups, the same hashes
        if op == 0:  # a save plan, sometimes with a gap
            ev_log.planned(req, [i for i in span if rng.random() > 0.15], g)
        elif op == 1:  # one rank's or both ranks' reports, in part
            hashes = tuple(req.block_hashes[i] for i in span if rng.random() > 0.2)
            ranks = rng.choice([[0], [1], [0, 1]])
            ev_log.landed([(r, g, hashes) for r in ranks])
        elif op == 2:
            ev_log.loaded(req, span, g, time.perf_counter())
        elif op == 3:  # the store lost some blocks
            gone = rng.sample(ev_log.live(), min(3, len(ev_log.live())))
            ev_log.missing(gone, "sweep", time.perf_counter())
        elif op == 4:
            ev_log.settled(req.request_id)
        elif op == 5:  # a cache reset: every live block said again, as it was
            check(ev_log, ev_log.take(), blocks, live)
            ev_log.cleared()
            again = []
            while batch := ev_log.take():
                again += batch
            assert said_live(again) == live
            check(ev_log, again, blocks, live)
            continue
        check(ev_log, ev_log.take(), blocks, live)
    for req in reqs:  # every request's saves settle: a run keeps little it has not live
        ev_log.settled(req.request_id)
    check(ev_log, ev_log.take(), blocks, live)
    for _, run in ev_log._live.values():
        assert len(run.hashes) <= 4 * run.live, "a run keeps four times its live blocks"
    assert not ev_log._planned and not ev_log._plans
