"""Startup against a master that is not there yet: the probe fails fast with the field named,
and degraded mode serves without the cache until the master appears."""

from __future__ import annotations

import time
import urllib.parse

import pytest

from connector.config import load_config
from connector.store.client import StoreHandle, StoreUnavailable, check_reachable
from devkit.local_cluster import MooncakeMaster, free_port
from tests.unit.test_config import BASE


def test_master_unreachable_fails_fast():
    cfg = load_config({**BASE, "master_server_address": f"127.0.0.1:{free_port()}"}, {})
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="master_server_address.*unreachable"):
        check_reachable(cfg.store, timeout=1.0)
    assert time.monotonic() - t0 < 5


def test_a_metadata_server_without_a_scheme_must_be_etcd(ha_etcd, monkeypatch):
    """Mooncake reads a metadata_server without a scheme (host:port[,host:port]) as etcd
    endpoints. One that names the master's HTTP metadata server instead is refused within the
    probe's timeout, the field and the fix named (setup() held the GIL for minutes, then
    blamed master_server_address); etcd passes, in a list too, and through no HTTP proxy."""
    master = MooncakeMaster().start()
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")  # a dead proxy
    try:
        http_md = urllib.parse.urlparse(master.metadata_server).netloc
        etcd = ha_etcd[0].endpoint

        def check(metadata_server: str) -> str:
            cfg = load_config(master.store_config(metadata_server=metadata_server), {})
            return check_reachable(cfg.store, timeout=1.0)

        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match=(
                rf"^metadata_server: {http_md} has no scheme, which Mooncake reads as etcd "
                rf"endpoints, but {http_md} answers GET /version with HTTP 404, .*; write "
                rf"http://{http_md}/metadata ")):
            check(http_md)
        assert time.monotonic() - t0 < 5
        assert check(etcd) == master.address
        assert check(f"{etcd},{http_md}") == master.address  # one of them is etcd
        assert check(f"http://{http_md}/metadata") == master.address  # a scheme: not this one's
    finally:
        master.stop()


def test_degrade_mode_serves_without_store_then_connects():
    late = MooncakeMaster()  # ports chosen, not started yet
    cfg = load_config(late.store_config(on_master_unreachable="degrade"), {})
    handle = StoreHandle(cfg.store, 0, 16 * 2**20, "degrade", timeout=0.5, retry_s=0.2)
    try:
        assert handle.client is None  # serving without the cache, no exception
        late.start()
        deadline = time.monotonic() + 30
        while handle.client is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert handle.client is not None and handle.client.health_check() == 0
    finally:
        handle.close()
        late.stop()
