"""Store KV events against a model, over random sequences of what the scheduler and workers
do in two KV cache groups holding the same hashes (plans, partial and repeated reports from
two TP ranks, loads, removals, settled requests and reports that come after they settled,
cache resets, the queue and live bounds hit): every announced block says the truth about itself
(its parent and tokens) and was stored (every rank reported it since its last plan, or a
lookup found it), a block is live
exactly while the model says so, a run's count of live blocks is right, a reset repeats every
live block as it was first said, and once every request's saves settled no run keeps more
than four times its live blocks (but for one whose blocks still wait in the late list).
Seeded, so a failure replays."""

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


def stored(events: list, reported: dict, loaded: set) -> None:
    """Every block newly announced was stored: each rank reported it since its last plan, or
    a lookup found it (`reported`, `loaded`: (group, external hash) each)."""
    for e in events:
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                key = (e.group_idx, h)
                assert reported.get(key) == set(range(TP)) or key in loaded, \
                    f"block {key} announced before every rank stored it"


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


# 315: a late block announced, the rest of its stretch aged out (a run that kept 5 blocks
# for 1 live before `_cut_late`)
@pytest.mark.parametrize("seed", [*range(40), 315])
def test_random_histories_keep_every_event_true(seed):
    rng = random.Random(seed)
    reqs = requests(rng)
    blocks = truth(reqs)
    ev_log = StoreEventLog(settings(queue=rng.choice([8, 24, 1000]),
                                    max_live=rng.choice([6, 20, 1000])),
                           TP, BS, lambda hs, g: [], 1, Counts(),
                           (("full_attention", None), ("full_attention", None)))
    live: set = set()
    reported: dict = {}  # (group, external hash) -> the ranks that reported it since its plan
    loaded: set = set()  # (group, external hash) a lookup found
    for _ in range(60):
        req = rng.choice(reqs)
        n = len(req.block_hashes)
        lo = rng.randrange(n)
        span = range(lo, rng.randrange(lo, n) + 1)
        op, g = rng.randrange(8), rng.choice([0, 0, 1])  # two groups, the same hashes
        if op == 0:  # a save plan, sometimes with a gap
            indices = [i for i in span if rng.random() > 0.15]
            ev_log.planned(req, indices, g)
            for i in indices:
                reported[(g, external_hash(req.block_hashes[i]))] = set()
        elif op in (1, 7):  # one rank's or both ranks' reports, in part; 7: after a settle
            if op == 7:  # its saves finished (past their deadline) with blocks still landing
                ev_log.settled(req.request_id)
            hashes = tuple(req.block_hashes[i] for i in span if rng.random() > 0.2)
            ranks = rng.choice([[0], [1], [0, 1]])
            ev_log.landed([(r, g, hashes) for r in ranks])
            for h in hashes:
                reported.setdefault((g, external_hash(h)), set()).update(ranks)
        elif op == 2:
            ev_log.loaded(req, span, g, time.perf_counter())
            loaded.update((g, external_hash(req.block_hashes[i])) for i in span)
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
        events = ev_log.take()
        stored(events, reported, loaded)
        check(ev_log, events, blocks, live)
    for req in reqs:  # every request's saves settle: a run keeps little it has not live
        ev_log.settled(req.request_id)
    check(ev_log, ev_log.take(), blocks, live)
    waiting = set(ev_log._late.values())  # may land yet: kept whole
    for _, run in ev_log._live.values():
        assert len(run.hashes) <= 4 * run.live or run in waiting, \
            "a run keeps four times its live blocks"
    # The rest never lands: it ages out of the late list, and no run keeps more than that.
    for k in range(ev_log.settings.queue // 17 + 2):
        tokens = [7000 + k] * (BS * 17)
        hashes = [hashlib.sha256(f"f{seed}-{k}-{i}".encode()).digest() for i in range(17)]
        filler = SimpleNamespace(request_id=f"f{k}", all_token_ids=tokens, lora_request=None,
                                 block_hashes=hashes)
        ev_log.planned(filler, range(17), 0)
        ev_log.settled(filler.request_id)
    assert not set(ev_log._late.values()) & waiting
    for _, run in ev_log._live.values():
        assert len(run.hashes) <= 4 * run.live, "a run keeps four times its live blocks"
    assert not ev_log._planned and not ev_log._plans
