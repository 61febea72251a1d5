"""End to end in real vLLM: engine A fills the store and exits; fresh engines B (1 and 4
receive threads) get their prefixes from the store and produce exactly the outputs of an engine
without the connector. A load that fails in the engine is recomputed with correct output, and
the exact comparison tells a wrong block (another prompt's) from the right one.
"""

from __future__ import annotations

import random

import pytest

from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.conftest import corrupt_stored_block, engine_extra, stored_block_keys

pytestmark = pytest.mark.side_by_side


def serve_from_store(server: VllmServer, prompts: list[list[int]]) -> tuple[list, dict, dict]:
    server.reset_prefix_cache()  # a shared engine may hold them locally from earlier tests
    before = server.metrics()
    outputs = [server.complete(p) for p in prompts]
    after = server.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return outputs, delta, after


def check_loaded_from_store(delta: dict, after: dict, threads: int) -> None:
    assert metric_sum(delta, "vllm:external_prefix_cache_hits_total") > 0
    assert metric_sum(delta, "vllm:mooncake_pool_load_bytes_total") > 0
    assert metric_sum(delta, "vllm:mooncake_pool_load_jobs_total", status="error") == 0
    assert metric_sum(after, "vllm:mooncake_pool_recv_threads") == threads  # the gauge itself


def test_fresh_engine_one_thread_loads_from_store(tiny_model, master, filled_store, prompts,
                                                  reference_outputs):
    server = VllmServer(tiny_model, connector_kv_config(
        engine_extra(master, cache_prefix=filled_store, load_threads=1))).start()
    try:
        outputs, delta, after = serve_from_store(server, prompts)
    finally:
        server.stop()
    assert outputs == reference_outputs
    check_loaded_from_store(delta, after, 1)


def test_fresh_engine_four_threads_loads_from_store(pooled_server, prompts, reference_outputs):
    outputs, delta, after = serve_from_store(pooled_server, prompts)
    assert outputs == reference_outputs
    check_loaded_from_store(delta, after, 4)
    assert pooled_server.metrics()[
        f'vllm:mooncake_pool_recv_threads{{engine="0",model_name="{pooled_server.model}",'
        'tp_rank="0"}'] == 4


def test_failed_load_in_engine_is_recomputed(pooled_server, store_client, filled_store):
    """Replace one stored block with an object of the wrong size: the lookup still hits, the
    load fails with -600, vLLM recomputes, and the output is unchanged."""
    prompt = [7 + (i * 37) % 900 for i in range(6 * BLOCK_SIZE + 5)]
    first = pooled_server.complete(prompt)  # computed from scratch, blocks saved
    corrupt_stored_block(pooled_server, store_client, filled_store, prompt, 3)
    pooled_server.reset_prefix_cache()
    before = pooled_server.metrics()
    again = pooled_server.complete(prompt)
    after = pooled_server.metrics()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert again == first
    assert metric_sum(delta, "vllm:mooncake_pool_failures_total", op="load", code="-600") == 1
    assert metric_sum(delta, "vllm:mooncake_pool_load_error_blocks_total") == 1
    assert metric_sum(delta, "vllm:mooncake_pool_load_jobs_total", status="error") == 1


def test_exactness_check_catches_another_prompts_block(pooled_server, store_client,
                                                       filled_store):
    """What every output comparison here relies on: it fails on a wrong block. Prompt Y's
    last full block in the store is overwritten with prompt X's block at the same position
    (same size and layout, so the load succeeds and nothing in the connector can notice);
    served from the store, Y's output differs from Y computed, while X, loaded honestly in the
    same pass, matches X computed."""
    rng = random.Random(20)
    x, y = ([rng.randrange(3, 1000) for _ in range(6 * BLOCK_SIZE + 5)] for _ in range(2))
    truth = [pooled_server.complete(p) for p in (x, y)]  # computed, blocks saved
    keys_x, keys_y = (stored_block_keys(pooled_server, store_client, filled_store, p)
                      for p in (x, y))
    assert store_client.upsert(keys_y[-1], store_client.get(keys_x[-1])) == 0
    try:
        outputs, delta, after = serve_from_store(pooled_server, [x, y])
    finally:
        store_client.remove(keys_y[-1], True)  # no wrong block stays behind
    check_loaded_from_store(delta, after, 4)
    assert metric_sum(delta, "vllm:external_prefix_cache_hits_total") >= 2 * 6 * BLOCK_SIZE
    assert outputs[0] == truth[0], "X, loaded from the store untouched, changed its output"
    assert outputs[1] != truth[1], "Y loaded X's block and the comparison did not notice"


def test_disable_log_stats_serves_from_store(tiny_model, master, filled_store, prompts,
                                             reference_outputs):
    """With --disable-log-stats vLLM discards connector stats; loads must work all the same.
    Evidence of loads comes from the master's own counter of replica lookups."""
    def replica_lookups() -> float:
        return sum(float(line.split()[-1]) for line in master.metrics_text().splitlines()
                   if line.startswith("master_batch_get_replica_list_requests_total"))

    server = VllmServer(tiny_model, connector_kv_config(engine_extra(
        master, cache_prefix=filled_store, load_threads=2)),
        extra_args=("--disable-log-stats",)).start()
    try:
        before = replica_lookups()
        outputs = [server.complete(p) for p in prompts]
        assert outputs == reference_outputs
        assert replica_lookups() > before
    finally:
        server.stop()
