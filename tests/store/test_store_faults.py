"""Store faults at the worker level (moved from tests/e2e/test_faults.py, whose engine-level
tests the fault matrix now covers): a full store refuses saves, counted, while loads of what
fit keep working; shutdown does not hang with jobs queued. A real master and store node of
this module's own; no engine.
"""

from __future__ import annotations

import time

import pytest

from connector.metadata import BlockTransfer, StepMetadata
from devkit.local_cluster import local_pool
from tests.worker_kit import hashes, run_step, settled_saves


@pytest.fixture(scope="module")
def pool():
    with local_pool("256MB") as (master, node):
        yield master, node


def test_full_store_rejects_saves_and_keeps_serving(make_worker_on):
    with local_pool("16MB") as (master, _node):
        w = make_worker_on(master, prefix="full", heads=16)
        hs = hashes("full", 192)  # 192 x 128 KiB blocks (24 MiB) into a 16 MB segment
        for i in range(0, 192, 32):
            run_step(w, StepMetadata(saves=(BlockTransfer(f"s{i}", tuple(range(32)),
                                                          hs[i:i + 32]),),
                                     free_after_jobs=(f"s{i}",)))
        c = settled_saves(w, 192)  # every key written, or counted as lost
        assert c["save_keys|0"] > 0 and c["save_error_keys|0"] > 0, dict(c)
        rejected = sum(v for k, v in c.items() if k.startswith("failures|0|save|"))
        assert rejected > 0, dict(c)
        # Loads of what did fit (and was not evicted since) keep working.
        exists = w._connected().batch_is_exist(w._keys.keys(hs, 0))
        kept = [h for h, e in zip(hs, exists, strict=True) if e == 1]
        assert kept, "nothing stayed in the store"
        done, errors = run_step(w, StepMetadata(loads=(BlockTransfer("r", (0,), kept[:1]),)))
        assert done == {"r"} and errors == set()


def test_shutdown_does_not_hang_with_jobs_queued(make_worker_on, pool):
    master, _ = pool
    w = make_worker_on(master, prefix="shutdown", threads=2)
    hs = hashes("shutdown", 16)
    w.start_load(StepMetadata(loads=tuple(BlockTransfer(f"q{i}", tuple(range(16)), hs)
                                          for i in range(200))))
    t0 = time.monotonic()
    w.shutdown()
    assert time.monotonic() - t0 < 15
