"""The parts of the fault matrix (tests/e2e/test_fault_matrix.py) that are not the cells: a
row's store (master and store node it may freeze, kill, fill or restart), the evidence a cell
reads from the engine's and the master's metrics, and the requests it sends.

Every wait here polls for what it waits for, with a bound that holds on a slow host, and
names what it saw when it gives up.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from connector.observability.metric_catalog import PREFIX as P
from devkit.local_cluster import HOST, MooncakeMaster, StoreNode, free_port, segment_mounted
from devkit.processes import freeze, thaw
from devkit.vllm_server import BLOCK_SIZE, Completion, VllmServer, metric_sum, parse_metrics

NO_SPACE = -200  # Mooncake's NO_AVAILABLE_HANDLE: a put found no free space


def poll(what: str, check: Callable[[], Any], timeout: float, every: float = 0.2) -> Any:
    """`check()` until it returns something true; AssertionError naming `what` and the last
    value seen after `timeout` seconds. A check that raises OSError (a process that did not
    answer its HTTP port in time: the recording run saw the master's do so once, on a stalled
    host, and the cell and every later one of its row failed on it) is retried like a false
    one."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if seen := check():
                return seen
        except OSError as e:
            seen = e
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s (last seen: {seen!r})")
        time.sleep(every)


def prompts(seed: int, n: int, blocks: int = 8) -> list[list[int]]:
    """`n` prompts of `blocks` full blocks (and 5 tokens more) that share nothing."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(blocks * BLOCK_SIZE + 5)] for _ in range(n)]


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def series(d: dict[str, float], part: str) -> dict[str, float]:
    """The non-zero samples of `d` whose name contains `part` (for failure messages)."""
    return {k.removeprefix(P): v for k, v in d.items() if part in k and v}


# ---- the store of one row -------------------------------------------------------------------
@dataclass
class Store:
    """A row's master and store node, and a plain client that fills and empties it. Its
    master never evicts a hard-pinned object (the junk of a full store)."""

    segment: str = "64MB"
    offload_dir: str | None = None  # a disk tier (the master runs with --enable_offload)
    client_ttl_s: int = 10  # the master's --client_ttl (Mooncake's default): see Row
    master: MooncakeMaster | None = None
    node: StoreNode | None = None
    client: Any = None
    _junk: np.ndarray = field(default_factory=lambda: np.zeros(1 << 20, dtype=np.uint8))
    _junk_keys: list[str] = field(default_factory=list)

    def start(self) -> Store:
        self.master = MooncakeMaster(offload=self.offload_dir is not None,
                                     extra_args=(f"--client_ttl={self.client_ttl_s}",)).start()
        self.node = StoreNode(self.master, segment_size=self.segment,
                              offload_path=self.offload_dir).start()
        return self

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        for proc in (p for p in (self.node and self.node.proc, self.master and self.master.proc)
                     if p is not None):
            with contextlib.suppress(ProcessLookupError):
                thaw(proc)
        if self.node:
            self.node.stop()
        if self.master:
            self.master.stop()

    # -- what the master says
    def master_metrics(self) -> dict[str, float]:
        return parse_metrics(self.master.metrics_text())

    def exist_rpcs(self) -> float:
        """Batch existence checks the master answered (the connector's lookups are these)."""
        return metric_sum(self.master_metrics(), "master_batch_exist_key_requests_total")

    def keys(self) -> float:
        return metric_sum(self.master_metrics(), "master_key_count")

    def healthy(self) -> str:
        """'' when the master answers and the node's segment is mounted, else what is wrong."""
        if self.master.proc is None or self.master.proc.poll() is not None:
            return "master not running"
        if self.node.proc is None or self.node.proc.poll() is not None:
            return "store node not running"
        try:
            segments = self.master.segments()
        except OSError as e:
            return f"master metrics port: {e}"
        if self.node.segment and self.node.segment not in segments:
            return f"segment {self.node.segment} not mounted (mounted: {sorted(segments)})"
        if not segment_mounted(self.master):
            return "no capacity mounted"
        if self.offload_dir and not segment_mounted(self.master,
                                                    "master_total_file_capacity_bytes"):
            return "disk tier not mounted"
        return ""

    def wait_healthy(self, timeout: float = 60.0) -> None:
        poll("store mounted and answering", lambda: not self.healthy() or None, timeout)

    # -- faults and their repair
    def freeze_node(self) -> None:
        freeze(self.node.proc)

    def node_listed(self) -> bool:
        """The master still lists the node's segment: a frozen node that outlived the client
        TTL is a dead one to the master (its objects gone), a different fault."""
        return self.node.segment in self.master.segments()

    def freeze_master(self) -> None:
        freeze(self.master.proc)

    def thaw_all(self) -> None:
        for proc in (self.node.proc, self.master.proc):
            if proc is not None and proc.poll() is None:
                thaw(proc)

    def kill_node(self) -> None:
        """SIGKILL: its segment stays listed on the master until the client TTL passes."""
        os.killpg(self.node.proc.pid, signal.SIGKILL)
        self.node.proc.wait(timeout=10)

    def replace_node(self, timeout: float = 90.0) -> None:
        """A new node process on a new port, as after a pod restart, once the master dropped
        the dead one's segment (else the master would still hand out its objects)."""
        dead = self.node.segment
        poll(f"master drops the dead segment {dead}",
             lambda: dead not in self.master.segments(), timeout, every=0.5)
        self.node = StoreNode(self.master, segment_size=self.segment, port=free_port(),
                              offload_path=self.offload_dir).start()
        self.wait_healthy()

    def kill_master(self) -> None:
        self._close_client()  # its calls would fail anyway; a fresh one after the restart
        self.master.kill()

    def restart_master(self) -> None:
        """Same ports: the engine's breaker and the node reconnect without a restart; the
        node mounts its segment again (the new master knows no objects)."""
        self.master.start()
        poll("store node remounts on the restarted master",
             lambda: segment_mounted(self.master), 90.0, every=0.5)
        self.node.segment = next(iter(self.master.segments()), "")
        self.wait_healthy()

    # -- a plain client: fill, empty
    def _connected(self) -> Any:
        if self.client is None:
            from mooncake.store import MooncakeDistributedStore

            client = MooncakeDistributedStore()
            assert client.setup(HOST, self.master.metadata_server, 0, 16 * 2**20, "tcp", "",
                                self.master.address) == 0
            assert client.register_buffer(self._junk.ctypes.data, self._junk.nbytes) == 0
            self.client = client
        return self.client

    def _close_client(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None

    def remove_all(self, settle_s: float = 30.0) -> int:
        """Every object gone (leases and pins ignored): what the master lists afterwards. On
        the disk-tier row a remove right after saves left objects listed (7, while the store
        node was still offloading them), so it is repeated until the master lists none or
        `settle_s` passed."""
        deadline = time.monotonic() + settle_s
        while True:
            self._connected().remove_all(True)
            left = int(self.keys())
            if left == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        self._junk_keys.clear()
        return left

    def fill(self) -> dict[str, float]:
        """Fill the memory segment with hard-pinned junk (never evicted) until the master's
        allocated bytes stop growing: 1 MiB puts until one finds no space, then 4 KiB ones
        (smaller than any block) likewise. Returns what the master says then."""
        from mooncake.store import ReplicateConfig

        client, cfg = self._connected(), ReplicateConfig()
        cfg.with_hard_pin = True
        refused: dict[int, int] = {}
        for size in (1 << 20, 4096):
            for _ in range(100_000):
                key = f"fault-matrix-junk/{size}/{len(self._junk_keys)}"
                code = client.batch_put_from([key], [self._junk.ctypes.data], [size], cfg)[0]
                if code != 0:
                    refused[size] = code
                    break
                self._junk_keys.append(key)
            else:
                raise AssertionError(f"{size}-byte puts never filled the store")
        m = self.master_metrics()
        allocated = metric_sum(m, "master_allocated_bytes")
        capacity = metric_sum(m, "master_total_capacity_bytes")
        assert set(refused.values()) == {NO_SPACE}, f"puts refused with {refused}, not no-space"
        assert capacity - allocated < (1 << 20), (allocated, capacity)
        return {"allocated_bytes": allocated, "capacity_bytes": capacity,
                "junk_objects": len(self._junk_keys)}

    def still_full(self) -> bool:
        """A 4 KiB put still finds no space."""
        from mooncake.store import ReplicateConfig

        cfg = ReplicateConfig()
        cfg.with_hard_pin = True
        key = f"fault-matrix-junk/probe/{time.monotonic_ns()}"
        code = self._connected().batch_put_from([key], [self._junk.ctypes.data], [4096], cfg)[0]
        if code == 0:
            self._junk_keys.append(key)
        return code == NO_SPACE


# ---- requests --------------------------------------------------------------------------------
@dataclass
class Reply:
    status: int
    output: Completion | None
    seconds: float
    error: str = ""
    started: float = 0.0  # time.monotonic() when it was sent


def send(server: VllmServer, prompt: list[int], max_tokens: int = 8) -> Reply:
    """One greedy completion; its HTTP status (the error's, if any) and wall time."""
    t0 = time.monotonic()
    try:
        out = server.complete(prompt, max_tokens=max_tokens)
        return Reply(200, out, time.monotonic() - t0, started=t0)
    except urllib.error.HTTPError as e:
        return Reply(e.code, None, time.monotonic() - t0, e.read().decode(errors="replace"), t0)
    except OSError as e:
        return Reply(0, None, time.monotonic() - t0, repr(e), t0)


def burst(server: VllmServer, work: list[list[int]], sequential: bool = False) -> list[Reply]:
    """The prompts at once (or one after another, for engines that are not batch-invariant)."""
    if sequential:
        return [send(server, p) for p in work]
    with ThreadPoolExecutor(len(work)) as pool:
        return list(pool.map(lambda p: send(server, p), work))


@contextlib.contextmanager
def scheduler_paused(server: VllmServer) -> Iterator[None]:
    """vLLM's scheduler paused with its queue kept (`POST /pause?mode=keep`, dev mode): a
    request sent meanwhile enters the waiting queue, where the connector starts its lookup
    (`on_new_request`), and none is scheduled, so none loads, until `/resume`. Requests that
    held the sequence slots instead ran out while a stalled host kept the master from
    answering (TP=2 fillers finished their whole context first)."""
    server.post("/pause?mode=keep&clear_cache=false")
    try:
        with urllib.request.urlopen(server.url + "/is_paused", timeout=10) as r:
            assert json.loads(r.read())["is_paused"], "vLLM did not pause its scheduler"
        yield
    finally:
        server.post("/resume")


# ---- host stalls -----------------------------------------------------------------------------
STALL_S = 0.1  # a stall this long is the host's, not contention: EEVDF slices are ms


class HostStalls:
    """When the host kept a thread of this process from running for over STALL_S at a time,
    though its timer had fired. A thread that wakes every 10 ms sees its run-queue wait
    (/proc/thread-self/schedstat: runnable, every CPU busy elsewhere), or its wake-up late by
    more than that, as far as the kernel counted steal meanwhile (/proc/stat: the VM's vCPUs
    not running at all, which the guest's run queue never sees; a late wake-up with no steal,
    such as this process's GIL, is not counted). On these 2-core VMs, while a TP=2 engine's
    pinned ranks compute, every other task was seen to wait tens of seconds at a stretch
    (docs/development.md); a request then waits for the host, not for the store, and a bound
    on what the store costs it must not count that. Contention on a fair scheduler (ms slices)
    stays far below STALL_S, and a connector that hangs or spins makes neither a run-queue
    wait of this thread at that scale nor steal. `steal_s`: the steal counted over the whole
    watch (every CPU's), recorded beside the stalls."""

    def __init__(self) -> None:
        self.stalls: list[tuple[float, float]] = []  # (start, end), time.monotonic()
        self.steal_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="host-stalls")

    @staticmethod
    def _steal() -> float:
        """Seconds of steal summed over the CPUs (/proc/stat's first line, USER_HZ ticks)."""
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")

    def _watch(self) -> None:
        with open("/proc/thread-self/schedstat") as f:
            def waited() -> float:
                f.seek(0)
                return int(f.read().split()[1]) / 1e9
            last, t_last, steal = waited(), time.monotonic(), self._steal()
            while not self._stop.wait(0.01):
                now, w, st = time.monotonic(), waited(), self._steal()
                late = max(w - last, min(now - t_last - 0.01, st - steal))
                if late > STALL_S:
                    self.stalls.append((now - late, now))
                last, t_last, steal = w, now, st

    def __enter__(self) -> HostStalls:
        self._steal_at_start = self._steal()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.steal_s = round(self._steal() - self._steal_at_start, 2)

    def within(self, start: float, end: float) -> float:
        """Seconds of stall between `start` and `end` (time.monotonic())."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.stalls)


def run_queue_s(pid: int) -> dict[str, float]:
    """Seconds each process of `pid`'s tree (by name: the API server, EngineCore, the TP
    ranks) has waited runnable for a CPU, over all its threads (schedstat). A diagnostic
    beside HostStalls: the engine's processes can be starved while the test's probe is not,
    and their spinning threads wait in the run queue legitimately, so it judges nothing."""
    out: dict[str, float] = {}
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        waited = 0.0
        try:
            name = p.name()
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                    waited += int(f.read().split()[1]) / 1e9
        except (OSError, psutil.Error):  # a thread or process ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + waited
    return out


def record(path: str | Path, doc: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
