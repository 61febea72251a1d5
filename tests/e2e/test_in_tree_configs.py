"""vLLM's usage doc for its in-tree `MooncakeStoreConnector`
(docs/features/mooncake_store_connector_usage.md), configuration by configuration, with this
connector's name in place of the in-tree one: each engine starts, logs how it took the in-tree
settings, and serves a second pass of its prompts from the store.

Adapted only where this machine differs from the doc's: protocol `tcp` (no RDMA NIC), segment and
buffer sizes in MB (not 80GB / 4GB), no `device_name`, and the master's real address. The doc's
Mooncake JSON goes through MOONCAKE_CONFIG_PATH, as the doc sets it. The master runs with the
doc's tenant and disk-tier flags (`--enable_multi_tenants` with `default` and `tenant-a` in its
quota policy, `--enable_offload`), so every configuration meets the store it was written for.

Outputs are compared only within an engine (store hit against its own recompute), in float32.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from devkit.local_cluster import MooncakeMaster, StoreNode
from devkit.vllm_server import BLOCK_SIZE, VllmServer, metric_sum
from tests.conftest import by_name_env
from tests.e2e.store_kit import (
    PREFIX,
    by_name,
    saved_blocks,
    serve,
    store_hits,
    wait_for_saves,
)

pytestmark = [pytest.mark.side_by_side, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def doc_master():
    m = MooncakeMaster(tenants={"default": "1GB", "tenant-a": "512MB"}, offload=True).start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def owner(doc_master, tmp_path_factory):
    """The doc's `mooncake_client` owner with a disk tier (`--enable_offload`), on the doc's
    P2PHANDSHAKE metadata like the engines."""
    node = StoreNode(doc_master, segment_size="256MB", metadata_server="P2PHANDSHAKE",
                     offload_path=str(tmp_path_factory.mktemp("offload"))).start()
    yield node
    node.stop()


def doc_json(master: MooncakeMaster, **fields) -> dict:
    """The doc's mooncake_config.json: its values, with this machine's protocol and sizes."""
    return {"mode": "embedded", "metadata_server": "P2PHANDSHAKE",
            "master_server_address": master.address, "global_segment_size": "128MB",
            "local_buffer_size": "64MB", "protocol": "tcp", "device_name": "",
            "enable_offload": False, **fields}


def prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(4 * BLOCK_SIZE + 7)] for _ in range(n)]


def engine(tiny_model, site, tmp_path, name, mooncake_json, kv_config, **env) -> VllmServer:
    path = Path(tmp_path) / f"{name}.json"
    path.write_text(json.dumps(mooncake_json))
    return VllmServer(tiny_model, kv_config, log_path=str(Path(tmp_path) / f"{name}.log"),
                      env={**by_name_env(site), "MOONCAKE_CONFIG_PATH": str(path), **env})


def start(tiny_model, site, tmp_path, name, mooncake_json, kv_config, **env) -> VllmServer:
    server = engine(tiny_model, site, tmp_path, name, mooncake_json, kv_config, **env)
    try:
        return server.start()
    except RuntimeError as e:  # the root cause is far above the log's last lines
        raise RuntimeError(f"{e}\n--- errors in {server.log_path}:\n" + "\n".join(
            line for line in Path(server.log_path).read_text(errors="replace").splitlines()
            if "Error" in line or "error:" in line)) from None


def hit_twice(server: VllmServer, ps: list[list[int]], saves: bool = True) -> dict[str, float]:
    """First pass computes (and stores), second pass loads: equal outputs, store hits."""
    first, _ = serve(server, ps)
    if saves:
        wait_for_saves(server, saved_blocks(ps))
    second, delta = serve(server, ps)
    assert second == first
    assert store_hits(delta) > 0
    assert metric_sum(delta, PREFIX + "load_bytes_total") > 0
    assert metric_sum(delta, PREFIX + "load_jobs_total", status="error") == 0
    return delta


def accepted(server: VllmServer) -> str:
    return "\n".join(line for line in open(server.log_path, errors="replace")
                     if "(in-tree setting)" in line)


def test_single_node_kv_cache_offloading(tiny_model, doc_master, owner, connector_site,
                                         tmp_path):
    """"Single-Node KV Cache Offloading": the doc's JSON and
    `{"kv_connector": ..., "kv_role": "kv_both"}`, nothing else."""
    server = start(tiny_model, connector_site, tmp_path, "single", doc_json(doc_master),
                   {"kv_connector": "PooledMooncakeStoreConnector", "kv_role": "kv_both"})
    try:
        hit_twice(server, prompts(1))
        assert "mode='embedded'" in accepted(server)
    finally:
        server.stop()


def multi(member: dict, role: str, connector_first: dict) -> dict:
    """The doc's P/D MultiConnector: the P2P connector first, the store connector second."""
    return {"kv_connector": "MultiConnector", "kv_role": role,
            "kv_connector_extra_config": {"connectors": [connector_first, member]}}


def test_disaggregated_prefill_and_decode_with_save_decode_cache(
        tiny_model, doc_master, owner, connector_site, tmp_path):
    """"Disaggregated Prefill-Decode (XpYd)": the prefiller (kv_producer) stores the prompts;
    the decoder (kv_consumer, with the doc's `save_decode_cache`) loads them from the store and
    stores the blocks its generated tokens fill. The doc pairs the store connector with
    MooncakeConnector (point-to-point, needs a GPU: `current_platform.set_device`); here the
    first member is the in-tree ExampleConnector, which runs on CPU."""
    ps = prompts(2)
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "p2p")}}
    prefill = start(tiny_model, connector_site, tmp_path, "prefill", doc_json(doc_master),
                    multi({"kv_connector": "PooledMooncakeStoreConnector", "kv_role": "kv_both"},
                          "kv_producer", example))
    decode = None
    try:
        first, _ = serve(prefill, ps)
        wait_for_saves(prefill, saved_blocks(ps))
        # The prefiller stays up: in `embedded` mode part of what it stored is in its segment.
        decode_example = {**example, "kv_connector_extra_config": {
            "shared_storage_path": str(tmp_path / "p2p-decode")}}  # empty: the store serves
        decode = start(tiny_model, connector_site, tmp_path, "decode", doc_json(doc_master),
                       multi({"kv_connector": "PooledMooncakeStoreConnector",
                              "kv_role": "kv_consumer",
                              "kv_connector_extra_config": {"save_decode_cache": True}},
                             "kv_consumer", decode_example))
        # 40 generated tokens fill at least one more block past each prompt's 4 full blocks.
        second, delta = serve(decode, ps, max_tokens=40)
        assert [o[:8] for o in second] == first
        assert store_hits(delta) == len(ps) * 4 * BLOCK_SIZE  # every prompt block
        wait_for_saves(decode, len(ps))  # at least the decode block of each
        assert "save_decode_cache=True" in accepted(decode)
    finally:
        for server in (decode, prefill):
            if server is not None:
                server.stop()


def test_store_tp_lcm_shares_one_store_across_prefill_tp_sizes(tiny_model, doc_master, owner,
                                                               connector_site, tmp_path):
    """"Sharing one Store across multiple Prefill TP sizes": the doc's `enable_store_tp_lcm`
    with `prefill_tp_sizes: [4, 2]` stores each block in lcm = 4 shares of the KV heads (the
    tiny model's 2 KV heads: one per object, docs/layouts.md), and the engine hits its own
    blocks with them."""
    server = start(tiny_model, connector_site, tmp_path, "lcm", doc_json(doc_master),
                   by_name(enable_store_tp_lcm=True, prefill_tp_sizes=[4, 2]))
    try:
        hit_twice(server, prompts(5))
        total = server.metrics()  # saves in the first pass, loads in the second
        for op in ("save", "load"):
            assert metric_sum(total, PREFIX + "layout_keys_total", op=op, layout="kv_heads",
                              store_tp_size="2", tp_size="1") > 0, op
    finally:
        server.stop()


def test_disk_offloading_standalone_store(tiny_model, doc_master, owner, connector_site,
                                          tmp_path):
    """"Disk Offloading": `standalone-store` (the engine holds no segment), `enable_offload`,
    the rank steered to the owner with MOONCAKE_PREFERRED_SEGMENT; plus the doc's environment
    variables (tier log, staging ratio, requester hostname)."""
    server = start(tiny_model, connector_site, tmp_path, "disk",
                   doc_json(doc_master, mode="standalone-store", global_segment_size=0,
                            enable_offload=True),
                   by_name(), MOONCAKE_PREFERRED_SEGMENT=owner.segment,
                   VLLM_MOONCAKE_STORE_TIER_LOG="1",
                   VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO="0.5",
                   MOONCAKE_REQUESTER_LOCAL_HOSTNAME="127.0.0.1")
    try:
        delta = hit_twice(server, prompts(3))
        # Every block was put on the owner, and the loads were classified by tier.
        assert metric_sum(delta, PREFIX + "load_tier_tokens_total") == \
            metric_sum(delta, "vllm:external_prefix_cache_hits_total")
        notes = accepted(server)
        assert "mode='standalone-store'" in notes and "MOONCAKE_REQUESTER_LOCAL_HOSTNAME" in notes
    finally:
        server.stop()


def test_tenant_isolation(tiny_model, doc_master, owner, connector_site, tmp_path):
    """"Tenant Isolation": `tenant_id: tenant-a` in the JSON, on a master with
    `--enable_multi_tenants` and a policy that registers it; with the doc's extra_config keys
    (`load_async`, `lookup_async`, `cache_prefix`). Another tenant does not see its blocks."""
    ps = prompts(4)
    server = start(tiny_model, connector_site, tmp_path, "tenant",
                   doc_json(doc_master, tenant_id="tenant-a"),
                   by_name(load_async=True, lookup_async=True, cache_prefix="doc"))
    try:
        delta = hit_twice(server, ps)
        assert metric_sum(delta, PREFIX + "lookup_hit_tokens_total", tenant="tenant-a") > 0
        assert "lookup_async=True" in accepted(server)
    finally:
        server.stop()
    other = start(tiny_model, connector_site, tmp_path, "default-tenant", doc_json(doc_master),
                  by_name(cache_prefix="doc"))
    try:
        _, delta = serve(other, ps)
        assert store_hits(delta) == 0  # same keys, other tenant: not visible
    finally:
        other.stop()
