"""The chart's store node sizes (`storeNodes.globalSegmentSize`, `localBufferSize`) against the
real `mooncake_client`: every form its schema admits mounts that many bytes, and the forms it
refuses are those the client reads as 0 (a store node that adds no memory, without an error).
The engines' sizes are read by the connector (`parse_size`), which takes KiB forms too."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from devkit.local_cluster import MooncakeMaster, StoreNode, _binary, free_port
from devkit.processes import HOST, spawn, stop_process, wait_port

SCHEMA = Path(__file__).resolve().parents[2] / "helm/mooncake-pooled-connector/values.schema.json"
MiB32 = 32 * 2**20


def pattern(definition: str) -> re.Pattern:
    (text,) = [a["pattern"] for a in json.loads(SCHEMA.read_text())["definitions"][definition][
        "anyOf"] if "pattern" in a]
    return re.compile(text)


def capacity(master: MooncakeMaster) -> float:
    for line in master.metrics_text().splitlines():
        if line.startswith("master_total_capacity_bytes "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("size", ["32MB", "32mb", "32M", "32 MB", "0.03125GB", "32768KB",
                                  "33554432"])
def test_every_store_node_size_the_chart_admits_mounts_it(size):
    assert pattern("storeNodeSize").match(size)
    master = MooncakeMaster().start()
    node = StoreNode(master, segment_size=size)
    try:
        node.start()  # waits until the master counts a mounted segment
        assert capacity(master) == MiB32
    finally:
        node.stop()
        master.stop()


@pytest.mark.parametrize("size", ["32MiB", "32Mi"])
def test_the_sizes_the_chart_refuses_for_store_nodes_mount_nothing(size, tmp_path):
    """A KiB-style size: the engines' schema admits 32MiB (the connector reads it), the store
    nodes' refuses it, as mooncake_client reads it as 0. If a Mooncake release reads it, this
    fails, and the store nodes' schema can admit it."""
    assert pattern("size").match("32MiB") and not pattern("size").match("32Mi")
    assert not pattern("storeNodeSize").match(size)
    master = MooncakeMaster().start()
    log = tmp_path / "node.log"
    port = free_port()
    proc = spawn([_binary("mooncake_client"), f"--master_server_address={master.address}",
                  f"--metadata_server={master.metadata_server}", f"--host={HOST}",
                  f"--port={port}", "--protocol=tcp", f"--global_segment_size={size}",
                  "--local_buffer_size=16MB"], log)
    try:
        wait_port(port, proc, "mooncake_client store node")
        deadline = time.monotonic() + 20
        while "Global segment size is 0, skip mounting segment" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        assert capacity(master) == 0
    finally:
        stop_process(proc)
        master.stop()
