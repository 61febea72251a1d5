"""KV caches exactly as vLLM's CPU worker allocates them, for the tests and benchmarks that
drive the connector's worker without an engine: vLLM's own KV cache config for the groups
(`get_kv_cache_config_from_groups`), its allocator and per-layer views (`allocate_kv_cache`),
in the attention backend's layout. Nothing about the shapes or strides is written here.
"""

from __future__ import annotations

import torch


def vllm_caches(groups: list[tuple[list[str], object]], num_blocks: int,
                layout: object = None, seed: int | None = 0
                ) -> tuple[dict[str, torch.Tensor], object]:
    """KV caches exactly as vLLM's CPU worker allocates them: vLLM's own KV cache config for
    these groups (`get_kv_cache_config_from_groups`) and its allocator and per-layer views
    (`allocate_kv_cache`), in `layout` (default: the CPU attention backend's). `groups`:
    (layer names, KV cache spec) per group. Returns the caches, filled with random values
    (seed None: zeros), and the KVCacheConfig."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    try:  # vLLM 0.33 moved the KV cache planning out of kv_cache_utils (same function)
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    layout = layout or CPUAttentionBackend.supported_kv_cache_layouts()[0]
    specs = [KVCacheGroupSpec(list(names), spec) for names, spec in groups]
    cfg = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout,
                                     num_gpu_blocks_override=num_blocks,
                                     prefix_cache_retention_interval=0))
    kv_cache_config = get_kv_cache_config_from_groups(cfg, specs, 1)
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in {t.untyped_storage().data_ptr(): t for t in caches.values()}.values():
            raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return caches, kv_cache_config
