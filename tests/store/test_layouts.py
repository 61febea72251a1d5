"""Stored layouts against a real Mooncake master and store node, at the worker level: caches as
vLLM allocates them (its KV cache config, allocator and per-layer views, in the CPU backend's
layout and in a token-major one), TP ranks as separate workers with their own store clients.

- A block stored by one TP size loads byte-exact into another (store_tp_size 2: TP 2 -> 1 and
  1 -> 2), staged and zero-copy.
- A rank holding part of a stored object (TP 2 reading store_tp_size 1) reads only its bytes,
  with ranged gets, and saves nothing.
- MLA: one object per block, written by rank 0, read by every rank of any TP size.
- Hybrid: each KV cache group (sliding window beside full attention, sharing one allocation)
  moves its own blocks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from connector.config import load_config
from connector.metadata import BlockTransfer, StepMetadata
from connector.store.groups import FULL, ONE_FULL, SLIDING, GroupSpec
from connector.store.keys import KeyBuilder, Layout
from connector.worker.kv_regions import interior_order, rank_heads
from connector.worker.worker import MooncakeStoreWorker
from tests.worker_kit import hashes, run_step, vllm_caches

NB = 32
HEADS = 4
GQA = FullAttentionSpec(block_size=32, num_kv_heads=HEADS, head_size=32, dtype=torch.bfloat16)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
MODES = {"staged": {"staging": "on", "staging_buffer_size": 3 * 8192},
         "zero_copy": {"staging": "off"}}


@pytest.fixture
def workers(master, store_node):
    made: list[MooncakeStoreWorker] = []

    def make(caches, prefix, tp=1, rank=0, store_tp=0, heads=HEADS, groups=ONE_FULL,
             layout=KVCacheLayout.LBHNC, **extra) -> MooncakeStoreWorker:
        cfg = load_config(master.store_config(global_segment_size=0, local_buffer_size="16MB",
                                              load_threads=2, **extra), environ={})
        lay = Layout("layout-model", "bfloat16", 32, heads, 32, len(LAYERS), tp,
                     store_tp_size=store_tp)
        w = MooncakeStoreWorker(cfg, KeyBuilder(prefix, lay, len(groups)), rank, NB,
                                groups=groups, layout_order=interior_order(layout))
        w.register_kv_caches(caches, "CPU_ATTN")
        made.append(w)
        return w

    yield make
    for w in made:
        w.shutdown()


def rank_caches(full: dict, spec, tp: int, rank: int, layout) -> dict:
    """Rank `rank` of a TP=`tp` engine: vLLM's caches for its KV heads, holding those heads'
    values from the TP=1 engine's `full` caches."""
    (h0, h1), _ = rank_heads(spec.num_kv_heads, tp, rank)
    local, _ = vllm_caches([(list(full), dataclasses.replace(spec, num_kv_heads=h1 - h0))],
                           NB, layout, seed=None)
    for name, t in local.items():
        t.copy_(full[name][:, h0:h1])
    return local


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (random bytes as bfloat16 hold NaNs, which never compare equal)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def save(w, rid, ids, hs, group=0):
    run_step(w, StepMetadata(saves=(BlockTransfer(rid, tuple(ids), hs, group),),
                             free_after_jobs=(rid,)))


def load(w, rid, ids, hs, group=0) -> set[int]:
    done, errors = run_step(w, StepMetadata(loads=(BlockTransfer(rid, tuple(ids), hs, group),)))
    assert done == {rid}
    return errors


def layout_keys(w) -> dict[str, float]:
    return {k: v for k, v in w.recorder.snapshot().data["c"].items()
            if k.startswith("layout_keys|")}


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC])
@pytest.mark.parametrize("mode", list(MODES))
def test_tp2_store_loads_into_tp1_and_back(workers, layout, mode):
    """store_tp_size 2: two TP=2 ranks store a block's two shards; a TP=1 engine loads both into
    one cache; what the TP=1 engine stores loads back into TP=2 ranks."""
    prefix = f"tp-{layout.name}-{mode}"
    full, _ = vllm_caches([(LAYERS, GQA)], NB, layout, seed=1)
    hs = hashes(prefix, 6)
    ranks = [workers(rank_caches(full, GQA, 2, r, layout), prefix, tp=2, rank=r, store_tp=2,
                     layout=layout, **MODES[mode]) for r in (0, 1)]
    for r, w in enumerate(ranks):
        save(w, f"w{r}", range(6), hs)
        assert layout_keys(w) == {f"layout_keys|{r}|save|kv_heads|full|2|2": 6}
    dst, _ = vllm_caches([(LAYERS, GQA)], NB, layout, seed=None)
    one = workers(dst, prefix, store_tp=2, layout=layout, **MODES[mode])
    assert load(one, "r", range(10, 16), hs) == set()
    for name in LAYERS:
        assert same(dst[name][10:16], full[name][0:6])
        assert not dst[name][:10].any() and not dst[name][16:].any()
    assert layout_keys(one) == {"layout_keys|0|load|kv_heads|full|2|1": 12}
    # The reverse: TP=1 stores (both shards of each block), TP=2 ranks load their own.
    hs2 = hashes(prefix + "-back", 4)
    save(one, "w1", range(10, 14), hs2)
    for r in (0, 1):
        back, _ = vllm_caches([(LAYERS, dataclasses.replace(GQA, num_kv_heads=2))], NB, layout,
                              seed=None)
        w = workers(back, prefix, tp=2, rank=r, store_tp=2, layout=layout, **MODES[mode])
        assert load(w, f"b{r}", range(20, 24), hs2) == set()
        for name in LAYERS:
            assert same(back[name][20:24], full[name][0:4, 2 * r:2 * r + 2])


@pytest.mark.parametrize("mode", list(MODES))
def test_a_rank_holding_part_of_an_object_reads_just_its_slice(workers, mode):
    """store_tp_size 1 (one object per block, written by a TP=1 engine): each TP=2 rank reads
    only its half of every layer (ranged gets: the bytes moved are its own), and has nothing
    it could save."""
    prefix = f"slice-{mode}"
    layout = KVCacheLayout.LBNHC  # token-major: a rank's half is one run per token
    full, _ = vllm_caches([(LAYERS, GQA)], NB, layout, seed=2)
    hs = hashes(prefix, 5)
    save(workers(full, prefix, store_tp=1, layout=layout, **MODES[mode]), "w", range(5), hs)
    for r in (0, 1):
        half, _ = vllm_caches([(LAYERS, dataclasses.replace(GQA, num_kv_heads=2))], NB, layout,
                              seed=None)
        w = workers(half, prefix, tp=2, rank=r, store_tp=1, layout=layout, **MODES[mode])
        assert w._io[0].save is None
        assert load(w, f"r{r}", range(7, 12), hs) == set()
        for name in LAYERS:
            assert same(half[name][7:12], full[name][0:5, 2 * r:2 * r + 2])
        stats = w.recorder.snapshot().data["c"]
        assert stats[f"layout_keys|{r}|load|kv_heads_slice|full|1|2"] == 5
        block = GQA.page_size_bytes * len(LAYERS)
        assert sum(v for k, v in stats.items() if k.startswith("load_bytes|")) == 5 * block // 2


def test_a_slice_reader_reads_layers_registered_above_the_next_in_memory(workers):
    """Zero-copy ranged gets address each object's runs from the lowest one (offsets are
    unsigned): with layers registered in the reverse of their order in memory, offsets taken
    from the first run went negative and every ranged get raised."""
    prefix = "slice-reversed"
    layout = KVCacheLayout.LBNHC
    full, _ = vllm_caches([(LAYERS, GQA)], NB, layout, seed=4)
    full = dict(reversed(full.items()))
    hs = hashes(prefix, 3)
    save(workers(full, prefix, store_tp=1, layout=layout, staging="off"), "w", range(3), hs)
    half, _ = vllm_caches([(LAYERS, dataclasses.replace(GQA, num_kv_heads=2))], NB, layout,
                          seed=None)
    half = dict(reversed(half.items()))
    w = workers(half, prefix, tp=2, rank=1, store_tp=1, layout=layout, staging="off")
    assert w._io[0].load.src_offsets is not None
    assert load(w, "r", range(5, 8), hs) == set()
    for name in LAYERS:
        assert same(half[name][5:8], full[name][0:3, 2:4])


def test_missing_slice_object_fails_only_its_blocks(workers):
    prefix = "slice-missing"
    full, _ = vllm_caches([(LAYERS, GQA)], NB, seed=3)
    hs = hashes(prefix, 4)
    save(workers(full, prefix, store_tp=1), "w", [0, 1, 3], (hs[0], hs[1], hs[3]))
    half, _ = vllm_caches([(LAYERS, dataclasses.replace(GQA, num_kv_heads=2))], NB, seed=None)
    w = workers(half, prefix, tp=2, rank=1, store_tp=1, staging="off")
    assert load(w, "r", [10, 11, 12, 13], hs) == {12}
    stats = w.recorder.snapshot().data["c"]
    assert stats["failures|1|load|-704"] == 1


def test_mla_latent_is_stored_once_and_loaded_by_every_rank(workers):
    """MLA: the latent is the same on every TP rank. Rank 0 of a TP=2 engine stores one object
    per block, rank 1 stores nothing; TP=1 and both TP=2 ranks load it."""
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    src, _ = vllm_caches([(LAYERS, spec)], NB, seed=4)
    hs = hashes("mla", 3)
    latent = (GroupSpec(latent=True),)
    writers = [workers(src, "mla", tp=2, rank=r, heads=1, groups=latent) for r in (0, 1)]
    assert writers[1]._io[0].save is None
    for r, w in enumerate(writers):
        save(w, f"w{r}", range(3), hs)
    assert layout_keys(writers[0]) == {"layout_keys|0|save|latent|full|1|2": 3}
    assert layout_keys(writers[1]) == {}
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        dst, _ = vllm_caches([(LAYERS, spec)], NB, seed=None)
        w = workers(dst, "mla", tp=tp, rank=rank, heads=1, groups=latent)
        assert load(w, "r", range(20, 23), hs) == set()
        for name in LAYERS:
            assert same(dst[name][20:23], src[name][0:3])


def test_hybrid_groups_move_their_own_blocks(workers):
    """A sliding-window group and a full-attention group overlay one allocation (vLLM's hybrid
    manager): each moves its own layers of its own block ids, and keys never collide."""
    sw = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                           sliding_window=64)
    full = dataclasses.replace(GQA, num_kv_heads=2)
    groups = (GroupSpec(SLIDING, 64, (LAYERS[0],)), GroupSpec(FULL, 0, (LAYERS[1],)))
    spec = [([LAYERS[0]], sw), ([LAYERS[1]], full)]
    src, _ = vllm_caches(spec, NB, seed=5)
    assert src[LAYERS[0]].data_ptr() == src[LAYERS[1]].data_ptr()  # one allocation
    hs = hashes("hybrid", 4)
    w = workers(src, "hybrid", heads=2, groups=groups)
    save(w, "s", [1, 2], hs[2:4], group=0)  # the window's blocks of the sliding group
    save(w, "f", [5, 6, 7, 8], hs, group=1)  # every block of the full group
    dst, _ = vllm_caches(spec, NB, seed=None)
    r = workers(dst, "hybrid", heads=2, groups=groups)
    assert load(r, "l0", [20, 21], hs[2:4], group=0) == set()
    assert load(r, "l1", [24, 25, 26, 27], hs, group=1) == set()
    assert same(dst[LAYERS[0]][20:22], src[LAYERS[0]][1:3])
    assert same(dst[LAYERS[1]][24:28], src[LAYERS[1]][5:9])
    # Group 0's keys are not group 1's: the full group's first blocks are not in group 0.
    assert load(r, "miss", [30, 31], hs[0:2], group=0) == {30, 31}
    stats = r.recorder.snapshot().data["c"]
    assert stats["layout_keys|0|load|kv_heads|sliding_window|1|1"] == 2
    assert stats["layout_keys|0|load|kv_heads|full|1|1"] == 4
