"""What the benchmark loads: the KV block geometry, the source blocks in the store, and the
request mixes.

Geometry: vLLM 0.32's CPU attention cache layout, one tensor per layer shaped
`[num_blocks, kv_heads, block_tokens, 2 * head_size]` (K and V interleaved per token row, see
`vllm/v1/attention/backends/cpu_attn.py`). The default (8 layers, 1 KV head, 32 tokens, head
128, bf16) makes one block 128 KiB across layers, stored as one object and scattered into 8
regions of 16 KiB on load. This layout is also the one vLLM's in-tree receive thread can
address (it views caches with blocks on dim 0), so both pools load into identical memory.

Source blocks are written once with raw puts under both key schemes (ours and the in-tree
one); requests then read windows of them into per-slot destination blocks, so concurrent
requests never write the same KV block and every load can be checked byte for byte.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

KIB = 1024


@dataclass(frozen=True)
class Geometry:
    """Shape of the destination KV cache and of one stored block."""

    layers: int = 8
    kv_heads: int = 1
    block_tokens: int = 32
    head_size: int = 128
    num_blocks: int = 2048
    dtype: torch.dtype = torch.bfloat16

    @property
    def region_bytes(self) -> int:
        """Bytes of one block in one layer (one multi-buffer entry)."""
        return self.kv_heads * self.block_tokens * 2 * self.head_size * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.layers * self.region_bytes

    @property
    def label(self) -> str:
        return f"{self.layers}x{self.region_bytes // 1024}KiB"

    def make_caches(self, device: str = "cpu") -> dict[str, torch.Tensor]:
        """The KV caches (device "meta": shapes and strides only, for the key signature)."""
        shape = (self.num_blocks, self.kv_heads, self.block_tokens, 2 * self.head_size)
        return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=self.dtype,
                                                                device=device)
                for i in range(self.layers)}

    @classmethod
    def for_block_bytes(cls, block_bytes: int, num_blocks: int) -> Geometry:
        """A geometry whose block is exactly `block_bytes` (layers of 16 KiB regions)."""
        base = cls(layers=1, num_blocks=num_blocks)
        if block_bytes % base.region_bytes == 0:
            return cls(layers=block_bytes // base.region_bytes, num_blocks=num_blocks)
        # Small or odd sizes: one layer whose head size makes up the block.
        per_row = base.kv_heads * base.block_tokens * 2 * base.dtype.itemsize
        if block_bytes % per_row:
            raise ValueError(f"block size {block_bytes} must be a multiple of {per_row} bytes")
        return cls(layers=1, head_size=block_bytes // per_row, num_blocks=num_blocks)


def block_hashes(count: int, tag: str = "bench") -> tuple[bytes, ...]:
    """Stable stand-ins for vLLM's sha256 block hashes."""
    return tuple(hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(count))


@dataclass(frozen=True)
class Request:
    """One request's load: `src[i]` (a source block index) goes into KV block `dst[i]`."""

    req_id: str
    src: tuple[int, ...]
    dst: tuple[int, ...]

    def parts(self, split: int) -> list[Request]:
        """The request as sub-jobs of at most `split` blocks (0 = one job)."""
        if split <= 0 or len(self.src) <= split:
            return [self]
        return [Request(f"{self.req_id}#{k}", self.src[i:i + split], self.dst[i:i + split])
                for k, i in enumerate(range(0, len(self.src), split))]


@dataclass(frozen=True)
class Workload:
    """A closed-loop request mix: `concurrency` requests outstanding, each replaced as it ends.

    `sizes` are blocks per request, used in turn. `split` > 0 submits each request as sub-jobs
    of that many blocks (the request ends when all its parts have).
    """

    name: str
    sizes: tuple[int, ...]
    concurrency: int
    split: int = 0
    description: str = ""

    @property
    def max_blocks(self) -> int:
        return max(self.sizes)

    @property
    def blocks_label(self) -> str:
        return str(self.sizes[0]) if len(set(self.sizes)) == 1 else \
            f"{min(self.sizes)}-{max(self.sizes)}"

    def requests(self, source_blocks: int, num_blocks: int) -> RequestStream:
        return RequestStream(self, source_blocks, num_blocks)


@dataclass
class RequestStream:
    """Hands out requests for free destination slots; slot i owns a fixed KV block range.

    When the slots do not fit in the cache (the tuner's long mixes), slots wrap around and
    may share KV blocks: fine for timing, but then the bytes cannot be checked
    (`exclusive` is False).
    """

    workload: Workload
    source_blocks: int
    num_blocks: int
    _count: Iterator[int] = field(default_factory=itertools.count)
    _free: list[int] = field(default_factory=list)
    _slot_of: dict[str, int] = field(default_factory=dict)
    last: dict[int, Request] = field(default_factory=dict)  # latest request per slot
    exclusive: bool = True

    def __post_init__(self) -> None:
        w = self.workload
        if w.max_blocks > self.num_blocks:
            raise ValueError(f"{w.name}: a {w.max_blocks}-block request does not fit in a "
                             f"{self.num_blocks}-block cache")
        self.exclusive = w.concurrency * w.max_blocks <= self.num_blocks
        self._free = list(range(w.concurrency))

    def take(self) -> Request | None:
        """A new request in a free slot, or None when all slots are busy."""
        if not self._free:
            return None
        slot = self._free.pop()
        i = next(self._count)
        sizes = self.workload.sizes
        n = sizes[i % len(sizes)]
        start = (i * 7919) % self.source_blocks  # spread reads over all source blocks
        src = tuple((start + k) % self.source_blocks for k in range(n))
        base = slot * self.workload.max_blocks
        dst = tuple((base + k) % self.num_blocks for k in range(n))
        req = Request(f"{self.workload.name}-{i}", src, dst)
        self._slot_of[req.req_id] = slot
        self.last[slot] = req
        return req

    def release(self, req_id: str) -> None:
        self._free.append(self._slot_of.pop(req_id))


def standard_workloads(quick: bool, long_blocks: int, split: int) -> list[Workload]:
    """The issue's mixes: many small concurrent requests, and a few long ones."""
    ws = [
        Workload("4-block", (4,), 32, description="many concurrent 4-block requests"),
        Workload("16-block", (16,), 32, description="many concurrent 16-block requests"),
    ]
    if not quick:
        ws.append(Workload("mix-1..64", (1, 2, 4, 8, 16, 32, 64), 32,
                           description="concurrent requests of 1 to 64 blocks"))
    ws.append(Workload(f"long-{long_blocks}", (long_blocks,), 1,
                       description=f"one {long_blocks}-block request at a time"))
    if split:
        ws.append(Workload(f"long-{long_blocks}/split{split}", (long_blocks,), 1, split=split,
                           description=f"the same, submitted as {split}-block sub-jobs"))
    return ws


def gather_block(caches: Sequence[torch.Tensor], block: int) -> torch.Tensor:
    """A KV block's bytes in store order: layer by layer."""
    return torch.cat([c[block].contiguous().view(torch.uint8).reshape(-1) for c in caches])
