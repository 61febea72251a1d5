"""Measure what one Mooncake get returns, and after how long, when a peer is frozen (SIGSTOP:
its TCP connections stay open, nothing answers) and Mooncake's own timeouts are at their
defaults: the figures behind the deadline contract (docs/reliability-failover.md), written to
docs/frozen-peer.json.

    python -m devkit.frozen_peer [--out docs/frozen-peer.json]

A local master and store node; a plain client stores one object on the node, then the master
and then the node are frozen for one get each and thawed. MC_TCP_STATUS_TIMEOUT_SEC,
MC_TRANSFER_TIMEOUT, MC_RPC_TIMEOUT_MS and MC_RPC_CONNECT_TIMEOUT_MS are removed from this
process's environment first, so the defaults apply (the connector sets them from
transfer_timeout / store_timeout_s).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import numpy as np

from connector.store.client import ERROR_NAMES, RPC_CONNECT_TIMEOUT_ENV, TIMEOUT_ENV
from devkit.ha_timeline import record
from devkit.local_cluster import MooncakeMaster, StoreNode
from devkit.processes import HOST

SIZE = 1 << 20


def frozen_get(proc, client, key: str, buf: np.ndarray) -> dict[str, Any]:
    """One get while `proc` is stopped: its result code and how long it took."""
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        code = client.get_into(key, buf.ctypes.data, SIZE)
        seconds = time.monotonic() - t0
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    return {"code": code, "name": ERROR_NAMES.get(code, ""), "seconds": round(seconds, 2)}


def measure() -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore

    for var in (*TIMEOUT_ENV, RPC_CONNECT_TIMEOUT_ENV):
        os.environ.pop(var, None)
    master = MooncakeMaster().start()
    node = None
    client = MooncakeDistributedStore()
    try:
        node = StoreNode(master, segment_size="64MB").start()
        assert client.setup(HOST, master.metadata_server, 0, 16 * SIZE, "tcp", "",
                            master.address) == 0
        buf = np.ones(SIZE, dtype=np.uint8)
        assert client.register_buffer(buf.ctypes.data, SIZE) == 0
        assert client.put_from("frozen-peer", buf.ctypes.data, SIZE) == 0
        # The master first: a store node frozen for 30 s may lose its segment (and the
        # object) on the master, so a get made afterwards could fail before any RPC.
        return {"loadavg_1m": round(os.getloadavg()[0], 2),
                "master": frozen_get(master.proc, client, "frozen-peer", buf),
                "store_node": frozen_get(node.proc, client, "frozen-peer", buf)}
    finally:
        client.close()
        if node is not None:
            node.stop()
        master.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/frozen-peer.json")
    args = ap.parse_args()
    out = measure()
    print(out)
    record("frozen_get", {
        "what": "one client get with a peer SIGSTOPped, Mooncake's default timeouts (30 s); "
                "seconds from the call", **out}, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
