"""In-step loads in real vLLM (connector.scheduler.step_loads), on a float32 engine so outputs
compare exactly: a prefix loaded inside the engine step gives the tokens the same engine computed
from scratch; an in-step load that fails is recomputed by vLLM with the same tokens; the TTFT
breakdown (connector.observability.ttft) reaches /metrics for both kinds of load, phase by phase;
requests queued behind the engine's one sequence slot load from their preloads
(connector.worker.preload) with the same tokens."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from connector.observability.metric_catalog import TTFT_PHASES
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.conftest import corrupt_stored_block, engine_extra
from tests.e2e.store_kit import settled_keys, wait_for_saves
from tests.worker_kit import wait_until

pytestmark = pytest.mark.timed

PREFIX = "steploads"
TOTAL = "vllm:mooncake_pool_ttft_store_seconds_count"
PHASE = "vllm:mooncake_pool_ttft_store_phase_seconds_count"


def prompt(seed: int, blocks: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(blocks * BLOCK_SIZE + 5)]


@pytest.fixture(scope="module")
def engine(tiny_model, master, store_node):
    """A float32 engine (VllmServer's default) whose every load after the first fits the
    in-step budget, with one sequence slot: requests sent together queue."""
    server = VllmServer(tiny_model, connector_kv_config(engine_extra(
        master, cache_prefix=PREFIX, load_threads=2, sync_load_ms=1000)),
        extra_args=("--max-num-seqs", "1")).start()
    yield server
    server.stop()


def delta(server: VllmServer, run) -> tuple[object, dict[str, float]]:
    before = server.metrics()
    out = run()
    after = server.metrics()
    return out, {k: after.get(k, 0) - before.get(k, 0) for k in after}


def wait_saved(server: VllmServer, keys: int) -> None:
    """The save thread writes after the response returns: until it wrote `keys` blocks."""
    wait_for_saves(server, keys, families=("save_keys",))


PRELOADED = "vllm:mooncake_pool_preload_keys_total"


def test_in_step_loads_give_the_computed_tokens(engine):
    prompts = [prompt(i) for i in range(4)]
    computed = [engine.complete(p) for p in prompts]  # the store is empty: all computed
    wait_saved(engine, 4 * 8)
    engine.reset_prefix_cache()
    loaded, d = delta(engine, lambda: [engine.complete(p) for p in prompts])
    assert loaded == computed
    assert metric_sum(d, "vllm:external_prefix_cache_hits_total") == 4 * 8 * BLOCK_SIZE
    # The first load is asynchronous (no transfer estimate yet); the rest run in the step.
    assert metric_sum(d, TOTAL, mode="async") == 1
    assert metric_sum(d, TOTAL, mode="sync") == 3
    for phase in TTFT_PHASES:  # every phase of the asynchronous one was measured
        assert metric_sum(d, PHASE, phase=phase) >= 1, phase
    assert metric_sum(d, PHASE, phase="load_transfer") == 4
    assert metric_sum(d, "vllm:mooncake_pool_load_jobs_total", status="error") == 0


def test_failed_in_step_load_is_recomputed(engine, store_client):
    """One stored block replaced by an object of the wrong size: the in-step load fails with
    -600 in the step that computes the request; vLLM discards that step's token for it and
    recomputes, and the output is the computed one."""
    p = prompt(100)
    computed = engine.complete(p)
    corrupt_stored_block(engine, store_client, PREFIX, p, 3)
    engine.complete(prompt(101))  # one more store hit first, so the estimate is fresh
    engine.reset_prefix_cache()
    engine.complete(prompt(101))
    again, d = delta(engine, lambda: engine.complete(p))
    assert again == computed
    assert metric_sum(d, TOTAL, mode="sync") == 1
    assert metric_sum(d, "vllm:mooncake_pool_failures_total", op="load", code="-600") == 1
    assert metric_sum(d, "vllm:mooncake_pool_load_error_blocks_total") == 1


def test_queued_requests_load_from_their_preloads(engine):
    """A long request holds the only sequence slot; four stored prompts sent meanwhile queue
    behind it (vLLM does not reach them, so it asks the connector nothing). Their lookups run
    on arrival and their prefixes are read into host memory while they wait; their loads then
    copy from there, with the tokens the engine computed."""
    prompts = [prompt(200 + i) for i in range(4)]
    saved = settled_keys(engine, ("save_keys",))
    computed = [engine.complete(p) for p in prompts]
    wait_saved(engine, saved + 4 * 8)
    engine.reset_prefix_cache()
    with ThreadPoolExecutor(5) as pool:
        blocker = pool.submit(engine.complete, prompt(300, blocks=1), 128)
        wait_until(lambda: metric_sum(engine.metrics(), "vllm:num_requests_running") == 1, 30,
                   "the long request never ran")
        loaded, d = delta(engine, lambda: list(pool.map(engine.complete, prompts)))
        blocker.result()
    assert loaded == computed
    assert metric_sum(d, "vllm:external_prefix_cache_hits_total") == 4 * 8 * BLOCK_SIZE
    used = metric_sum(d, PRELOADED, outcome="used")
    assert 8 <= used <= 4 * 8, {k: v for k, v in d.items() if "preload_keys" in k and v}
    assert metric_sum(d, PRELOADED, outcome="failed") == 0
