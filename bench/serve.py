"""End-to-end serving benchmark: real `vllm serve` engines driven by `vllm bench serve`, the
client vLLM ships, on a prefix-heavy workload, with and without the store.

    python -m bench.serve --json docs/serve.json --png docs/serve-ttft.png   # full run
    python -m bench.serve --quick --json /tmp/serve.json                     # smoke run

Workload: vLLM's `prefix_repetition` dataset (no download), one distinct prefix per request,
the same seed on every engine, so every engine sees the same prompts: the documents a fleet
shares. Cross-engine reuse is the case measured: a *filler* engine serves the workload once and
saves it to a Mooncake store node; then a *fresh* engine (never saw the prompts) serves it,
its prefixes coming from the store. Cases, side by side in one run:

1. `no-connector`: no KV connector, local prefix cache cold (reset before each round);
2. `in-tree`: vLLM's in-tree `MooncakeStoreConnector` (4 receive threads), loaded through
   `bench.intree_cpu` (a host event for its save path; the rest unchanged);
3. `ours-1t`, 4. `ours-4t`, 5. `ours-auto`: this connector with 1, 4 and `auto` receive threads;
6. `local-warm`: the no-connector engine serving the workload a second time, its local prefix
   cache warm: the limit of reuse.

Each case runs `rounds` times per load point (one concurrency level that keeps the engine
busy, one Poisson request rate); before each round the engine's local prefix cache is reset,
so store cases read the store again and `no-connector` recomputes. TTFT, ITL and request
throughput are the client's numbers; prompt tokens from the store are the engine's own
counters on /metrics. The box is shared, so every run records the load average, and the
report gives the median over rounds with the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.run import TCP_QUEUE_ENV, git_commit
from bench.tune import save_figure
from devkit.local_cluster import MooncakeMaster, StoreNode
from devkit.tiny_model import make_tiny_llama
from devkit.vllm_server import (
    BLOCK_SIZE,
    SERVING_DTYPE,
    VllmServer,
    connector_kv_config,
    metric_sum,
)

ENGINE_START_S = 300.0
CASES = ("no-connector", "in-tree", "ours-1t", "ours-4t", "ours-auto", "local-warm")
# Engine counters read before and after each run (summed over label sets).
COUNTERS = {"store_hit_tokens": "vllm:external_prefix_cache_hits_total",
            "store_queried_tokens": "vllm:external_prefix_cache_queries_total",
            "local_hit_tokens": "vllm:prefix_cache_hits_total",
            "prompt_tokens": "vllm:prompt_tokens_total"}


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
                   help="smoke run: no-connector, ours-4t and local-warm, one load point, one "
                        "round, a smaller model (three engine starts: minutes)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--png", type=Path, help="plot the TTFT distribution per case here")
    p.add_argument("--cases", help=f"comma list out of {','.join(CASES)}")
    p.add_argument("--rounds", type=int, help="rounds per case and load point (full 3, quick 1)")
    p.add_argument("--prompts", type=int, help="requests per run (full 32, quick 8)")
    p.add_argument("--prefix-len", type=int, help="shared-prefix tokens (full 960, quick 448)")
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8,
                   help="max concurrency of the busy load point")
    p.add_argument("--rate", default="2", help="requests/s of the Poisson load point")
    p.add_argument("--layers", type=int, help="model layers (full 8, quick 4)")
    p.add_argument("--hidden", type=int, help="model hidden size (full 1024, quick 512)")
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "mcpool-bench")
    p.add_argument("--mooncake-tcp-defaults", action="store_true",
                   help="do not raise Mooncake's per-peer TCP queue limits")
    a = p.parse_args(argv)
    q = a.quick
    a.cases = [c.strip() for c in a.cases.split(",")] if a.cases else \
        (["no-connector", "ours-4t", "local-warm"] if q else list(CASES))
    unknown = set(a.cases) - set(CASES)
    if unknown:
        p.error(f"--cases: unknown {sorted(unknown)}; choose from {','.join(CASES)}")
    a.rounds = a.rounds or (1 if q else 3)
    a.prompts = a.prompts or (8 if q else 32)
    a.prefix_len = a.prefix_len or (448 if q else 960)
    a.layers = a.layers or (4 if q else 8)
    a.hidden = a.hidden or (512 if q else 1024)
    a.points = [LoadPoint(f"concurrency-{a.concurrency}", "inf", a.concurrency)]
    if not q:
        a.points.append(LoadPoint(f"rate-{a.rate}", a.rate, a.prompts))
    return a


class Stack:
    """Mooncake master + store node, and engines started on demand against them."""

    def __init__(self, model: str, work: Path, env: dict[str, str], segment: str) -> None:
        self.model, self.work, self.env = model, work, env
        self.master = MooncakeMaster().start()
        self.node = StoreNode(self.master, segment_size=segment).start()
        self.intree_cfg = self.master.write_config_file(
            work / "mooncake-intree.json", global_segment_size=0, local_buffer_size="64MB",
            mode="standalone-store")

    def close(self) -> None:
        self.node.stop()
        self.master.stop()

    def server(self, kind: str, name: str) -> VllmServer:
        """kind: none | in-tree | ours-<threads>."""
        env = dict(self.env)
        kv = None
        if kind == "in-tree":
            kv = {"kv_connector": "CpuMooncakeStoreConnector",
                  "kv_connector_module_path": "bench.intree_cpu", "kv_role": "kv_both",
                  "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"load_async": True}}
            env.update(MOONCAKE_CONFIG_PATH=self.intree_cfg, VLLM_MOONCAKE_LOAD_RECV_THREADS="4")
        elif kind.startswith("ours-"):
            threads = kind.removeprefix("ours-")
            kv = connector_kv_config(self.master.store_config(
                global_segment_size=0, local_buffer_size="64MB", cache_prefix="serve",
                load_threads=threads if threads == "auto" else int(threads)))
        # bfloat16 as served in production: this benchmark times engines, it compares no
        # outputs (docs/serve.json was recorded so).
        return VllmServer(self.model, kv, env=env, log_path=str(self.work / f"vllm-{name}.log"),
                          dtype=SERVING_DTYPE)

    @contextmanager
    def engine(self, kind: str, name: str) -> Iterator[VllmServer]:
        server = self.server(kind, name)
        t0 = time.perf_counter()
        server.start(timeout=ENGINE_START_S)
        server.start_s = round(time.perf_counter() - t0, 1)  # type: ignore[attr-defined]
        try:
            # One unrelated prompt first: allocation, first forward, store connections.
            server.complete(list(range(5, 5 + 3 * BLOCK_SIZE + 1)), max_tokens=2)
            yield server
        finally:
            server.stop()


def bench_serve(server: VllmServer, workload: Workload, point: LoadPoint, out: Path
                ) -> dict[str, Any]:
    """One `vllm bench serve` run; the client's result JSON plus engine counter deltas."""
    before = server.metrics()
    load0 = os.getloadavg()[0]
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "openai",
           "--base-url", server.url, "--endpoint", "/v1/completions", "--model", server.model,
           "--tokenizer", server.model, *workload.args(), *point.args(),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--disable-tqdm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    time.sleep(1.5)  # one more stats interval reaches /metrics
    after = server.metrics()
    r = json.loads(out.read_text())
    counters = {k: metric_sum(after, m) - metric_sum(before, m) for k, m in COUNTERS.items()}
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
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


def run_case(stack: Stack, case: str, kind: str, workload: Workload,
             points: Sequence[LoadPoint], rounds: int, out: Path) -> dict[str, dict[str, Any]]:
    """All rounds of a case on one engine; `no-connector` also yields `local-warm` runs."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with stack.engine(kind, case) as server:
        for rnd in range(rounds):
            for pt in points:
                server.reset_prefix_cache()
                names = ["no-connector", "local-warm"] if case == "no-connector" else [case]
                for name in names:  # local-warm: the same run again, local cache now warm
                    res = bench_serve(server, workload, pt, out / f"{name}-{pt.name}-{rnd}.json")
                    runs.setdefault(name, {}).setdefault(pt.name, []).append(res)
                    print(f"  {name:<13} {pt.name:<15} round {rnd}: TTFT p50 "
                          f"{res['ttft_p50_ms']:8.1f} ms p99 {res['ttft_p99_ms']:8.1f} ms, "
                          f"store hit tokens {res['store_hit_tokens']}, load "
                          f"{res['loadavg_1m'][0]:.1f}", flush=True)
        start_s = server.start_s  # type: ignore[attr-defined]
    return {name: {"engine_start_s": start_s, "points": pts} for name, pts in runs.items()}


def fill(stack: Stack, kind: str, workload: Workload, point: LoadPoint, out: Path
         ) -> dict[str, Any]:
    """A filler engine serves the workload once, saving it to the store."""
    with stack.engine(kind, f"filler-{kind}") as server:
        res = bench_serve(server, workload, point, out / f"filler-{kind}.json")
        time.sleep(3.0)  # let the save thread drain the last requests' blocks
        saved = server.metrics()
    res.pop("ttfts_ms")
    res["saved_keys"] = int(metric_sum(saved, "vllm:mooncake_pool_save_keys_total"))
    return res


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of each per-run statistic, with its spread."""
    out: dict[str, Any] = {"rounds": len(runs)}
    for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "request_throughput",
              "store_hit_tokens", "local_hit_tokens", "prompt_tokens", "loadavg_1m"):
        vals = [r[k][0] if k == "loadavg_1m" else r[k] for r in runs]
        out[k] = round(statistics.median(vals), 3)
        out[k + "_range"] = [round(min(vals), 3), round(max(vals), 3)]
    out["failed"] = sum(r["failed"] for r in runs)
    return out


def evaluate(summary: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's serving targets per load point; `met` None where a case is missing."""
    targets = []

    def add(name: str, measured: dict[str, Any], met: bool | None) -> None:
        targets.append({"target": name, "measured": measured, "met": met})

    def ratios(a: str, b: str, stat: str) -> dict[str, float] | None:
        if a not in summary or b not in summary:
            return None
        return {pt: round(summary[a][pt][stat] / summary[b][pt][stat], 3)
                for pt in summary[a] if pt in summary[b] and summary[b][pt][stat]}

    def check(name: str, a: str, b: str, stat: str, bound: float) -> None:
        r = ratios(a, b, stat)
        add(name, r or {}, None if not r else all(v <= bound for v in r.values()))

    check("ours-4t TTFT p50 <= 0.5x no-connector", "ours-4t", "no-connector", "ttft_p50_ms",
          0.5)
    check("store TTFT p50 (ours-4t) within 1.5x of a local prefix-cache hit (local-warm)",
          "ours-4t", "local-warm", "ttft_p50_ms", 1.5)
    check("ours-4t TTFT p99 no worse than in-tree (4 threads) by more than 5 %", "ours-4t",
          "in-tree", "ttft_p99_ms", 1.05)
    fixed = [c for c in ("ours-1t", "ours-4t") if c in summary]
    if "ours-auto" in summary and fixed:
        best = {pt: min(summary[c][pt]["ttft_p50_ms"] for c in fixed)
                for pt in summary["ours-auto"]}
        r = {pt: round(summary["ours-auto"][pt]["ttft_p50_ms"] / best[pt], 3) for pt in best}
        add("ours-auto TTFT p50 within 10 % of the best fixed setting (1t, 4t)", r,
            all(v <= 1.10 for v in r.values()))
    else:
        add("ours-auto TTFT p50 within 10 % of the best fixed setting (1t, 4t)", {}, None)
    return targets


def format_report(result: dict[str, Any]) -> str:
    mark = {True: "MET   ", False: "MISSED", None: "n/a   "}
    lines = [f"{'case':<13} {'load point':<15} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
             f"{'ITL p99':>8} {'req/s':>6} {'store tok':>9} {'local tok':>9} {'rounds':>6}"]
    for case, pts in result["summary"].items():
        for pt, s in pts.items():
            lines.append(f"{case:<13} {pt:<15} {s['ttft_p50_ms']:>9.1f} {s['ttft_p99_ms']:>9.1f} "
                         f"{s['itl_p50_ms']:>8.2f} {s['itl_p99_ms']:>8.2f} "
                         f"{s['request_throughput']:>6.2f} {s['store_hit_tokens']:>9.0f} "
                         f"{s['local_hit_tokens']:>9.0f} {s['rounds']:>6}")
    lines += ["", "Targets:"] + [f"  [{mark[t['met']]}] {t['target']}: {t['measured']}"
                                 for t in result["targets"]]
    return "\n".join(lines)


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
                 f"{m['model']['hidden']} Llama, {m['host']['cpus']} CPUs (shared)", fontsize=10)
    save_figure(fig, path, 90)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    model_dir = a.model_dir / f"llama-{a.layers}x{a.hidden}"
    model = str(make_tiny_llama(model_dir, layers=a.layers, hidden=a.hidden))
    workload = Workload(a.prompts, a.prefix_len, a.suffix_len, a.output_len)
    env = {"GLOG_minloglevel": "1", **({} if a.mooncake_tcp_defaults else TCP_QUEUE_ENV)}
    kinds = {"no-connector": "none", "local-warm": "none", "in-tree": "in-tree",
             "ours-1t": "ours-1", "ours-4t": "ours-4", "ours-auto": "ours-auto"}
    kv_bytes = a.layers * 2 * BLOCK_SIZE * 2 * (a.hidden // 4) * 2
    per_format = a.prompts * ((a.prefix_len + a.suffix_len) // BLOCK_SIZE + 1) * kv_bytes
    segment = f"{max(1, -(-2 * per_format // 2**30))}GB"  # both key formats
    result: dict[str, Any] = {"meta": {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": "quick" if a.quick else "full",
        "commit": git_commit(), "client": "vllm bench serve",
        "host": {"cpus": os.cpu_count(), "loadavg_start": list(os.getloadavg())},
        "model": {"layers": a.layers, "hidden": a.hidden, "heads": 4, "kv_heads": 2,
                  "kv_bytes_per_block": kv_bytes, "block_tokens": BLOCK_SIZE},
        "workload": {"dataset": "prefix_repetition", "prompts": a.prompts,
                     "prefix_len": a.prefix_len, "suffix_len": a.suffix_len,
                     "output_len": a.output_len, "distinct_prefixes": a.prompts, "seed": 0},
        "load_points": [vars(p) for p in a.points], "rounds": a.rounds, "cases": a.cases,
        "mooncake_env": {} if a.mooncake_tcp_defaults else TCP_QUEUE_ENV,
        "store_segment": segment,
        "method": "filler engine serves the workload once per key format (ours, in-tree) and "
                  "is stopped; each case then runs on a fresh engine; every round starts with "
                  "POST /reset_prefix_cache; local-warm is the no-connector engine serving the "
                  "same run again right after its cold run"}}
    stack = Stack(model, work, env, segment)
    runs: dict[str, Any] = {}
    try:
        fillers = {}
        if any(kinds[c].startswith("ours") for c in a.cases):
            print("filling the store (ours) ...", flush=True)
            fillers["ours"] = fill(stack, "ours-4", workload, a.points[0], work)
        if "in-tree" in a.cases:
            print("filling the store (in-tree) ...", flush=True)
            fillers["in-tree"] = fill(stack, "in-tree", workload, a.points[0], work)
        result["fillers"] = fillers
        for case in a.cases:
            if case == "local-warm" or case in runs:
                continue
            print(f"case {case} ...", flush=True)
            runs.update(run_case(stack, case, kinds[case], workload, a.points, a.rounds, work))
    finally:
        stack.close()
    result["runs"] = {c: runs[c] for c in a.cases if c in runs}
    result["summary"] = {c: {pt: summarize(v) for pt, v in r["points"].items()}
                         for c, r in result["runs"].items()}
    result["targets"] = evaluate(result["summary"])
    result["meta"]["host"]["loadavg_end"] = list(os.getloadavg())
    result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    text = format_report(result)
    print(text)
    if a.png:
        plot(result, a.png)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
