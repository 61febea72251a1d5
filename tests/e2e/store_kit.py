"""Helpers for the tests that start engines configured the way operators configure them: by
connector name, with the in-tree connector's settings, tenants, a disk tier or MultiConnector."""

from __future__ import annotations

import time
from typing import Any

from devkit.vllm_server import BLOCK_SIZE, VllmServer, metric_sum

PREFIX = "vllm:mooncake_pool_"
FLOAT32 = ("--dtype", "float32")  # outputs are compared exactly only in float32 (GUIDE.md)


def by_name(role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """A kv-transfer-config naming the connector only, as vLLM's usage doc names its own."""
    cfg: dict[str, Any] = {"kv_connector": "PooledMooncakeStoreConnector", "kv_role": role,
                           "kv_load_failure_policy": "recompute"}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


def saved_blocks(prompts: list[list[int]]) -> int:
    """Blocks the prompts fill (each is stored once, or skipped if already stored)."""
    return sum(len(p) // BLOCK_SIZE for p in prompts)


def wait_for_saves(server: VllmServer, blocks: int, timeout: float = 120.0) -> None:
    """Until the engine wrote (or found already stored) `blocks` blocks."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        done = metric_sum(m, PREFIX + "save_keys_total") + \
            metric_sum(m, PREFIX + "save_skipped_keys_total")
        if done >= blocks:
            return
        assert time.monotonic() < deadline, f"saves did not finish ({done} of {blocks} blocks)"
        time.sleep(0.3)


def serve(server: VllmServer, prompts: list[list[int]], max_tokens: int = 8
          ) -> tuple[list[list[int]], dict[str, float]]:
    """Outputs of the prompts (the local prefix cache reset first, so hits come from the
    store), and how every series moved meanwhile."""
    server.reset_prefix_cache()
    before = server.metrics()
    outputs = [server.complete(p, max_tokens=max_tokens) for p in prompts]
    after = server.metrics()
    return outputs, {k: after.get(k, 0) - before.get(k, 0) for k in after}


def store_hits(delta: dict[str, float], **labels: str) -> float:
    """Prompt tokens the engine loaded from the store during `delta` (vLLM's own counter)."""
    return metric_sum(delta, "vllm:external_prefix_cache_hits_total", **labels)
