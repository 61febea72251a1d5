"""Scheduler side of KV cache groups and store shards, against a real master: a prefix is a hit
only as far as every group can restore it, a sliding-window group is probed, loaded and saved
only for its window, the blocks its saves read stay out of vLLM's block pool until the saves
are done, and an engine that cannot write its layout saves nothing."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from vllm.v1.core.block_pool import BlockPool

from connector.config import load_config
from connector.scheduler.prefix_probe import FIRST_WINDOW
from connector.scheduler.scheduler import MooncakeStoreScheduler
from connector.store.groups import FULL, ONE_FULL, SLIDING, GroupSpec
from connector.store.keys import KeyBuilder, Layout
from tests.store.test_scheduler import BS, ask, request, step_output
from tests.worker_kit import hashes

# Window 64 tokens, blocks of 32: a hit of n blocks needs sliding blocks n-2 and n-1.
HYBRID = (GroupSpec(SLIDING, 64, ("l0",)), GroupSpec(FULL, 0, ("l1",)))


def make(master, groups=HYBRID, tp=1, store_tp=0, **extra) -> MooncakeStoreScheduler:
    cfg = load_config(master.store_config(**extra), environ={})
    keys = KeyBuilder("groups", Layout("m", "bfloat16", BS, 2, 32, 2, tp, store_tp_size=store_tp),
                      len(groups))
    s = MooncakeStoreScheduler(cfg, keys, BS, groups)
    s.add_layout({r: "registered" for r in range(tp)})
    return s


@pytest.fixture
def sched(master, store_node):
    made = []

    def new(**kw):
        made.append(make(master, **kw))
        return made[-1]

    yield new
    for s in made:
        s.shutdown()


def put(client, sched, group, hs):
    buf = np.zeros(64, dtype=np.uint8)
    client.register_buffer(buf.ctypes.data, buf.nbytes)
    keys = sched._keys.all_shard_keys(hs, group)
    assert client.batch_put_from(keys, [buf.ctypes.data] * len(keys), [64] * len(keys)) == \
        [0] * len(keys)


def test_hit_needs_every_group(sched, store_client):
    s = sched()
    hs = hashes("every-group", 12)
    put(store_client, s, 1, hs[:10])       # full attention: blocks 0-9
    put(store_client, s, 0, hs[6:8])       # sliding window: only the window before block 8
    assert ask(s, request("a", hs, 12 * BS + 1)) == (8 * BS, True)
    # Without the window, the full group's 10 blocks are worth nothing but block 0's window.
    t = sched()
    hs2 = hashes("no-window", 12)
    put(store_client, t, 1, hs2[:10])
    put(store_client, t, 0, hs2[:1])
    assert ask(t, request("b", hs2, 12 * BS + 1)) == (1 * BS, True)
    # The full group bounds the sliding one: a window stored past a gap in the full group
    # does not count.
    u = sched()
    hs3 = hashes("gap", 12)
    put(store_client, u, 1, hs3[:4])
    put(store_client, u, 0, hs3[:12])
    assert ask(u, request("c", hs3, 12 * BS + 1)) == (4 * BS, True)


def test_sliding_window_is_probed_from_the_right_only(sched, store_client):
    """A 400-block prompt: the full group is probed in growing windows, the sliding group only
    in one window at the end (vLLM #47317's lookup mask)."""
    s = sched()
    hs = hashes("probe", 400)
    put(store_client, s, 1, hs)
    put(store_client, s, 0, hs[398:400])
    assert ask(s, request("p", hs, 400 * BS + 1)) == (400 * BS, True)
    probed = s.recorder.snapshot().data["c"]["lookup_keys"]
    assert probed == 400 + FIRST_WINDOW  # every full block once, the sliding group's tail


def pool_with(n: int = 64) -> BlockPool:
    return BlockPool(n, enable_caching=True, hash_block_size=BS)


def test_sliding_group_loads_only_its_window(sched, store_client):
    s = sched()
    s.bind_block_pool(pool_with())
    hs = hashes("window-load", 6)
    put(store_client, s, 1, hs)
    put(store_client, s, 0, hs[4:6])
    req = request("w", hs, 6 * BS + 1)
    assert ask(s, req) == (6 * BS, True)
    # vLLM allocates the sliding group's window only; the skipped blocks are the null block.
    s.update_state_after_alloc(req, SimpleNamespace(
        get_block_ids=lambda: ([0, 0, 0, 0, 11, 12, 13], [21, 22, 23, 24, 25, 26, 27])), 6 * BS)
    meta = s.build_connector_meta(step_output())
    assert [(t.group, t.block_ids, t.block_hashes) for t in meta.loads] == [
        (0, (11, 12), tuple(hs[4:6])), (1, (21, 22, 23, 24, 25, 26), tuple(hs))]


def test_sliding_group_saves_the_replay_window_pinned_until_saved(sched):
    """A 10-block prompt (321 tokens) computed in one step: the full group saves every block,
    the sliding group the two blocks before the replay boundary (block 10), and those two stay
    held in vLLM's pool after vLLM frees them, until the request's saves are reported done."""
    s = sched()
    pool = pool_with()
    s.bind_block_pool(pool)
    hs = hashes("window-save", 10)
    req = request("s", hs, 10 * BS + 1)
    sw_blocks = pool.get_new_blocks(11)
    full_blocks = pool.get_new_blocks(11)
    s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
    sw_ids, full_ids = [b.block_id for b in sw_blocks], [b.block_id for b in full_blocks]
    meta = s.build_connector_meta(step_output(
        [SimpleNamespace(req_id="s", block_ids=(sw_ids, full_ids), num_computed_tokens=0)],
        {"s": 10 * BS + 1}))
    assert [(t.group, t.block_ids) for t in meta.saves] == [
        (0, tuple(sw_ids[8:10])), (1, tuple(full_ids[:10]))]
    pool.free_blocks(sw_blocks)  # vLLM moves past the window (and ends the request)
    pool.free_blocks(full_blocks)
    assert [pool.blocks[i].ref_cnt for i in sw_ids[7:11]] == [0, 1, 1, 0]
    assert s.request_finished(req, full_ids) == (True, None)
    s.update_connector_output(SimpleNamespace(finished_sending={"s"}, finished_recving=None))
    assert [pool.blocks[i].ref_cnt for i in sw_ids[8:10]] == [0, 0]
    assert pool.get_num_free_blocks() == 63  # all but the null block


def test_a_preempted_request_releases_its_pins(sched):
    s = sched()
    pool = pool_with()
    s.bind_block_pool(pool)
    req = request("p", hashes("preempt", 4), 4 * BS + 1)
    blocks = [pool.get_new_blocks(5), pool.get_new_blocks(5)]
    ids = [[b.block_id for b in g] for g in blocks]
    s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
    s.build_connector_meta(step_output(
        [SimpleNamespace(req_id="p", block_ids=tuple(ids), num_computed_tokens=0)],
        {"p": 4 * BS + 1}))
    for g in blocks:
        pool.free_blocks(g)
    assert sum(pool.blocks[i].ref_cnt for i in ids[0]) == 2
    so = step_output()
    so.preempted_req_ids = {"p"}
    s.build_connector_meta(so)
    assert sum(pool.blocks[i].ref_cnt for i in ids[0]) == 0


def test_an_engine_that_cannot_write_its_layout_saves_nothing(sched):
    """store_tp_size 1 on TP=2: each object spans both ranks' heads; the engine reads them
    (slices) but plans no saves, so it holds no blocks for saves either."""
    s = sched(groups=ONE_FULL, tp=2, store_tp=1)
    assert not s.saves
    req = request("r", hashes("reader", 3), 3 * BS + 1)
    s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    meta = s.build_connector_meta(step_output(
        [SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4],), num_computed_tokens=0)],
        {"r": 3 * BS + 1}))
    assert meta.saves == () and s.request_finished(req, [1, 2, 3, 4]) == (False, None)
    assert sched(groups=ONE_FULL, tp=2, store_tp=2).saves


def test_vllms_reset_of_running_requests_frees_their_pinned_blocks(master, tiny_model):
    """vLLM's reset_prefix_cache(reset_running_requests=True), which pause_generation(mode=
    "keep", clear_cache=True) does around a weight update, preempts every running request
    outside a step and then needs every block free. A running request of a hybrid model holds
    pins on the sliding-window blocks its saves read; before, they were released only at the
    next step, so vLLM's reset raised RuntimeError. Its real Scheduler, with this connector."""
    import torch
    from vllm import SamplingParams
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    ktc = KVTransferConfig(kv_connector="PooledMooncakeStoreConnector",
                           kv_connector_module_path="connector", kv_role="kv_both",
                           kv_connector_extra_config=master.store_config(lookup_wait_ms=10000))
    config = VllmConfig(model_config=ModelConfig(model=tiny_model, dtype="float32"),
                        cache_config=CacheConfig(block_size=BS), kv_transfer_config=ktc)
    config.cache_config.num_gpu_blocks = 64
    kw = {"block_size": BS, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    kv_cache_config = KVCacheConfig(64, [], [
        KVCacheGroupSpec(["l0"], SlidingWindowSpec(sliding_window=64, **kw)),
        KVCacheGroupSpec(["l1"], FullAttentionSpec(**kw))])
    s = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, block_size=BS,
                  structured_output_manager=StructuredOutputManager(config), log_stats=False)
    try:
        s.connector.scheduler.add_layout({0: "registered"})  # the worker's report
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        s.add_request(Request("r", list(range(10 * BS)), SamplingParams(max_tokens=8), None,
                              block_hasher=get_request_block_hasher(BS, fn)))
        out = s.schedule()
        assert [t.group for t in out.kv_connector_metadata.saves] == [0, 1]
        s.update_from_output(out, ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0},
                                                    sampled_token_ids=[[7]]))
        assert [r.request_id for r in s.running] == ["r"]
        assert s.reset_prefix_cache(reset_running_requests=True)
        assert s.schedule().kv_connector_metadata.preempted == ("r",)
    finally:
        s.shutdown()
