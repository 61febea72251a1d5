"""The preflight (`python -m connector.doctor`, console script `mcpool-doctor`) against a real
Mooncake master and store node, with each failure it claims to detect staged for real: the
master down, a wrong HA cluster id (etcd + an HA master), the store full, no segment mounted,
and the wrong protocol. Each must print its named line and exit non-zero; a healthy deployment
passes every check and names what it found (the master or HA leader, the segments)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from connector.config import CLUSTER_ID_ENV, CONFIG_PATH_ENV
from connector.doctor import TEST_OBJECT_BYTES
from devkit.ha_cluster import Etcd, HaMaster
from devkit.local_cluster import MooncakeMaster, StoreNode, free_port, local_pool
from devkit.processes import HOST

ROOT = Path(__file__).resolve().parents[2]
CHECK_NAMES = ("config", "master", "segments", "protocol", "round trip")
# only when the config names a tenant, a disk tier, store KV events
OPTIONAL_CHECKS = ("tenant", "disk tier", "kv events")


def doctor(master, tmp_path: Path, *args: str, metrics_port: int | None = None,
           env: dict | None = None, cmd: tuple[str, ...] = (sys.executable, "-m",
                                                            "connector.doctor"),
           **cfg) -> tuple[int, dict[str, str]]:
    """Run the doctor as an engine's pod would: the Mooncake file in MOONCAKE_CONFIG_PATH.
    Returns the exit status and {check name: its line}."""
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / f"mooncake-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps(master.store_config(**cfg)))
    environ = {k: v for k, v in os.environ.items() if k != CLUSTER_ID_ENV}
    environ.update({CONFIG_PATH_ENV: str(path), "PYTHONPATH": str(ROOT), **(env or {})})
    port = master.metrics_port if metrics_port is None else metrics_port
    r = subprocess.run([*cmd, f"--master-metrics-port={port}", "--timeout=2", *args],
                       env=environ, capture_output=True, text=True, timeout=180, cwd=ROOT)
    lines = {}
    for line in r.stdout.splitlines():
        status, rest = line[:4], line[5:]
        name = next(n for n in CHECK_NAMES + OPTIONAL_CHECKS if rest.startswith(n))
        lines[name] = f"{status} {rest[len(name):].strip()}"
    assert lines, f"no output (rc {r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    return r.returncode, lines


@pytest.fixture(scope="module")
def pool():
    with local_pool() as p:
        yield p


def test_healthy_pool_passes_every_check_and_names_what_it_found(pool, tmp_path):
    master, node = pool
    rc, lines = doctor(master, tmp_path)
    assert rc == 0, lines
    assert set(lines) == set(CHECK_NAMES) and all(v.startswith("PASS") for v in lines.values())
    assert f"Mooncake master {master.address}" in lines["master"]
    assert "1 mounted" in lines["segments"] and f"{HOST}:" in lines["segments"]
    assert "64.0 MiB" in lines["segments"]
    assert "put, get and remove" in lines["round trip"]


def test_master_down(tmp_path):
    gone = MooncakeMaster()  # ports chosen, never started
    rc, lines = doctor(gone, tmp_path)
    assert rc == 1
    assert lines["master"].startswith("FAIL") and "unreachable" in lines["master"]
    assert f"Mooncake master {gone.address} is unreachable" in lines["master"]
    assert "start mooncake_master there" in lines["master"]  # the fix
    assert all(lines[n].startswith("SKIP") for n in ("segments", "protocol", "round trip"))


def test_no_segment_mounted(tmp_path):
    master = MooncakeMaster().start()
    try:
        rc, lines = doctor(master, tmp_path)
    finally:
        master.stop()
    assert rc == 1
    assert lines["master"].startswith("PASS")
    assert lines["segments"].startswith("FAIL no store segment mounted: 0 on master")
    assert "start the store nodes" in lines["segments"]
    assert lines["round trip"].startswith("FAIL") and "-200" in lines["round trip"]


def test_fewer_segments_than_expected(pool, tmp_path):
    """helm test passes the store-node count: one node missing is a failure."""
    master, _ = pool
    rc, lines = doctor(master, tmp_path, "--min-segments=2")
    assert rc == 1
    assert lines["segments"].startswith("FAIL no store segment mounted: 1 on master")
    assert "expected at least 2" in lines["segments"]


def test_wrong_protocol(pool, tmp_path):
    master, node = pool
    rc, lines = doctor(master, tmp_path, protocol="rdma", device_name="mlx5_0")
    assert rc == 1
    assert lines["protocol"].startswith("FAIL wrong protocol: rdma in the config, but segment")
    assert "uses tcp" in lines["protocol"]
    assert lines["round trip"].startswith("FAIL")  # no RDMA device here: client setup fails


def test_store_full(tmp_path):
    """Every byte of the only segment holds an object under a one-hour lease, so the master
    can evict nothing: the round trip's put fails and says the store is full."""
    from mooncake.store import MooncakeDistributedStore

    master = MooncakeMaster(extra_args=("--default_kv_lease_ttl=1h",)).start()
    node = StoreNode(master, segment_size="16MB").start()
    filler = MooncakeDistributedStore()
    try:
        assert filler.setup(HOST, master.metadata_server, 0, 16 * 2**20, "tcp", "",
                            master.address) == 0
        keys: list[str] = []
        # 1 MiB objects, then objects of the doctor's test size into what is left (less than
        # 1 MiB can stay free, room for the test object); is_exist takes each object's lease
        # at once, so eviction cannot pick it
        for blob in (b"x" * 2**20, b"y" * TEST_OBJECT_BYTES):
            while len(keys) < 400 and filler.put(key := f"fill{len(keys)}", blob) == 0 \
                    and filler.is_exist(key) == 1:
                keys.append(key)
        assert 8 <= len(keys) < 400, len(keys)
        assert min(filler.batch_is_exist(keys)) == 1  # every object still there
        rc, lines = doctor(master, tmp_path)
    finally:
        filler.close()
        node.stop()
        master.stop()
    assert rc == 1
    assert lines["segments"].startswith("PASS") and "free of 16.0 MiB" in lines["segments"]
    assert lines["round trip"].startswith("FAIL put of a 64.0 KiB test object failed: -200")
    assert "store full" in lines["round trip"] and "add store nodes" in lines["round trip"]


@pytest.fixture(scope="module")
def ha_group(tmp_path_factory):
    """etcd, one HA master (the leader) and a store node of its cluster."""
    log_dir = str(tmp_path_factory.mktemp("ha"))
    etcd = Etcd(log_dir=log_dir).start()
    master = HaMaster(log_dir=log_dir, etcd_endpoints=etcd.endpoint, cluster_id="doctor-ha")
    node = None
    try:
        master.start()
        master_group = _Group(etcd, master)
        node = StoreNode(master_group, segment_size="32MB",
                         env={CLUSTER_ID_ENV: "doctor-ha"}).start()
        yield master_group
    finally:
        for p in (node, master, etcd):
            if p is not None:
                p.stop()


class _Group:
    """What StoreNode and `doctor` read from a master, for an HA group of one."""

    def __init__(self, etcd: Etcd, leader: HaMaster) -> None:
        self.leader, self.log_dir = leader, leader.log_dir
        self.address = self.metadata_server = f"etcd://{etcd.endpoint}"
        self.metrics_port = leader.metrics_port

    def metrics_text(self) -> str:
        return self.leader.metrics_text()

    def store_config(self, **kw) -> dict:
        return {"master_server_address": self.address, "metadata_server": self.address,
                "cluster_id": "doctor-ha", "protocol": "tcp", "local_hostname": HOST, **kw}


def test_ha_group_names_its_leader(ha_group, tmp_path):
    """And the round trip's figure is the round trip: closing an HA client waits out
    Mooncake's 30 s leader watch, which the doctor neither counts nor waits for (it counted
    it before). The reads of etcd and of the master's admin port go to them directly, not
    through the pod's HTTP proxy (here a dead one, for downloads)."""
    rc, lines = doctor(ha_group, tmp_path, env={"http_proxy": f"http://{HOST}:{free_port()}"})
    assert rc == 0, lines
    assert lines["master"].startswith(f"PASS leader {ha_group.leader.address} of cluster id "
                                      "'doctor-ha', named by etcd")
    ms = int(lines["round trip"].split(" in ")[1].split(" ms")[0])
    assert ms < 30_000, lines["round trip"]


@pytest.mark.parametrize("blank", ["", " "])
def test_a_blank_cluster_id_variable_is_unset(ha_group, tmp_path, blank):
    """MC_STORE_CLUSTER_ID set blank (a chart's empty value): the configured cluster_id is
    used, as the config reads a blank variable as unset. Before, the blank stayed, Mooncake
    read it as its default cluster id, and the store client's setup failed; whitespace made
    the leader read ask etcd for cluster id ' '."""
    rc, lines = doctor(ha_group, tmp_path, env={CLUSTER_ID_ENV: blank})
    assert rc == 0, lines
    assert lines["master"].startswith("PASS leader"), lines
    assert lines["round trip"].startswith("PASS"), lines


def test_wrong_cluster_id(ha_group, tmp_path):
    rc, lines = doctor(ha_group, tmp_path, cluster_id="not-doctor-ha")
    assert rc == 1
    assert lines["master"].startswith("FAIL master_server_address: no Mooncake master leads "
                                      "cluster id 'not-doctor-ha'")
    assert "set cluster_id to their --cluster_id" in lines["master"]


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stdout + r.stderr


def test_console_script_from_the_wheel(pool, tmp_path):
    """`pip install` of the package gives an `mcpool-doctor` command that runs the same checks."""
    src, wheels, target = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)  # what docker/Dockerfile builds the wheel from
    shutil.copytree(ROOT / "connector", src / "connector",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    _ok(subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(wheels), str(src)], capture_output=True, text=True, timeout=300))
    _ok(subprocess.run([*pip, "install", "-q", "--no-deps", "--target", str(target),
                        *map(str, wheels.glob("*.whl"))], capture_output=True, text=True,
                       timeout=300))
    script = target / "bin" / "mcpool-doctor"
    assert script.exists(), sorted(p.name for p in (target / "bin").iterdir())
    master, _ = pool
    rc, lines = doctor(master, tmp_path / "run", cmd=(sys.executable, str(script)),
                       env={"PYTHONPATH": str(target)})
    assert rc == 0 and all(v.startswith("PASS") for v in lines.values()), lines


def test_bad_config_fails_the_config_line_only(tmp_path):
    gone = MooncakeMaster()
    rc, lines = doctor(gone, tmp_path, "--kv-transfer-config",
                       json.dumps({"kv_connector": "PooledMooncakeStoreConnector",
                                   "kv_connector_extra_config": {"load_threads": 0}}),
                       metrics_port=free_port())
    assert rc == 1
    assert lines["config"].startswith("FAIL kv_connector_extra_config.load_threads: must be "
                                      "1..64, got 0")
    assert lines["master"].startswith("SKIP")


@pytest.fixture(scope="module")
def tenant_pool(tmp_path_factory):
    """A multi-tenant master (tenant "a" in its policy) with a disk tier on its store node."""
    master = MooncakeMaster(tenants={"a": "16MB"}, offload=True).start()
    node = StoreNode(master, segment_size="64MB",
                     offload_path=str(tmp_path_factory.mktemp("offload"))).start()
    yield master
    node.stop()
    master.stop()


def test_tenant_in_the_policy_with_its_quota(tenant_pool, tmp_path):
    rc, lines = doctor(tenant_pool, tmp_path, tenant_id="a")
    assert rc == 0, lines
    assert lines["tenant"].startswith("PASS") and "of a 16.0 MiB quota" in lines["tenant"]
    assert lines["round trip"].startswith("PASS")


def test_tenant_missing_from_the_policy(tenant_pool, tmp_path):
    rc, lines = doctor(tenant_pool, tmp_path, tenant_id="b")
    assert rc == 1
    assert lines["tenant"] == (
        "FAIL tenant 'b' is not in the quota policy of master "
        f"{tenant_pool.address}: every put of it is refused (-1701); fix: add it to the "
        "master's policy (the --tenant_quota_connector_uri file, or PUT "
        "/api/v1/tenant_quotas?tenant_id=b), or set tenant_id to a tenant the policy lists")
    assert "-1701 TENANT_NOT_REGISTERED: tenant 'b' is not in the master's quota policy" in \
        lines["round trip"]  # the put itself confirms it
    # The default tenant is not special: unlisted, it cannot write either.
    rc, lines = doctor(tenant_pool, tmp_path)
    assert rc == 1 and "tenant" not in lines and "-1701" in lines["round trip"]


def test_tenant_on_a_master_without_tenants(pool, tmp_path):
    rc, lines = doctor(pool[0], tmp_path, tenant_id="a")
    assert rc == 0 and "a key namespace only" in lines["tenant"], lines


def test_disk_tier_mounted_or_missing(tenant_pool, pool, tmp_path):
    rc, lines = doctor(tenant_pool, tmp_path, tenant_id="a", enable_offload=True)
    assert rc == 0 and lines["disk tier"].startswith("PASS disk tier mounted"), lines
    rc, lines = doctor(pool[0], tmp_path, enable_offload=True)
    assert rc == 1 and lines["disk tier"].startswith(
        "FAIL enable_offload is set, but no store node has a disk tier mounted"), lines
    assert "disk tier" not in doctor(pool[0], tmp_path)[1]  # not asked for: not checked



def test_kv_events_say_what_routers_take_and_whether_the_sweep_answers(pool, tmp_path):
    """With store KV events on: the medium and locality, what Dynamo's indexer and llm-d's
    scorer make of them, and a query of the sweep's address (the master's admin port)."""
    master, _ = pool
    http = f"{HOST}:{master.metrics_port}"

    def events(**keys) -> tuple[int, dict[str, str]]:
        extra = {"kv_events": "on", "kv_events_master_http": http, **keys}
        return doctor(master, tmp_path, "--kv-transfer-config",
                      json.dumps({"kv_connector_extra_config": extra}))

    rc, lines = events()
    assert rc == 0 and lines["kv events"].startswith("PASS"), lines
    assert "locality unset: Dynamo's indexer files them under its disk tier" in \
        lines["kv events"] and f"the sweep's address {http} answers" in lines["kv events"]
    rc, lines = events(kv_events_locality="remote")
    assert rc == 0 and "Dynamo's indexer drops every one (locality REMOTE)" in \
        lines["kv events"], lines
    wrong = f"{HOST}:{free_port()}"
    rc, lines = events(kv_events_master_http=wrong)
    assert rc == 1 and lines["kv events"].startswith("FAIL"), lines
    assert f"the sweep's address {wrong} does not answer" in lines["kv events"]
    assert "fix: set kv_events_master_http" in lines["kv events"]
