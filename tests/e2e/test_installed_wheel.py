"""`vllm serve` with the connector's name alone, as an operator runs it after
`pip install mooncake-pooled-connector`: the wheel built from this checkout, installed into a
directory of its own (no editable checkout on the path, not run from the checkout), its
`vllm.general_plugins` entry point registering the connector in every vLLM process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from devkit.vllm_server import VllmServer, metric_sum
from tests.conftest import engine_extra
from tests.e2e.store_kit import PREFIX, by_name, serve, store_hits

pytestmark = [pytest.mark.side_by_side, pytest.mark.timeout(900)]


def test_connector_by_name_from_the_installed_wheel(tiny_model, master, store_node, prompts,
                                                    connector_site, tmp_path):
    # In that environment `connector` is the wheel's copy, and its entry point is visible.
    probe = subprocess.run(
        [sys.executable, "-c", "import connector, importlib.metadata as md; "
         "print(connector.__file__); print([e.value for e in md.entry_points("
         "group='vllm.general_plugins')])"],
        env={**os.environ, "PYTHONPATH": connector_site}, cwd=tmp_path, capture_output=True,
        text=True, check=True).stdout.splitlines()
    assert probe[0].startswith(connector_site), probe
    assert "connector.plugin:register" in probe[1], probe

    # The wheel's directory is the whole PYTHONPATH, and vllm serve runs outside the checkout.
    server = VllmServer(tiny_model, by_name(**engine_extra(master, cache_prefix="wheel")),
                        env={"PYTHONPATH": connector_site}, cwd=tmp_path).start()
    try:
        first, _ = serve(server, prompts)
        second, delta = serve(server, prompts)  # its reset waits for the saves
        metrics = server.metrics()
    finally:
        server.stop()
    assert second == first
    assert store_hits(delta) > 0 and metric_sum(delta, PREFIX + "load_bytes_total") > 0
    assert metric_sum(metrics, PREFIX + "recv_threads") == 1
    log = open(server.log_path, errors="replace").read()
    assert "kv_connector_module_path=None" in log  # really by name
