"""What the store moves with no connector and no pool: sequential raw batch gets, everything
prepared before the clock starts, master direct.

- `batch_get_into`: each block into one contiguous 128 KiB slot of a registered buffer: the
  reference the sweep's `%ref` column divides by. It is one thread reading sequentially,
  measured once before the sweep, so it is not a ceiling: pooled rows can and do exceed it;
- `batch_get_into_multi_buffers`: each block scattered into the KV layout's regions (one per
  layer), as the connector must: the same layout with the pool and Python taken away.

Each is measured at several keys-per-call sizes, since one huge call is not the fastest
(the transfer engine queues every (key, region) as its own transfer); the best size counts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.loop import Guard
from bench.testbed import Source, Testbed, open_client
from bench.workloads import Geometry
from connector.worker.kv_regions import compute_regions


def _sweep_reads(tb: Testbed, call: Any, n: int, batch: int, reps: int,
                 guard: Guard | None) -> list[float]:
    """Seconds per rep of reading all n keys in calls of `batch` keys; a rep during which
    other processes loaded the machine is redone by `guard`, as in the sweep."""
    def once() -> tuple[float, float]:
        meter = tb.cpu_meter()
        meter.start()
        t0 = time.perf_counter()
        for i in range(0, n, batch):
            call(i, min(n, i + batch))
        dt = time.perf_counter() - t0
        return dt, meter.stop()["others"]

    guard = guard or Guard()  # no retries
    return [guard.attempt(once, tb.cpu_meter)[0] for _ in range(reps)]


def raw_ceilings(tb: Testbed, caches: dict[str, torch.Tensor], geometry: Geometry,
                 source: Source, batches: Sequence[int], reps: int,
                 guard: Guard | None = None) -> dict[str, Any]:
    n = min(source.count, geometry.num_blocks)
    bb = geometry.block_bytes
    names = source.our_keys[:n]
    buf = torch.empty((n, bb), dtype=torch.uint8)
    regions = compute_regions(caches, geometry.num_blocks)
    addrs, sizes = regions.addresses(list(range(n)))
    client = open_client(tb)
    result: dict[str, Any] = {"keys": n, "block_bytes": bb, "regions_per_block": len(sizes[0])}
    try:
        if client.register_buffer(buf.data_ptr(), buf.numel()) != 0:
            raise RuntimeError("ceiling: register_buffer failed")
        for ptr, size in regions.storages:
            if client.register_buffer(ptr, size) != 0:
                raise RuntimeError("ceiling: register_buffer failed for the KV caches")
        ptrs = [buf.data_ptr() + i * bb for i in range(n)]

        def contiguous(i: int, j: int) -> None:
            res = client.batch_get_into(names[i:j], ptrs[i:j], [bb] * (j - i))
            if any(r != bb for r in res):
                raise RuntimeError(f"ceiling: batch_get_into failed: {sorted(set(res))[:4]}")

        def scattered(i: int, j: int) -> None:
            res = client.batch_get_into_multi_buffers(names[i:j], addrs[i:j], sizes[i:j])
            if any(r != bb for r in res):
                raise RuntimeError(f"ceiling: multi-buffer get failed: {sorted(set(res))[:4]}")

        for name, call in (("batch_get_into", contiguous), ("multi_buffers", scattered)):
            by_batch = {}
            for k in batches:
                k = min(k, n)
                secs = _sweep_reads(tb, call, n, k, reps, guard)
                by_batch[str(k)] = [round(n * bb / s / 1e9, 4) for s in secs]
            best = max(by_batch, key=lambda k: statistics.median(by_batch[k]))
            result[name] = {"gbps": statistics.median(by_batch[best]), "best_keys_per_call":
                            int(best), "gbps_reps": by_batch[best], "by_keys_per_call": by_batch}
        if not torch.equal(buf, source.data[:n]):
            raise RuntimeError("ceiling: store returned wrong bytes")
        client.unregister_buffer(buf.data_ptr())
        for ptr, _ in regions.storages:
            client.unregister_buffer(ptr)
    finally:
        client.close()
    result["gbps"] = result["batch_get_into"]["gbps"]
    result["multibuffer_gbps"] = result["multi_buffers"]["gbps"]
    return result
