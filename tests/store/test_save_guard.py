"""No block computed on a failed in-step load reaches the store (connector.worker.save_guard), with
a real master and store node. A step loads request "a"'s prefix in-step while its forward
computes the rest of "a" and request "b" (which may have taken "a"'s blocks as a local prefix
hit). The load fails: neither request's save of that step, nor any later one, is made, and
each is counted as lost with code `unsafe`. A step whose in-step load succeeds saves as usual.
At TP=2 a load that fails on one rank keeps every rank's saves of the step out of the store.
A request that a later step schedules on the failed load's blocks (vLLM's own scheduler, a step
ahead as async scheduling does) is kept out with it (connector.scheduler.load_deps).
"""

from __future__ import annotations

import threading

import pytest

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


class AsyncSteps:
    """vLLM's real Scheduler with this connector, scheduling as async scheduling (vLLM's
    default) does: a step before the previous step's output came back. Its store lookups find
    a 6-block prefix (objects under the scheduler's keys); its workers are a test worker whose
    keys are its own, so an in-step load of that prefix fails unless `loads_ok`."""

    PROMPT = list(range(200))  # 6 full blocks and 8 tokens

    def __init__(self, master, tiny_model: str, worker, monkeypatch) -> None:
        import numpy as np
        import torch
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from tests.conftest import plain_client

        ktc = KVTransferConfig(kv_connector="PooledMooncakeStoreConnector",
                               kv_connector_module_path="connector", kv_role="kv_both",
                               kv_connector_extra_config=master.store_config(
                                   lookup_wait_ms=10000))
        config = VllmConfig(model_config=ModelConfig(model=tiny_model, dtype="float32"),
                            cache_config=CacheConfig(block_size=32, enable_prefix_caching=True),
                            kv_transfer_config=ktc)
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32)
        self.vllm = Scheduler(vllm_config=config, kv_cache_config=KVCacheConfig(
            NUM_BLOCKS, [], [KVCacheGroupSpec(["l0", "l1"], spec)]),
            structured_output_manager=StructuredOutputManager(config), block_size=32,
            log_stats=False)
        self.sched = self.vllm.connector.scheduler
        self.sched.add_layout({0: "registered"})  # the worker's report
        # the step-load estimate says: in the step
        monkeypatch.setattr(self.sched._step_loads, "take", lambda *a, **k: True)
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        self._hasher = get_request_block_hasher(32, fn)
        self.worker = worker
        self.errors: set[int] = set()
        client = plain_client(master)
        try:
            buf = np.zeros(64, dtype=np.uint8)
            client.register_buffer(buf.ctypes.data, buf.nbytes)
            keys = self.sched._keys.all_shard_keys(self.request("fill").block_hashes[:6], 0)
            assert client.batch_put_from(keys, [buf.ctypes.data] * len(keys),
                                         [64] * len(keys)) == [0] * len(keys)
        finally:
            client.close()

    def request(self, rid: str, tail: int = 0):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        return Request(rid, [*self.PROMPT, *[5] * tail], SamplingParams(max_tokens=4), None,
                       block_hasher=self._hasher)

    def step(self, *requests) -> StepMetadata:
        """Admit `requests` and schedule a step; the worker runs it as vLLM's model runner
        does (the step's loads, its forward, its saves, then the load errors: `errors`)."""
        for r in requests:
            self.vllm.add_request(r)
        meta = self.vllm.schedule().kv_connector_metadata
        w = self.worker
        w.note_free_after(meta)
        w.start_load(meta)
        w.start_save(meta)
        self.errors |= w.get_load_errors()
        return meta

    def report(self) -> None:
        from types import SimpleNamespace

        from connector.metadata import WorkerReport

        self.sched.update_connector_output(SimpleNamespace(
            finished_sending=None, finished_recving=None,
            kv_connector_worker_meta=WorkerReport({}, self.worker.take_load_times())))


def test_a_later_step_on_a_failed_in_step_loads_blocks_saves_nothing(
        make_worker_on, cluster, tiny_model, monkeypatch):
    """vLLM caches r1's blocks when it allocates them for r1's in-step load, and schedules
    the next step before this one's output comes back: r3 takes them as a local prefix hit
    and computes its next block on them. r1's load fails, so that block attends to bytes the
    load never wrote, and it must not reach the store. Before, only r1's own step was kept out
    (in_step_peers); r3's save was made."""
    master, _ = cluster
    w = make_worker_on(master, prefix="deps-fail", **SYNC)
    s = AsyncSteps(master, tiny_model, w, monkeypatch)
    try:
        first = s.step(s.request("r1"))
        assert [(t.req_id, len(t.block_ids)) for t in first.sync_loads] == [("r1", 6)]
        then = s.step(s.request("r3", tail=40))  # before step N's output
        assert [t.req_id for t in then.saves] == ["r3"]
        assert s.errors == set(first.sync_loads[0].block_ids)  # r1's load failed
        c = settled_saves(w, 1)
        t = then.saves[0]
        made = w._keys.object_keys(t.block_hashes, w._io[0].save.shards, 0)
        assert w._store.require().batch_is_exist(made) == [0] * len(made), \
            "a block computed on a failed load's blocks reached the store"
        assert c["failures|0|save|unsafe"] == 1 and c["save_keys|0"] == 0, dict(c)
        assert then.load_deps == (("r3", "r1"),)
        s.report()  # r1's load failed: its blocks and r3's left vLLM's prefix cache
        later = s.step(s.request("r4", tail=70))
        assert [(t.req_id, len(t.block_ids)) for t in later.sync_loads] == [("r4", 6)]
        assert later.load_deps == ()
    finally:
        s.vllm.shutdown()


@pytest.mark.parametrize("aborted", ["after the report", "before the report"])
def test_a_failed_in_step_loads_blocks_leave_vllms_prefix_cache(
        make_worker_on, cluster, tiny_model, monkeypatch, aborted):
    """r3 computed a block on r1's failed load (scheduled a step ahead) and was kept out by its
    name; then both finish, and vLLM's prefix cache keeps their blocks. r9, r3's prompt and
    more (a conversation's next turn), took them as a local hit, was named with nobody (their
    owners were gone) and saved blocks computed on them. Now the failure's report evicts them:
    r9 loads the prefix from the store itself. Aborted before the report, their blocks are
    followed until it comes."""
    from vllm.v1.request import RequestStatus

    master, _ = cluster
    w = make_worker_on(master, prefix="deps-evict", **SYNC)
    s = AsyncSteps(master, tiny_model, w, monkeypatch)
    try:
        s.step(s.request("r1"))
        then = s.step(s.request("r3", tail=40))
        assert then.load_deps == (("r3", "r1"),) and s.errors  # and r1's load failed
        settled_saves(w, 1)  # r3's, not made
        if aborted == "before the report":
            s.vllm.finish_requests(["r1", "r3"], RequestStatus.FINISHED_ABORTED)
        s.report()
        if aborted == "after the report":
            s.vllm.finish_requests(["r1", "r3"], RequestStatus.FINISHED_ABORTED)
        later = s.step(s.request("r9", tail=70))
        assert [t.req_id for t in later.saves] == ["r9"]
        t = later.saves[0]
        settled_saves(w, len(t.block_ids))
        made = w._keys.object_keys(t.block_hashes, w._io[0].save.shards, 0)
        assert w._store.require().batch_is_exist(made) == [0] * len(made), \
            "a block computed on a failed load's blocks reached the store"
        assert [(t.req_id, len(t.block_ids)) for t in later.sync_loads] == [("r9", 6)]
    finally:
        s.vllm.shutdown()


def test_once_an_in_step_load_is_reported_whole_nothing_waits_on_it(
        make_worker_on, cluster, tiny_model, monkeypatch):
    """The same steps with r1's prefix stored under the worker's keys too: its load succeeds,
    r3's block is saved, and once the step's report says so, a request taking r1's blocks is
    named with nobody."""
    master, _ = cluster
    w = make_worker_on(master, prefix="deps-ok", **SYNC)
    s = AsyncSteps(master, tiny_model, w, monkeypatch)
    try:
        hs = tuple(s.request("fill").block_hashes[:6])
        run_step(w, StepMetadata(saves=(BlockTransfer("fill", tuple(range(50, 56)), hs),),
                                 free_after_jobs=("fill",)))
        assert settled_saves(w, 6)["save_keys|0"] == 6
        first = s.step(s.request("r1"))
        assert [t.req_id for t in first.sync_loads] == ["r1"]
        then = s.step(s.request("r3", tail=40))
        assert then.load_deps == (("r3", "r1"),)  # not known yet when it was scheduled
        assert not s.errors
        c = settled_saves(w, 1)
        assert c["save_keys|0"] == 1 and not c["failures|0|save|unsafe"], dict(c)
        s.report()
        later = s.step(s.request("r4", tail=70))
        assert later.load_deps == () and not s.sched._load_deps.following
    finally:
        s.vllm.shutdown()
