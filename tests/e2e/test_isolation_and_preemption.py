"""A second model on the same store and key prefix gets no hits; under KV-memory pressure with
preemptions and saves in flight, no stored block ever holds another request's data."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from connector.observability.metric_catalog import PREFIX as P
from devkit.tiny_model import make_tiny_llama
from devkit.vllm_server import VllmServer, connector_kv_config, metric_sum
from tests.conftest import engine_extra

pytestmark = pytest.mark.side_by_side


def test_other_model_no_hits_and_preemption_stores_only_correct_blocks(
        tmp_path_factory, master, filled_store, prompts):
    # Same architecture and shapes as the session model, other weights and path: the layout
    # fingerprint differs only by model identity.
    other = str(make_tiny_llama(tmp_path_factory.mktemp("other-llama"), seed=1))
    server = VllmServer(
        other, connector_kv_config(engine_extra(master, cache_prefix=filled_store,
                                                load_threads=4)),
        max_model_len=1024,
        # 40 blocks of 32 tokens: a burst of 12 requests of ~14 blocks must preempt.
        extra_args=("--num-gpu-blocks-override", "40"),
    ).start()
    try:
        # 1. The store holds these prompts for the session model, under the same prefix.
        # prompts[0] and [1] have different prefixes, so nothing of this engine's own is
        # stored yet when they are looked up.
        truth = [server.complete(p) for p in prompts[:2]]
        m = server.metrics()
        assert metric_sum(m, "vllm:external_prefix_cache_hits_total") == 0
        assert metric_sum(m, P + "lookup_hit_tokens_total") == 0
        assert metric_sum(m, P + "lookup_miss_tokens_total") > 0
        truth += [server.complete(p) for p in prompts[2:]]

        # 2. Memory pressure: preemptions while saves of the same blocks are in flight.
        server.reset_prefix_cache()
        with ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda p: server.complete(p, max_tokens=64), prompts * 2))
        assert metric_sum(server.metrics(), "vllm:num_preemptions_total") > 0

        # 3. Everything stored is right: reload from the store and compare.
        server.reset_prefix_cache()
        before = server.metrics()
        again = [server.complete(p) for p in prompts]
        after = server.metrics()
        assert again == truth
        loaded = metric_sum(after, P + "load_bytes_total") - metric_sum(
            before, P + "load_bytes_total")
        assert loaded > 0
        assert metric_sum(after, P + "load_jobs_total", status="error") == 0
    finally:
        server.stop()
