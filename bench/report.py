"""Turn measurements into the printed tables, the JSON rows and the target verdicts."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from bench.sweep import Cell, group_by

PHASES = ("queue_wait", "prepare", "master_lookup", "transfer")


QUIET_MEDIAN, QUIET_MAX = 0.1, 0.5  # cores other processes may use while a run is recorded


def quiet(others: Sequence[float]) -> bool:
    """A recorded run is quiet when processes outside its tree used few cores per turn (the
    median at most QUIET_MEDIAN, none over QUIET_MAX). Not the load average: on 2 cores a
    benchmark's own engines push it past the core count."""
    return statistics.median(others) <= QUIET_MEDIAN and max(others) <= QUIET_MAX


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


def build_rows(cells: Sequence[Cell], ceiling_gbps: float, mb_ceiling_gbps: float,
               block_bytes: int, get_ms: dict[float, float]) -> list[dict[str, Any]]:
    """One JSON object per (rtt, workload, driver, threads), with its ratios."""
    groups = group_by(cells)
    rows = []
    for (rtt, wname, kind), by_t in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        base = by_t.get(1) or by_t[min(by_t)]
        intree = groups.get((rtt, wname, "in-tree"), {})
        multibuf = groups.get((rtt, wname, "ours-multibuf"), {})
        for t, c in sorted(by_t.items()):
            w = c.workload
            phases = c.phases()
            shares = phases.shares() if phases is not None else {}
            service = phases.service_shares() if phases is not None else {}
            row: dict[str, Any] = {
                "workload": wname, "driver": kind, "threads": t, "master_rtt_ms": rtt,
                "measured_1key_get_ms": _r(get_ms.get(rtt), 2),
                "blocks_per_job": w.sizes[0] if len(set(w.sizes)) == 1
                else round(statistics.mean(w.sizes), 1),
                "blocks_per_job_label": w.blocks_label, "sub_job_blocks": w.split or None,
                "concurrency": w.concurrency, "block_bytes": block_bytes,
                "gbps": _r(c.gbps, 4), "gbps_reps": [_r(r.gbps, 4) for r in c.runs],
                "p50_ms": _r(c.latency_ms(50), 2), "p99_ms": _r(c.latency_ms(99), 2),
                "ratio_to_1_thread": _r(c.gbps / base.gbps if base.gbps else None),
                "ratio_to_ceiling": _r(c.gbps / ceiling_gbps if ceiling_gbps else None),
                "ratio_to_multibuffer_ceiling":
                    _r(c.gbps / mb_ceiling_gbps if mb_ceiling_gbps else None),
                "requests": sum(r.requests for r in c.runs),
                "error_blocks": sum(r.error_blocks for r in c.runs),
                "verified_blocks": sum(r.verified_blocks for r in c.runs),
                "time_shares": {k: _r(shares.get(k)) for k in PHASES} if shares else None,
                "service_shares": {k: _r(v) for k, v in service.items()} if service else None,
                "cpu_cores": c.cpu(),
                "attempts": sum(r.attempts for r in c.runs),
                "jobs_per_thread": [phases.jobs_per_thread.get(str(i), 0) for i in range(t)]
                if phases is not None else None,
            }
            if kind != "in-tree" and t in intree and intree[t].gbps:
                pairs = [a.gbps / b.gbps for a, b in zip(c.runs, intree[t].runs, strict=False)
                         if b.gbps]
                row["ratio_to_intree"] = _r(statistics.median(pairs))
                row["ratio_to_intree_reps"] = [_r(x) for x in pairs]
            if kind == "ours" and t in multibuf and multibuf[t].gbps:
                row["ratio_to_multibuf"] = _r(c.gbps / multibuf[t].gbps)
            rows.append(row)
    return rows


def _pct(x: float | None) -> str:
    return "  -  " if x is None else f"{x * 100:4.0f}%"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(rows: Sequence[dict[str, Any]], ceiling: dict[str, Any]) -> str:
    c, m = ceiling["batch_get_into"], ceiling["multi_buffers"]
    out = [
        f"Reference get (one thread, sequential, measured once before the sweep; not a "
        f"ceiling): batch_get_into, {ceiling['keys']} x {ceiling['block_bytes'] // 1024} KiB "
        f"blocks in calls of {c['best_keys_per_call']} keys, contiguous prepared buffer, master "
        f"direct: {c['gbps']:.3f} GB/s (reps {', '.join(f'{x:.3f}' for x in c['gbps_reps'])})",
        f"Same-layout raw: batch_get_into_multi_buffers into the KV layout "
        f"({ceiling['regions_per_block']} regions/block), calls of {m['best_keys_per_call']} "
        f"keys: {m['gbps']:.3f} GB/s (reps {', '.join(f'{x:.3f}' for x in m['gbps_reps'])})",
    ]
    hdr = (f"{'workload':<22} {'driver':<7} {'T':>2} {'GB/s':>6} {'x1T':>5} {'%ref':>5} "
           f"{'vs-in-tree':>10} {'p50 ms':>8} {'p99 ms':>8} {'queue':>5} {'prep':>5} "
           f"{'lookup':>6} {'xfer':>5} {'cpu c/n/tot':>14} {'oth':>4} {'err':>4} jobs/thread")
    rtt = None
    for r in rows:
        if r["master_rtt_ms"] != rtt:
            rtt = r["master_rtt_ms"]
            where = "direct" if rtt == 0 else "through the delay proxy"
            out += ["", f"== master RTT {rtt:g} ms ({where}; measured 1-key get "
                        f"{_f(r['measured_1key_get_ms'], '.2f')} ms) ==", hdr, "-" * len(hdr)]
        q = (r["time_shares"] or {}).get("queue_wait")
        s = r["service_shares"] or {}
        cpu = r["cpu_cores"]
        cpu_s = f"{cpu.get('client', 0):.2f}/{cpu.get('store_node', 0):.2f}/" \
                f"{cpu.get('total', 0):.2f}"
        jobs = r["jobs_per_thread"]
        jobs_s = "" if not jobs or r["blocks_per_job"] < 256 else ",".join(map(str, jobs))
        out.append(
            f"{r['workload']:<22} {r['driver']:<7} {r['threads']:>2} {r['gbps']:>6.3f} "
            f"{_f(r['ratio_to_1_thread'], '5.2f'):>5} {_pct(r['ratio_to_ceiling']):>5} "
            f"{_f(r.get('ratio_to_intree'), '10.2f'):>10} {_f(r['p50_ms'], '8.1f'):>8} "
            f"{_f(r['p99_ms'], '8.1f'):>8} {_pct(q):>5} "
            f"{_pct(s.get('prepare')):>5} {_pct(s.get('master_lookup')):>6} "
            f"{_pct(s.get('transfer')):>5} {cpu_s:>14} {cpu.get('others', 0):>4.2f} "
            f"{r['error_blocks']:>4} {jobs_s}")
    return "\n".join(out)


def _order_k(n: int, level: float) -> int:
    """Largest k with P(Binomial(n, 1/2) < k+1) * 2 <= 1 - level (0 when n is too small)."""
    k = 0
    while k + 1 < n and 2 * sum(math.comb(n, i) for i in range(k + 2)) / 2**n <= 1 - level:
        k += 1
    return k


def median_interval(xs: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median: the order statistics that the sign test
    puts around it with at least `level` coverage (the whole range when n is too small)."""
    v = sorted(xs)
    n = len(v)
    k = _order_k(n, level)
    return (v[k], v[n - 1 - k]) if n else (math.nan, math.nan)


def interval_coverage(n: int, level: float = 0.95) -> float:
    """The coverage `median_interval` actually has for n values (below `level` when n is too
    small: under 6 values even the whole range covers less than 95 %)."""
    if n == 0:
        return 0.0
    k = _order_k(n, level)
    return 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def round_ratios(summary: dict[str, Any], cfg: str) -> list[float]:
    """Per-round throughput of cfg over that round's baseline (the mean of the baseline
    configurations), from a comparison summary's per-round reps."""
    configs = summary["configs"]
    names = [n for n in summary["baseline"].removesuffix(" (mean)").split(" + ") if n in configs]
    base = [statistics.mean(xs) for xs in zip(*(configs[n]["gbps_reps"] for n in names),
                                              strict=True)]
    return [x / b for x, b in zip(configs[cfg]["gbps_reps"], base, strict=True) if b]


def loss_interval(summary: dict[str, Any], cfg: str) -> tuple[float, float]:
    """95 % interval of cfg's throughput loss in percent (from the per-round ratios)."""
    lo, hi = median_interval(round_ratios(summary, cfg))
    return round((1 - hi) * 100, 1), round((1 - lo) * 100, 1)


def format_comparison(title: str, summary: dict[str, Any]) -> str:
    lines = [f"{title}: {summary['workload']}, T={summary['threads']}, master RTT "
             f"{summary['master_rtt_ms']:g} ms, {summary['rounds']} alternating rounds "
             f"(median of per-round ratios to {summary['baseline']!r}; [95 % interval of the "
             f"median loss])"]
    for cfg, v in summary["configs"].items():
        model = v.get("cpu_model_loss_pct")
        lo, hi = loss_interval(summary, cfg)
        lines.append(f"  {cfg:<12} {v['gbps_median']:.3f} GB/s  ratio {v['ratio_to_baseline']:.3f}"
                     f"  loss {v['loss_pct']:+.1f} % [{lo:+.1f}, {hi:+.1f}]"
                     + (f" (CPU model {model:+.2f} %)" if model is not None else "")
                     + f"  client CPU {v['client_cpu_s_per_gb']:.2f} s/GB  cores "
                       f"{v['cores_by_process']}  reps {v['gbps_reps']}")
    if "per_job_cpu_us" in summary:
        lines.append(f"  subscriber CPU per load job (us): {summary['per_job_cpu_us']}")
    for k in ("aa_loss_pct", "spans_exported", "spans_export_failed", "otlp_receiver"):
        if k in summary:
            lines.append(f"  {k}: {summary[k]}")
    return "\n".join(lines)


def _paired(a: dict[str, Any], b: dict[str, Any]) -> list[float]:
    return [x / y for x, y in zip(a["gbps_reps"], b["gbps_reps"], strict=False) if y]


def intree_effects(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Ours against the in-tree pool, split in two effects measured on the same cells
    (workload, RTT, threads) and paired by interleaved rep:
    - pool: ours-multibuf / in-tree, the same store call (multi-buffer) through each pool;
    - staging: ours / ours-multibuf, the same pool with and without staged transfers (which
      `staging: auto` turns on only for host-memory KV over tcp, never on GPUs or RDMA).
    Per workload: the median over all paired reps; overall: the median over cells of each
    cell's median, with its range."""
    idx = {(r["master_rtt_ms"], r["workload"], r["driver"], r["threads"]): r for r in rows}
    per_w: dict[str, dict[str, list[float]]] = {}
    cells: dict[str, list[float]] = {"pool": [], "staging": [], "total": []}
    for (rtt, w, drv, t), mb in sorted(idx.items()):
        it, ours = idx.get((rtt, w, "in-tree", t)), idx.get((rtt, w, "ours", t))
        if drv != "ours-multibuf" or it is None or ours is None:
            continue
        for name, (a, b) in {"pool": (mb, it), "staging": (ours, mb), "total": (ours, it)}.items():
            ratios = _paired(a, b)
            per_w.setdefault(w, {}).setdefault(name, []).extend(ratios)
            cells[name].append(statistics.median(ratios))
    if not cells["pool"]:
        return {}

    def stat(v: list[float]) -> dict[str, Any]:
        return {"n": len(v), "median": round(statistics.median(v), 3),
                "min": round(min(v), 3), "max": round(max(v), 3)}

    return {"cells": len(cells["pool"]), "by_cell": {k: stat(v) for k, v in cells.items()},
            "by_workload": {w: {k: {"pairs": len(v), "median": round(statistics.median(v), 3),
                                    "sign_test_p": round(sign_test(v), 4)}
                                for k, v in d.items()} for w, d in per_w.items()}}


def format_intree_effects(eff: dict[str, Any]) -> str:
    if not eff:
        return "In-tree comparison: needs ours, ours-multibuf and in-tree rows"
    lines = [f"In-tree comparison split in two effects ({eff['cells']} cells, paired reps; "
             f"pool = ours-multibuf/in-tree, staging = ours/ours-multibuf, total = ours/in-tree)"]
    for w, d in eff["by_workload"].items():
        lines.append(f"  {w:<20} " + "  ".join(
            f"{k} {v['median']:.2f}x (p {v['sign_test_p']:.3f})" for k, v in d.items()))
    lines.append("  median over cells     " + "  ".join(
        f"{k} {v['median']:.2f}x [{v['min']:.2f}-{v['max']:.2f}]"
        for k, v in eff["by_cell"].items()))
    return "\n".join(lines)


def format_ttft(ttft: dict[str, Any]) -> str:
    if "skipped" in ttft:
        return f"Engine TTFT: skipped ({ttft['skipped']})"
    m = ttft["model"]
    lines = [f"Engine TTFT: llama {m['layers']} layers x hidden {m['hidden']} "
             f"(head {m['head_size']}), {ttft['prompts']} prompts of "
             f"{ttft['prompt_tokens']} tokens "
             f"({ttft['hit_blocks_per_prompt']} blocks from the store on a hit, "
             f"{m['kv_bytes_per_block'] // 1024} KiB each)"]
    for r in ttft["by_threads"]:
        lines.append(f"  T={r['threads']}: recompute p50 {r['recompute_p50_ms']:.0f} ms, store hit "
                     f"p50 {r['hit_p50_ms']:.0f} ms -> {r['hit_over_recompute']:.2f}x "
                     f"(outputs match: {r['outputs_match']}; host-cached prompt tokens "
                     f"{r['host_cached_prompt_tokens']:.0f})")
    return "\n".join(lines)


def sign_test(ratios: Sequence[float]) -> float:
    """Two-sided sign test of 'ratio differs from 1' (ties dropped)."""
    lo = sum(x < 1 for x in ratios)
    hi = sum(x > 1 for x in ratios)
    n, k = lo + hi, min(lo, hi)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def _row(rows: Sequence[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def evaluate_targets(rows: Sequence[dict[str, Any]], overhead: dict[str, Any] | None,
                     ttft: dict[str, Any] | None, single_region: Sequence[dict[str, Any]] = (),
                     auto: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The issue's targets as measured ratios; `met` is None where there is no measurement."""
    out: list[dict[str, Any]] = []

    def add(name: str, measured: Any, met: bool | None, note: str = "") -> None:
        out.append({"target": name, "measured": measured, "met": met, "note": note})

    r5 = _row(rows, workload="4-block", driver="ours", threads=4, master_rtt_ms=5.0)
    add("4-block jobs, 5 ms RTT: 4 threads >= 3x 1 thread (ours)",
        r5 and r5["ratio_to_1_thread"], None if r5 is None else r5["ratio_to_1_thread"] >= 3)
    r1 = _row(rows, workload="4-block", driver="ours", threads=4, master_rtt_ms=1.0)
    add("4-block jobs, 1 ms RTT: report 4T/1T ratio and CPU (ours)",
        r1 and {"ratio_4t_1t": r1["ratio_to_1_thread"], "cpu_cores": r1["cpu_cores"]}, None,
        "report only")
    for label, rs in (("KV layout of the sweep", rows), ("one region per block", single_region)):
        zero = [r for r in rs if r["driver"] == "ours" and r["master_rtt_ms"] == 0]
        if not zero:
            continue
        best = max(zero, key=lambda r: r["ratio_to_ceiling"] or 0)
        add(f"no added delay: connector load path >= 70 % of the single-thread reference get "
            f"({label}, "
            f"{best['layout']})",
            {"best": best["ratio_to_ceiling"], "workload": best["workload"],
             "threads": best["threads"], "gbps": best["gbps"],
             "vs_same_layout_raw": best["ratio_to_multibuffer_ceiling"]},
            best["ratio_to_ceiling"] >= 0.7)
    by_w: dict[str, list[float]] = {}
    for r in rows:
        if r["driver"] == "ours":
            by_w.setdefault(r["workload"], []).extend(r.get("ratio_to_intree_reps") or [])
    if any(by_w.values()):
        verdicts = {w: {"pairs": len(v), "median": round(statistics.median(v), 3),
                        "ours_slower": sum(x < 1 for x in v), "sign_test_p": round(sign_test(v), 4)}
                    for w, v in by_w.items() if v}
        slower = [w for w, v in verdicts.items() if v["median"] < 1 and v["sign_test_p"] < 0.05]
        add("at least as fast as the in-tree pool on every workload", verdicts, not slower,
            "paired repetitions (same workload, RTT and thread count, run back to back) pooled "
            "per workload; missed only where ours is slower with sign-test p < 0.05")
    if overhead:
        cfgs = overhead["configs"]
        loss = cfgs["trace_1.0"]["loss_pct"]
        lo, hi = loss_interval(overhead, "trace_1.0")
        add("instrumentation (metrics + tracing at 1.0) costs <= 2 % throughput",
            {"measured_loss_pct": loss, "interval_95": [lo, hi],
             "aa_loss_pct": overhead.get("aa_loss_pct"),
             "cpu_model_loss_pct": cfgs["trace_1.0"].get("cpu_model_loss_pct")},
            False if loss > 2.0 else (True if hi <= 2.0 else None),
            "measured: median per-round loss against off + off_again, with a 95 % interval; "
            "met if the interval's upper end is <= 2 %, missed if the median loss is > 2 %, "
            "unresolved otherwise")
    if ttft and "by_threads" in ttft:
        worst = max(r["hit_over_recompute"] for r in ttft["by_threads"])
        add("store-hit TTFT <= 0.5x recompute",
            {str(r["threads"]): r["hit_over_recompute"] for r in ttft["by_threads"]},
            worst <= 0.5)
    if auto:
        add("load_threads auto within 10 % of the best fixed setting",
            {f"{r['workload']} RTT {r['master_rtt_ms']:g} ms": r["auto_over_best_fixed"]
             for r in auto}, all(r["auto_over_best_fixed"] >= 0.9 for r in auto))
    return out


def format_targets(targets: Sequence[dict[str, Any]]) -> str:
    mark = {True: "MET   ", False: "MISSED", None: "INFO  "}
    return "\n".join(["Targets:"] + [f"  [{mark[t['met']]}] {t['target']}: {t['measured']}"
                                     for t in targets])


def long_request_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole long requests vs the same requests split into sub-jobs, per driver/RTT/threads."""
    out = []
    for r in rows:
        if not r["sub_job_blocks"]:
            continue
        whole = _row(rows, workload=r["workload"].split("/")[0], driver=r["driver"],
                     threads=r["threads"], master_rtt_ms=r["master_rtt_ms"])
        if whole is None or not whole["p50_ms"]:
            continue
        out.append({"driver": r["driver"], "master_rtt_ms": r["master_rtt_ms"],
                    "threads": r["threads"], "blocks": r["blocks_per_job"],
                    "sub_job_blocks": r["sub_job_blocks"],
                    "whole_p50_ms": whole["p50_ms"], "split_p50_ms": r["p50_ms"],
                    "whole_gbps": whole["gbps"], "split_gbps": r["gbps"],
                    "speedup": _r(whole["p50_ms"] / r["p50_ms"]) if r["p50_ms"] else None,
                    "whole_jobs_per_thread": whole["jobs_per_thread"],
                    "split_jobs_per_thread": r["jobs_per_thread"]})
    return out


def format_long(summary: Sequence[dict[str, Any]]) -> str:
    lines = ["Long requests, one at a time: whole vs split into parts (ours: the connector's "
             "load_split_blocks; in-tree: sub-jobs built by the benchmark)"]
    for s in summary:
        lines.append(f"  {s['driver']:<7} RTT {s['master_rtt_ms']:g} ms T={s['threads']}: "
                     f"{s['blocks']} blocks whole p50 {s['whole_p50_ms']:.0f} ms "
                     f"({s['whole_gbps']:.3f} GB/s) vs {s['sub_job_blocks']}-block sub-jobs "
                     f"{s['split_p50_ms']:.0f} ms ({s['split_gbps']:.3f} GB/s): "
                     f"{s['speedup']}x")
    return "\n".join(lines)
