"""The control path at long context: what one store hit and one save cost this connector in
Python, on the engine's cores, against prompt length, on a 70B-shaped layout (80 layers, 8 KV
heads, head size 128, bf16, block size 16, TP=1), beside vLLM's in-tree
`MooncakeStoreConnector` on the same inputs.

Steps, each timed on its own (wall and this process's CPU, which counts every thread of it):
- `lookup`: the scheduler's lookup of a prompt whose every block is stored, from the request's
  arrival (`prefetch`, as `on_new_request` calls it) to vLLM's answer
  (`get_num_new_matched_tokens`, asked once per scheduler step, the steps back to back): the
  keys of every block and the batch existence checks against a real master (objects of one
  byte under the real keys: only the keys matter);
- `plan`: `update_state_after_alloc` and `build_connector_meta` for that request: the step's
  load plan;
- `load_prep_first`: what a receive thread does before its store call (`_load`): the
  objects' keys, units and the per-object buffer address lists the multi-buffer get takes,
  for blocks used the first time since the KV cache was registered (their address lists are
  made: `ObjectPlan.addresses`);
- `load_prep`: the same for blocks used before, whose address lists were kept: every block,
  once an engine has run a while (its KV cache's blocks are used over and over);
- `save_plan`: a prompt computed from scratch: its lookup miss, then `build_connector_meta`
  with the request scheduled, which plans the save of every block;
- `save_prep`: what a save thread does before its put: keys and address lists (kept ones,
  the blocks having been loaded before);
- `events_load` and `events_save`, with store KV events on (`--kv-events-config`): the
  scheduler announcing every block of the hit (`StoreEventLog.loaded`), and the blocks of the
  save planned, reported landed by the save thread (`_landed`, `WorkerLanded`), announced once
  landed, then taken for vLLM's publisher (`take`). A fresh event log each time: a block's
  first announcement, not a repeat of one still live;
- `events_load_full`: `events_load` into a log at its live bound (`kv_events_max_live`, here
  the prompt's blocks, all held by another prompt's): each block announced withdraws the
  oldest live one in the same step, the steady state of an engine whose live set filled
  before the store evicted its blocks. In neither total;
- `events_sweep`: one round of the KV events' removal sweep over the hit's blocks, live
  (`StoreEventLog.sweep`: every block's keys asked of the master's admin port, 256 keys a
  request, on one kept-alive connection, as the sweep thread does). Not a per-request cost: a
  round runs every `kv_events_sweep_s` over every live block (up to `kv_events_max_live`), on
  the scheduler's process.
"End to end" sums every step but `load_prep_first` and the events: what a request costs an
engine that has run a while; "with KV events" adds both event steps (not the sweep). Beside them,
`exist_call`: Mooncake's batch existence check of every key of the prompt alone, one call from
a plain client (the store's own share of a lookup); and `exist_absent`, the same call for as
many keys the store does not hold (the save's): the master leases each object it finds, so
the two differ by what a hit costs it per key.
For the steps that ask the master (`lookup`, `events_sweep`, `exist_call`, `exist_absent`),
the master process's CPU over the step too (every thread's, from /proc): what the engines'
lookups and sweeps cost a master they share.
In-tree, on the same hashes, block ids and KV tensors: `keys` (`RankLocalStoreLayout.key_for`
per block, as its scheduler and worker build them) and `prepare_values` (its address lists,
vectorised in vllm#48531). Its scheduler's lookup needs a running engine's config and is not
timed; the comparison is on the steps both have.

The KV tensors are the real shape (8,194 blocks of 80 layers, 43 GB) but never touched: the
kernel backs untouched pages with nothing, and only their addresses are read. No transfer
runs: the bytes are not what this measures.

Sizes are interleaved round by round (each round times every size once, in a rotated order),
and each step's figure is the median of the rounds with its range.

    python -m bench.control_path [--rounds 7] [--out docs/control-path.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_events import BlockStored
from vllm.utils.gc_utils import freeze_gc_heap

from bench.testbed import OthersMeter, Testbed, open_client
from connector.config import load_config
from connector.observability.kv_event_settings import EventSettings
from connector.observability.kv_events import StoreEventLog, WorkerLanded
from connector.scheduler.scheduler import MooncakeStoreScheduler
from connector.store.keys import KeyBuilder, Layout, kv_signature
from connector.store.master_http import MasterKeys
from connector.worker.kv_regions import ObjectPlan, plan_group
from connector.worker.worker import _landed
from devkit.local_cluster import local_pool
from devkit.provenance import git_commit

REPO = Path(__file__).resolve().parent.parent
LAYERS, HEADS, HEAD_SIZE, BLOCK = 80, 8, 128, 16
TOKENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
TARGET_MS_PER_1000_BLOCKS = 2.0
EVENT_STEPS = ("events_load", "events_save")
ROUND_STEPS = ("events_sweep",)  # per sweep round, not per request: in no total
FULL_STEPS = ("events_load_full",)  # at the live bound: a state, not every request's cost
Sample = tuple[float, float, float | None]  # wall ms, this process's CPU ms, the master's


def kv_caches(num_blocks: int, layers: int) -> dict[str, torch.Tensor]:
    """Per-layer KV tensors, blocks first (`[B, 2, H, N, C]`), allocated and never touched."""
    return {f"model.layers.{i}.self_attn": torch.empty(
        (num_blocks, 2, HEADS, BLOCK, HEAD_SIZE), dtype=torch.bfloat16) for i in range(layers)}


def timed(fn: Callable[[], Any], master: MasterCpu | None = None
          ) -> tuple[float, float, float | None, Any]:
    """(wall ms, process CPU ms, the master's CPU ms or None, result) of one call."""
    m0 = master.seconds() if master else 0.0
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    wall, cpu = (time.perf_counter() - w0) * 1e3, (time.process_time() - c0) * 1e3
    return wall, cpu, (master.seconds() - m0) * 1e3 if master else None, out


class MasterCpu:
    """The master process's CPU time, every thread's (`/proc/<pid>/task/*/schedstat`, in ns:
    /proc/<pid>/stat counts 10 ms ticks, coarser than a call). Read between calls only."""

    def __init__(self, pid: int) -> None:
        self._tasks = Path(f"/proc/{pid}/task")

    def seconds(self) -> float:
        total = 0
        for task in self._tasks.iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9


class Ours:
    """This connector's scheduler over a real master, and one rank's object plan."""

    def __init__(self, master: Any, caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        cfg = load_config(master.store_config(global_segment_size=0,
                                              local_buffer_size="64MB"), environ={})
        sig = kv_signature(caches, num_blocks)
        keys = KeyBuilder("ctl", Layout("llama-70b", "bfloat16", BLOCK, HEADS, HEAD_SIZE,
                                        len(caches), 1))
        self.keys = keys.with_signature(sig)
        self.sched = MooncakeStoreScheduler(cfg, keys, BLOCK)
        self.sched.add_layout({0: sig})
        self.tail = num_blocks - 1  # each prompt's last, partial block
        self._caches, self._num_blocks = caches, num_blocks
        self.plan = plan_group(caches, num_blocks, HEADS, 1).load
        self.master_http = f"{master.host}:{master.metrics_port}"
        self.master_cpu = MasterCpu(master.proc.pid)
        self.sweeper = MasterKeys(self.master_http)  # kept alive, as the sweep thread's
        # Plans whose address lists were made for a first use: kept to the end of the round,
        # so that no timed step runs just after a free of their lists (the allocator handing
        # memory back and faulting it in again, which an engine's first use does not pay).
        self._firsts: list[ObjectPlan] = []
        # The event logs, made before their timed steps and kept to the end of the round, as
        # an engine's one log outlives every request: a step pays for its events, not for
        # making or freeing a log (its 8,192-block live set, 1 to 3 ms to free).
        self._logs: list[StoreEventLog] = []
        self._n = 0

    def next_round(self) -> None:
        self._firsts.clear()
        self._logs.clear()

    def store(self, client: Any, hashes: list[bytes]) -> None:
        """One-byte objects under the keys of `hashes`: lookups find them."""
        buf = np.zeros(1, dtype=np.uint8)
        client.register_buffer(buf.ctypes.data, 1)
        keys = self.keys.all_shard_keys(hashes)
        for i in range(0, len(keys), 1024):
            part = keys[i:i + 1024]
            rc = client.batch_put_from(part, [buf.ctypes.data] * len(part), [1] * len(part))
            assert rc == [0] * len(part), f"storing the lookup keys failed: {set(rc)}"

    def _request(self, hashes: list[bytes]) -> SimpleNamespace:
        self._n += 1
        n = len(hashes) * BLOCK + 1
        return SimpleNamespace(request_id=f"r{self._n}", block_hashes=list(hashes),
                               num_tokens=n, num_prompt_tokens=n, trace_headers=None,
                               all_token_ids=list(range(1000, 1000 + n)), lora_request=None,
                               mm_features=[], prompt_embeds=None, cache_salt=None)

    def _events(self, max_live: int = 1 << 20) -> StoreEventLog:
        """A fresh scheduler's store event log with room for every block in its queue (its
        sweep thread not started: `events_sweep` runs a round itself), kept to the end of the
        round."""
        log = StoreEventLog(EventSettings("STORAGE", None, 0.0, self.master_http, 1 << 20,
                                          max_live), 1, BLOCK, self.keys.all_shard_keys, 1,
                            lambda *a, **k: None, (("full_attention", None),))
        self._logs.append(log)
        return log

    def _full_events(self, n: int) -> StoreEventLog:
        """An event log at its live bound of `n` blocks, every one another prompt's."""
        log = self._events(max_live=n)
        fill = [hashlib.sha256(f"ctl-live-{i}".encode()).digest() for i in range(n)]
        log.loaded(self._request(fill), range(n), 0, 0.0)
        log.take()
        return log

    @staticmethod
    def _events_load(log: StoreEventLog, req: SimpleNamespace) -> int:
        """The hit's blocks announced (live after the events were taken: what the sweep
        walks); how many blocks the events announced stored."""
        log.loaded(req, range(len(req.block_hashes)), 0, 0.0)
        return sum(len(e.block_hashes) for e in log.take() if isinstance(e, BlockStored))

    @staticmethod
    def _events_save(log: StoreEventLog, req: SimpleNamespace) -> int:
        n = len(req.block_hashes)
        log.planned(req, range(n), 0)
        worker = WorkerLanded(0, 1 << 20, lambda *a, **k: None)
        worker.add(0, _landed(req.block_hashes, [0] * n, range(n), [0] * n, 1))
        log.landed(worker.take().get_all_events())
        return sum(len(e.block_hashes) for e in log.take())

    def _ask(self, req: SimpleNamespace) -> tuple[int, bool]:
        """The request's arrival, then vLLM's ask once per scheduler step until the lookup
        answers, the steps back to back (their forward passes are not the connector's). Each
        step has its own `lookup_wait_ms` to wait in, as `build_connector_meta` gives it: asks
        in a loop with the budget spent would spin against the lookup thread for the GIL and
        count their own CPU as the lookup's."""
        self.sched.prefetch(req)
        while True:
            self.sched.step_waited_s = 0.0  # a new step
            res = self.sched.get_num_new_matched_tokens(req, 0)
            if res[0] is not None:
                return res

    def _step(self, new: list[Any]) -> Any:
        return self.sched.build_connector_meta(SimpleNamespace(
            preempted_req_ids=set(), scheduled_new_reqs=new,
            num_scheduled_tokens={r.req_id: r.tokens for r in new},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                  new_block_ids=[], num_computed_tokens=[])))

    def _prep(self, hashes: list[bytes], ids: list[int], plan: ObjectPlan | None = None
              ) -> Any:
        plan = plan or self.plan
        keys = self.keys.object_keys(hashes, plan.shards)
        return keys, plan.addresses(plan.units(ids))

    def hit(self, hashes: list[bytes], ids: list[int]) -> dict[str, Sample]:
        req = self._request(hashes)
        out = {}
        *out["lookup"], res = timed(lambda: self._ask(req), self.master_cpu)
        assert res == (len(hashes) * BLOCK, True), f"lookup of {len(hashes)} blocks: {res}"
        blocks = SimpleNamespace(get_block_ids=lambda: ([*ids, self.tail],))

        def plan() -> Any:
            self.sched.update_state_after_alloc(req, blocks, res[0])
            return self._step([])

        *out["plan"], meta = timed(plan)
        assert sum(len(t.block_ids) for t in meta.loads) == len(ids), "not one load plan"
        self._firsts.append(plan_group(self._caches, self._num_blocks, HEADS, 1).load)
        *out["load_prep_first"], _ = timed(lambda: self._prep(hashes, ids, self._firsts[-1]))
        *out["load_prep"], _ = timed(lambda: self._prep(hashes, ids))
        log = self._events()
        *out["events_load"], announced = timed(lambda: self._events_load(log, req))
        assert announced == len(ids), f"{announced} blocks announced of a hit of {len(ids)}"
        *out["events_sweep"], gone = timed(lambda: log.sweep(self.sweeper), self.master_cpu)
        assert gone == 0 and len(log.live()) == len(ids), f"the sweep removed {gone} blocks"
        full = self._full_events(len(ids))
        *out["events_load_full"], announced = timed(lambda: self._events_load(full, req))
        assert announced == len(ids) and set(full.live()) == {(0, h) for h in hashes}, \
            "the hit's blocks did not replace the live set's"
        self.sched.update_connector_output(SimpleNamespace(finished_sending=None,
                                                           finished_recving={req.request_id}))
        self.sched.request_finished(req, [*ids, self.tail])
        return out

    def save(self, hashes: list[bytes], ids: list[int]) -> dict[str, Sample]:
        req = self._request(hashes)
        assert self._ask(req) == (0, False), "a prompt to save was found in the store"
        new = SimpleNamespace(req_id=req.request_id, block_ids=([*ids, self.tail],),
                              num_computed_tokens=0, tokens=req.num_tokens)
        self.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)),
                                            0)
        out = {}
        *out["save_plan"], meta = timed(lambda: self._step([new]))
        assert sum(len(t.block_ids) for t in meta.saves) == len(ids), "not one save plan"
        *out["save_prep"], _ = timed(lambda: self._prep(hashes, ids))
        log = self._events()
        *out["events_save"], announced = timed(lambda: self._events_save(log, req))
        assert announced == len(ids), f"{announced} blocks announced of a save of {len(ids)}"
        self.sched.update_connector_output(SimpleNamespace(finished_sending={req.request_id},
                                                           finished_recving=None))
        self.sched.request_finished(req, [*ids, self.tail])
        return out


class InTree:
    """vLLM's in-tree store layout (key and address preparation) on the same tensors."""

    def __init__(self, caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            KeyMetadata,
            RankLocalStoreLayout,
        )

        self.layout = RankLocalStoreLayout(KeyMetadata("llama-70b", 0, 0, 0, 0), BLOCK, BLOCK)
        self.layout.register_kv_caches(list(caches.values()), num_blocks)
        assert len(self.layout.kv_caches_base_addr) == len(caches), "in-tree: a region per layer"

    def run(self, hashes: list[bytes], ids: list[int]) -> dict[str, Sample]:
        out = {}
        *out["keys"], _ = timed(lambda: [self.layout.key_for(0, h) for h in hashes])
        chunks = [(i * BLOCK, (i + 1) * BLOCK) for i in range(len(ids))]
        *out["prepare_values"], vals = timed(
            lambda: self.layout.prepare_values(chunks, ids, [0] * len(chunks)))
        assert len(vals[0]) == len(ids), "in-tree: not one descriptor per block"
        return out


def summarise(samples: dict[str, list[Sample]], blocks: int) -> dict[str, Any]:
    """Per step, the median and range of each measure; the master's CPU where it was read."""
    out = {}
    for step, xs in samples.items():
        wall, cpu = [x[0] for x in xs], [x[1] for x in xs]
        out[step] = {"wall_ms": round(statistics.median(wall), 3),
                     "wall_ms_range": [round(min(wall), 3), round(max(wall), 3)],
                     "cpu_ms": round(statistics.median(cpu), 3),
                     "cpu_ms_range": [round(min(cpu), 3), round(max(cpu), 3)],
                     "wall_ms_per_1000_blocks": round(statistics.median(wall) / blocks * 1e3, 3)}
        if xs[0][2] is not None:
            master = [x[2] for x in xs]
            out[step] |= {"master_cpu_ms": round(statistics.median(master), 3),
                          "master_cpu_ms_range": [round(min(master), 3), round(max(master), 3)]}
    return out


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """What the collector scans, as in an engine: vLLM's EngineCore freezes its startup heap
    (`freeze_gc_heap`), so a collection walks what was made since. Unfrozen however the block
    ends: a bench that raised must not leave the rest of its process (a pytest worker) frozen."""
    freeze_gc_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def run(rounds: int, tokens: tuple[int, ...] = TOKENS, layers: int = LAYERS) -> dict[str, Any]:
    """Every size's steps, `rounds` rounds after a warm-up round."""
    most = max(tokens) // BLOCK
    num_blocks = most + 2  # vLLM's null block 0, and each prompt's last, partial block
    caches = kv_caches(num_blocks, layers)
    hashes = [hashlib.sha256(f"ctl-{i}".encode()).digest() for i in range(most)]
    fresh = [hashlib.sha256(f"ctl-save-{i}".encode()).digest() for i in range(most)]
    ids = list(range(1, most + 1))
    sizes = [t // BLOCK for t in tokens]
    samples: dict[tuple[str, int], dict[str, list]] = {}
    with local_pool("256MB") as (master, _node):
        client = open_client(Testbed(master.address, master.metadata_server))
        ours, intree = Ours(master, caches, num_blocks), InTree(caches, num_blocks)
        ours.store(client, hashes)
        with frozen_heap():
            others: list[float] = []
            for rnd in range(rounds + 1):  # round 0 warms every path and is not kept
                order = sizes[rnd % len(sizes):] + sizes[:rnd % len(sizes)]
                ours.next_round()
                meter = OthersMeter()
                meter.start()
                for n in order:
                    keys = ours.keys.all_shard_keys(hashes[:n])
                    absent = ours.keys.all_shard_keys(fresh[:n])
                    for name, res in (("ours", ours.hit(hashes[:n], ids[:n])),
                                      ("ours", ours.save(fresh[:n], ids[:n])),
                                      ("in_tree", intree.run(hashes[:n], ids[:n])),
                                      ("store", {"exist_call": timed(
                                          lambda k=keys: client.batch_is_exist(k),
                                          ours.master_cpu)[:3],
                                                 "exist_absent": timed(
                                          lambda k=absent: client.batch_is_exist(k),
                                          ours.master_cpu)[:3]})):
                        for step, v in res.items():
                            if rnd:
                                samples.setdefault((name, n), {}).setdefault(step, []).append(v)
                if rnd:
                    others.append(meter.stop())
            ours.sched.shutdown()
            ours.sweeper.close()
            client.close()
    out: dict[str, Any] = {"sizes": []}
    for n in sizes:
        row = {"tokens": n * BLOCK, "blocks": n, "ours": summarise(samples[("ours", n)], n),
               "in_tree": summarise(samples[("in_tree", n)], n),
               "store": summarise(samples[("store", n)], n)}
        o, i = row["ours"], row["in_tree"]
        row["ours_end_to_end_ms"] = round(sum(
            o[s]["wall_ms"] for s in o if s not in ("load_prep_first", *EVENT_STEPS,
                                                    *ROUND_STEPS, *FULL_STEPS)), 3)
        row["ours_with_kv_events_ms"] = round(row["ours_end_to_end_ms"] + sum(
            o[s]["wall_ms"] for s in EVENT_STEPS), 3)
        # Against the in-tree connector, which makes its lists every time: ours made too.
        row["ours_comparable_ms"] = round(o["load_prep_first"]["wall_ms"], 3)
        row["in_tree_comparable_ms"] = round(i["keys"]["wall_ms"] + i["prepare_values"]["wall_ms"],
                                             3)
        out["sizes"].append(row)
    return {**out, "others_cores": {"median": round(statistics.median(others), 3),
                                    "max": round(max(others), 3)}}


def plot(doc: dict[str, Any], path: Path) -> None:
    """The curve: each step's median against blocks, log-log, with the target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["sizes"]
    x = [r["blocks"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, steps in (("ours", rows[0]["ours"]), ("in_tree", rows[0]["in_tree"])):
        for step in steps:
            ax.plot(x, [r[side][step]["wall_ms"] for r in rows], marker="o" if side == "ours"
                    else "s", linestyle="-" if side == "ours" else "--",
                    label=f"{'ours' if side == 'ours' else 'in-tree'}: {step}")
    ax.plot(x, [r["ours_end_to_end_ms"] for r in rows], color="black", linewidth=2,
            label="ours: end to end")
    ax.plot(x, [r["ours_with_kv_events_ms"] for r in rows], color="black", linewidth=2,
            linestyle="--", label="ours: end to end with KV events")
    ax.plot(x, [n * doc["target_ms_per_1000_blocks"] / 1e3 for n in x], color="red",
            linestyle=":",
            label=f"target: {doc['target_ms_per_1000_blocks']:g} ms per 1,000 blocks")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("blocks per request (16 tokens each)")
    ax.set_ylabel("ms (median of rounds)")
    ax.set_title("Control path per request, 70B-shaped layout (80 layers, 8 KV heads)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "control-path.json")
    a = p.parse_args(argv)
    result = run(a.rounds)
    doc = {"what": "bench/control_path.py: per-request control steps against prompt length",
           "layout": {"layers": LAYERS, "kv_heads": HEADS, "head_size": HEAD_SIZE,
                      "block_size": BLOCK, "dtype": "bfloat16", "tp": 1},
           "rounds": a.rounds, "target_ms_per_1000_blocks": TARGET_MS_PER_1000_BLOCKS,
           "commit": git_commit(), "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           **result}
    a.out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, a.out.with_suffix(".png"))
    for row in result["sizes"]:
        print(f"{row['tokens']:>7} tokens {row['blocks']:>5} blocks: ours "
              + ", ".join(f"{s} {v['wall_ms']:.2f}" for s, v in row["ours"].items())
              + " | in-tree " + ", ".join(f"{s} {v['wall_ms']:.2f}"
                                          for s, v in row["in_tree"].items()) + " ms")
    print("others_cores", result["others_cores"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
