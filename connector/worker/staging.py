"""Staged block copies: the store moves each object as ONE contiguous buffer, and a few torch
copies move it between that buffer and its runs in the KV cache.

Why: an object in vLLM's KV layout is R runs (one per layer, or per layer and K/V, or per
token when a store shard's heads are interleaved with others), and the store's multi-buffer
calls move every run as its own slice. Over Mooncake's TCP transport each slice costs client
CPU: with 8 regions of 16 KiB a multi-buffer get moves about a third of what a contiguous get
moves on the same cores (docs/benchmark.md). A staging buffer per thread makes each key one
slice, and R `index_copy_` calls (memory speed, GIL released) scatter a whole batch into place.
With RDMA, or KV caches on a GPU, the NIC scatters for free and staging would only add a copy,
and a single-run object is already one slice, so `staging: auto` uses it for multi-run objects
in host memory over TCP only.

Units, not blocks: a plan's unit is one (block, store shard) object (`ObjectPlan.units`). A
unit that is a slice of its stored object (a rank holding part of a shard's heads) is read
with Mooncake's ranged get, only its own bytes: `ranged_get`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from connector.worker.kv_regions import ObjectPlan

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def ranged_get(client: Any, keys: list[str], addrs: Sequence[Sequence[int]],
               sizes: list[list[int]], src_offsets: Sequence[int]) -> list[int]:
    """Read byte ranges `src_offsets` (the same for every key) of objects into buffers with
    Mooncake's `get_into_ranges`; per-key results as the multi-buffer get returns them (bytes
    read, or the first error, such as -704 for a missing key).

    Not the get-session pair (`batch_get_session_start` + `batch_get_into_multi_buffer_ranges`):
    inside a TP=2 vLLM engine here its gets took 3 to 5 s and one rank's failed with -600
    after 3 s, while `get_into_ranges` moved the same ranges in milliseconds."""
    offs = list(src_offsets)
    # Each key's runs are addressed from its lowest one: offsets are unsigned (a block's later
    # layers may lie below its first in memory).
    bases = [min(a) for a in addrs]
    dst = [[[x - b for x in a]] for a, b in zip(addrs, bases, strict=True)]
    res = client.get_into_ranges(bases, [[k] for k in keys], dst, [[offs] for _ in keys],
                                 [[list(z)] for z in sizes])
    return [next((r for r in ranges[0] if r < 0), sum(ranges[0])) for ranges in res]


def _word(plan: ObjectPlan) -> tuple[int, torch.dtype]:
    """The widest integer type every run offset, stride and size is a multiple of (wide
    elements make `index_copy_` run at memcpy speed; bytes would be about 6x slower)."""
    offsets = [int(b) - st.data_ptr() for row in plan.bases
               for b, st in zip(row, plan.region_storages, strict=True)]
    values = [*offsets, *plan.strides.tolist(), *plan.sizes]
    return next((w, dt) for w, dt in _WORDS if all(v % w == 0 for v in values))


class BlockStager:
    """One thread's staging buffer of `capacity` units of one plan, registered with the
    store."""

    def __init__(self, plan: ObjectPlan, num_blocks: int, buffer_bytes: int) -> None:
        if plan.on_cuda or not plan.region_storages:
            raise ValueError("staging needs the KV caches in host memory")
        w, dt = _word(plan)
        self.plan = plan
        self.block_bytes = plan.block_bytes
        self.capacity = max(1, buffer_bytes // self.block_bytes)
        self.buffer = torch.empty((self.capacity, self.block_bytes // w), dtype=dt)
        ptr = self.buffer.data_ptr()
        self.addresses = [ptr + i * self.block_bytes for i in range(self.capacity)]
        self.sizes = [self.block_bytes] * self.capacity
        # Per piece, each run as a [num_blocks, size] tensor over the cache memory, and its
        # columns in a staged unit (the unit is the runs concatenated in this order).
        self._runs: list[list[tuple[torch.Tensor, int, int]]] = []
        for row in plan.bases.tolist():
            views, col = [], 0
            for base, stride, size, st in zip(row, plan.strides.tolist(), plan.sizes,
                                              plan.region_storages, strict=True):
                view = torch.empty(0, dtype=dt).set_(st, (base - st.data_ptr()) // w,
                                                     (num_blocks, size // w), (stride // w, 1))
                views.append((view, col, col + size // w))
                col += size // w
            self._runs.append(views)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _by_piece(self, units: Sequence[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(piece, block ids, staging rows) for each piece the units touch."""
        p = self.plan.pieces
        out = []
        for piece in range(p):
            rows = [i for i, u in enumerate(units) if u % p == piece]
            if rows:
                out.append((piece, torch.tensor([units[i] // p for i in rows]),
                            torch.tensor(rows, dtype=torch.int64)))
        return out

    def scatter(self, units: Sequence[int], rows: Sequence[int] | None = None) -> None:
        """Copy staged units (rows 0..n-1, or `rows`) into their places in the KV cache."""
        if not units:
            return
        src = self.buffer[:len(units)] if rows is None else \
            self.buffer.index_select(0, torch.tensor(rows, dtype=torch.int64))
        for piece, blocks, idx in self._by_piece(units):
            part = src if len(idx) == len(units) else src.index_select(0, idx)
            for view, a, b in self._runs[piece]:
                view.index_copy_(0, blocks, part[:, a:b])

    def gather(self, units: Sequence[int]) -> None:
        """Copy units from the KV cache into staging rows 0..n-1."""
        dst = self.buffer[:len(units)]
        for piece, blocks, idx in self._by_piece(units):
            for view, a, b in self._runs[piece]:
                if len(idx) == len(units):
                    dst[:, a:b] = view.index_select(0, blocks)
                else:
                    dst[idx, a:b] = view.index_select(0, blocks)

    def get(self, client: Any, keys: list[str], units: list[int],
            touching: Callable[[], AbstractContextManager[bool]], per_call: int = 0,
            alive: Callable[[], bool] = lambda: True) -> list[int]:
        """Get into the buffer a buffer-full (or `per_call` units, if fewer) at a time and
        scatter the units that arrived whole; per-key results as the store's multi-buffer get
        returns them.

        `touching()` guards each scatter (the only write into the KV cache): when it yields
        False the job has expired, its blocks belong to vLLM again, and the get stops.
        `alive()` is asked before each further call: none starts past the job's deadline."""
        results: list[int] = []
        step = min(self.capacity, per_call) if per_call else self.capacity
        for i in range(0, len(keys), step):
            if i and not alive():
                return results
            n = min(step, len(keys) - i)
            res = self.fetch(client, keys[i:i + n], range(n))
            ids = units[i:i + n]
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

    def fetch(self, client: Any, keys: list[str], rows: Sequence[int]) -> list[int]:
        """Get `keys` into staging `rows` (one call), scattering nothing; per-key results."""
        addrs = [self.addresses[r] for r in rows]
        if self.plan.src_offsets is None:
            return client.batch_get_into(keys, addrs, [self.block_bytes] * len(keys))
        # slices: this rank's runs of each object, back to back in a row
        starts = [0, *itertools.accumulate(self.plan.sizes)][:-1]
        return ranged_get(client, keys, [[a + s for s in starts] for a in addrs],
                          [list(self.plan.sizes)] * len(keys), self.plan.src_offsets)

    def put(self, client: Any, keys: list[str], units: list[int],
            reading: Callable[[], AbstractContextManager[bool]], replicate: Any = None
            ) -> list[int]:
        """Gather and put a buffer-full at a time; per-key results of `batch_put_from` for the
        buffer-fulls put, stopping (fewer results than keys) at the first `reading()` that
        yields False (the job expired or was dropped: it must not read the blocks again).

        Each gather alone runs inside `reading()`; each put reads only the staging buffer and
        runs outside it. So the job can be expired (at its deadline) or dropped (a
        preemption) during any put, and lets go of the blocks at once: a later buffer-full is
        gathered only if the job still holds them. What holds the blocks is a copy at memory
        speed, never a store call."""
        results: list[int] = []
        step = self.capacity
        for i in range(0, len(keys), step):
            with reading() as ok:
                if not ok:
                    return results
                self.gather(units[i:i + step])
            results.extend(self._put(client, keys[i:i + step], replicate))
        return results

    def _put(self, client: Any, keys: list[str], replicate: Any) -> list[int]:
        """Put staging rows 0..len(keys)-1 under `keys`."""
        args = (keys, self.addresses[:len(keys)], self.sizes[:len(keys)])
        return client.batch_put_from(*args, replicate) if replicate is not None \
            else client.batch_put_from(*args)
