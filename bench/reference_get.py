"""The limit of a store hit: one request's prefix bytes moved by one plain `batch_get_into`.

`ReferenceGet` puts `blocks` objects of `block_bytes` (the bytes one request of the workload
loads) on the store node once, from a client with no segment of its own, as the engines' saves
do; `measure` then times single `batch_get_into` calls of all of them into a registered
contiguous buffer (no connector, no pool, no copies into a KV layout), checking the bytes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from devkit.local_cluster import MooncakeMaster

PREFIX = "bench-serve-reference"


class ReferenceGet:
    def __init__(self, master: MooncakeMaster, blocks: int, block_bytes: int) -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.blocks, self.block_bytes = blocks, block_bytes
        self.keys = [f"{PREFIX}-{i}" for i in range(blocks)]
        self._src = torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(0))
        self._dst = torch.empty_like(self._src)
        self._client = MooncakeDistributedStore()
        rc = self._client.setup("127.0.0.1", master.metadata_server, 0, 64 << 20, "tcp", "",
                                master.address)
        if rc != 0:
            raise RuntimeError(f"reference client: setup against {master.address} failed: {rc}")
        for t in (self._src, self._dst):
            if self._client.register_buffer(t.data_ptr(), t.numel()) != 0:
                raise RuntimeError("reference client: register_buffer failed")
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        rcs = self._client.batch_put_from(self.keys, self._addrs(self._src),
                                          [block_bytes] * blocks, cfg)
        if any(r not in (0, -705) for r in rcs):
            raise RuntimeError(f"reference client: put failed: {sorted(set(rcs))[:4]}")

    def _addrs(self, t: torch.Tensor) -> list[int]:
        return [t.data_ptr() + i * self.block_bytes for i in range(self.blocks)]

    def measure(self, reps: int) -> dict[str, Any]:
        """Milliseconds of each of `reps` gets of every block in one call (after one warm-up)."""
        addrs, sizes = self._addrs(self._dst), [self.block_bytes] * self.blocks
        ms = []
        for i in range(reps + 1):
            self._dst.zero_()
            t0 = time.perf_counter()
            res = self._client.batch_get_into(self.keys, addrs, sizes)
            dt = time.perf_counter() - t0
            if any(r != self.block_bytes for r in res) or not torch.equal(self._dst, self._src):
                raise RuntimeError(f"reference get returned {sorted(set(res))[:4]} or wrong "
                                   "bytes")
            if i:
                ms.append(round(dt * 1e3, 3))
        return {"median_ms": statistics.median(ms), "reps_ms": ms}

    def close(self) -> None:
        self._client.batch_remove(self.keys, True)
        self._client.close()
