"""Time to first token of a store hit served from the disk tier, against a hit served from
memory and against recompute, through a real `vllm serve` with the connector.

    python -m bench.disk_tier [--rounds 8] [--out docs/disk-tier.json]

Setup: a Mooncake master and a store node with `--enable_offload` (a memory segment and a disk
tier in a temporary directory), an engine with `enable_offload: true` (every load classified by
tier), and the model of the engine-level benchmark (`bench/engine.py`: a local Llama, 8 layers,
hidden 1024, 1024-token prompts, 31 blocks of 512 KiB loaded per hit).

1. Disk prompts: served once (their blocks are stored, and the store node writes them to disk);
   then filler objects written by a plain client cycle the memory until a read of every disk
   prompt is served from disk alone (the tier series say so); the filler is removed.
2. Memory prompts: served once; a read confirms they are served from memory alone.
3. Rounds: in each, one disk prompt, one memory prompt and one fresh prompt (recompute), each
   after POST /reset_prefix_cache, in an order that rotates every round. Every timed request is
   checked against the tier series: a disk case that was not served from disk alone, or a memory
   case not from memory alone, fails the run.

TTFT = time to the first streamed token. Reported: the median per case, and per round the ratios
disk / memory and disk / recompute, with their median and range over rounds. The machine's
load average at the start and the end is recorded with them: ratios measured side by side in
one round share the machine's state, the absolute times do not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine import make_prompts, stream_ttft
from devkit.local_cluster import HOST, MooncakeMaster, StoreNode
from devkit.provenance import git_commit
from devkit.vllm_server import (
    BLOCK_SIZE,
    REPO,
    SERVING_DTYPE,
    VllmServer,
    connector_kv_config,
    metric_sum,
)

CASES = ("disk", "memory", "recompute")
TIER_TOKENS = "vllm:mooncake_pool_load_tier_tokens_total"
FILLER_BYTES = 512 * 2**10  # one filler object: the size of a block of this model
LEASE_MS = 500  # blocks become evictable this long after their last use


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Bench:
    def __init__(self, server: VllmServer, master: MooncakeMaster) -> None:
        self.server, self.master = server, master
        self._filler: list[str] = []
        self._client: Any = None

    def timed(self, prompt: list[int]) -> tuple[float, dict[str, float], list[str]]:
        """TTFT of a prompt from a reset local cache, the tokens each tier served it, and the
        streamed texts."""
        self.server.reset_prefix_cache()
        before = self.server.metrics()
        ttft, texts = stream_ttft(self.server, prompt)
        after = self.server.metrics()
        tiers = {t: metric_sum(after, TIER_TOKENS, tier=t) - metric_sum(before, TIER_TOKENS,
                                                                          tier=t)
                 for t in ("memory", "disk", "unknown")}
        return ttft, tiers, texts

    def wait_saved(self, blocks: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            m = self.server.metrics()
            done = metric_sum(m, "vllm:mooncake_pool_save_keys_total") + \
                metric_sum(m, "vllm:mooncake_pool_save_skipped_keys_total")
            if done >= blocks:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"saves did not finish ({done} of {blocks} blocks)")
            time.sleep(0.5)

    def _plain_client(self) -> Any:
        if self._client is None:
            import numpy as np
            from mooncake.store import MooncakeDistributedStore

            client = MooncakeDistributedStore()
            if client.setup(HOST, self.master.metadata_server, 0, 64 * 2**20, "tcp", "",
                            self.master.address) != 0:
                raise RuntimeError("filler client setup failed")
            self._buf = np.full(FILLER_BYTES, 0x5A, dtype=np.uint8)
            client.register_buffer(self._buf.ctypes.data, self._buf.nbytes)
            self._client = client
        return self._client

    def cycle_memory(self, mb: int) -> None:
        """Write `mb` MB of filler: the memory evicts what has not been used for LEASE_MS."""
        client = self._plain_client()
        n = mb * 2**20 // FILLER_BYTES
        keys = [f"bench-filler/{len(self._filler) + i}" for i in range(n)]
        for i in range(0, n, 16):
            client.batch_put_from(keys[i:i + 16], [self._buf.ctypes.data] * len(keys[i:i + 16]),
                                  [FILLER_BYTES] * len(keys[i:i + 16]))
        self._filler += keys

    def remove_filler(self) -> None:
        if self._filler:
            self._plain_client().batch_remove(self._filler, force=True)
            self._filler = []

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def run(rounds: int, segment_mb: int, layers: int, hidden: int, prompt_tokens: int,
        work: Path) -> dict[str, Any]:
    from devkit.tiny_model import make_tiny_llama

    model = str(make_tiny_llama(work / "model", layers=layers, hidden=hidden))
    disk_p, mem_p, fresh_p = (make_prompts(rounds, prompt_tokens, seed=s) for s in (11, 12, 13))
    blocks = (prompt_tokens - 1) // BLOCK_SIZE
    master = MooncakeMaster(offload=True, extra_args=(f"--default_kv_lease_ttl={LEASE_MS}",))
    master.start()
    node = server = bench = None
    try:
        node = StoreNode(master, segment_size=f"{segment_mb}MB",
                         offload_path=str(work / "offload")).start()
        extra = master.store_config(global_segment_size=0, local_buffer_size="256MB",
                                    enable_offload=True, cache_prefix="disk-bench")
        server = VllmServer(model, connector_kv_config(extra), max_model_len=2048,
                            dtype=SERVING_DTYPE, log_path=str(work / "vllm.log"))
        server.start(timeout=600)
        bench = Bench(server, master)
        warm = make_prompts(1, 4 * BLOCK_SIZE + 1, seed=999)[0]
        bench.timed(warm)
        bench.wait_saved(4)
        bench.timed(warm)

        reference = {}  # the first tokens as computed, to compare the hits with
        for p in disk_p:  # stored; then the memory is cycled until they are on disk only
            reference[tuple(p)] = bench.timed(p)[2]
        bench.wait_saved(4 + rounds * (prompt_tokens // BLOCK_SIZE))
        for _ in range(40):
            bench.cycle_memory(segment_mb)
            time.sleep(2 * LEASE_MS / 1e3)
            served = [bench.timed(p)[1] for p in disk_p]
            if all(s["disk"] == blocks * BLOCK_SIZE for s in served):
                break
        else:
            raise RuntimeError(f"the disk prompts stayed partly in memory: {served}")
        bench.remove_filler()
        for p in mem_p:
            reference[tuple(p)] = bench.timed(p)[2]
        bench.wait_saved(4 + 2 * rounds * (prompt_tokens // BLOCK_SIZE))
        for p in mem_p:  # now hits: from memory alone
            if bench.timed(p)[1]["memory"] != blocks * BLOCK_SIZE:
                raise RuntimeError("the memory prompts are not all in memory")

        load_start = _loadavg()
        started = time.time()
        per_round: list[dict[str, Any]] = []
        for r in range(rounds):
            order = CASES[r % 3:] + CASES[:r % 3]
            row: dict[str, Any] = {"order": list(order)}
            for case in order:
                prompt = {"disk": disk_p, "memory": mem_p, "recompute": fresh_p}[case][r]
                ttft, tiers, texts = bench.timed(prompt)
                want = {"disk": {"disk": blocks * BLOCK_SIZE},
                        "memory": {"memory": blocks * BLOCK_SIZE}, "recompute": {}}[case]
                got = {t: v for t, v in tiers.items() if v}
                if got != want:
                    raise RuntimeError(f"round {r} {case}: served by {got}, expected {want}")
                row[case] = {"ttft_ms": round(ttft * 1e3, 1)}
                if case != "recompute":
                    row[case]["same_first_tokens"] = texts == reference[tuple(prompt)]
            row["disk_over_memory"] = round(row["disk"]["ttft_ms"] / row["memory"]["ttft_ms"], 3)
            row["disk_over_recompute"] = round(row["disk"]["ttft_ms"]
                                               / row["recompute"]["ttft_ms"], 3)
            row["memory_over_recompute"] = round(row["memory"]["ttft_ms"]
                                                 / row["recompute"]["ttft_ms"], 3)
            per_round.append(row)
        wall = time.time() - started
        load_end = _loadavg()
    finally:
        if bench is not None:
            bench.close()
        for proc in (server, node):
            if proc is not None:
                proc.stop()
        master.stop()

    def summary(key: str) -> dict[str, float]:
        vals = [r[key] for r in per_round]
        return {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals)}

    return {
        "meta": {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "wall_s": round(wall),
                 "host": {"cpus": os.cpu_count(), "loadavg_start": load_start,
                          "loadavg_end": load_end},
                 # Noisy, as in bench.serve: a load average over the core count.
                 "quiet": max(load_start[0], load_end[0]) <= os.cpu_count(),
                 "command": "python -m bench.disk_tier"},
        "setup": {"model": {"layers": layers, "hidden": hidden, "kv_heads": 2,
                            "dtype": SERVING_DTYPE,
                            "kv_bytes_per_block": layers * 2 * BLOCK_SIZE * 2 * (hidden // 4) * 2},
                  "prompt_tokens": prompt_tokens, "blocks_per_hit": blocks,
                  "memory_segment_mb": segment_mb, "lease_ms": LEASE_MS, "rounds": rounds},
        "ttft_p50_ms": {c: round(statistics.median(r[c]["ttft_ms"] for r in per_round), 1)
                        for c in CASES},
        "ratios": {k: summary(k) for k in ("disk_over_memory", "disk_over_recompute",
                                           "memory_over_recompute")},
        "same_first_tokens": all(r[c]["same_first_tokens"] for r in per_round
                                 for c in ("disk", "memory")),
        "rounds": per_round,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--segment-mb", type=int, default=512,
                   help="memory segment of the store node (holds the memory and recompute "
                        "prompts of every round)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "disk-tier.json")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-disk-"))
    try:
        result = run(a.rounds, a.segment_mb, a.layers, a.hidden, a.prompt_tokens, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("ttft_p50_ms", "ratios")}, indent=1))
    print(f"wrote {a.out}; load average {result['meta']['host']['loadavg_start']} -> "
          f"{result['meta']['host']['loadavg_end']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
