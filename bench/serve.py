"""End-to-end serving benchmark: real `vllm serve` engines driven by `vllm bench serve`, the
client vLLM ships, on a prefix-heavy workload, with and without the store, cases side by side.

    python -m bench.serve --json docs/serve.json --png docs/serve-ttft.png   # full run
    python -m bench.serve --quick --json /tmp/serve.json                     # smoke run

Workload: vLLM's `prefix_repetition` dataset (no download), one distinct prefix per request,
the same seed on every engine, so every engine sees the same prompts: the documents a fleet
shares. Cases, every engine up for the whole run:

1. `no-connector`: no KV connector, local prefix cache cold (recompute);
2. `local-warm`: the same engine serving the same run again at once, its local prefix cache
   warm: the limit of reuse;
3. `in-tree`: vLLM's in-tree `MooncakeStoreConnector` (4 receive threads), loaded through
   `bench.intree_cpu` (a host event for its save path; the rest unchanged);
4. `ours-1t`, 5. `ours-4t`, 6. `ours-auto`: this connector with 1, 4 and `auto` receive
   threads;
7. `ours-4t-async`: ours-4t with every load asynchronous and queued after the forward pass
   (`sync_load_ms: 0`, `load_early_start: false`): the load path before issue 23;
8. `ours-4t-noahead` (only when named in `--cases`): ours-4t with `lookup_ahead: 0`, so no
   lookup starts before vLLM reaches its request and nothing is preloaded: the queue study

    python -m bench.serve --cases ours-4t,ours-4t-noahead --max-num-seqs 2 \
        --json docs/serve-queued.json

   runs the engines with `--max-num-seqs 2`, so that requests queue at the busy load point
   (`queued-concurrency-8`), beside one where they do not (`unqueued-concurrency-1`);
   `--queued-rate R` adds an open-loop one where they queue (`queued-rate-R`, Poisson).

The first connector engine of each key format serves the workload once, filling the store;
every connector engine then serves it once more unmeasured (its loads give the in-step
estimate). Then, per round and load point (one concurrency level that keeps the engine busy,
one Poisson request rate), the cases run in a fresh random order, each after
`POST /reset_prefix_cache` (store cases read the store again), and so does a reference get of
one request's prefix bytes (`bench.reference_get`). Comparisons are medians of per-round
paired values with 95 % intervals (`bench.serve_stats`). The load average and the cores used
by processes outside the benchmark's tree are recorded at every turn; a run is marked noisy
when the latter are not low (`bench.testbed.quiet`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.reference_get import ReferenceGet
from bench.report import quiet
from bench.run import TCP_QUEUE_ENV
from bench.serve_stats import breakdown_of, breakdown_rows, evaluate, summarize
from bench.testbed import OthersMeter
from bench.tune import save_figure
from devkit.local_cluster import MooncakeMaster, StoreNode
from devkit.provenance import git_commit
from devkit.tiny_model import make_tiny_llama
from devkit.vllm_server import (
    BLOCK_SIZE,
    SERVING_DTYPE,
    VllmServer,
    connector_kv_config,
    metric_sum,
)

ENGINE_START_S = 300.0
ENGINE_GIB = 3.0  # resident memory of one engine (API server + engine core + 1 GiB KV cache)
DEFAULT_CASES = ("no-connector", "local-warm", "in-tree", "ours-1t", "ours-4t", "ours-auto",
                 "ours-4t-async")
CASES = (*DEFAULT_CASES, "ours-4t-noahead")
QUICK_CASES = ("no-connector", "local-warm", "ours-4t")
ENGINE_OF = {"no-connector": "none", "local-warm": "none", "in-tree": "in-tree",
             "ours-1t": "ours-1", "ours-4t": "ours-4", "ours-auto": "ours-auto",
             "ours-4t-async": "ours-4-async", "ours-4t-noahead": "ours-4-noahead"}
VARIANTS = {"async": {"sync_load_ms": 0, "load_early_start": False},  # before issue 23
            "noahead": {"lookup_ahead": 0}}  # no look-ahead lookups, hence no preloads
REFERENCE = "reference get"
REFERENCE_REPS = 7
# Engine counters read before and after each run (summed over label sets).
COUNTERS = {"store_hit_tokens": "vllm:external_prefix_cache_hits_total",
            "store_queried_tokens": "vllm:external_prefix_cache_queries_total",
            "local_hit_tokens": "vllm:prefix_cache_hits_total",
            "prompt_tokens": "vllm:prompt_tokens_total"}
PRELOADED = "vllm:mooncake_pool_preload_keys_total"  # its outcome="used" series: preload_used_keys


@dataclass(frozen=True)
class LoadPoint:
    """One `vllm bench serve` traffic shape."""

    name: str
    request_rate: str  # "inf" = all at once, bounded by max_concurrency
    max_concurrency: int

    def args(self) -> list[str]:
        return ["--request-rate", self.request_rate, "--max-concurrency",
                str(self.max_concurrency)]


@dataclass(frozen=True)
class Workload:
    prompts: int
    prefix_len: int
    suffix_len: int
    output_len: int

    @property
    def hit_blocks(self) -> int:
        """Blocks one request can load: full blocks, leaving one token to compute."""
        return (self.prefix_len + self.suffix_len - 1) // BLOCK_SIZE

    def args(self) -> list[str]:
        return ["--dataset-name", "prefix_repetition", "--num-prompts", str(self.prompts),
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-num-prefixes", str(self.prompts),
                "--prefix-repetition-output-len", str(self.output_len), "--ignore-eos",
                "--seed", "0"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {', '.join(QUICK_CASES)}, one load point, two rounds, a "
                        "smaller model (under 5 minutes)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--png", type=Path, help="plot the TTFT distribution per case here")
    p.add_argument("--cases", help=f"comma list out of {','.join(CASES)}")
    p.add_argument("--rounds", type=int,
                   help="rounds per load point (full 6: the fewest that give a 95 %% interval "
                        "of the median; quick 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the per-round case orders")
    p.add_argument("--prompts", type=int, help="requests per run (full 32, quick 8)")
    p.add_argument("--prefix-len", type=int, help="shared-prefix tokens (full 960, quick 448)")
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8,
                   help="max concurrency of the busy load point")
    p.add_argument("--rate", default="2", help="requests/s of the Poisson load point")
    p.add_argument("--layers", type=int, help="model layers (full 8, quick 4)")
    p.add_argument("--hidden", type=int, help="model hidden size (full 1024, quick 512)")
    p.add_argument("--max-num-seqs", type=int,
                   help="vLLM's --max-num-seqs for every engine; the load points become "
                        "queued-concurrency-C (C > this: requests queue) and "
                        "unqueued-concurrency-1")
    p.add_argument("--queued-rate",
                   help="with --max-num-seqs, also a Poisson load point of this many "
                        "requests/s (queued-rate-R): an open loop, where a shorter service "
                        "time shortens the queue, unlike the closed loop of queued-concurrency")
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "mcpool-bench")
    p.add_argument("--mooncake-tcp-defaults", action="store_true",
                   help="do not raise Mooncake's per-peer TCP queue limits")
    a = p.parse_args(argv)
    q = a.quick
    a.cases = [c.strip() for c in a.cases.split(",")] if a.cases else \
        list(QUICK_CASES if q else DEFAULT_CASES)
    unknown = set(a.cases) - set(CASES)
    if unknown:
        p.error(f"--cases: unknown {sorted(unknown)}; choose from {','.join(CASES)}")
    a.rounds = a.rounds or (2 if q else 6)
    a.prompts = a.prompts or (8 if q else 32)
    a.prefix_len = a.prefix_len or (448 if q else 960)
    a.layers = a.layers or (4 if q else 8)
    a.hidden = a.hidden or (512 if q else 1024)
    if a.max_num_seqs:
        if a.concurrency <= a.max_num_seqs:
            p.error(f"--concurrency {a.concurrency}: requests queue only above --max-num-seqs "
                    f"{a.max_num_seqs}; raise --concurrency")
        a.points = [LoadPoint(f"queued-concurrency-{a.concurrency}", "inf", a.concurrency),
                    *([LoadPoint(f"queued-rate-{a.queued_rate}", a.queued_rate, a.prompts)]
                      if a.queued_rate else []),
                    LoadPoint("unqueued-concurrency-1", "inf", 1)]
        return a
    a.points = [LoadPoint(f"concurrency-{a.concurrency}", "inf", a.concurrency)]
    if not q:
        a.points.append(LoadPoint(f"rate-{a.rate}", a.rate, a.prompts))
    return a


def mem_available_gib() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kb / 2**20


class Stack:
    """Mooncake master + store node, and one engine per kind, kept up for the whole run."""

    def __init__(self, model: str, work: Path, env: dict[str, str], segment: str,
                 engine_args: tuple[str, ...] = ()) -> None:
        self.model, self.work, self.env = model, work, env
        self.engine_args = engine_args  # for every engine (--max-num-seqs)
        self.master = MooncakeMaster().start()
        self.node = StoreNode(self.master, segment_size=segment).start()
        self.intree_cfg = self.master.write_config_file(
            work / "mooncake-intree.json", global_segment_size=0, local_buffer_size="64MB",
            mode="standalone-store")
        self.engines: dict[str, VllmServer] = {}
        self.start_s: dict[str, float] = {}  # per kind: seconds its engine took to start

    def close(self) -> None:
        for server in self.engines.values():
            server.stop()
        self.node.stop()
        self.master.stop()

    def server(self, kind: str) -> VllmServer:
        """kind: none | in-tree | ours-<threads>[-<variant>]."""
        env = dict(self.env)
        kv = None
        if kind == "in-tree":
            kv = {"kv_connector": "CpuMooncakeStoreConnector",
                  "kv_connector_module_path": "bench.intree_cpu", "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"load_async": True}}
            env.update(MOONCAKE_CONFIG_PATH=self.intree_cfg, VLLM_MOONCAKE_LOAD_RECV_THREADS="4")
        elif kind.startswith("ours-"):
            threads, _, variant = kind.removeprefix("ours-").partition("-")
            kv = connector_kv_config(self.master.store_config(
                global_segment_size=0, local_buffer_size="64MB", cache_prefix="serve",
                load_threads=threads if threads == "auto" else int(threads),
                **VARIANTS.get(variant, {})))
        # bfloat16 as served in production: this benchmark times engines, it compares no
        # outputs.
        return VllmServer(self.model, kv, env=env, log_path=str(self.work / f"vllm-{kind}.log"),
                          dtype=SERVING_DTYPE, extra_args=self.engine_args)

    def start(self, kind: str) -> VllmServer:
        server = self.server(kind)
        t0 = time.perf_counter()
        server.start(timeout=ENGINE_START_S)
        self.engines[kind] = server
        self.start_s[kind] = round(time.perf_counter() - t0, 1)
        # One unrelated prompt first: allocation, first forward, store connections.
        server.complete(list(range(5, 5 + 3 * BLOCK_SIZE + 1)), max_tokens=2)
        return server


def run_client(server: VllmServer, workload: Workload, point: LoadPoint, out: Path
               ) -> dict[str, Any]:
    """One `vllm bench serve` run (in this process: its startup is paid once, not per turn):
    the client's result JSON, engine counter deltas and the TTFT breakdown of the run."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", server.model, "--tokenizer", server.model, *workload.args(), *point.args(),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(out.parent),
        "--result-filename", out.name, "--disable-tqdm"])
    before = server.metrics()
    load0 = os.getloadavg()[0]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        bench_main(args)
    time.sleep(1.0)  # one more stats interval reaches /metrics
    after = server.metrics()
    r = json.loads(out.read_text())
    if r["completed"] != workload.prompts:
        raise RuntimeError(f"vllm bench serve completed {r['completed']} of {workload.prompts}"
                           f":\n{log.getvalue()[-2000:]}")
    counters = {k: metric_sum(after, m) - metric_sum(before, m) for k, m in COUNTERS.items()}
    counters["preload_used_keys"] = (metric_sum(after, PRELOADED, outcome="used")
                                     - metric_sum(before, PRELOADED, outcome="used"))
    return {
        "completed": r["completed"], "failed": r.get("failed", 0),
        "duration_s": round(r["duration"], 2),
        "request_throughput": round(r["request_throughput"], 3),
        "ttft_p50_ms": round(r["median_ttft_ms"], 1), "ttft_p99_ms": round(r["p99_ttft_ms"], 1),
        "ttft_mean_ms": round(r["mean_ttft_ms"], 1),
        "itl_p50_ms": round(r["median_itl_ms"], 2), "itl_p99_ms": round(r["p99_itl_ms"], 2),
        "ttfts_ms": [round(x * 1e3, 1) for x in r["ttfts"]],
        "total_input_tokens": r["total_input_tokens"],
        **{k: int(v) for k, v in counters.items()},
        "breakdown": breakdown_of(before, after),
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


class Bench:
    """The engines, the reference get, and the rounds."""

    def __init__(self, a: argparse.Namespace, stack: Stack, workload: Workload) -> None:
        self.a, self.stack, self.workload = a, stack, workload
        self.kinds = sorted({ENGINE_OF[c] for c in a.cases})
        self.runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
        self.turns: list[dict[str, Any]] = []  # every turn's order and load, for the record
        # Reference get per load point: each round's median, and every rep.
        self.reference_ms: dict[str, list[float]] = {p.name: [] for p in a.points}
        self.reference_reps: dict[str, list[list[float]]] = {p.name: [] for p in a.points}

    def start_engines(self) -> dict[str, float]:
        need = len(self.kinds) * ENGINE_GIB + 1
        have = mem_available_gib()
        if have < need:
            raise SystemExit(f"bench.serve: {len(self.kinds)} engines need about {need:.0f} "
                             f"GiB and {have:.1f} GiB are available; run fewer --cases")
        print(f"starting engines {', '.join(self.kinds)} ...", flush=True)
        # As many at a time as there are cores: a start is mostly one busy Python process.
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(self.stack.start, self.kinds))
        return dict(self.stack.start_s)

    def _serve(self, kind: str, point: LoadPoint, name: str) -> dict[str, Any]:
        out = self.stack.work / f"{name}.json"
        return run_client(self.stack.engines[kind], self.workload, point, out)

    def fill_and_warm(self) -> dict[str, Any]:
        """The first engine of each key format stores the workload; then every connector
        engine serves it once from the store, unmeasured."""
        pt = self.a.points[0]
        connected = [k for k in self.kinds if k != "none"]
        fillers: dict[str, Any] = {}
        for fmt in ("ours", "in-tree"):
            kind = next((k for k in connected if k.startswith(fmt)), None)
            if kind is not None:
                print(f"filling the store ({fmt}) ...", flush=True)
                res = self._serve(kind, pt, f"fill-{kind}")
                fillers[fmt] = {"engine": kind} | {
                    k: res[k] for k in ("completed", "duration_s", "loadavg_1m")}
        time.sleep(3.0)  # let the save threads drain the last requests' blocks
        if "ours" in fillers:
            fillers["ours"]["saved_keys"] = int(metric_sum(
                self.stack.engines[fillers["ours"]["engine"]].metrics(),
                "vllm:mooncake_pool_save_keys_total"))
        for kind in connected:
            print(f"warming {kind} ...", flush=True)
            self.stack.engines[kind].reset_prefix_cache()
            self._serve(kind, pt, f"warm-{kind}")
        return fillers

    def run_rounds(self, reference: ReferenceGet) -> None:
        rng = random.Random(self.a.seed)
        turns = [c for c in self.a.cases if c != "local-warm" or "no-connector" not in
                 self.a.cases] + [REFERENCE]
        for rnd in range(self.a.rounds):
            for pt in self.a.points:
                order = rng.sample(turns, len(turns))
                for case in order:
                    load = os.getloadavg()[0]
                    others = OthersMeter()
                    others.start()
                    if case == REFERENCE:
                        m = reference.measure(REFERENCE_REPS)
                        self.reference_ms[pt.name].append(m["median_ms"])
                        self.reference_reps[pt.name].append(m["reps_ms"])
                        print(f"  {REFERENCE:<13} {pt.name:<15} round {rnd}: "
                              f"{m['median_ms']:8.2f} ms, load {load:.1f}", flush=True)
                    else:
                        self._turn(case, pt, rnd)
                    self.turns.append({"round": rnd, "point": pt.name, "case": case,
                                       "loadavg_1m": round(load, 2),
                                       "others_cores": others.stop()})

    def _turn(self, case: str, pt: LoadPoint, rnd: int) -> None:
        kind = ENGINE_OF[case]
        server = self.stack.engines[kind]
        server.reset_prefix_cache()
        names = [case]
        if kind == "none" and "local-warm" in self.a.cases:
            names = [n for n in ("no-connector", "local-warm") if n in self.a.cases or
                     n == "no-connector"]  # local-warm: the same run again, cache now warm
        for name in names:
            res = self._serve(kind, pt, f"{name}-{pt.name}-{rnd}")
            if name in self.a.cases:
                self.runs.setdefault(name, {}).setdefault(pt.name, []).append(res)
                print(f"  {name:<13} {pt.name:<15} round {rnd}: TTFT p50 "
                      f"{res['ttft_p50_ms']:8.1f} ms p99 {res['ttft_p99_ms']:8.1f} ms, "
                      f"store hit tokens {res['store_hit_tokens']}, load "
                      f"{res['loadavg_1m'][0]:.1f}", flush=True)


def format_report(result: dict[str, Any]) -> str:
    mark = {True: "MET     ", False: "MISSED  ", None: "UNRESOLV"}
    lines = [f"{'case':<13} {'load point':<15} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
             f"{'ITL p99':>8} {'req/s':>6} {'store tok':>9} {'local tok':>9} {'rounds':>6}"]
    for case, pts in result["summary"].items():
        for pt, s in pts.items():
            lines.append(f"{case:<13} {pt:<15} {s['ttft_p50_ms']:>9.1f} {s['ttft_p99_ms']:>9.1f} "
                         f"{s['itl_p50_ms']:>8.2f} {s['itl_p99_ms']:>8.2f} "
                         f"{s['request_throughput']:>6.2f} {s['store_hit_tokens']:>9.0f} "
                         f"{s['local_hit_tokens']:>9.0f} {s['rounds']:>6}")
    lines += ["", format_breakdown(result)]
    ref = result["reference"]
    lines += ["", f"Reference get of one request's prefix ({ref['blocks']} blocks, "
                  f"{ref['bytes'] / 2**20:.1f} MiB), median per round: {ref['per_round_ms']} ms"]
    lines += ["", "Comparisons (median of per-round paired values [95 % interval]):"]
    for t in result["targets"]:
        for pt, v in t["points"].items():
            tag = mark[v["met"]] if t["bound"] is not None else "        "
            lines.append(f"  [{tag}] {t['target']}: {pt} {v['median']:.2f} "
                         f"[{v['interval'][0]:.2f}, {v['interval'][1]:.2f}] {v['reason']}")
    m = result["meta"]
    lines += ["", f"load average: max {m['host']['loadavg_max']:.1f} on {m['host']['cpus']} "
                  f"CPUs; other processes used up to {m['host']['others_cores_max']:.2f} cores "
                  "in a turn" + (" -- NOISY run: re-record on a quiet machine" if m["noisy"]
                                 else "")]
    return "\n".join(lines)


def format_breakdown(result: dict[str, Any]) -> str:
    rows = breakdown_rows(result["summary"])
    widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(["TTFT added by the store, mean ms per request that loaded (engine "
                      "histograms):", *lines])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = list(next(iter(result["summary"].values())))
    fig, axes = plt.subplots(1, len(points), figsize=(max(8, 6.5 * len(points)), 4.6),
                             squeeze=False)
    for ax, pt in zip(axes[0], points, strict=True):
        cases = [c for c in result["runs"] if pt in result["runs"][c]["points"]]
        data = [[t for r in result["runs"][c]["points"][pt] for t in r["ttfts_ms"]]
                for c in cases]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(cases) + 1), cases, rotation=20)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (ms, log scale)")
        ax.set_title(f"{pt}: TTFT per request, all rounds")
        ax.grid(axis="y", alpha=0.3)
    m = result["meta"]
    fig.suptitle(f"vllm bench serve, prefix_repetition {m['workload']['prefix_len']}+"
                 f"{m['workload']['suffix_len']} tokens, {m['model']['layers']}x"
                 f"{m['model']['hidden']} Llama, {m['host']['cpus']} CPUs, cases interleaved",
                 fontsize=10)
    save_figure(fig, path, 90)


@contextlib.contextmanager
def reference_get(stack: Stack, workload: Workload, kv_bytes: int) -> Iterator[ReferenceGet]:
    ref = ReferenceGet(stack.master, workload.hit_blocks, kv_bytes)
    try:
        yield ref
    finally:
        ref.close()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    model_dir = a.model_dir / f"llama-{a.layers}x{a.hidden}"
    model = str(make_tiny_llama(model_dir, layers=a.layers, hidden=a.hidden))
    workload = Workload(a.prompts, a.prefix_len, a.suffix_len, a.output_len)
    env = {"GLOG_minloglevel": "1", **({} if a.mooncake_tcp_defaults else TCP_QUEUE_ENV)}
    kv_bytes = a.layers * 2 * BLOCK_SIZE * 2 * (a.hidden // 4) * 2
    per_format = a.prompts * ((a.prefix_len + a.suffix_len) // BLOCK_SIZE + 1) * kv_bytes
    segment = f"{max(1, -(-(2 * per_format + 2**28) // 2**30))}GB"  # both formats, reference
    cpus = os.cpu_count() or 1
    result: dict[str, Any] = {"meta": {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": "quick" if a.quick else "full",
        "commit": git_commit(), "client": "vllm bench serve (in process)",
        "command": "python -m bench.serve " + " ".join(argv if argv is not None
                                                       else sys.argv[1:]),
        "host": {"cpus": cpus, "loadavg_start": list(os.getloadavg())},
        "model": {"layers": a.layers, "hidden": a.hidden, "heads": 4, "kv_heads": 2,
                  "kv_bytes_per_block": kv_bytes, "block_tokens": BLOCK_SIZE,
                  "dtype": "bfloat16 (no output-equality check here)"},
        "workload": {"dataset": "prefix_repetition", "prompts": a.prompts,
                     "prefix_len": a.prefix_len, "suffix_len": a.suffix_len,
                     "output_len": a.output_len, "distinct_prefixes": a.prompts, "seed": 0},
        "load_points": [vars(p) for p in a.points], "rounds": a.rounds, "cases": a.cases,
        "max_num_seqs": a.max_num_seqs,
        "order_seed": a.seed,
        "mooncake_env": {} if a.mooncake_tcp_defaults else TCP_QUEUE_ENV,
        "store_segment": segment,
        "method": "every engine up for the whole run; the first engine of each key format "
                  "fills the store, every connector engine serves the workload once more "
                  "unmeasured; then per round and load point the cases (and a reference get "
                  "of one request's prefix) run in a fresh random order, each after POST "
                  "/reset_prefix_cache; local-warm is the no-connector engine serving the same "
                  "run again right after its cold run"}}
    stack = Stack(model, work, env, segment,
                  ("--max-num-seqs", str(a.max_num_seqs)) if a.max_num_seqs else ())
    bench = Bench(a, stack, workload)
    try:
        result["engine_start_s"] = bench.start_engines()
        result["fillers"] = bench.fill_and_warm()
        with reference_get(stack, workload, kv_bytes) as ref:
            bench.run_rounds(ref)
    finally:
        stack.close()
    result["reference"] = {"blocks": workload.hit_blocks, "bytes": workload.hit_blocks * kv_bytes,
                           "call": "batch_get_into, one call, registered contiguous buffer",
                           "per_round_ms": bench.reference_ms,  # by load point
                           "reps_ms": bench.reference_reps}
    result["runs"] = {c: {"engine": ENGINE_OF[c], "points": bench.runs[c]}
                      for c in a.cases if c in bench.runs}
    result["summary"] = {c: {pt: summarize(v) for pt, v in r["points"].items()}
                         for c, r in result["runs"].items()}
    result["targets"] = evaluate(result)
    loads = [t["loadavg_1m"] for t in bench.turns]
    result["turns"] = bench.turns
    result["meta"]["host"] |= {"loadavg_end": list(os.getloadavg()), "loadavg_max": max(loads),
                               "others_cores_max": max(t["others_cores"] for t in bench.turns)}
    result["meta"]["noisy"] = not quiet([t["others_cores"] for t in bench.turns])
    result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(format_report(result))
    if a.png:
        plot(result, a.png)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
