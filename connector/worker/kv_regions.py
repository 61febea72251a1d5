"""Where each stored KV object lives in this rank's memory.

A KV cache group's block is stored as `shards` objects (the in-tree connector's
`store_tp_size`): shard s holds KV heads [s*H/S, (s+1)*H/S) of every layer of the group, in
layer order, each layer's bytes in the cache's own memory order. Nothing in an object depends
on the TP size of the engine that wrote it, so engines with other TP sizes read it:

- a rank whose heads cover whole shards moves those objects (a TP=1 engine moves every shard
  of a block; a TP=S engine one per rank);
- a rank whose heads are part of a shard (TP > S) reads just its byte ranges of that object
  (Mooncake's ranged gets), and cannot write it alone, so it does not save;
- an MLA latent (H = 1) is one object per block that every rank reads and rank 0 writes; a
  GQA head replicated over several ranks (TP > H) is written by the first of them.

Per rank and group an `ObjectPlan` lists the pieces (one per object a block involves) and,
for every piece, its runs: contiguous byte ranges of the cache at `base + block * stride`,
with their offsets inside the stored object. Tensors are vLLM's per-layer views with blocks on
dim 0 (`[B, H, N, C]`) or dim 1 (`[2, B, ...]`, K and V split), heads first after the block
dimension; any stride order inside a block (head-major or token-major) works.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from connector.config import BY_NAME


class LayoutError(ValueError):
    """The KV cache tensors have a shape this connector cannot address."""


@dataclass(frozen=True)
class _Region:
    """One layer (or its K or V half): block b's interior starts at `base + b * stride`."""

    name: str
    base: int
    stride: int  # bytes from one block to the next
    shape: tuple[int, ...]  # interior: heads first
    estrides: tuple[int, ...]  # interior strides, in elements
    dtype: torch.dtype
    storage: torch.UntypedStorage
    layout_order: tuple[int, ...] | None = None  # vLLM's KV cache layout, when known

    @property
    def es(self) -> int:
        return self.dtype.itemsize

    def order(self, shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """Interior dimensions (of `shape`, default this region's) from outermost to innermost
        in memory. vLLM's layout says it; without one, the strides do, and a dimension of size
        1 (no place in memory, whatever its stride) goes first. The layout matters where a
        rank holds one head: its strides cannot tell head-major from token-major, but the
        shard it is part of is one or the other."""
        shape = shape or self.shape
        if self.layout_order is not None and len(self.layout_order) == len(shape):
            return self.layout_order
        return tuple(sorted(range(len(shape)), key=lambda i: (
            shape[i] != 1, -self.estrides[i], i)))


def _regions(kv_caches: Mapping[str, torch.Tensor], num_blocks: int,
             layout_order: tuple[int, ...] | None = None) -> list[_Region]:
    out = []
    for name, t in kv_caches.items():
        if t.shape[0] == num_blocks:
            views = [(name, t)]
        elif t.dim() > 1 and t.shape[1] == num_blocks:
            views = [(f"{name}#{i}", t[i]) for i in range(t.shape[0])]
        else:
            raise LayoutError(
                f"KV cache {name}: shape {tuple(t.shape)} has no dimension of num_blocks="
                f"{num_blocks} in position 0 or 1; this layout is not supported")
        for part, v in views:
            if v.dim() < 2 or v.stride(-1) != 1 and v.shape[-1] > 1:
                raise LayoutError(f"KV cache {name}: innermost dimension of {tuple(v.shape)} "
                                  f"with strides {v.stride()} is not contiguous")
            out.append(_Region(part, v.data_ptr(), v.stride(0) * v.element_size(),
                               tuple(v.shape[1:]), tuple(v.stride()[1:]), v.dtype,
                               t.untyped_storage(), layout_order))
    if not out:
        raise LayoutError("no KV cache tensors were registered")
    return out


def _runs(r: _Region, heads: tuple[int, int], shard: tuple[int, int], local0: int
          ) -> tuple[list[tuple[int, int, int]], int]:
    """Heads `heads` (global ids; this rank holds heads from `local0`) of one block of region
    `r`, as (offset in the block, bytes, offset in shard `shard`'s part of the object) runs,
    and the bytes of that part. The shard's part is its heads' interior in `r`'s memory order,
    so it is the same whichever TP size holds it."""
    order = r.order()
    sshape = (heads[1] - heads[0],) + r.shape[1:]
    cshape = (shard[1] - shard[0],) + r.shape[1:]
    cstr = [0] * len(cshape)
    acc = 1
    for i in reversed(order):
        cstr[i], acc = acc, acc * cshape[i]
    run, k = 1, len(order) - 1
    while k >= 0:  # merge inner dimensions contiguous both here and in the object
        i = order[k]
        if sshape[i] != 1 and not (r.estrides[i] == run and cstr[i] == run):
            break
        run *= sshape[i]
        k -= 1
    outer = [i for i in order[:k + 1] if sshape[i] > 1]
    base_here = (heads[0] - local0) * r.estrides[0]
    base_obj = (heads[0] - shard[0]) * cstr[0]
    runs = [(r.es * (base_here + sum(x * r.estrides[i] for x, i in zip(idx, outer, strict=True))),
             r.es * run,
             r.es * (base_obj + sum(x * cstr[i] for x, i in zip(idx, outer, strict=True))))
            for idx in itertools.product(*(range(sshape[i]) for i in outer))]
    return runs, acc * r.es


# What an ObjectPlan counts per kept address list (see ObjectPlan.addresses): a Python int and
# its slot per run, and the row's own header.
_INT_BYTES, _ROW_BYTES = 40, 64
ADDRESS_CACHE_DEFAULT = BY_NAME["address_cache_size"].default


@dataclass(frozen=True)
class ObjectPlan:
    """How this rank moves one group's objects: for each block, one unit per piece (store
    shard). Unit `u` is piece `u % pieces` of block `u // pieces`; its bytes here are runs
    `bases[p] + block * strides` of `sizes`, back to back (a "local object"). `src_offsets`
    place the runs inside the stored object when a piece is a slice of it (else None)."""

    shards: tuple[int, ...]  # store shard of each piece
    bases: np.ndarray  # int64 [P, R]: address of each run in block 0
    strides: np.ndarray  # int64 [R]
    sizes: tuple[int, ...]  # [R]
    src_offsets: tuple[int, ...] | None  # [R], for slices
    object_bytes: int  # bytes of the stored object
    storages: tuple[tuple[int, int], ...]  # unique (ptr, nbytes) to register with the store
    on_cuda: bool
    region_storages: tuple[torch.UntypedStorage, ...] = ()  # [R]: the memory each run is in
    cache_bytes: int = ADDRESS_CACHE_DEFAULT  # address_cache_size: see `addresses`
    _rows: dict[int, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def pieces(self) -> int:
        return len(self.shards)

    @property
    def block_bytes(self) -> int:
        """Bytes of one unit in this rank's memory (== object_bytes unless a slice)."""
        return sum(self.sizes)

    def units(self, block_ids: Sequence[int]) -> list[int]:
        """The units of these blocks, block-major (as `KeyBuilder.object_keys` orders keys)."""
        p = self.pieces
        if p == 1:  # a rank moving whole objects (most layouts): unit == block
            return list(block_ids)
        return (np.asarray(block_ids, dtype=np.int64)[:, None] * p + np.arange(p)).ravel().tolist()

    def addresses(self, units: Sequence[int]
                  ) -> tuple[list[tuple[int, ...]], list[list[int]]]:
        """Per-unit buffer addresses and sizes, as the store's multi-buffer calls take them
        (any sequence). Making the Python ints of the addresses is most of what a long
        prompt's load or save costs before its store call (one per run and block:
        docs/performance.md), and a unit's addresses never change while its KV cache is
        registered: so each unit's are made once and kept, up to about `cache_bytes` per
        plan (`kept_units`, the units first used; past that, made per call). Kept as tuples of ints,
        which the garbage collector stops tracking: kept lists would be walked by every
        full collection of the worker process."""
        rows = self._rows
        got = list(map(rows.get, units))
        sizes = list(self.sizes)
        if all(got):  # every row kept (a row is a non-empty tuple)
            return got, [sizes] * len(units)
        todo = [u for u, row in zip(units, got, strict=True) if row is None]
        made = dict(zip(todo, self._make(todo), strict=True))
        room = self.kept_units - len(rows)
        if room > 0:  # threads may add at once: the bound holds to within one call each
            rows.update(itertools.islice(made.items(), room))
        return [row or made[u] for u, row in zip(units, got, strict=True)], [sizes] * len(units)

    @property
    def row_bytes(self) -> int:
        """What one unit's kept address list counts against `cache_bytes`."""
        return len(self.sizes) * _INT_BYTES + _ROW_BYTES

    @property
    def kept_units(self) -> int:
        """How many units' address lists `cache_bytes` holds."""
        return self.cache_bytes // self.row_bytes

    def _make(self, units: list[int]) -> list[tuple[int, ...]]:
        """Each unit's run addresses, a tuple of Python ints per unit, made in one C pass
        from the int64 rows: `tolist()` made a list per unit first, as many objects again
        for the garbage collector to walk while they were made, and its passes over them
        grew faster than the blocks (docs/performance.md, first use)."""
        u = np.asarray(units, dtype=np.int64)
        blocks, piece = np.divmod(u, self.pieces)
        rows = blocks[:, None] * self.strides[None, :] + self.bases[piece]
        return list(struct.Struct(f"={rows.shape[1]}q").iter_unpack(rows.tobytes()))


@dataclass(frozen=True)
class GroupIO:
    """One group on one rank: what it loads, what it saves (None: nothing), and the
    TP-independent description of the stored bytes (part of the key fingerprint)."""

    load: ObjectPlan
    save: ObjectPlan | None
    description: str


def rank_heads(heads: int, tp_size: int, tp_rank: int) -> tuple[tuple[int, int], bool]:
    """The KV heads this rank holds, and whether it is the first of the ranks holding them
    (vLLM replicates heads when tp_size > heads)."""
    if tp_size <= heads:
        per = heads // tp_size
        return (tp_rank * per, (tp_rank + 1) * per), True
    replicas = tp_size // heads
    h = tp_rank // replicas
    return (h, h + 1), tp_rank % replicas == 0


def interior_order(kv_cache_layout: Any) -> tuple[int, ...] | None:
    """The memory order of a block's [H, N, C] in vLLM's KVCacheLayout (None: unknown)."""
    view = getattr(kv_cache_layout, "layer_view_order", None)
    return None if view is None else tuple(i - 1 for i in view if i != 0)


def plan_group(kv_caches: Mapping[str, torch.Tensor], num_blocks: int, heads: int,
               shards: int, tp_size: int = 1, tp_rank: int = 0,
               layout_order: tuple[int, ...] | None = None,
               address_cache: int = ADDRESS_CACHE_DEFAULT) -> GroupIO:
    """The plans of one group (its layers' tensors, in order) on rank `tp_rank`, with the
    model's `heads` KV heads split into `shards` store objects per block. `layout_order`:
    `interior_order` of vLLM's KV cache layout; `address_cache`: `address_cache_size`."""
    regions = _regions(kv_caches, num_blocks, layout_order)
    local, primary = rank_heads(heads, tp_size, tp_rank)
    per_shard = heads // shards
    first = local[0] // per_shard
    pieces = [(s, (max(s * per_shard, local[0]), min((s + 1) * per_shard, local[1])),
               (s * per_shard, (s + 1) * per_shard))
              for s in range(first, (local[1] - 1) // per_shard + 1)]
    whole = all(want == rng for _, want, rng in pieces)
    if len({want[1] - want[0] for _, want, _ in pieces}) > 1:
        raise LayoutError(f"{shards} store shards of {heads} KV heads do not nest with TP size "
                          f"{tp_size}: rank {tp_rank} would hold parts of shards of other sizes")
    n_local = local[1] - local[0]
    # This rank's block is one object exactly when it holds one whole shard: then the tensor's
    # interior is moved as it is, whatever its dimensions mean.
    as_is = pieces == [(first, local, local)]
    odd = [r for r in regions if r.shape[0] != n_local]
    if odd and not as_is:
        raise LayoutError(
            f"KV cache {odd[0].name}: {odd[0].shape} per block does not hold this rank's "
            f"{n_local} KV heads on the dimension after the blocks, so its heads cannot be "
            f"split into store shards; set store_tp_size to the TP size ({tp_size})")

    def part(r: _Region, want: tuple[int, int], rng: tuple[int, int]):
        if r.shape[0] != n_local:
            n = r.shape[0]
            return _runs(r, (0, n), (0, n), 0)
        return _runs(r, want, rng, local[0])

    bases, layout = [], None
    for _s, want, rng in pieces:
        row, runs, obj = [], [], 0
        for r in regions:
            rr, nbytes = part(r, want, rng)
            row += [r.base + off for off, _, _ in rr]
            runs += [(size, obj + src, r.stride, r.storage) for _, size, src in rr]
            obj += nbytes
        bases.append(row)
        layout = layout or (runs, obj)
    runs, obj = layout
    storages: dict[int, int] = {}
    for r in regions:
        ptr = r.storage.data_ptr()
        storages[ptr] = max(storages.get(ptr, 0), r.storage.nbytes())
    plan = ObjectPlan(
        shards=tuple(s for s, _, _ in pieces), bases=np.asarray(bases, dtype=np.int64),
        strides=np.asarray([x[2] for x in runs], dtype=np.int64),
        sizes=tuple(x[0] for x in runs),
        src_offsets=None if whole else tuple(x[1] for x in runs), object_bytes=obj,
        storages=tuple(storages.items()),
        on_cuda=any(r.storage.device.type == "cuda" for r in regions),
        region_storages=tuple(x[3] for x in runs), cache_bytes=address_cache)
    def describe(r: _Region) -> str:
        shape = (per_shard,) + r.shape[1:] if r.shape[0] == n_local else r.shape
        return (f"{r.name}:[{','.join(map(str, shape))}]o[{','.join(map(str, r.order(shape)))}]"
                f"{str(r.dtype).removeprefix('torch.')}x{r.es}")

    desc = ";".join(map(describe, regions))
    return GroupIO(load=plan, save=plan if whole and primary else None, description=desc)


def compute_regions(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> ObjectPlan:
    """Each block as one object: every layer's whole interior (a single-shard layout)."""
    return plan_group(kv_caches, num_blocks, 1, 1).load
