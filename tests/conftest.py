"""Shared, session-scoped real components: a Mooncake master, a standalone store node (so stored
blocks outlive the engines that wrote them), the tiny model, reference outputs from an engine
without the connector, and a 4-thread engine whose prefixes come from the store.

vLLM engines take ~40 s to start here, so each is started once per session and shared.
"""

from __future__ import annotations

import random

import pytest

from devkit.local_cluster import MooncakeMaster, StoreNode
from devkit.tiny_model import make_tiny_llama
from devkit.vllm_server import VllmServer, connector_kv_config

PREFIX_TOKENS = 320  # 10 blocks of 32
SUFFIX_TOKENS = 48


def make_prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts with long shared prefixes: two groups of three share a 320-token prefix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(PREFIX_TOKENS)] for _ in range(2)]
    return [prefixes[i % 2] + [rng.randrange(3, 1000) for _ in range(SUFFIX_TOKENS)]
            for i in range(n)]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


@pytest.fixture(scope="session")
def store_node(master):
    node = StoreNode(master, segment_size="512MB").start()
    yield node
    node.stop()


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return make_prompts()


def engine_extra(master: MooncakeMaster, **kw) -> dict:
    """Connector config for an engine that keeps no bytes itself (the store node does)."""
    return master.store_config(global_segment_size=0, local_buffer_size="64MB", **kw)


@pytest.fixture(scope="session")
def reference_outputs(tiny_model, prompts) -> list[list[int]]:
    """Greedy outputs of an engine with no connector: the ground truth."""
    server = VllmServer(tiny_model).start()
    try:
        return [server.complete(p) for p in prompts]
    finally:
        server.stop()


@pytest.fixture(scope="session")
def filled_store(tiny_model, master, store_node, prompts, reference_outputs) -> str:
    """Engine A (1 receive thread) serves the prompts once, saving their blocks, then exits."""
    prefix = "e2e"
    server = VllmServer(tiny_model, connector_kv_config(
        engine_extra(master, cache_prefix=prefix, load_threads=1))).start()
    try:
        outputs = [server.complete(p) for p in prompts]
    finally:
        server.stop()
    assert outputs == reference_outputs
    return prefix


@pytest.fixture(scope="session")
def pooled_server(tiny_model, master, filled_store):
    """A fresh engine with 4 receive threads over the filled store, every load path timed."""
    server = VllmServer(tiny_model, connector_kv_config(engine_extra(
        master, cache_prefix=filled_store, load_threads=4, master_lookup_sample_ratio=1.0,
    ))).start()
    yield server
    server.stop()
