"""A real router credits the store: NVIDIA Dynamo's KV indexer (ai-dynamo-runtime 1.6.1 from
PyPI, `python -m dynamo.indexer`, in an environment of its own: scripts/setup_dynamo.sh)
subscribed to a real `vllm serve` with the connector's store KV events, with the settings as
shipped: on the router's side only the engine's address and block size, on the engine's only
`--kv-events-config` (ZMQ, bound) and the store's address (docs/kv-events.md, "Dynamo").

One engine (float32) over one small store (a 16 MB store node segment: 512 blocks of 32 KiB,
leases of 0.5 s), Dynamo's indexer registered with the engine as worker 1:
- after a fill, the indexer credits every stored prompt's prefix, from its disk tier (where it
  files `medium` STORAGE);
- after `/reset_prefix_cache` (vLLM's AllBlocksCleared, which Dynamo applies to every tier of
  the engine), the indexer still credits them: from the store alone, the engine's own KV cache
  holding none of them;
- while the engine writes three times the store's capacity, what the indexer holds of the
  store for the engine (its disk tier in `/dump`) never exceeds the capacity plus one round of
  writes (the blocks written between two sweeps), and a prompt the store evicted loses its
  credit while the newest ones keep theirs.
With RECORD_ROUTER=1 the figures go to docs/router-dynamo.json, which docs/kv-events.md
renders (bench/claims.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from devkit.local_cluster import HOST, free_port, local_pool
from devkit.processes import spawn, stop_process, wait_http
from devkit.vllm_server import BLOCK_SIZE, REPO, VllmServer, connector_kv_config, metric_sum
from tests.conftest import engine_extra
from tests.e2e.kv_events_kit import poked
from tests.e2e.store_kit import settled_keys, wait_for_saves

pytestmark = pytest.mark.side_by_side

INDEXER = REPO / "bin" / "dynamo-env" / "bin" / "python"
SEGMENT = "16MB"
LEASE = ("--default_kv_lease_ttl=500",)  # evictable soon after use (test_kv_events.py)
SWEEP_S = 0.5
PROMPT_BLOCKS = 8
ROUND_PROMPTS = 8
ROUNDS = 24  # 24 x 8 x 8 = 1536 blocks, three times the 512 the segment holds
WORKER = 1
P = "vllm:mooncake_pool_"
JSON = REPO / "docs" / "router-dynamo.json"


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE + 5)]
            for _ in range(n)]


FIRST = prompts(7, 4)
CREDIT = PROMPT_BLOCKS * BLOCK_SIZE  # a whole stored prefix, in tokens


class DynamoIndexer:
    """Dynamo's standalone indexer, subscribed (ZMQ SUB, connecting) to one engine."""

    def __init__(self, engine_endpoint: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.proc = spawn([str(INDEXER), "-m", "dynamo.indexer", "--block-size",
                           str(BLOCK_SIZE), "--port", str(self.port), "--threads", "1",
                           "--workers", f"{WORKER}={engine_endpoint}"], log)
        wait_http(self.url + "/health", self.proc, "dynamo.indexer", 60)

    def _call(self, path: str, body: dict | None = None):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode()
                                     if body is not None else None,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def credit(self, tokens: list[int]) -> dict[str, int]:
        """The engine's overlap with `tokens` per tier, cumulative as Dynamo reports it
        (`disk` counts the device and host tiers too)."""
        out = self._call("/query", {"token_ids": tokens, "model_name": "default"})
        return out.get("instances", {}).get(str(WORKER), {"gpu": 0, "disk": 0})

    def disk_blocks(self) -> int:
        """Blocks the indexer holds in the engine's disk tier (STORAGE), from /dump."""
        n = 0
        for entry in self._call("/dump").values():
            for ev in entry.get("events", []):
                if ev.get("worker_id") == WORKER and ev.get("storage_tier") == "disk":
                    n += len((ev["event"]["data"].get("stored") or {}).get("blocks", []))
        return n

    def stop(self) -> None:
        stop_process(self.proc)


def credited(indexer: DynamoIndexer, tokens: list[list[int]], ok, agg=all) -> list | None:
    """Each prompt's credit when `agg` (all, any) of them satisfy `ok`, else None."""
    cs = [indexer.credit(p) for p in tokens]
    return cs if agg(ok(c) for c in cs) else None


def wait(what: str, check, timeout: float = 60.0, poke: VllmServer | None = None):
    deadline = time.monotonic() + timeout
    while not (seen := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        if poke is not None:
            poked(poke)
        time.sleep(0.25)
    return seen


def test_dynamo_indexer_credits_the_store_follows_evictions_and_survives_a_reset(tiny_model,
                                                                                tmp_path):
    if not INDEXER.exists():
        pytest.fail(f"{INDEXER} missing: run scripts/setup_dynamo.sh (scripts/setup.sh does)")
    zmq_port = free_port()
    record: dict = {"what": "Dynamo's KV indexer (ai-dynamo-runtime 1.6.1) fed by vllm serve "
                            "with the connector's store KV events as shipped"}
    with local_pool(SEGMENT, extra_args=LEASE) as (master, _node):
        extra = engine_extra(master, cache_prefix="router-dynamo", kv_events="on",
                             kv_events_sweep_s=SWEEP_S,
                             kv_events_master_http=f"{HOST}:{master.metrics_port}")
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{zmq_port}"}  # vLLM binds; Dynamo connects
        server = VllmServer(tiny_model, connector_kv_config(extra),
                            extra_args=("--kv-events-config", json.dumps(events))).start()
        indexer = None
        try:
            indexer = DynamoIndexer(f"tcp://{HOST}:{zmq_port}", tmp_path / "indexer.log")
            heard(server, indexer)
            record |= run(server, indexer, master)
        finally:
            server.stop()
            if indexer is not None:
                indexer.stop()
    churn = record["churn"]
    print(f"Dynamo: capacity {churn['capacity_blocks']} blocks, held at most "
          f"{churn['disk_blocks_held_max']} (slack {churn['slack_blocks']}); first prompts' "
          f"credit after the churn {churn['first_prompts_credit_after']}")
    assert churn["disk_blocks_held_max"] <= churn["capacity_blocks"] + churn["slack_blocks"], \
        churn
    if os.environ.get("RECORD_ROUTER") == "1":
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()
        record |= {"commit": commit, "block_tokens": BLOCK_SIZE, "prompt_blocks":
                   PROMPT_BLOCKS, "sweep_s": SWEEP_S, "segment": SEGMENT}
        JSON.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")


def heard(server: VllmServer, indexer: DynamoIndexer) -> None:
    """Until the indexer hears the engine: its listener connects once the engine's publisher
    is bound, and a ZMQ subscriber hears nothing published before its subscription arrived.
    A prompt of its own each try (a block already cached makes no event), outside the test's."""
    tries = iter(range(100, 10_000))

    def one() -> bool:
        p = prompts(next(tries), 1)[0]
        server.complete(p)
        return indexer.credit(p)["gpu"] > 0

    wait("the indexer hears the engine's events", one)


def run(server: VllmServer, indexer: DynamoIndexer, master) -> dict:
    out: dict = {}
    # 1. A fill: every stored prompt's prefix credited, its blocks in the disk tier.
    held0, base = indexer.disk_blocks(), settled_keys(server)
    for p in FIRST:
        server.complete(p)
    wait_for_saves(server, base + len(FIRST) * PROMPT_BLOCKS)
    wait("a disk-tier block per stored block", lambda: indexer.disk_blocks()
         >= held0 + len(FIRST) * PROMPT_BLOCKS, poke=server)
    filled = [indexer.credit(p) for p in FIRST]
    assert all(c["disk"] >= CREDIT for c in filled), filled
    out["fill"] = {"prompts": len(FIRST), "credited_tokens": [c["disk"] for c in filled],
                   "disk_blocks": indexer.disk_blocks()}

    # 2. A prefix cache reset: AllBlocksCleared, then the store's blocks again.
    server.reset_prefix_cache()
    reset = wait("the store blocks credited again after the reset",
                 lambda: credited(indexer, FIRST, lambda c: c["gpu"] == 0
                                  and c["disk"] >= CREDIT), poke=server)
    out["after_reset"] = {"credited_tokens": [c["disk"] for c in reset],
                          "gpu_tokens": [c["gpu"] for c in reset]}

    # 3. Three times the capacity: what the indexer holds stays within it plus a round, and
    #    an evicted prompt's credit falls while the newest keeps its own.
    m = server.metrics()
    per_key = metric_sum(m, f"{P}save_bytes_total") / metric_sum(m, f"{P}save_keys_total")
    total = next(float(line.split()[-1]) for line in master.metrics_text().splitlines()
                 if line.startswith("master_total_capacity_bytes "))
    cap, slack = int(total // per_key), ROUND_PROMPTS * PROMPT_BLOCKS
    held = []
    for r in range(ROUNDS):
        for p in prompts(1000 + r, ROUND_PROMPTS):
            server.complete(p)
        wait_for_saves(server, base + (len(FIRST) + (r + 1) * ROUND_PROMPTS) * PROMPT_BLOCKS)
        time.sleep(2 * SWEEP_S)  # a sweep after the round's saves
        poked(server)
        held.append(indexer.disk_blocks())
    newest = prompts(1000 + ROUNDS - 1, ROUND_PROMPTS)[-1]
    latest = wait("the newest prompt credited", lambda: (
        c if (c := indexer.credit(newest))["disk"] >= CREDIT else None), poke=server)
    evicted = wait("a first prompt's credit falls", lambda: credited(
        indexer, FIRST, lambda c: c["disk"] < CREDIT, any), poke=server)
    out["churn"] = {"capacity_blocks": cap, "slack_blocks": slack, "rounds": ROUNDS,
                    "blocks_written": (len(FIRST) + ROUNDS * ROUND_PROMPTS) * PROMPT_BLOCKS,
                    "disk_blocks_held_max": max(held), "disk_blocks_held_end": held[-1],
                    "first_prompts_credit_after": [c["disk"] for c in evicted],
                    "newest_prompt_credit": latest["disk"]}
    return out
