"""PrefixProbe's windows against an in-memory key set (the real master's answers are in
tests/store/test_scheduler*.py): the hit is always the longest prefix every group can
restore, whatever is stored, and the round trips are as few as the docstring says."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from connector.scheduler.prefix_probe import FIRST_WINDOW, Late, PrefixProbe
from connector.store.groups import FULL, ONE_FULL, SLIDING, GroupSpec, window_hit

BS = 16
NEVER = SimpleNamespace(at=math.inf)


class Store:
    """Keys `g{group}s{shard}/{hash}`; every call recorded (its key count)."""

    def __init__(self, shards: int = 1) -> None:
        self.shards, self.held, self.calls = shards, set(), []

    def keys(self, hashes, group):
        return [f"g{group}s{s}/{h.hex()}" for h in hashes for s in range(self.shards)]

    def put(self, hashes, group=0, shards=None):
        for s in range(self.shards) if shards is None else shards:
            self.held |= {f"g{group}s{s}/{h.hex()}" for h in hashes}

    def exist(self, keys):
        self.calls.append(len(keys))
        return [int(k in self.held) for k in keys]

    def probe(self, hashes, groups=ONE_FULL):
        return PrefixProbe(hashes, groups, self.shards, BS, self.keys, self.exist)


def blocks(n: int, tag: str = "b") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def test_a_whole_prompt_stored_is_two_calls_every_block_asked_once():
    store, hs = Store(shards=2), blocks(2000)
    store.put(hs)
    probe = store.probe(hs)
    assert probe.run(NEVER) == 2000
    # The first window with the last block, then the rest; two shards' keys each.
    assert store.calls == [(FIRST_WINDOW + 1) * 2, (2000 - FIRST_WINDOW - 1) * 2]
    assert probe.keys_asked == 2000 * 2


def test_a_new_suffix_grows_the_windows_and_asks_little_past_the_hit():
    store, hs = Store(), blocks(2000)
    store.put(hs[:300])  # a stored prefix, then blocks nobody stored
    probe = store.probe(hs)
    assert probe.run(NEVER) == 300
    assert store.calls == [FIRST_WINDOW + 1, 4 * FIRST_WINDOW]
    assert list(probe.gone()) == [*((0, h) for h in hs[300:320]), (0, hs[1999])]


def test_a_prompt_stored_but_its_last_block_is_a_hit_of_the_rest():
    store, hs = Store(), blocks(500)
    store.put(hs[:-1])
    assert store.probe(hs).run(NEVER) == 499
    assert store.calls == [FIRST_WINDOW + 1, 4 * FIRST_WINDOW, 500 - 5 * FIRST_WINDOW]


def test_a_block_on_some_shards_only_is_not_there():
    store, hs = Store(shards=2), blocks(100)
    store.put(hs)
    store.held.discard(store.keys([hs[40]], 0)[1])  # block 40: shard 1 gone
    assert store.probe(hs).run(NEVER) == 40


@pytest.mark.parametrize("seed", range(200))
def test_the_hit_is_the_longest_stored_prefix_whatever_is_stored(seed):
    """Random stored sets (holes, a stored or absent last block, partial shards) in a full
    and a sliding-window group: the probe's hit is what asking every block would give."""
    rng = random.Random(seed)
    n = rng.choice([1, 2, 63, 64, 65, 66, 200, 1500])
    store, hs = Store(shards=rng.choice([1, 2])), blocks(n, f"s{seed}-")
    groups = rng.choice([ONE_FULL, (GroupSpec(FULL), GroupSpec(SLIDING, window=4 * BS))])
    for g in range(len(groups)):
        cut = rng.randrange(n + 1)
        shape = rng.choice(["prefix", "all but the last", "holes", "random"])
        holes = set(rng.sample(range(n), min(n, 3)))
        stored = [h for i, h in enumerate(hs)
                  if (i < cut if shape == "prefix" else i < n - 1 if shape == "all but the last"
                      else i not in holes if shape == "holes"
                      else i < cut or rng.random() < 0.7)]
        store.put(stored, g)
        if rng.random() < 0.3:
            store.put(hs, g, shards=[0])  # some blocks on shard 0 only
    full = [bytearray(1 if all(k in store.held for k in store.keys([h], g)) else 2
                      for h in hs) for g in range(len(groups))]

    def truth(g: int, lo: int, hi: int) -> int:
        i = full[g].find(2, lo, hi)
        return hi if i < 0 else i

    assert store.probe(hs, groups).run(NEVER) == window_hit(groups, truth, n, BS)


def test_past_its_deadline_a_probe_makes_no_call_and_proves_what_it_asked():
    store, hs = Store(), blocks(400)
    store.put(hs[:200])
    probe = store.probe(hs)
    with pytest.raises(Late):
        probe.run(SimpleNamespace(at=0.0))
    assert store.calls == [] and probe.proven() == 0
    deadline = SimpleNamespace(at=math.inf)

    def exist_then_expire(keys):
        deadline.at = 0.0  # the deadline passes during the first call
        return store.exist(keys)

    probe = PrefixProbe(hs, ONE_FULL, 1, BS, store.keys, exist_then_expire)
    with pytest.raises(Late):
        probe.run(deadline)
    assert probe.proven() == FIRST_WINDOW  # what the first window proved


def test_a_short_answer_is_refused():
    store, hs = Store(), blocks(10)
    probe = PrefixProbe(hs, ONE_FULL, 1, BS, store.keys, lambda keys: [1] * (len(keys) - 1))
    with pytest.raises(ValueError, match="answered 9 of 10 keys"):
        probe.run(NEVER)
