"""Measure a Mooncake master failover as the connector's store client sees it, and write the
timeline that docs/reliability-failover.md quotes (docs/failover.json):

    python -m devkit.ha_timeline [--runs 2] [--out docs/failover.json] [--client-only]

then run the engine-level HA tests (tests/e2e/test_ha_failover.py, a real `vllm serve`), which
add their figures to the same file, and re-render the quoted passages (`bench.claims`): one
command re-records everything the failover tables show.

Each run starts a local HA group (devkit.ha_cluster), stores N objects through the
connector's `StoreHandle` (with the engines' probe interval), SIGKILLs the leader, and records
(seconds after the kill): when etcd names the new leader, when it serves, when the store node
has remounted its segment on it, when the connector's circuit breaker closes, the first get of
an old object and the first put that succeed (store hits are back), how long one store call
blocked while no leader served, and how many of the N objects are still readable. Part of the
time to store hits is the connector's and the store node's own: `store_hits_after_serving_s`
is what remains once the new leader serves. The 1-minute load average is recorded with each
run (this machine is shared: re-record on a quiet one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from connector.config import load_config
from connector.store.client import MASTER_DOWN_CODES, StoreHandle, etcd_leader
from devkit.ha_cluster import HaCluster, HaMaster
from devkit.local_cluster import segment_mounted
from devkit.provenance import git_commit

OBJECT_BYTES = 64 * 2**10
RECORD_ENV = "MCPOOL_FAILOVER_RECORD"  # path: the HA tests add their figures to it


def record(section: str, data: dict[str, Any], path: str | None = None) -> None:
    """Write `data` under `section` of the failover JSON (read-modify-write), with the commit
    and host it was measured on; a no-op unless a path is given or $MCPOOL_FAILOVER_RECORD."""
    path = path or os.environ.get(RECORD_ENV)
    if not path:
        return
    commit = git_commit()
    doc = json.loads(Path(path).read_text()) if Path(path).exists() else {}
    doc[section] = {**data, "commit": commit, "host": f"{platform.machine()} "
                    f"{os.cpu_count()} CPUs", "mooncake": _mooncake_version()}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def _until(pred, timeout: float, step: float = 0.02) -> float | None:
    """Seconds until pred() is true (None on timeout), polling every `step`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def _watch(pred, timeout: float, since, out: dict[str, Any], key: str) -> threading.Thread:
    """A thread that sets out[key] to since() once pred() is true."""
    def run() -> None:
        if _until(pred, timeout) is not None:
            out[key] = since()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def measure_failover(cluster: HaCluster, objects: int = 200, timeout: float = 60.0,
                     store_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Kill the leader of a running `cluster` and time the failover; the killed master is
    started again (as the new standby) before returning. `store_config`: the connector
    fields of the client (default `cluster.store_config()`; a process keeps one etcd client,
    so tests pass the endpoint their other clients use)."""
    cfg = load_config(store_config or cluster.store_config(), os.environ).store
    handle = StoreHandle(cfg, 0, 2 * objects * OBJECT_BYTES, "fail", 5.0)  # engines' probe_s
    client = handle.client
    data = np.random.default_rng(0).integers(0, 255, objects * OBJECT_BYTES, dtype=np.uint8)
    back = np.zeros_like(data)
    for buf in (data, back):
        assert client.register_buffer(buf.ctypes.data, buf.nbytes) == 0
    tag = f"timeline-{time.time_ns()}"
    keys = [f"{tag}-{i}" for i in range(objects)]
    addrs = [data.ctypes.data + i * OBJECT_BYTES for i in range(objects)]
    assert client.batch_put_from(keys, addrs, [OBJECT_BYTES] * objects) == [0] * objects
    time.sleep(1.5)  # > --oplog_poll_interval_ms: the standby has applied the puts
    old = cluster.leader()
    out: dict[str, Any] = {"loadavg_1m": round(os.getloadavg()[0], 2)}
    t_kill = time.monotonic()
    old.kill()
    since = lambda: round(time.monotonic() - t_kill, 3)  # noqa: E731

    def new_leader() -> HaMaster | None:
        return next((m for m in cluster.masters
                     if m is not old and m.proc is not None and m.serving()), None)

    def serving_then_remounted() -> None:
        """One poller for both: two side by side could see the remount (which needs the
        leader serving) a poll before the other saw it serve."""
        if _until(lambda: new_leader() is not None, timeout) is not None:
            out["new_leader_serving_s"] = since()
            if _until(lambda: (m := new_leader()) is not None and segment_mounted(m),
                      timeout) is not None:
                out["segment_remounted_s"] = since()

    watchers = [  # cheap polls of etcd and the masters' admin ports, side by side
        _watch(lambda: etcd_leader(cfg, 1.0)[0] not in ("", old.address), timeout, since, out,
               "new_leader_in_etcd_s"),
        threading.Thread(target=serving_then_remounted, daemon=True)]
    watchers[-1].start()
    first = client.batch_is_exist([keys[0]])[0]  # the call that trips the breaker
    out |= {"first_call_code": first, "first_call_s": since()}
    assert first in MASTER_DOWN_CODES, f"a call right after the kill returned {first}"
    handle.trip(first)
    assert handle.ready() is None, "the breaker did not open on the first failed call"

    def blocked_call() -> None:  # what every job would pay without the breaker
        t = time.monotonic()
        out["blocked_call_code"] = client.batch_is_exist([keys[0]])[0]
        out["blocked_call_s"] = round(time.monotonic() - t, 3)

    blocked = threading.Thread(target=blocked_call)
    blocked.start()
    # Jobs make store calls only while the breaker is closed: so do these.
    _until(lambda: handle.ready() is not None, timeout)
    out["breaker_closed_s"] = since()
    _until(lambda: client.get_into(keys[0], back.ctypes.data, OBJECT_BYTES) == OBJECT_BYTES,
           timeout)
    out["first_old_get_ok_s"] = since()
    _until(lambda: client.put_from(f"{tag}-new", data.ctypes.data, OBJECT_BYTES) == 0, timeout)
    out["first_put_ok_s"] = since()
    for t in (blocked, *watchers):
        t.join()
    new = cluster.leader()
    out["store_hits_after_serving_s"] = round(out["first_old_get_ok_s"]
                                              - out["new_leader_serving_s"], 3)
    got = client.batch_get_into(keys, [back.ctypes.data + i * OBJECT_BYTES
                                       for i in range(objects)], [OBJECT_BYTES] * objects)
    out["objects"] = objects
    out["objects_readable_after"] = sum(1 for r in got if r == OBJECT_BYTES)
    out["objects_identical_after"] = bool(np.array_equal(back, data))
    failovers, down_s = handle.take_outage()
    out["connector_failovers"], out["connector_down_s"] = failovers, round(down_s, 3)
    out["new_leader"] = new.address != old.address
    handle.close()
    cluster.restart(old)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", default="docs/failover.json")
    ap.add_argument("--client-only", action="store_true",
                    help="only the client timeline: no engine-level tests, no re-rendering")
    args = ap.parse_args()
    environ = dict(os.environ)  # the engines' tests start from the caller's environment
    cluster = HaCluster().start()
    os.environ.update(cluster.env)
    try:
        runs = [measure_failover(cluster) for _ in range(args.runs)]
    finally:
        cluster.stop()
    for r in runs:
        print(json.dumps(r))
    record("timeline", {
        "what": "SIGKILL of the HA leader (2 masters, --enable_oplog, etcd 3.4, one store "
                "node), seen by the connector's StoreHandle; seconds after the kill",
        "runs": runs}, args.out)
    print(f"wrote {args.out}")
    if args.client_only:
        return
    out = str(Path(args.out).resolve())
    subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/e2e/test_ha_failover.py"],
                   env={**environ, RECORD_ENV: out}, check=True)
    subprocess.run([sys.executable, "-m", "bench.claims"], check=True)


def _mooncake_version() -> str:
    from importlib.metadata import version

    return version("mooncake-transfer-engine-non-cuda")


if __name__ == "__main__":
    main()
