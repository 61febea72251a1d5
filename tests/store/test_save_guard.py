"""No block computed on a failed in-step load reaches the store (connector.worker.save_guard), with
a real master and store node. A step loads request "a"'s prefix in-step while its forward
computes the rest of "a" and request "b" (which may have taken "a"'s blocks as a local prefix
hit). The load fails: neither request's save of that step, nor any later one, is made, and
each is counted as lost with code `unsafe`. A step whose in-step load succeeds saves as usual.
At TP=2 a load that fails on one rank keeps every rank's saves of the step out of the store.
"""

from __future__ import annotations

import threading

from connector.config import load_config
from connector.metadata import BlockTransfer, StepMetadata
from connector.store.keys import KeyBuilder, Layout
from connector.worker.worker import MooncakeStoreWorker
from tests.store import test_deadlines
from tests.store.test_deadlines import stored
from tests.store.test_step_loads import SYNC
from tests.worker_kit import LAYERS, NUM_BLOCKS, hashes, kv_caches, run_step, settled_saves

cluster = test_deadlines.cluster  # a master and store node of this module's own


def step(load_hashes, saves: dict[str, tuple[bytes, ...]], first_block: int) -> StepMetadata:
    """An in-step load of "a" into blocks 40.., and saves of each request's new blocks."""
    ids = iter(range(first_block, first_block + 64))
    return StepMetadata(
        sync_loads=(BlockTransfer("a", tuple(range(40, 40 + len(load_hashes))), load_hashes),),
        saves=tuple(BlockTransfer(r, tuple(next(ids) for _ in hs), hs)
                    for r, hs in saves.items()),
        free_after_jobs=tuple(saves), in_step_peers=("a", "b"))


def test_a_failed_in_step_load_saves_nothing_of_its_step_or_later(make_worker_on, cluster):
    master, _ = cluster
    hs = stored(make_worker_on, master, "guard-fail", n=4)
    w = make_worker_on(master, prefix="guard-fail", **SYNC)
    missing = (hs[0], hs[1], hashes("guard-absent", 1)[0], hs[3])  # the load fails at block 42
    new = {"a": hashes("guard-a", 2), "b": hashes("guard-b", 3)}
    run_step(w, step(missing, new, 0))
    later = {"b": hashes("guard-b-later", 2)}  # b's next chunk attends to its tainted blocks
    run_step(w, StepMetadata(saves=(BlockTransfer("b", (10, 11), later["b"]),),
                             free_after_jobs=("b",)))
    c = settled_saves(w, 7)
    assert c["save_error_keys|0"] == 7 and c["save_keys|0"] == 0, dict(c)
    assert c["failures|0|save|unsafe"] == 3, dict(c)  # a's and b's, then b's later one
    client = w._store.require()
    keys = [k for r, hs_ in (*new.items(), *later.items())
            for k in w._keys.object_keys(hs_, w._io[0].save.shards, 0)]
    assert client.batch_is_exist(keys) == [0] * len(keys), "a tainted block reached the store"
    # Once vLLM reports them finished their ids are free again (ids never come back in vLLM).
    w.get_transfer_results({"a", "b"})
    assert not w.save_guard.split([BlockTransfer("b", (1,), hashes("x", 1))])[1]


def test_a_step_whose_in_step_load_succeeds_saves(make_worker_on, cluster):
    master, _ = cluster
    hs = stored(make_worker_on, master, "guard-ok", n=4)
    w = make_worker_on(master, prefix="guard-ok", **SYNC)
    new = {"a": hashes("guard-ok-a", 2), "b": hashes("guard-ok-b", 3)}
    run_step(w, step(hs, new, 0))
    c = settled_saves(w, 5)
    assert c["save_keys|0"] == 5 and c["save_error_keys|0"] == 0, dict(c)


class TpGroup:
    """vLLM's TP group for two worker ranks of this process (`MooncakeStoreWorker.any_rank`):
    each rank gives its flag and gets the OR once both gave theirs, as the engine's gloo
    all-reduce does."""

    def __init__(self) -> None:
        self._flags = [False, False]
        self._barrier = threading.Barrier(2)
        self.rounds = 0

    def rank(self, r: int):
        def any_rank(flag: bool) -> bool:
            self._flags[r] = flag
            self._barrier.wait(timeout=30)
            out = any(self._flags)
            if r == 0:
                self.rounds += 1
            self._barrier.wait(timeout=30)  # both read before either writes again
            return out
        return any_rank


def test_at_tp2_a_load_failed_on_one_rank_saves_nothing_on_any_rank(cluster):
    """Two TP=2 ranks (store_tp_size 2: each loads and saves its own shard) run a step that
    loads "a"'s prefix in-step and saves the blocks the forward computes. Rank 1's shard of one
    block is gone, so only rank 1's load fails; rank 0's forward still ran on rank 1's unfilled
    heads (the attention output's all-reduce), so neither rank may save that step's blocks:
    else a later save by rank 1 alone completes the block with rank 0's wrong shard."""
    master, _ = cluster
    layout = Layout("guard-tp2", "bfloat16", 32, 2, 32, LAYERS, 2, store_tp_size=2)
    cfg = load_config(master.store_config(global_segment_size=0, local_buffer_size="16MB",
                                          load_threads=2, **SYNC), environ={})
    group = TpGroup()
    ranks = []
    try:
        for r in (0, 1):
            w = MooncakeStoreWorker(cfg, KeyBuilder("guard-tp2", layout), r, NUM_BLOCKS)
            w.register_kv_caches(kv_caches(heads=1, seed=r))  # this rank's one KV head
            w.any_rank = group.rank(r)
            ranks.append(w)
        prefix = hashes("guard-tp2-prefix", 4)
        for r, w in enumerate(ranks):  # both shards of the prefix stored
            run_step(w, StepMetadata(saves=(BlockTransfer(f"fill-{r}", tuple(range(4)),
                                                          prefix),),
                                     free_after_jobs=(f"fill-{r}",)))
            assert settled_saves(w, 4)[f"save_keys|{r}"] == 4
        client = ranks[0]._store.require()
        keys = ranks[0]._keys
        gone = keys.object_keys(prefix[2:3], (1,), 0)  # rank 1's shard of block 2
        assert client.remove(gone[0], True) == 0
        new = {"a": hashes("guard-tp2-a", 2), "b": hashes("guard-tp2-b", 3)}
        errors: list[set[int]] = [set(), set()]

        def rank_step(r: int) -> None:
            errors[r] = run_step(ranks[r], step(prefix, new, 0))[1]

        threads = [threading.Thread(target=rank_step, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert group.rounds == 1, "the ranks did not agree once on the step's in-step loads"
        assert errors[0] == set() and errors[1], errors  # only rank 1's load failed
        for r, w in enumerate(ranks):
            c = settled_saves(w, 5)
            assert c[f"save_keys|{r}"] == 0 and c[f"failures|{r}|save|unsafe"] == 2, dict(c)
        made = keys.object_keys([h for hs in new.values() for h in hs], (0, 1), 0)
        assert client.batch_is_exist(made) == [0] * len(made), \
            "a shard of a block computed on rank 1's unfilled heads reached the store"
    finally:
        for w in ranks:
            w.shutdown()
