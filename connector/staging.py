"""Staged block copies: the store moves each block as ONE contiguous buffer, and a few torch
copies move it between that buffer and the block's KV regions.

Why: a block in vLLM's KV layout is R regions (one per layer, or per layer and K/V), and the
store's multi-buffer calls move every region as its own slice. Over Mooncake's TCP transport each
slice costs client CPU: with 8 regions of 16 KiB a multi-buffer get moves about a third of what a
contiguous get moves on the same cores (docs/benchmark.md). A staging buffer per thread makes
each key one slice, and R `index_copy_` calls (memory speed, GIL released) scatter a whole batch
into place. With RDMA, or KV caches on a GPU, the NIC scatters for free and staging would only
add a copy, and a single-region block is already one slice, so `staging: auto` uses it for
multi-region blocks in host memory over TCP only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from connector.kv_regions import BlockRegions

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _word(regions: BlockRegions) -> tuple[int, torch.dtype]:
    """The widest integer type every region offset, stride and size is a multiple of (wide
    elements make `index_copy_` run at memcpy speed; bytes would be about 6x slower)."""
    offsets = [int(b) - st.data_ptr() for b, st in zip(regions.bases, regions.region_storages,
                                                       strict=True)]
    values = [*offsets, *regions.strides.tolist(), *regions.sizes]
    return next((w, dt) for w, dt in _WORDS if all(v % w == 0 for v in values))


class BlockStager:
    """One thread's staging buffer of `capacity` blocks, registered with the store."""

    def __init__(self, regions: BlockRegions, num_blocks: int, buffer_bytes: int) -> None:
        if regions.on_cuda or not regions.region_storages:
            raise ValueError("staging needs the KV caches in host memory")
        w, dt = _word(regions)
        self.block_bytes = regions.block_bytes
        self.capacity = max(1, buffer_bytes // self.block_bytes)
        self.buffer = torch.empty((self.capacity, self.block_bytes // w), dtype=dt)
        ptr = self.buffer.data_ptr()
        self.addresses = [ptr + i * self.block_bytes for i in range(self.capacity)]
        self.sizes = [self.block_bytes] * self.capacity
        # Each region as a [num_blocks, size] tensor over the cache memory, and its columns in
        # a staged block (the stored object is the regions concatenated in this order).
        self._regions: list[tuple[torch.Tensor, int, int]] = []
        col = 0
        for base, stride, size, st in zip(regions.bases.tolist(), regions.strides.tolist(),
                                          regions.sizes, regions.region_storages, strict=True):
            view = torch.empty(0, dtype=dt).set_(st, (base - st.data_ptr()) // w,
                                                 (num_blocks, size // w), (stride // w, 1))
            self._regions.append((view, col, col + size // w))
            col += size // w

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def scatter(self, block_ids: Sequence[int], rows: Sequence[int] | None = None) -> None:
        """Copy staged blocks (rows 0..n-1, or `rows`) into KV blocks `block_ids`."""
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.int64)
        src = self.buffer[:len(block_ids)] if rows is None else \
            self.buffer.index_select(0, torch.tensor(rows, dtype=torch.int64))
        for view, a, b in self._regions:
            view.index_copy_(0, idx, src[:, a:b])

    def get(self, client: Any, keys: list[str], block_ids: list[int],
            touching: Callable[[], AbstractContextManager[bool]], per_call: int = 0
            ) -> list[int]:
        """Get into the buffer a buffer-full (or `per_call` blocks, if fewer) at a time and
        scatter the blocks that arrived whole; per-key results as the store's multi-buffer get
        returns them.

        `touching()` guards each scatter (the only write into the KV cache): when it yields
        False the job has expired, its blocks belong to vLLM again, and the get stops."""
        results: list[int] = []
        step = min(self.capacity, per_call) if per_call else self.capacity
        for i in range(0, len(keys), step):
            n = min(step, len(keys) - i)
            res = client.batch_get_into(keys[i:i + n], self.addresses[:n], self.sizes[:n])
            ids = block_ids[i:i + n]
            ok = [j for j, r in enumerate(res) if r == self.block_bytes]
            with touching() as allowed:
                if not allowed:
                    return results
                if len(ok) == len(res):
                    self.scatter(ids)
                elif ok:  # never copy a short or failed read into the cache
                    self.scatter([ids[j] for j in ok], rows=ok)
            results.extend(res)
        return results

    def put(self, client: Any, keys: list[str], block_ids: list[int],
            reading: Callable[[], AbstractContextManager[bool]], replicate: Any = None
            ) -> list[int]:
        """Gather and put a buffer-full at a time; per-key results of `batch_put_from`, or []
        when `reading()` yields False (the job expired: it must not read the blocks).

        The KV blocks are read only inside one `reading()`, from the first gather to the
        last: the puts of earlier chunks run inside it, since a later chunk must never be
        gathered from blocks vLLM took back meanwhile. The last chunk's put reads only the
        staging buffer (for a job that fits the buffer, the only put), so the job may be
        expired during it without harm."""
        results: list[int] = []
        step = self.capacity
        if not keys:
            return results
        with reading() as ok:
            if not ok:
                return results
            for i in range(0, len(keys), step):
                self.gather(block_ids[i:i + step])
                if i + step < len(keys):
                    results.extend(self._put(client, keys[i:i + step], replicate))
        last = (len(keys) - 1) // step * step
        results.extend(self._put(client, keys[last:], replicate))
        return results

    def _put(self, client: Any, keys: list[str], replicate: Any) -> list[int]:
        """Put staging rows 0..len(keys)-1 under `keys`."""
        args = (keys, self.addresses[:len(keys)], self.sizes[:len(keys)])
        return client.batch_put_from(*args, replicate) if replicate is not None \
            else client.batch_put_from(*args)

    def gather(self, block_ids: Sequence[int]) -> None:
        """Copy KV blocks `block_ids` into staging rows 0..n-1."""
        idx = torch.tensor(block_ids, dtype=torch.int64)
        dst = self.buffer[:len(block_ids)]
        for view, a, b in self._regions:
            dst[:, a:b] = view.index_select(0, idx)
