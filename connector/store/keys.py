"""Store keys: one object per (KV cache group, store shard, block), namespaced by a layout
fingerprint.

    <cache_prefix>/<model>/<fingerprint>/g<group>s<shard>of<shards>/<block hash hex>

The fingerprint hashes everything that defines a stored object's bytes: model identity, how its
weights are quantized and its config overridden, dtype, block size, the model's KV heads and
how many store shards split them, head size, layers, hash algorithm, device, and the signature
of the registered KV memory (each group's layers in order, with each layer's per-shard shape,
memory order and element type; the attention backend). It does not hash this engine's TP
size: an object holds a shard of the heads, the same bytes whichever TP size wrote it, so
engines of other TP sizes read it.
Two layouts that differ in any of the bytes never share a key; they simply miss.

The key is unambiguous by construction: `cache_prefix` is letters, digits, `.`, `_`, `-`
(checked in the config), the model part is reduced to that set, and every other part is hex
or fixed text, so `/` only ever separates parts. The model's full name goes into the
fingerprint, JSON-encoded field by field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level

PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")  # cache_prefix (config.py enforces it)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What must match for a stored block to be byte-compatible with this engine's cache."""

    model: str
    dtype: str
    block_size: int
    num_kv_heads: int  # the model's, across TP ranks (1 for an MLA latent)
    head_size: int
    num_layers: int
    tp_size: int  # this engine's: it picks which shards a rank moves, not their bytes
    hash_algo: str = "sha256"
    cache_layout: str = ""
    revision: str = ""
    # What the workers really registered (`kv_signature`). The scheduler learns it from their
    # handshake before the first request, so both sides key blocks by the real memory layout.
    kv_signature: str = ""
    store_tp_size: int = 0  # the in-tree setting (0: this engine's TP size)
    # A Mooncake tenant other than the default one. A master started without
    # --enable_multi_tenants ignores the client's tenant (one tenant reads another's objects),
    # so the tenant is part of the keys: tenants never share a block on any master.
    tenant: str = ""
    # How the weights are quantized ("" for not at all): vLLM's method and its settings. The
    # same model quantized computes other keys and values for the same tokens, so an engine
    # serving it (`--quantization fp8_per_tensor`) must not read the unquantized engines'
    # blocks, nor they its.
    quantization: str = ""
    # The Hugging Face config overrides the engine was started with (`--hf-overrides`; ""
    # for none): they can change what the model computes for the same tokens (a RoPE scaling
    # such as YaRN changes every key), so engines with other overrides do not share.
    hf_overrides: str = ""

    @property
    def shards(self) -> int:
        """Store objects per block and group: the heads split `store_tp_size` ways (a shard
        holds at least one head; heads replicated across ranks are stored once)."""
        return min(self.store_tp_size or self.tp_size, self.num_kv_heads)

    def fingerprint(self) -> str:
        text = json.dumps([
            self.model, self.revision, self.dtype, self.block_size, self.num_kv_heads,
            # 0: the pipeline stage, always the first (layout_from_vllm refuses PP); kept so
            # that keys stay the same.
            self.shards, self.head_size, self.num_layers, 0, self.hash_algo,
            self.cache_layout, self.kv_signature, *([self.tenant] if self.tenant else []),
            # objects, where a tenant is a string: none reads like another
            *([{"quantization": self.quantization}] if self.quantization else []),
            *([{"hf_overrides": self.hf_overrides}] if self.hf_overrides else [])])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def layout_signature(backend: str, groups: Sequence[Any], descriptions: Sequence[str]) -> str:
    """A stable description of the stored objects: the attention backend, and per KV cache
    group its kind and window and its layers in order, each with the shape of one shard's part
    of a block (block dimension left out), the order of its dimensions in memory, dtype and
    element size (`GroupIO.description`). Equal for every TP size that holds the same model;
    different for anything that changes the bytes or their order (NHD vs HND, another dtype,
    other layers, or the same layers in another order)."""
    return json.dumps([backend, *([g.kind, g.window, d]
                                  for g, d in zip(groups, descriptions, strict=True))])


def kv_signature(kv_caches: Mapping[str, Any], num_blocks: int, backend: str = "") -> str:
    """The signature of a single-shard engine with one full-attention group of these caches
    (a TP=1 engine without store_tp_size; the benchmark keys its blocks this way)."""
    from connector.store.groups import ONE_FULL
    from connector.worker.kv_regions import plan_group

    return layout_signature(backend, ONE_FULL,
                            (plan_group(kv_caches, num_blocks, 1, 1).description,))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text.strip("/").split("/")[-1])[:64] or "model"


class KeyBuilder:
    """Builds store keys for one layout; one instance per process, reused on every call."""

    def __init__(self, cache_prefix: str, layout: Layout, groups: int = 1) -> None:
        if not PREFIX_RE.match(cache_prefix):
            raise ValueError(f"cache_prefix {cache_prefix!r}: use 1-64 of A-Z a-z 0-9 . _ -")
        self.cache_prefix = cache_prefix
        self.layout = layout
        self.groups = groups
        self.fingerprint = layout.fingerprint()
        base = f"{cache_prefix}/{_slug(layout.model)}/{self.fingerprint}"
        n = layout.shards
        self._prefix = tuple(tuple(f"{base}/g{g}s{s}of{n}/" for s in range(n))
                             for g in range(groups))

    def with_signature(self, signature: str) -> KeyBuilder:
        """The same namespace, fingerprinted with the registered KV memory's signature."""
        return KeyBuilder(self.cache_prefix,
                          dataclasses.replace(self.layout, kv_signature=signature), self.groups)

    def keys(self, block_hashes: Sequence[bytes], shard: int = 0, group: int = 0) -> list[str]:
        """Keys of the given blocks in one shard of one group."""
        return self.object_keys(block_hashes, (shard,), group)

    def object_keys(self, block_hashes: Sequence[bytes], shards: Sequence[int],
                    group: int = 0) -> list[str]:
        """Keys of the blocks' objects in `shards`, block-major (as `ObjectPlan.units`)."""
        ps = [self._prefix[group][s] for s in shards]
        if len(ps) == 1:  # a rank's own shard, or an unsplit layout: no inner loop, which
            p = ps[0]     # costs a sixth of a long prompt's keys
            return [p + h for h in map(bytes.hex, block_hashes)]
        return [p + h.hex() for h in block_hashes for p in ps]

    def all_shard_keys(self, block_hashes: Sequence[bytes], group: int = 0) -> list[str]:
        """Keys of every shard of the blocks, block-major (block i at i*S..i*S+S-1): a block
        can be restored only if every shard is stored."""
        return self.object_keys(block_hashes, range(self.layout.shards), group)


def layout_from_vllm(vllm_config: Any, model_id: str | None = None,
                     store_tp_size: int | None = None, latent: bool = False,
                     tenant: str = "", store_tp_field: str = "store_tp_size") -> Layout:
    """The layout both the scheduler and the workers derive from vLLM's config (they must
    agree); `tenant`: the store client's, "" for the default tenant (keys as before tenants);
    `store_tp_field`: the setting `store_tp_size` comes from, named by an error about it."""
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
    if pc.pipeline_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size={pc.pipeline_parallel_size}: each pipeline stage holds "
            "other layers, but the scheduler's lookups and the stored layout describe one "
            "stage's; serve without pipeline parallelism (use tensor parallelism), or without "
            "the connector")
    for cp in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if (getattr(pc, cp, 1) or 1) > 1:
            raise ValueError(f"{cp}={getattr(pc, cp)}: context parallelism splits a block's "
                             "tokens across ranks, which this connector's store layout does not "
                             "describe; serve without it, or without the connector")
    heads = 1 if latent or getattr(mc, "use_mla", False) else mc.get_total_num_kv_heads()
    return Layout(
        model=model_id or mc.model,
        revision="" if model_id else (getattr(mc, "revision", None) or ""),
        dtype=dtype,
        block_size=cc.block_size,
        num_kv_heads=heads,
        head_size=mc.get_head_size(),
        num_layers=mc.get_num_layers(pc),
        tp_size=tp,
        hash_algo=algo,
        cache_layout=device,
        store_tp_size=check_store_tp_size(store_tp_size, heads, tp, store_tp_field),
        tenant=tenant,
        quantization=quantization_of(mc),
        hf_overrides=hf_overrides_of(mc),
    )


def quantization_of(model_config: Any) -> str:
    """How vLLM quantizes the model's weights, as text ("" for not at all): the method of
    `--quantization` and the settings given with it (`quantization_config`), in vLLM's own
    stable form for hashing configs (`normalize_value`, which its compile cache keys use).
    A checkpoint quantized already is named by the model: the method vLLM resolves for it is a
    kernel chosen by the GPU (awq or awq_marlin), which must not split a fleet's keys."""
    method = getattr(model_config, "quantization", None)
    if getattr(getattr(model_config, "model_arch_config", None), "quantization_config", None):
        method = None
    settings = getattr(model_config, "quantization_config", None)
    if method is None and settings is None:
        return ""
    from vllm.config.utils import normalize_value

    return json.dumps([method, normalize_value(settings)])


def hf_overrides_of(model_config: Any) -> str:
    """The engine's Hugging Face config overrides as text ("" for none): a dict in vLLM's
    stable form for hashing configs, a function (vLLM's Python API only) by its name."""
    overrides = getattr(model_config, "hf_overrides", None)
    if not overrides:
        return ""
    if callable(overrides):
        return f"{overrides.__module__}.{overrides.__qualname__}"
    from vllm.config.utils import normalize_value

    return json.dumps(normalize_value(overrides))


def check_disk_tier(layout: Layout, enable_offload: bool,
                    store_tp_field: str = "store_tp_size") -> None:
    """Refuse a disk tier where this engine's ranks read slices of stored objects (a store
    shard holds the KV heads of several ranks): Mooncake 0.3.13 serves such ranged gets from
    memory replicas only, and fails them (-600) for an object on disk
    (tests/store/test_disk_tier_worker.py), so every disk hit would fail. `store_tp_field`:
    the setting the store TP size comes from."""
    if enable_offload and layout.shards < min(layout.tp_size, layout.num_kv_heads):
        raise ValueError(
            f"enable_offload: with {store_tp_field} {layout.shards} below the TP size "
            f"{layout.tp_size} each rank reads a slice of every stored object, which Mooncake "
            f"cannot serve from its disk tier; {store_tp_advice(store_tp_field, layout.tp_size)}"
            ", or serve without the disk tier")


def store_tp_advice(store_tp_field: str, n: int) -> str:
    """How to make the store TP size a multiple of `n`, by the setting it comes from."""
    if store_tp_field == "store_tp_size":
        return f"set store_tp_size to a multiple of {n}"
    return f"choose prefill_tp_sizes whose least common multiple is a multiple of {n}"


def check_store_tp_size(store_tp_size: int | None, heads: int, tp_size: int = 1,
                        field: str = "store_tp_size") -> int:
    """The configured store TP size, checked against the model's KV heads and this engine's
    TP size (0: unset); an error names `field`, the setting it comes from. Shards and ranks
    must nest: each rank holds whole shards, or each shard spans whole ranks."""
    if not store_tp_size:
        return 0
    if heads % store_tp_size and store_tp_size % heads:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"{field}: {store_tp_size} does not split the model's {heads} KV heads "
            f"evenly; use one of {divisors} or a multiple of {heads}")
    shards, ranks = min(store_tp_size, heads), min(tp_size, heads)
    if max(shards, ranks) % min(shards, ranks):
        raise ValueError(
            f"{field}: {store_tp_size} and this engine's TP size {tp_size} do not nest "
            f"(a rank would hold one and a half shards); use a multiple or a divisor of "
            f"{tp_size}")
    return store_tp_size
