"""Where each KV block lives in memory: one store object per block is the concatenation of a
fixed list of regions (one per layer, or per layer and K/V when they are split), each at
`base + block_id * stride`.

Handles caches indexed by block on dim 0 (`[num_blocks, ...]`) and on dim 1
(`[2, num_blocks, ...]`, K and V split: the CPU and FlashAttention layouts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class LayoutError(ValueError):
    """The KV cache tensors have a shape this connector cannot address."""


@dataclass(frozen=True)
class BlockRegions:
    bases: np.ndarray  # int64 [R]: address of block 0 in each region
    strides: np.ndarray  # int64 [R]: bytes from one block to the next
    sizes: tuple[int, ...]  # bytes of one block in each region
    storages: tuple[tuple[int, int], ...]  # unique (ptr, nbytes) to register with the store
    on_cuda: bool
    region_storages: tuple[torch.UntypedStorage, ...] = ()  # [R]: the memory each region is in

    @property
    def block_bytes(self) -> int:
        return sum(self.sizes)

    def addresses(self, block_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per-block buffer address lists and size lists, as the store's multi-buffer calls take."""
        ids = np.asarray(block_ids, dtype=np.int64)
        addrs = (ids[:, None] * self.strides[None, :] + self.bases[None, :]).tolist()
        sizes = list(self.sizes)
        return addrs, [sizes] * len(addrs)


def compute_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> BlockRegions:
    bases: list[int] = []
    strides: list[int] = []
    sizes: list[int] = []
    storages: dict[int, int] = {}
    region_storages: list[torch.UntypedStorage] = []
    on_cuda = False
    for name, t in kv_caches.items():
        on_cuda = on_cuda or t.is_cuda
        es = t.element_size()
        if t.shape[0] == num_blocks:
            block_dim = 0
        elif t.dim() > 1 and t.shape[1] == num_blocks:
            block_dim = 1
        else:
            raise LayoutError(
                f"KV cache {name}: shape {tuple(t.shape)} has no dimension of num_blocks="
                f"{num_blocks} in position 0 or 1; this layout is not supported"
            )
        inner = int(np.prod(t.shape[block_dim + 1:], dtype=np.int64))
        if not t[(0,) * (block_dim + 1)].is_contiguous() or t.stride(block_dim) < inner:
            raise LayoutError(
                f"KV cache {name}: block interior of shape {tuple(t.shape[block_dim + 1:])} "
                f"with strides {t.stride()} is not contiguous; this layout is not supported"
            )
        leading = t.shape[0] if block_dim == 1 else 1
        st = t.untyped_storage()
        for i in range(leading):
            bases.append(t.data_ptr() + i * (t.stride(0) * es if block_dim == 1 else 0))
            strides.append(t.stride(block_dim) * es)
            sizes.append(inner * es)
            region_storages.append(st)
        storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
    if not bases:
        raise LayoutError("no KV cache tensors were registered")
    return BlockRegions(
        bases=np.asarray(bases, dtype=np.int64),
        strides=np.asarray(strides, dtype=np.int64),
        sizes=tuple(sizes),
        storages=tuple(storages.items()),
        on_cuda=on_cuda,
        region_storages=tuple(region_storages),
    )
