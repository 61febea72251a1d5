"""The store the benchmark runs against: a local master + store node (or the user's own store),
the source blocks written once, the delay proxy per RTT setting, and CPU accounting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.proxy import DelayProxy
from bench.workloads import Geometry, block_hashes
from connector.store.keys import KeyBuilder, Layout, kv_signature

PREFIX = "bench"
INTREE_MODEL = "bench-model"
PUT_BATCH = 64
_TICKS = os.sysconf("SC_CLK_TCK")


def our_keys(geometry: Geometry, prefix: str = PREFIX) -> KeyBuilder:
    """The keys our worker uses for these caches (signed with their registered layout)."""
    layout = Layout(INTREE_MODEL, str(geometry.dtype).removeprefix("torch."),
                    geometry.block_tokens, geometry.kv_heads, geometry.head_size,
                    geometry.layers, 1)
    return KeyBuilder(prefix, layout).with_signature(
        kv_signature(geometry.make_caches("meta"), geometry.num_blocks))


def intree_key_prefix() -> str:
    """The in-tree connector's rank-local key prefix for TP rank 0 (data.PoolKey)."""
    return f"{INTREE_MODEL}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"


def open_client(tb: Testbed, master: str | None = None, local_buffer: int = 64 << 20) -> Any:
    """A plain store client with no segment of its own (blocks live on the store nodes)."""
    from mooncake.store import MooncakeDistributedStore

    master = master or tb.master_address
    store = MooncakeDistributedStore()
    rc = store.setup(tb.local_hostname, tb.metadata_server, 0, local_buffer, tb.protocol,
                     tb.device_name, master)
    if rc != 0:
        raise RuntimeError(f"Mooncake client setup against {master} failed: {rc}")
    return store


@dataclass
class Source:
    """The source blocks: their bytes (for verification) and their keys in both schemes."""

    data: torch.Tensor  # uint8 [count, block_bytes]
    hashes: tuple[bytes, ...]
    our_keys: list[str]
    intree_keys: list[str]
    prefix: str = PREFIX

    @property
    def count(self) -> int:
        return len(self.hashes)


def fill_store(tb: Testbed, geometry: Geometry, count: int, prefix: str = PREFIX,
               intree: bool = True, seed: int = 0) -> Source:
    """Put `count` random blocks under our keys (and the in-tree keys) with raw batch puts."""
    from mooncake.store import ReplicateConfig

    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (count, geometry.block_bytes), dtype=torch.uint8, generator=g)
    hashes = block_hashes(count, prefix)
    ours = our_keys(geometry, prefix).keys(hashes, 0)
    theirs = [f"{intree_key_prefix()}@{h.hex()}" for h in hashes] if intree else []
    client = open_client(tb)
    try:
        if client.register_buffer(data.data_ptr(), data.numel()) != 0:
            raise RuntimeError("register_buffer failed for the source blocks")
        cfg = ReplicateConfig()
        cfg.replica_num = 1
        bb = geometry.block_bytes
        for keys in (ours, theirs):
            for i in range(0, count, PUT_BATCH):
                ks = keys[i:i + PUT_BATCH]
                ptrs = [data.data_ptr() + (i + k) * bb for k in range(len(ks))]
                rc = client.batch_put_from(ks, ptrs, [bb] * len(ks), cfg)
                bad = [r for r in rc if r not in (0, -705)]  # -705: already there
                if bad:
                    raise RuntimeError(f"put of source blocks failed: {bad[:4]}")
        client.unregister_buffer(data.data_ptr())
    finally:
        client.close()
    return Source(data, hashes, ours, theirs, prefix)


def remove_source(tb: Testbed, source: Source) -> None:
    """Delete the source blocks (the tuner cleans up after itself in a user's store)."""
    client = open_client(tb)
    try:
        for keys in (source.our_keys, source.intree_keys):
            for i in range(0, len(keys), 512):
                client.batch_remove(keys[i:i + 512], True)
    finally:
        client.close()


def _proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
    except (OSError, IndexError, ValueError):
        return 0.0


def _system_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (user..steal, not idle or iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / _TICKS


@dataclass
class CpuMeter:
    """Cores used per component over a window, from /proc (threads included), and "others":
    what every other process on the machine used meanwhile (the noise on a shared box)."""

    pids: dict[str, int]
    _start: dict[str, float] = field(default_factory=dict)
    _busy0: float = 0.0
    _t0: float = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._busy0 = _system_busy_s()
        self._start = {k: _proc_cpu_s(p) for k, p in self.pids.items()}

    def stop(self) -> dict[str, float]:
        dt = max(1e-9, time.perf_counter() - self._t0)
        used = {k: (_proc_cpu_s(p) - self._start.get(k, 0.0)) / dt for k, p in self.pids.items()}
        ours = sum(used.values())
        others = max(0.0, (_system_busy_s() - self._busy0) / dt - ours)
        out = {k: round(v, 2) for k, v in used.items()}
        out["total"] = round(ours, 2)
        out["others"] = round(others, 2)
        return out


def _descendants(root: int) -> list[int]:
    """root and every live process below it (by the parent ids in /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


class OthersMeter:
    """Cores that processes outside this one's process tree (its engines, store, master and
    client included) used over a window: what else runs on the machine."""

    def start(self) -> None:
        self._t0, self._busy0, self._ours0 = time.perf_counter(), _system_busy_s(), self._ours()

    @staticmethod
    def _ours() -> float:
        return sum(_proc_cpu_s(p) for p in _descendants(os.getpid()))

    def stop(self) -> float:
        dt = max(1e-9, time.perf_counter() - self._t0)
        return round(max(0.0, (_system_busy_s() - self._busy0 - (self._ours() - self._ours0))
                         / dt), 2)


def wait_until_quiet(meter: CpuMeter, threshold: float, max_wait_s: float,
                     window_s: float = 1.0) -> float:
    """Wait (up to max_wait_s) for a window in which other processes use < threshold cores.

    Returns the seconds waited. On a shared machine, runs measured while another job
    saturates the cores say nothing about the code under test.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < max_wait_s:
        meter.start()
        time.sleep(window_s)
        if meter.stop()["others"] < threshold:
            break
    return time.monotonic() - t0


@dataclass
class Testbed:
    """A master and store node to load from (local, or given), plus the delay proxy."""

    master_address: str
    metadata_server: str
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    pids: dict[str, int] = field(default_factory=dict)
    proxy: DelayProxy | None = None
    _owned: list = field(default_factory=list)

    @classmethod
    @contextmanager
    def local(cls, segment: str = "2GB") -> Iterator[Testbed]:
        """Start mooncake_master + a standalone store node on free loopback ports."""
        from devkit.local_cluster import MooncakeMaster, StoreNode

        master = MooncakeMaster().start()
        node = tb = None
        try:
            node = StoreNode(master, segment_size=segment).start()
            tb = cls(master.address, master.metadata_server,
                     pids={"client": os.getpid(), "master": master.proc.pid,
                           "store_node": node.proc.pid})
            yield tb
        finally:
            if tb is not None:
                tb.set_rtt(0.0)  # stops the proxy
            if node is not None:
                node.stop()
            master.stop()

    def set_rtt(self, rtt_ms: float, mbps: float = 0.0) -> str:
        """Route new clients' master RPCs through a proxy adding `rtt_ms` (0 = direct)."""
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
            self.pids.pop("proxy", None)
        if rtt_ms <= 0 and mbps <= 0:
            return self.master_address
        self.proxy = DelayProxy(self.master_address, rtt_ms, mbps).start()
        self.pids["proxy"] = self.proxy.proc.pid
        return self.proxy.address

    def store_fields(self, master: str) -> dict[str, Any]:
        """The connector's Mooncake fields for a client of this store via `master`."""
        return {"metadata_server": self.metadata_server, "master_server_address": master,
                "protocol": self.protocol, "device_name": self.device_name,
                "local_hostname": self.local_hostname}

    def cpu_meter(self) -> CpuMeter:
        return CpuMeter(dict(self.pids))
