"""The whole local stack in one call: a tiny model, a Mooncake master, a store node holding the
bytes, and `vllm serve` with the connector. Used by the demo and the soak script."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from devkit.ha_cluster import HaCluster
from devkit.local_cluster import MooncakeMaster, StoreNode
from devkit.tiny_model import make_tiny_llama
from devkit.vllm_server import VllmServer, connector_kv_config


@contextlib.contextmanager
def local_stack(threads: int, segment: str = "1GB", ha: HaCluster | None = None,
                **extra) -> Iterator[VllmServer]:
    """Yield a started server; everything is stopped on exit. With `ha`, that HA master group
    (etcd, two masters, a store node) replaces the single master and its store node."""
    work = Path(tempfile.mkdtemp(prefix="mcpool-"))
    model = str(make_tiny_llama(work / "model"))
    master = node = server = None
    try:
        if ha is not None:
            ha.start()
            store = ha.store_config()
            print(f"stack: model {model}; HA masters {[m.address for m in ha.masters]} "
                  f"(leader {ha.leader().address}) via {ha.address}, cluster id {ha.cluster_id}")
        else:
            master = MooncakeMaster().start()
            node = StoreNode(master, segment_size=segment).start()
            store = master.store_config()
            print(f"stack: model {model}; mooncake_master {master.address}; store node port "
                  f"{node.port}")
        server = VllmServer(model, connector_kv_config({
            **store, "global_segment_size": 0, "local_buffer_size": "64MB",
            "load_threads": threads, **extra}))
        print(f"stack: starting vllm serve with the connector (log: {server.log_path}) ...")
        yield server.start()
    finally:
        for proc in (server, node, master, ha):
            if proc is not None:
                proc.stop()
