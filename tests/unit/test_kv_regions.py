"""Block addressing on its own: every region of a block is exactly the tensor slice of that
block, for both cache layouts, and shapes the connector cannot address are refused; a store
shard is the same bytes whichever TP size holds it (caches as vLLM allocates them)."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from connector.worker.kv_regions import LayoutError, compute_regions, interior_order, plan_group
from tests.unit.test_staging import NB, layouts
from tests.worker_kit import vllm_caches


@pytest.mark.parametrize("name", list(layouts()))
def test_each_region_is_the_tensor_slice_of_its_block_in_order(name):
    """In order: a stored block is its regions' bytes concatenated in this order (layers as
    registered, K before V), so another order stores other bytes under the same key."""
    caches = layouts()[name]
    regions = compute_regions(caches, NB)
    addrs, sizes = regions.addresses([3, 0, NB - 1])
    for row, block in enumerate((3, 0, NB - 1)):
        expected = []
        for t in caches.values():
            parts = (t[0, block], t[1, block]) if name == "kv_split_dim1" else (t[block],)
            expected += [(p.data_ptr(), p.numel() * p.element_size()) for p in parts]
        assert list(zip(addrs[row], sizes[row], strict=True)) == expected
    assert regions.block_bytes == sum(sizes[0]) and not regions.on_cuda


def test_address_lists_are_made_once_per_unit_and_kept_within_their_bound():
    """A unit's address list is made on its first use and the same list is handed out after
    (a long prompt's lists are most of its preparation); past the bound (address_cache_size),
    lists are made per call, and every answer is the unit's addresses whatever was kept."""
    caches = layouts()["kv_split_dim1"]
    fresh = compute_regions(caches, NB)
    plan = plan_group(caches, NB, 1, 1, address_cache=3 * fresh.row_bytes).load
    assert plan.kept_units == 3
    units = [5, 2, 5, NB - 1, 0, 7]
    first, sizes = plan.addresses(units)
    expected = [fresh._make([u])[0] for u in units]
    assert first == expected and sizes == [list(plan.sizes)] * len(units)
    again, _ = plan.addresses(units)
    assert again == expected
    assert sorted(plan._rows) == [2, 5, NB - 1], "the first 3 units used are kept, no more"
    assert all(again[i] is first[i] for i in range(4)), "a kept list is handed out again"
    assert again[4] is not first[4] and again[5] is not first[5], \
        "a unit past the bound gets a list made for the call"


def test_region_order_follows_the_registration_order_not_the_addresses():
    """Layers registered from the highest address down keep that order (the one every rank
    and engine registers in): regions sorted by address would store other bytes."""
    caches = layouts()["blocks_dim0"]
    descending = dict(sorted(caches.items(), key=lambda kv: -kv[1].data_ptr()))
    addrs, _ = compute_regions(descending, NB).addresses([5])
    assert list(addrs[0]) == [t[5].data_ptr() for t in descending.values()] != sorted(addrs[0])


def test_registered_storages_cover_every_region_once():
    caches = layouts()["kv_split_dim1"]
    regions = compute_regions(caches, NB)
    assert sorted(regions.storages) == sorted(
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in caches.values())


def test_a_cache_without_a_block_dimension_is_refused():
    with pytest.raises(LayoutError):
        compute_regions({"l0": torch.zeros(3, 5, 7)}, NB)


def _object_bytes(plan, unit: int) -> bytes:
    addrs, sizes = plan.addresses([unit])
    return b"".join(ctypes.string_at(a, s) for a, s in zip(addrs[0], sizes[0], strict=True))


def _rank_caches(full: dict, spec, heads: int, tp: int, rank: int, layout) -> dict:
    """What rank `rank` of a TP=`tp` engine holds: vLLM's caches for its KV heads, with those
    heads' values from the TP=1 engine's caches."""
    from connector.worker.kv_regions import rank_heads

    (h0, h1), _ = rank_heads(heads, tp, rank)
    local, _ = vllm_caches([(list(full), dataclasses.replace(spec, num_kv_heads=h1 - h0))],
                           NB, layout, seed=None)
    for name, t in local.items():
        t.copy_(full[name][:, h0:h1])
    return local


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_store_objects_are_the_same_bytes_for_every_tp_size(layout, shards):
    """Every rank of TP 1, 2, 4 and 8 (heads replicated on pairs) moves exactly the bytes of
    the TP=1 engine's objects: whole shards, or its slice of one at the object's offsets; the
    description (in the keys) is the same; and only a rank holding a whole shard, the first of
    its replicas, saves it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout

    lay, heads = KVCacheLayout[layout], 4
    spec = FullAttentionSpec(block_size=32, num_kv_heads=heads, head_size=32,
                             dtype=torch.bfloat16)
    full, _ = vllm_caches([(["l0", "l1", "l2"], spec)], NB, lay)
    order = interior_order(lay)
    ref = plan_group(full, NB, heads, shards, layout_order=order)
    objects = {s: _object_bytes(ref.load, 5 * ref.load.pieces + p)
               for p, s in enumerate(ref.load.shards)}
    assert len(objects) == shards and ref.save is ref.load
    for tp in (1, 2, 4, 8):
        for rank in range(tp):
            io = plan_group(_rank_caches(full, spec, heads, tp, rank, lay), NB, heads, shards,
                            tp, rank, order)
            assert io.description == ref.description
            for p, s in enumerate(io.load.shards):
                got = _object_bytes(io.load, 5 * io.load.pieces + p)
                want = objects[s] if io.load.src_offsets is None else b"".join(
                    objects[s][o:o + n] for o, n in zip(io.load.src_offsets, io.load.sizes,
                                                        strict=True))
                if got != want:  # (pytest's diff of two long byte strings takes minutes)
                    pytest.fail(f"TP={tp} rank {rank} moves other bytes than shard {s}")
            whole = heads // shards <= max(1, heads // tp)
            assert (io.load.src_offsets is None) == whole
            assert (io.save is not None) == (whole and (tp <= heads or rank % 2 == 0))


def test_a_latent_is_one_object_every_rank_reads_and_rank_0_writes():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    caches, _ = vllm_caches([(["m0", "m1"], spec)], NB)
    ios = [plan_group(caches, NB, 1, 1, 2, r) for r in (0, 1)]
    assert [io.load.shards for io in ios] == [(0,), (0,)]
    assert ios[0].save is not None and ios[1].save is None
    assert ios[0].load.block_bytes == 2 * 16 * 576 * 2  # two layers' latents, once
