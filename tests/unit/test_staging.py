"""BlockStager against the store's own addressing: staged bytes must be exactly what a
multi-buffer transfer would read or write at `ObjectPlan.addresses`, for both cache layouts
(blocks on dim 0, and K/V split with blocks on dim 1), and in any block order."""

from __future__ import annotations

import ctypes

import pytest
import torch

from connector.worker.kv_regions import compute_regions
from connector.worker.staging import BlockStager

NB = 16


def layouts() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(shape, generator=g).to(torch.bfloat16)  # noqa: E731
    return {"blocks_dim0": {f"l{i}": rnd(NB, 1, 32, 256) for i in range(3)},
            "kv_split_dim1": {f"l{i}": rnd(2, NB, 2, 32, 32) for i in range(2)}}


def object_bytes(regions, block_id: int) -> bytes:
    """A block's stored object: its regions' bytes concatenated, read at the store's addresses."""
    addrs, sizes = regions.addresses([block_id])
    return b"".join(ctypes.string_at(a, s) for a, s in zip(addrs[0], sizes[0], strict=True))


@pytest.mark.parametrize("name", list(layouts()))
def test_gather_matches_store_addressing(name):
    caches = layouts()[name]
    regions = compute_regions(caches, NB)
    st = BlockStager(regions, NB, 4 * regions.block_bytes)
    ids = [7, 2, 11]
    st.gather(ids)
    staged = st.buffer[:3].numpy().tobytes()
    bb = regions.block_bytes
    for i, b in enumerate(ids):
        assert staged[i * bb:(i + 1) * bb] == object_bytes(regions, b)


@pytest.mark.parametrize("name", list(layouts()))
def test_scatter_writes_only_target_blocks(name):
    caches = layouts()[name]
    regions = compute_regions(caches, NB)
    st = BlockStager(regions, NB, 3 * regions.block_bytes)
    assert st.capacity == 3
    src = [object_bytes(regions, b) for b in (0, 1, 2)]
    before = {k: t.clone() for k, t in caches.items()}
    st.gather([0, 1, 2])
    st.scatter([9, 4], rows=[2, 0])  # row 1 (block 1) is not written anywhere
    assert object_bytes(regions, 9) == src[2]
    assert object_bytes(regions, 4) == src[0]
    for b in set(range(NB)) - {9, 4}:
        for k, t in caches.items():
            sel = (slice(None), b) if name == "kv_split_dim1" else (b,)
            assert torch.equal(t[sel], before[k][sel])


def test_capacity_is_at_least_one_block():
    regions = compute_regions(layouts()["blocks_dim0"], NB)
    assert BlockStager(regions, NB, 10).capacity == 1


def test_byte_aligned_regions_use_a_narrow_word():
    caches = {"l0": torch.zeros(NB, 3, dtype=torch.uint8)}  # 3-byte regions
    regions = compute_regions(caches, NB)
    st = BlockStager(regions, NB, 1024)
    caches["l0"][5] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    st.gather([5])
    st.scatter([6])
    assert caches["l0"][6].tolist() == [1, 2, 3]


def test_a_chunked_get_makes_no_call_past_the_jobs_deadline():
    """Three buffer-fulls to get; the deadline passes after the first one is scattered. No
    second call starts (before: the second get ran, then its scatter was refused: one store
    call past the bound). The deadline is moved, not waited for: a 50 ms deadline could pass
    before the first scatter on a loaded host."""
    import contextlib
    import threading
    import time

    from connector.worker.recv_pool import RUNNING, Ticket

    regions = compute_regions(layouts()["blocks_dim0"], NB)
    st = BlockStager(regions, NB, 2 * regions.block_bytes)
    expired: list[str] = []
    ticket = Ticket("job", time.monotonic() + 3600, threading.Lock(),
                    lambda t, reason: expired.append(reason))
    ticket.state = RUNNING
    calls: list[int] = []

    class Client:
        def batch_get_into(self, keys, addrs, sizes):
            calls.append(len(keys))
            return [regions.block_bytes] * len(keys)

    @contextlib.contextmanager
    def touching():
        with ticket.touching() as ok:
            yield ok
        ticket.deadline = time.monotonic() - 1  # it passes once the first one is in place

    results = st.get(Client(), [f"k{i}" for i in range(6)], list(range(6)), touching,
                     alive=ticket.alive)
    assert calls == [2] and len(results) == 2 and expired == ["timeout"]
