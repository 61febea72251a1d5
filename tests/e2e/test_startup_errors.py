"""A real vllm serve refuses to start, with the field named, instead of hanging."""

from __future__ import annotations

import time

import pytest

from devkit.local_cluster import MooncakeMaster
from devkit.vllm_server import VllmServer, connector_kv_config

pytestmark = pytest.mark.side_by_side


def test_vllm_refuses_to_start_with_bad_thread_count(tiny_model, master):
    """The whole engine stops at startup with the field named, instead of hanging."""
    server = VllmServer(tiny_model, connector_kv_config(master.store_config(load_threads=0)))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        server.start(timeout=180)
    assert time.monotonic() - t0 < 180
    assert "load_threads: must be 1..64, got 0" in server.log_tail(400), e.value


def test_vllm_refuses_to_start_when_master_unreachable(tiny_model):
    late = MooncakeMaster()  # ports chosen, never started
    server = VllmServer(tiny_model, connector_kv_config(late.store_config()))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        server.start(timeout=180)
    assert time.monotonic() - t0 < 120  # no 90 s setup() retry loop per process
    assert f"master_server_address: Mooncake master {late.address} is unreachable" in \
        server.log_tail(400)
