"""Start a real Mooncake master (and optionally a standalone store node) on free loopback ports.

Used by the tests, the demo and the benchmark: everything runs the same binaries as production
(`mooncake_master`, `mooncake_client` from the Mooncake wheel), protocol tcp on 127.0.0.1, with the
master's built-in HTTP metadata server. Not used by the connector itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from devkit.processes import HOST, spawn, stop_process, wait_port

# Mooncake's transfer engines bind random ports in this range.
TRANSFER_ENGINE_PORTS = range(15000, 17001)


def ephemeral_ports() -> range:
    """The kernel's range for the local ports of outgoing connections."""
    lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return range(int(lo), int(hi) + 1)


_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port for a server that binds it only later (a vLLM API server binds
    after some 16 s of imports; an HA standby when it is promoted). Chosen outside the
    ephemeral range, where any outgoing connection may take it meanwhile (CI saw a vLLM server
    fail with "Address already in use"; a promoted master logs "Failed to start master
    service: 1"), and outside the transfer engines' range. Each pytest-xdist worker draws from
    its own share, a process never hands one out twice, and the draw is random so that
    concurrent test runs rarely pick the same one."""
    ephemeral = ephemeral_ports()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % workers
    share = [p for p in range(TRANSFER_ENGINE_PORTS.stop, 65536)
             if p % workers == worker and p not in ephemeral and p not in _handed_out]
    for port in random.sample(share, min(200, len(share))):
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port outside the ephemeral and transfer-engine ranges")


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} not found; run scripts/setup.sh")
    return found


@dataclass
class MooncakeMaster:
    """A `mooncake_master` process with its HTTP metadata server and metrics port."""

    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    log_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="mooncake-master-"))
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    host: str = HOST  # the address it binds and advertises
    # Multi-tenant mode (--enable_multi_tenants): tenant name -> quota ("64MB"), written as
    # the master's file quota policy. None: no tenants (every client in the default tenant).
    tenants: dict[str, str] | None = None
    offload: bool = False  # --enable_offload: store nodes may keep a disk tier

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def command(self) -> list[str]:
        return [
            _binary("mooncake_master"),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={HOST}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            "--rpc_enable_tcp_no_delay=true",
            *self._tenant_args(),
            *(["--enable_offload=true"] if self.offload else []),
            *self.extra_args,
        ]

    def _tenant_args(self) -> list[str]:
        if self.tenants is None:
            return []
        policy = Path(self.log_dir) / "tenant_quotas.yaml"
        policy.write_text(quota_policy(self.tenants))
        return ["--enable_multi_tenants=true", "--tenant_quota_connector_type=file",
                f"--tenant_quota_connector_uri={policy}"]

    def start(self) -> MooncakeMaster:
        self.proc = spawn(self.command(), Path(self.log_dir) / "master.log")
        wait_port(self.rpc_port, self.proc, "mooncake_master")
        wait_port(self.http_port, self.proc, "mooncake_master metadata server")
        # It can open after the others (seen: a store node's start, asking it for the
        # mounted segments, was refused).
        wait_port(self.metrics_port, self.proc, "mooncake_master metrics server")
        return self

    def metrics_text(self) -> str:
        url = f"http://{self.host}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()

    def segments(self) -> set[str]:
        """Names (`host:port`) of the memory segments mounted on this master."""
        url = f"http://{self.host}:{self.metrics_port}/get_all_segments"
        with urllib.request.urlopen(url, timeout=5) as r:
            return set(r.read().decode().split())

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as in a crash: unlike `stop` (SIGTERM, which it may take a while to act
        on while still answering), RPCs in flight lose their connection at once."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def store_config(self, **overrides) -> dict:
        """The Mooncake fields of the connector config that point at this master."""
        cfg = {
            "metadata_server": self.metadata_server,
            "master_server_address": self.address,
            "protocol": "tcp",
            "local_hostname": HOST,
        }
        cfg.update(overrides)
        return cfg

    def write_config_file(self, path: str | os.PathLike, **overrides) -> str:
        Path(path).write_text(json.dumps(self.store_config(**overrides)))
        return str(path)


def quota_policy(tenants: dict[str, str]) -> str:
    """Mooncake's tenant quota policy (schema version 1) for the given name -> quota."""
    lines = ["version: 1", "tenants:"]
    for name, quota in tenants.items():
        lines += [f"  - name: {json.dumps(name)}", f"    quota: {quota}"]
    return "\n".join(lines) + "\n"


# A disk tier sized for the dev kit's tiny models: Mooncake's bucket backend writes a bucket
# once it holds 500 keys or 256 MB, and offloads once per 10 s heartbeat; small buckets and a
# 1 s heartbeat make blocks reach the disk within seconds. Override any of them in `env`.
DEV_OFFLOAD_ENV = {
    "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
    "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": "8",
    "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(4 * 2**20),
}


@dataclass
class StoreNode:
    """A standalone `mooncake_client` that contributes a global segment to the pool.

    Blocks placed on it outlive the engines that wrote them, as in production.
    """

    master: MooncakeMaster
    segment_size: str = "1GB"
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)  # e.g. MC_STORE_CLUSTER_ID for HA
    proc: subprocess.Popen | None = None
    # A disk tier (--enable_offload) in this directory; the master needs offload=True too.
    offload_path: str | None = None
    segment: str = ""  # its segment's name once started (for preferred_segment)
    # Another metadata server than the master's, e.g. "P2PHANDSHAKE" (clients then must use it
    # too: a P2PHANDSHAKE client cannot open segments published on the HTTP server).
    metadata_server: str = ""

    def start(self) -> StoreNode:
        segments = getattr(self.master, "segments", set)  # an HA group has no single master
        before = segments()
        args = [
            _binary("mooncake_client"),
            f"--master_server_address={self.master.address}",
            f"--metadata_server={self.metadata_server or self.master.metadata_server}",
            f"--host={HOST}",
            f"--port={self.port}",
            "--protocol=tcp",
            f"--global_segment_size={self.segment_size}",
            "--local_buffer_size=16MB",
        ]
        env = {**os.environ, **self.env}
        if self.offload_path:  # Mooncake refuses a directory that does not exist
            Path(self.offload_path).mkdir(parents=True, exist_ok=True)
            args.append("--enable_offload=true")
            env = {**os.environ, **DEV_OFFLOAD_ENV,
                   "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": self.offload_path, **self.env}
        self.proc = spawn(args, Path(self.master.log_dir) / f"store-node-{self.port}.log",
                          env=env)
        wait_port(self.port, self.proc, "mooncake_client store node")
        _wait_segment_mounted(self.master)
        if self.offload_path:  # the disk tier mounts a few seconds later
            _wait_segment_mounted(self.master, family="master_total_file_capacity_bytes")
        self.segment = next(iter(segments() - before), "")
        return self

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


@contextlib.contextmanager
def local_pool(segment_size: str = "64MB", **master_kw) -> Iterator[tuple[MooncakeMaster,
                                                                          StoreNode]]:
    """A master (`MooncakeMaster(**master_kw)`) and one store node of the caller's own, to
    freeze, kill or configure without touching shared ones. Both stop on exit, the master also
    when the node fails to start."""
    master = MooncakeMaster(**master_kw).start()
    try:
        node = StoreNode(master, segment_size=segment_size).start()
        try:
            yield master, node
        finally:
            node.stop()
    finally:
        master.stop()


def segment_mounted(master: MooncakeMaster, family: str = "master_total_capacity_bytes"
                    ) -> bool:
    """Whether the master reports some mounted capacity (a store node has mounted on it), of
    memory or, with `master_total_file_capacity_bytes`, of a disk tier."""
    try:
        return any(line.startswith(family + " ") and float(line.split()[-1]) > 0
                   for line in master.metrics_text().splitlines())
    except OSError:
        return False


def _wait_segment_mounted(master: MooncakeMaster, timeout: float = 20.0,
                          family: str = "master_total_capacity_bytes") -> None:
    """Block until the master reports some mounted capacity (the node finished mounting)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if segment_mounted(master, family):
            return
        time.sleep(0.1)
    raise TimeoutError(f"store node did not mount its segment on the master in time ({family})")
