"""The worker against a store with a disk tier (real master and store node with
`--enable_offload`): blocks evicted from memory load back byte-exact from disk, each job split
so its get fits the owner's staging buffer (a larger get fails whole with -10, as the first
reader shows), and every loaded token is counted under the tier that served it."""

from __future__ import annotations

import time

import pytest
import torch

from connector.metadata import BlockTransfer, StepMetadata
from devkit.local_cluster import MooncakeMaster, StoreNode
from tests.worker_kit import hashes, kv_caches, run_step

HEADS = 8  # KV heads of the test caches: a block is 64 KiB
BLOCK = 64 * 1024
OWNER_BUFFER = 8 * BLOCK  # the store node's disk staging buffer


@pytest.fixture
def disk_cluster(tmp_path_factory):
    """A fresh master and store node per test: the first test fills the memory."""
    master = MooncakeMaster(offload=True, extra_args=("--default_kv_lease_ttl=200",)).start()
    node = StoreNode(master, segment_size="16MB", offload_path=str(tmp_path_factory.mktemp("d")),
                     env={"MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(OWNER_BUFFER)})
    node.start()
    yield master
    node.stop()
    master.stop()


def save(worker, req_id, block_ids, hs):
    run_step(worker, StepMetadata(saves=(BlockTransfer(req_id, tuple(block_ids), hs),),
                                  free_after_jobs=(req_id,)))


def tiers(client, keys: list[str]) -> set[str]:
    from connector.worker.worker import replica_tier

    descs = client.batch_get_replica_desc(keys)
    return {replica_tier(descs.get(k)) for k in keys}


@pytest.mark.parametrize("staging", ["off", "on"])
def test_evicted_blocks_load_from_disk_split_to_fit(make_worker_on, disk_cluster, staging):
    from mooncake.store import MooncakeDistributedStore

    src = kv_caches(HEADS, seed=3)
    writer = make_worker_on(disk_cluster, caches=src, prefix="disk", staging="off",
                            kv_heads=HEADS)
    hs = hashes("disk", 32)
    save(writer, "w", range(32), hs)
    keys = writer._keys.keys(hs, 0)
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", disk_cluster.metadata_server, 0, 16 * 2**20, "tcp", "",
                        disk_cluster.address) == 0
    try:
        # Write 24 MB more into the 16 MB memory (256 blocks), until the first 32 blocks live on
        # disk only. Not looked at meanwhile: a replica query counts as a use, and the master
        # evicts the least recently used blocks.
        deadline, n = time.monotonic() + 180, 0
        while n == 0 or tiers(client, keys) != {"disk"}:
            assert time.monotonic() < deadline, tiers(client, keys)
            for _ in range(12):
                save(writer, f"fill{n}", range(32, 64), hashes(f"fill{n}", 32))
                n += 1
                time.sleep(0.3)
    finally:
        client.close()

    # One get of 32 disk blocks (2 MiB) overflows the owner's 512 KiB buffer: all -10.
    whole = make_worker_on(disk_cluster, caches=kv_caches(HEADS, seed=None), prefix="disk",
                           staging=staging, kv_heads=HEADS)
    _, errors = run_step(whole, StepMetadata(loads=(BlockTransfer("a", tuple(range(32)), hs),)))
    assert errors == set(range(32))
    assert whole.recorder.snapshot().data["c"]["failures|0|load|-10"] == 1

    # With the disk tier declared: gets of at most 6 blocks (6 x (64 KiB + 8 KiB) <= 90 % of
    # 512 KiB) for the one reader of a worker with one load thread and no in-step thread, one
    # after another, all loaded, byte-exact, and counted as served from disk. Every get in
    # flight shares the owner's buffer: a worker with 4 load threads and an in-step thread
    # (5 readers) asks for 1 block per get, so that its 5 gets at once still fit.
    assert make_worker_on(disk_cluster, prefix="disk", enable_offload=True, kv_heads=HEADS,
                          heads=HEADS, disk_staging_buffer_size=OWNER_BUFFER, threads=4,
                          sync_load_ms=20)._disk_chunk == 1
    dst = kv_caches(HEADS, seed=None)
    split = make_worker_on(disk_cluster, caches=dst, prefix="disk", staging=staging,
                           enable_offload=True, disk_staging_buffer_size=OWNER_BUFFER,
                           kv_heads=HEADS, threads=1, sync_load_ms=0)
    assert split._disk_chunk == 6
    done, errors = run_step(split, StepMetadata(loads=(BlockTransfer("b", tuple(range(32)),
                                                                     hs),)))
    assert done == {"b"} and errors == set()
    for name in src:
        assert torch.equal(dst[name][:, :32], src[name][:, :32])
    c = split.recorder.snapshot().data["c"]
    assert c["load_tier_tokens|0|disk"] == 32 * 32 and "load_tier_tokens|0|memory" not in c
    assert c["load_tier_bytes|0|disk"] == 32 * BLOCK
    assert sum(v for k, v in c.items() if k.startswith("load_jobs|0|")) == 1  # one job

    # A rank of a TP=2 engine reading store_tp_size 1 objects asks for its half of each (the
    # ranged gets that work from memory, tests/store/test_layouts.py): Mooncake fails them for
    # objects on disk. Why the connector refuses a disk tier for such layouts
    # (connector.store.keys.check_disk_tier).
    assert tiers_of(disk_cluster, keys) == {"disk"}
    half = kv_caches(HEADS // 2, seed=None)
    reader = make_worker_on(disk_cluster, caches=half, prefix="disk", staging=staging,
                            enable_offload=True, disk_staging_buffer_size=OWNER_BUFFER,
                            kv_heads=HEADS, tp_size=2, store_tp=1)
    assert reader._io[0].load.src_offsets is not None
    _, errors = run_step(reader, StepMetadata(loads=(BlockTransfer("c", tuple(range(32)), hs),)))
    assert errors == set(range(32))
    assert reader.recorder.snapshot().data["c"]["failures|0|load|-600"] >= 1


def tiers_of(master, keys: list[str]) -> set[str]:
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", master.metadata_server, 0, 16 * 2**20, "tcp", "",
                        master.address) == 0
    try:
        return tiers(client, keys)
    finally:
        client.close()


def test_blocks_in_memory_are_counted_as_memory(make_worker_on, disk_cluster):
    src = kv_caches(HEADS, seed=4)
    w = make_worker_on(disk_cluster, caches=src, prefix="mem", staging="off",
                       enable_offload=True, disk_staging_buffer_size=OWNER_BUFFER)
    hs = hashes("mem", 4)
    save(w, "w", range(4), hs)
    w.recorder.snapshot()
    done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("r", tuple(range(8, 12)),
                                                                 hs),)))
    assert errors == set()
    c = w.recorder.snapshot().data["c"]
    assert c["load_tier_tokens|0|memory"] == 4 * 32 and "load_tier_tokens|0|disk" not in c


def test_a_block_larger_than_the_owner_buffer_is_a_startup_error(make_worker_on, disk_cluster):
    with pytest.raises(ValueError, match="disk_staging_buffer_size: .* hold no store object"):
        make_worker_on(disk_cluster, heads=HEADS, prefix="tiny", enable_offload=True,
                       disk_staging_buffer_size=BLOCK)
