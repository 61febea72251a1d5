"""The test servers' ports: chosen where nothing else can take them between the pick and the
server's late bind (CI saw a vLLM API server, which binds after its imports, fail with
"Address already in use" on a port drawn from the ephemeral range)."""

from devkit import local_cluster
from devkit.local_cluster import TRANSFER_ENGINE_PORTS, ephemeral_ports, free_port


def test_ports_are_outside_the_ephemeral_and_transfer_engine_ranges_and_never_repeat():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port not in ephemeral_ports() and port not in TRANSFER_ENGINE_PORTS, port


def test_xdist_workers_draw_from_disjoint_shares(monkeypatch):
    drawn = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setattr(local_cluster, "_handed_out", set())
        drawn[worker] = {free_port() for _ in range(100)}
    assert len(drawn["gw0"]) == len(drawn["gw1"]) == 100
    assert not drawn["gw0"] & drawn["gw1"]
