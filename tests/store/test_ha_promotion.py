"""A failover that does not finish, and how a deployment gets out of it without a person.

Mooncake 0.3.13's promoted standby binds its RPC port only once it has won the election; if
the port is taken then (in the kernel's ephemeral range, any outgoing connection can take
it), the serve phase fails ("Failed to start master service: 1"), the master falls back to
standby for about a second and exits with status 255 (see
/work/shared/reference/mooncake-ha/promotion-failure.md). The other master was the leader that
died: nothing serves until something starts a master again. The dev kit's supervisor does it
here, Kubernetes' restartPolicy in the chart (tests/deploy/test_helm_ha.py), and the dev kit's
RPC ports come from outside the ephemeral range so the case cannot arise on its own.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from connector.config import load_config
from connector.store.client import MASTER_DOWN_CODES, StoreHandle
from devkit.ha_cluster import HaMaster
from devkit.local_cluster import TRANSFER_ENGINE_PORTS, ephemeral_ports
from tests.conftest import ha_group, in_process_config

OBJECTS, SIZE = 64, 64 * 2**10


def test_devkit_master_rpc_ports_cannot_be_taken_meanwhile():
    for _ in range(20):
        port = HaMaster().rpc_port
        assert port not in ephemeral_ports() and port not in TRANSFER_ENGINE_PORTS, port


def wait_for(pred, timeout: float, why: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, why
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture
def cluster(ha_etcd, monkeypatch):
    c = ha_group(ha_etcd, "promotion", segment_size="64MB", supervise=False).start()
    for k, v in c.env.items():
        monkeypatch.setenv(k, v)
    yield c
    c.stop()


def test_failed_promotion_recovers_when_the_master_is_restarted(cluster, ha_etcd):
    cfg = load_config(in_process_config(cluster, ha_etcd), {}).store
    h = StoreHandle(cfg, 0, 2 * OBJECTS * SIZE, "fail", 5.0, probe_s=0.1)
    try:
        client = h.client
        data = np.random.default_rng(1).integers(0, 255, OBJECTS * SIZE, dtype=np.uint8)
        back = np.zeros_like(data)
        for buf in (data, back):
            assert client.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        keys = [f"promotion-{i}" for i in range(OBJECTS)]
        addrs = [data.ctypes.data + i * SIZE for i in range(OBJECTS)]
        assert client.batch_put_from(keys, addrs, [SIZE] * OBJECTS) == [0] * OBJECTS
        time.sleep(1.5)  # > --oplog_poll_interval_ms: the standby has applied the puts
        leader, standby = cluster.leader(), cluster.standby()
        with socket.socket() as taken:
            taken.bind((standby.host, standby.rpc_port))  # as an outgoing connection would
            leader.kill()
            res = h.require().batch_is_exist([keys[0]])
            assert res[0] in MASTER_DOWN_CODES, res
            h.check(res)
            assert h.ready() is None  # the breaker is open: jobs fail fast to recompute
            wait_for(lambda: standby.proc.poll() is not None, 90, "the standby never exited")
        # Reproduced: the promotion failed and the process exited; nothing serves.
        assert standby.proc.returncode == 255, standby.proc.returncode
        assert "Failed to start master service" in standby.log()
        assert not any(m.serving() for m in cluster.masters if m.proc is not None)
        t_exit = time.monotonic()
        cluster.supervise = True  # the port is free again: a restart recovers
        assert cluster.wait_serving(90) is standby
        serving_s = time.monotonic() - t_exit
        assert standby.exits == [255]
        closed_s = wait_for(lambda: h.ready() is not None, 30, "the breaker never closed")
        print(f"restarted master served {serving_s:.1f}s after the exit, breaker closed "
              f"{closed_s:.2f}s later")
        assert closed_s < 5.0  # a probe round, not another outage
        into = [back.ctypes.data + i * SIZE for i in range(OBJECTS)]

        def all_readable() -> bool:  # -703 until the store node has remounted its segment
            return client.batch_get_into(keys, into, [SIZE] * OBJECTS) == [SIZE] * OBJECTS

        wait_for(all_readable, 30, "the objects stored before the kill are not readable")
        assert np.array_equal(back, data)  # the restarted master replayed the oplog
    finally:
        h.close()
