"""This connector inside vLLM's MultiConnector, next to an in-tree connector that runs on CPU
(ExampleConnector, with handshake metadata as NixlConnector has: tests/e2e/handshake_connector.py),
in both orders, in real `vllm serve`:
- the engine starts, and requests succeed (before the fix the first request returned 500 and the
  engine's output handler died: MultiConnector looks members up by class name in the API
  server; and placed second, this connector got the other member's handshake metadata and
  refused to start, "different KV layouts ['None']");
- a fresh engine's prompts hit the store, with the outputs of an engine without the connector
  (float32, conftest's reference_outputs);
- this connector's metrics are on /metrics.
One engine loads the connector by module path with vLLM's plugins off (VLLM_PLUGINS=""), the
fresh ones by name through the installed wheel's entry point.
"""

from __future__ import annotations

import pytest

from devkit.vllm_server import BLOCK_SIZE, VllmServer, metric_sum
from tests.conftest import by_name_env, engine_extra
from tests.e2e.store_kit import PREFIX, serve, store_hits

pytestmark = [pytest.mark.side_by_side, pytest.mark.timeout(1800)]


def example(path) -> dict:
    return {"kv_connector": "HandshakeExampleConnector",
            "kv_connector_module_path": "tests.e2e.handshake_connector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def ours(master, by_module: bool = False) -> dict:
    cfg = {"kv_connector": "PooledMooncakeStoreConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": engine_extra(master, cache_prefix="multi")}
    if by_module:
        cfg["kv_connector_module_path"] = "connector"
    return cfg


def multi(*members: dict) -> dict:
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": list(members)}}


@pytest.fixture(scope="module")
def filled(tiny_model, master, store_node, prompts, reference_outputs, tmp_path_factory) -> None:
    """An engine with this connector second, loaded by module path with no vLLM plugin, stores
    the prompts."""
    path = tmp_path_factory.mktemp("example-fill")
    server = VllmServer(tiny_model, multi(example(path), ours(master, by_module=True)),
                        env={"VLLM_PLUGINS": ""}).start()
    try:
        outputs, _ = serve(server, prompts)
        server.reset_prefix_cache()  # accepted once every save is stored
        assert outputs == reference_outputs
        assert server.proc.poll() is None
    finally:
        server.stop()


@pytest.mark.parametrize("order", ["ours-first", "ours-second"])
def test_fresh_engine_in_multiconnector_hits_the_store(order, tiny_model, master, filled,
                                                       prompts, reference_outputs, connector_site,
                                                       tmp_path):
    members = [ours(master), example(tmp_path / "example")]  # an empty ExampleConnector
    if order == "ours-second":
        members.reverse()
    server = VllmServer(tiny_model, multi(*members), env=by_name_env(connector_site)).start()
    try:
        outputs, delta = serve(server, prompts)
        again, _ = serve(server, prompts[:1])  # the engine still serves
        metrics = server.metrics()
    finally:
        server.stop()
    assert outputs == reference_outputs and again == reference_outputs[:1]
    # Every block looked up was in the store, and vLLM took the prefixes from it.
    assert metric_sum(delta, PREFIX + "lookup_miss_tokens_total") == 0
    assert metric_sum(delta, PREFIX + "lookup_hit_tokens_total") >= \
        len(prompts) * ((len(prompts[0]) - 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert store_hits(delta) > 0
    assert metric_sum(delta, PREFIX + "load_bytes_total") > 0
    assert metric_sum(delta, PREFIX + "load_jobs_total", status="error") == 0
    assert metric_sum(metrics, PREFIX + "recv_threads") == 1
    assert metric_sum(metrics, PREFIX + "lookups_total", result="hit") >= len(prompts)
