"""A local Mooncake HA master group: etcd, two masters that elect a leader through it and
replicate metadata with the oplog, and a store node; etcd is also the metadata server.

This is the configuration that survives a leader failure (measured: every object readable after
the standby is promoted). Without `--enable_oplog` a promoted standby knows no objects (-704).
Clients must use the masters' cluster id (`MC_STORE_CLUSTER_ID`), else their setup fails with
"No master is available".

    cluster = HaCluster().start()
    cluster.store_config()   # connector fields: etcd:// addresses and cluster_id
    cluster.leader().kill()  # the standby serves after the lease and its warm-up, with all metadata

A master that exits on its own is started again by a supervisor thread, as Kubernetes'
`restartPolicy: Always` does for the chart's masters: a promoted standby whose RPC port was
taken exits with status 255, and without a restart no master serves again. The masters' RPC
ports are chosen where no outgoing connection can take them (`free_port`). A master that
the caller kills or stops is left alone (`restart` brings it back).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from connector.config import CLUSTER_ID_ENV
from connector.store.client import RPC_CONNECT_TIMEOUT_ENV, RPC_TIMEOUT_ENV
from devkit.local_cluster import MooncakeMaster, StoreNode, _binary, free_port
from devkit.processes import HOST, spawn, stop_process, wait_http

logger = logging.getLogger(__name__)


@dataclass
class Etcd:
    """A single-member etcd (Debian's `etcd-server`, installed by scripts/setup.sh)."""

    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="mooncake-etcd-"))
    proc: object = None
    host: str = HOST

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self) -> Etcd:
        binary = shutil.which("etcd") or "/usr/bin/etcd"
        if not Path(binary).exists():
            raise FileNotFoundError("etcd not found; run scripts/setup.sh (apt etcd-server)")
        client, peer = f"http://{self.endpoint}", f"http://{self.host}:{self.peer_port}"
        args = [binary, "--name", "mcpool", "--data-dir", str(Path(self.log_dir) / "data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"mcpool={peer}", "--initial-cluster-state", "new"]
        self.proc = spawn(args, Path(self.log_dir) / "etcd.log")
        wait_http(f"{client}/health", self.proc, "etcd", 30.0)
        return self

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


@dataclass
class HaMaster(MooncakeMaster):
    """One `mooncake_master` of an HA group. Its admin port (metrics_port) serves /metrics,
    /role (leader | standby), /ha_status and /health (JSON with role and service_ready)."""

    rpc_port: int = field(default_factory=free_port)  # bound only once promoted
    etcd_endpoints: str = ""
    cluster_id: str = ""
    wrap: tuple[str, ...] = ()  # argv prefix, e.g. ("ip", "netns", "exec", NS)
    exits: list[int] = field(default_factory=list)  # statuses of exits the supervisor saw

    @property
    def metadata_server(self) -> str:
        return f"etcd://{self.etcd_endpoints}"

    def command(self) -> list[str]:
        return [
            *self.wrap, _binary("mooncake_master"),
            "--enable_ha=true", "--ha_backend_type=etcd",
            f"--etcd_endpoints={self.etcd_endpoints}", f"--cluster_id={self.cluster_id}",
            "--enable_oplog=true",
            f"--rpc_address={self.host}", f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
            "--rpc_enable_tcp_no_delay=true", "--logtostderr=true",
            *self.extra_args,
        ]

    def start(self) -> HaMaster:
        self.proc = spawn(self.command(), Path(self.log_dir) / f"master-{self.rpc_port}.log")
        wait_http(f"http://{self.host}:{self.metrics_port}/health", self.proc, "mooncake_master",
                  30)
        return self

    def health(self) -> dict:
        """The admin /health answer ({} when the master does not answer)."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/health",
                                        timeout=1) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def serving(self) -> bool:
        h = self.health()
        return h.get("role") == "leader" and bool(h.get("service_ready"))

    def log(self) -> str:
        return (Path(self.log_dir) / f"master-{self.rpc_port}.log").read_text(errors="replace")

    def following(self) -> bool:
        """A standby whose oplog watcher runs (ha_standby_state 3 = WATCHING)."""
        if self.health().get("role") != "standby":
            return False
        return any(line == "ha_standby_state 3" for line in self.metrics_text().splitlines())


@dataclass
class HaCluster:
    """etcd + two HA masters + a store node, all on loopback."""

    cluster_id: str = "mcpool-dev"
    segment_size: str = "512MB"
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="mooncake-ha-"))
    # None: start one of our own (made in __post_init__). One already running is shared: left
    # running at stop (give each group on it its own cluster_id).
    etcd: Etcd | None = None
    masters: list[HaMaster] = field(default_factory=list)
    node: StoreNode | None = None
    supervise: bool = True  # start a master again when it exits on its own
    restart_delay_s: float = 1.0  # between an exit (or a failed start) and the next start
    _supervisor: threading.Thread | None = field(default=None, repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False)
    _own_etcd: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.etcd = self.etcd or Etcd(log_dir=self.log_dir)
        self.masters = self.masters or [
            HaMaster(log_dir=self.log_dir, etcd_endpoints=self.etcd.endpoint,
                     cluster_id=self.cluster_id) for _ in range(2)]

    # StoreNode reads these from its "master": the group's address, not one process.
    @property
    def address(self) -> str:
        return f"etcd://{self.etcd.endpoint}"

    @property
    def metadata_server(self) -> str:
        return self.address

    @property
    def env(self) -> dict[str, str]:
        """For a store node or plain client of this group: its cluster id, and the RPC bounds
        the connector sets for itself (Mooncake's 30 s default kept a store node on a
        partitioned leader for 30 s before it remounted on the new one)."""
        return {CLUSTER_ID_ENV: self.cluster_id, RPC_TIMEOUT_ENV: "5000",
                RPC_CONNECT_TIMEOUT_ENV: "1000"}

    def metrics_text(self) -> str:
        return self.leader().metrics_text()

    def start(self, timeout: float = 60.0) -> HaCluster:
        if self.etcd.proc is None:
            self.etcd.start()
            self._own_etcd = True
        first, second = self.masters
        first.start()
        self.wait_serving(timeout)  # the first master wins the election
        second.start()
        self.wait_following(second, timeout)
        self.node = StoreNode(self, segment_size=self.segment_size, env=self.env).start()
        self._supervisor = threading.Thread(target=self._supervise, name="ha-supervisor",
                                            daemon=True)
        self._supervisor.start()
        return self

    def _supervise(self) -> None:
        """Start again every master whose process exited while nobody stopped it."""
        while not self._stopping.wait(0.1):
            for m in self.masters:
                proc = m.proc
                if not self.supervise or proc is None or proc.poll() is None:
                    continue
                m.exits.append(proc.returncode)
                logger.warning("master %s exited with status %d; starting it again in %.1fs",
                               m.address, proc.returncode, self.restart_delay_s)
                if self._stopping.wait(self.restart_delay_s) or m.proc is not proc:
                    continue  # stopping, or the caller restarted or killed it meanwhile
                try:
                    m.start()
                except (RuntimeError, TimeoutError) as e:  # exited again at once: next round
                    logger.warning("master %s did not start again: %s", m.address, e)

    def leader(self) -> HaMaster:
        for m in self.masters:
            if m.proc is not None and m.serving():
                return m
        raise LookupError("no HA master is serving as leader")

    def standby(self) -> HaMaster:
        return next(m for m in self.masters if m is not self.leader())

    def wait_serving(self, timeout: float, exclude: HaMaster | None = None) -> HaMaster:
        """Block until a master (other than `exclude`) serves as leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.masters:
                if m is not exclude and m.proc is not None and m.serving():
                    return m
            time.sleep(0.05)
        raise TimeoutError(f"no HA master served as leader within {timeout}s")

    def wait_following(self, master: HaMaster, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not master.following():
            if time.monotonic() > deadline:
                raise TimeoutError(f"master {master.address} did not follow the leader")
            time.sleep(0.1)

    def restart(self, master: HaMaster, timeout: float = 60.0) -> None:
        """Start a stopped master again on its ports; it rejoins as a standby."""
        master.start()
        self.wait_following(master, timeout)

    def store_config(self, **overrides) -> dict:
        """The connector fields that point at this group."""
        cfg = {"master_server_address": self.address, "metadata_server": self.metadata_server,
               "cluster_id": self.cluster_id, "protocol": "tcp", "local_hostname": HOST}
        cfg.update(overrides)
        return cfg

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(60)
        for proc in (self.node, *self.masters, self.etcd if self._own_etcd else None):
            if proc is not None:
                proc.stop()
