"""Block addressing on its own: every region of a block is exactly the tensor slice of that
block, for both cache layouts, and shapes the connector cannot address are refused."""

from __future__ import annotations

import pytest
import torch

from connector.kv_regions import LayoutError, compute_regions
from tests.unit.test_staging import NB, layouts


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


def test_region_order_follows_the_registration_order_not_the_addresses():
    """Layers registered from the highest address down keep that order (the one every rank
    and engine registers in): regions sorted by address would store other bytes."""
    caches = layouts()["blocks_dim0"]
    descending = dict(sorted(caches.items(), key=lambda kv: -kv[1].data_ptr()))
    addrs, _ = compute_regions(descending, NB).addresses([5])
    assert addrs[0] == [t[5].data_ptr() for t in descending.values()] != sorted(addrs[0])


def test_registered_storages_cover_every_region_once():
    caches = layouts()["kv_split_dim1"]
    regions = compute_regions(caches, NB)
    assert sorted(regions.storages) == sorted(
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in caches.values())


def test_a_cache_without_a_block_dimension_is_refused():
    with pytest.raises(LayoutError):
        compute_regions({"l0": torch.zeros(3, 5, 7)}, NB)
