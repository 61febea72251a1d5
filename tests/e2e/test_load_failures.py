"""A failed store load on a hybrid model (sliding-window layers beside full attention: two KV
cache groups) costs a recompute, under vLLM's default `kv_load_failure_policy` (`fail`).

vLLM 0.32's scheduler raises RuntimeError (EngineCore dies) when a connector reports block ids that
failed to load on a model with several KV cache groups; the connector reports such failures per
request instead (`connector.scheduler.load_failures`). One stored block is replaced with an object
of the wrong size, so the lookup hits and the load fails with -600: the engine stays healthy, the
output is the one computed without the connector (float32), the failure is on /metrics, and the next
request for the same prompt hits the store again.
"""

from __future__ import annotations

import random

import pytest

from devkit.tiny_model import make_tiny_llama
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.conftest import corrupt_stored_block, engine_extra

pytestmark = pytest.mark.side_by_side

PREFIX = "load-failures-hybrid"


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("hybrid"), heads=4, kv_heads=2,
                               sliding_window=64))


def test_a_failed_load_on_a_hybrid_model_costs_a_recompute(hybrid_model, master, store_node,
                                                            store_client):
    rng = random.Random(29)
    prompts = [[rng.randrange(3, 1000) for _ in range(6 * BLOCK_SIZE + 5)] for _ in range(3)]
    ref = VllmServer(hybrid_model).start()
    try:
        want = [ref.complete(p) for p in prompts]
    finally:
        ref.stop()
    server = VllmServer(hybrid_model, connector_kv_config(
        engine_extra(master, cache_prefix=PREFIX))).start()
    try:
        assert [server.complete(p) for p in prompts] == want  # computed, blocks saved
        # Group 1 is the full-attention one (vLLM groups the sliding layers, first, as 0).
        broken = corrupt_stored_block(server, store_client, PREFIX, prompts[1], 3, group=1)
        server.reset_prefix_cache()
        before = server.metrics()
        got = [server.complete(p) for p in prompts]
        after = server.metrics()
        assert server.proc.poll() is None, server.log_tail()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert got == want
        # The fault landed: one load failed on the replaced object; the others hit.
        assert metric_sum(delta, "vllm:mooncake_pool_failures_total", op="load",
                          code="-600") == 1, delta
        assert metric_sum(delta, "vllm:mooncake_pool_load_jobs_total", status="error") >= 1
        assert metric_sum(delta, "vllm:external_prefix_cache_hits_total") >= 2 * 6 * BLOCK_SIZE
        # Recovered: with the bad object gone, the prompt is saved again (its first request
        # loads what is left before the hole) and then loads whole from the store.
        assert store_client.remove(broken, True) == 0
        for _ in range(2):
            server.reset_prefix_cache()
            before = server.metrics()
            assert server.complete(prompts[1]) == want[1]
            after = server.metrics()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert metric_sum(delta, "vllm:external_prefix_cache_hits_total") >= 6 * BLOCK_SIZE
        assert metric_sum(delta, "vllm:mooncake_pool_load_jobs_total", status="error") == 0
    finally:
        server.stop()
