"""Store keys: one object per (KV block, TP rank), namespaced by a layout fingerprint.

    <cache_prefix>/<model>/<fingerprint>/tp<size>r<rank>/<block hash hex>

The fingerprint hashes everything that changes the bytes of a block (model identity, dtype,
block size, KV heads per rank, head size, layer count, hash algorithm, cache layout), so two
models or layouts can never read each other's blocks: they simply miss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level


@dataclasses.dataclass(frozen=True)
class Layout:
    """What must match for a stored block to be byte-compatible with this engine's cache."""

    model: str
    dtype: str
    block_size: int
    num_kv_heads_per_rank: int
    head_size: int
    num_layers: int
    tp_size: int
    pp_rank: int = 0
    hash_algo: str = "sha256"
    cache_layout: str = ""
    revision: str = ""
    # What the worker really registered (`kv_signature`): attention backend, each KV tensor's
    # shape, stride order, dtype and element size. The scheduler learns it from the workers'
    # handshake before the first request, so both sides key blocks by the real memory layout.
    kv_signature: str = ""

    def fingerprint(self) -> str:
        text = "|".join(str(v) for v in (
            self.model, self.revision, self.dtype, self.block_size,
            self.num_kv_heads_per_rank, self.head_size,
            self.num_layers, self.tp_size, self.pp_rank, self.hash_algo, self.cache_layout,
            self.kv_signature,
        ))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def kv_signature(kv_caches: Mapping[str, Any], num_blocks: int, backend: str = "") -> str:
    """A stable description of the registered KV memory: per distinct tensor its shape (the
    block dimension written B), the order of its dimensions in memory (by stride, outermost
    first), dtype and element size; and the attention backend's name. Two engines whose
    tensors have equal shapes but another dimension order (NHD vs HND) or element type get
    different signatures, so they never read each other's blocks."""
    parts = []
    for t in kv_caches.values():
        shape = ",".join("B" if d == num_blocks else str(d) for d in t.shape)
        order = ",".join(str(i) for i in sorted(range(t.dim()), key=lambda i: (-t.stride(i), i)))
        dtype = str(t.dtype).removeprefix("torch.")
        parts.append(f"[{shape}]o[{order}]{dtype}x{t.element_size()}")
    return ";".join([backend, *sorted(set(parts))])


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.strip("/").split("/")[-1])[:64] or "model"


class KeyBuilder:
    """Builds store keys for one layout; one instance per process, reused on every call."""

    def __init__(self, cache_prefix: str, layout: Layout) -> None:
        self.cache_prefix = cache_prefix
        self.layout = layout
        self.fingerprint = layout.fingerprint()
        base = f"{cache_prefix}/{_slug(layout.model)}/{self.fingerprint}"
        self._rank_prefix = tuple(
            f"{base}/tp{layout.tp_size}r{r}/" for r in range(layout.tp_size)
        )

    def with_signature(self, signature: str) -> KeyBuilder:
        """The same namespace, fingerprinted with the registered KV memory's signature."""
        return KeyBuilder(self.cache_prefix, dataclasses.replace(self.layout,
                                                                 kv_signature=signature))

    def keys(self, block_hashes: Sequence[bytes], tp_rank: int) -> list[str]:
        """Keys of the given blocks in rank `tp_rank`'s namespace."""
        p = self._rank_prefix[tp_rank]
        return [p + h.hex() for h in block_hashes]

    def all_rank_keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        """Keys of the blocks in every rank's namespace, block-major (block i at i*tp..i*tp+tp-1).

        A block is a hit only if every rank holds its part.
        """
        return [p + h.hex() for h in block_hashes for p in self._rank_prefix]


def layout_from_vllm(vllm_config: Any, model_id: str = "") -> Layout:
    """The layout both the scheduler and the workers derive from vLLM's config (they must agree)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    algo = getattr(cc, "prefix_caching_hash_algo", "sha256")
    if algo not in ("sha256", "sha256_cbor") and "PYTHONHASHSEED" not in os.environ:
        logger.warning(
            "prefix_caching_hash_algo=%s without PYTHONHASHSEED: block hashes differ between "
            "processes, so engines will never hit each other's blocks; set PYTHONHASHSEED to "
            "the same value everywhere or use sha256", algo)
    try:
        from vllm.platforms import current_platform
        device = current_platform.device_type
    except Exception:  # noqa: BLE001 - platform detection is best effort here
        device = ""
    tp = pc.tensor_parallel_size
    return Layout(
        model=model_id or mc.model,
        revision="" if model_id else (getattr(mc, "revision", None) or ""),
        dtype=dtype,
        block_size=cc.block_size,
        num_kv_heads_per_rank=mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(),
        num_layers=mc.get_num_layers(pc),
        tp_size=tp,
        pp_rank=(pc.rank // tp) % pc.pipeline_parallel_size,
        hash_algo=algo,
        cache_layout=device,
    )
