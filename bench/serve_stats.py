"""The serving benchmark's arithmetic, over the JSON's runs (so `bench.claims` re-judges a
committed run by the current rules):

- comparisons between cases as the median of per-round paired values, with a distribution-free
  95 % interval (`bench.report.median_interval`); a target is met only when the whole interval
  is on its side, missed when the median is not, and otherwise not resolved;
- the store-hit gap: per round and load point, (store-hit TTFT p50 - local-hit TTFT p50)
  over the reference get of one request's prefix bytes measured in that round's order;
- the TTFT breakdown: the engine's `ttft_store_*` histograms (sums and counts) over a run, as
  the mean milliseconds per request that loaded from the store, by phase and by mode.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from bench.report import interval_coverage, median_interval
from connector.observability.metric_catalog import PREFIX, TTFT_MODES, TTFT_PHASES

LEVEL = 0.95
FIXED = ("ours-1t", "ours-4t")  # the fixed thread counts ours-auto is judged against
BEST_FIXED = "best fixed"
PHASE_SERIES = PREFIX + "ttft_store_phase_seconds"
TOTAL_SERIES = PREFIX + "ttft_store_seconds"


@dataclass(frozen=True)
class Comparison:
    """Case `a` against case `b` on a per-run statistic. kind "ratio": a / b; "gap":
    (a - b) / the round's reference get time. `bound`: the target (the value must be at most
    this), or None for a comparison reported without a target."""

    name: str
    a: str
    b: str
    stat: str = "ttft_p50_ms"
    kind: str = "ratio"
    bound: float | None = None
    at: str = ""  # judged only at the load points whose name starts with this


COMPARISONS = (
    Comparison("ours-4t TTFT p50 <= 0.5x no-connector", "ours-4t", "no-connector", bound=0.5),
    Comparison("store-hit TTFT p50 gap (ours-4t - local-warm) <= 1.5x the reference get of "
               "one request's prefix", "ours-4t", "local-warm", kind="gap", bound=1.5),
    Comparison("store hit vs local hit TTFT p50 (ours-4t / local-warm)", "ours-4t",
               "local-warm"),
    Comparison("store-hit TTFT p50 gap with every load asynchronous (ours-4t-async - "
               "local-warm) / reference get", "ours-4t-async", "local-warm", kind="gap"),
    Comparison("in-step and early loads: ours-4t / ours-4t-async TTFT p50", "ours-4t",
               "ours-4t-async"),
    Comparison("in-step and early loads: ours-4t / ours-4t-async TTFT p99", "ours-4t",
               "ours-4t-async", "ttft_p99_ms"),
    Comparison("ours-4t / in-tree (4 threads) TTFT p50", "ours-4t", "in-tree"),
    Comparison("ours-4t TTFT p99 no worse than in-tree (4 threads) by more than 5 %",
               "ours-4t", "in-tree", "ttft_p99_ms", bound=1.05),
    Comparison("4 threads vs 1: ours-4t / ours-1t TTFT p50", "ours-4t", "ours-1t"),
    Comparison("ours-auto TTFT p50 within 10 % of the best fixed setting (1t, 4t)",
               "ours-auto", BEST_FIXED, bound=1.10),
    Comparison("look-ahead lookups and preloads where requests queue: ours-4t TTFT p50 <= 0.8x "
               "ours-4t-noahead", "ours-4t", "ours-4t-noahead", bound=0.8, at="queued"),
    Comparison("look-ahead lookups and preloads where requests queue: ours-4t / "
               "ours-4t-noahead TTFT p99", "ours-4t", "ours-4t-noahead", "ttft_p99_ms",
               at="queued"),
    Comparison("look-ahead lookups and preloads where requests do not queue: ours-4t TTFT p50 "
               "no worse than ours-4t-noahead by more than 5 %", "ours-4t", "ours-4t-noahead",
               bound=1.05, at="unqueued"),
)


def breakdown_of(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Sums (s) and counts of the ttft_store histograms over one run, from /metrics samples
    taken before and after it (each series summed over its other labels)."""
    def delta(series: str, label: str, value: str) -> list[float]:
        def total(samples: dict[str, float], suffix: str) -> float:
            return sum(v for k, v in samples.items()
                       if k.startswith(series + suffix + "{") and f'{label}="{value}"' in k)
        return [round(total(after, "_sum") - total(before, "_sum"), 6),
                int(total(after, "_count") - total(before, "_count"))]
    return {"phases": {p: delta(PHASE_SERIES, "phase", p) for p in TTFT_PHASES},
            "modes": {m: delta(TOTAL_SERIES, "mode", m) for m in TTFT_MODES}}


def summarize_breakdown(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Mean ms per request that loaded from the store, over all rounds: per mode, and per
    phase over every such request (a phase a request skipped counts 0, so the phases add up
    to the mean store time)."""
    modes = {m: [sum(r["breakdown"]["modes"][m][i] for r in runs) for i in (0, 1)]
             for m in TTFT_MODES}
    n = sum(c for _, c in modes.values())
    if not n:
        return None
    phases = {p: sum(r["breakdown"]["phases"][p][0] for r in runs) for p in TTFT_PHASES}
    return {
        "requests": n,
        "requests_by_mode": {m: c for m, (_, c) in modes.items()},
        "store_ms": round(sum(s for s, _ in modes.values()) / n * 1e3, 2),
        "store_ms_by_mode": {m: round(s / c * 1e3, 2) for m, (s, c) in modes.items() if c},
        "phases_ms": {p: round(s / n * 1e3, 2) for p, s in phases.items()},
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of each per-run statistic, with its spread, and the breakdown."""
    out: dict[str, Any] = {"rounds": len(runs)}
    for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "request_throughput",
              "store_hit_tokens", "local_hit_tokens", "prompt_tokens", "loadavg_1m"):
        vals = [r[k][0] if k == "loadavg_1m" else r[k] for r in runs]
        out[k] = round(statistics.median(vals), 3)
        out[k + "_range"] = [round(min(vals), 3), round(max(vals), 3)]
    if "preload_used_keys" in runs[0]:  # store objects copied from preloads, per run
        out["preload_used_keys"] = statistics.median(r["preload_used_keys"] for r in runs)
    out["failed"] = sum(r["failed"] for r in runs)
    out["breakdown"] = summarize_breakdown(runs) if "breakdown" in runs[0] else None
    return out


def _best_fixed(summary: dict[str, dict[str, Any]], point: str) -> str | None:
    fixed = [c for c in FIXED if point in summary.get(c, {})]
    return min(fixed, key=lambda c: summary[c][point]["ttft_p50_ms"]) if fixed else None


def _judge(values: list[float], bound: float | None) -> dict[str, Any]:
    med = statistics.median(values)
    lo, hi = median_interval(values, LEVEL)
    cov = interval_coverage(len(values), LEVEL)
    out = {"per_round": [round(v, 3) for v in values], "median": round(med, 3),
           "interval": [round(lo, 3), round(hi, 3)], "coverage": round(cov, 3)}
    if bound is None:
        return out | {"met": None, "reason": ""}
    if cov < LEVEL:
        return out | {"met": None, "reason": f"{len(values)} rounds give a {cov:.0%} interval, "
                                              f"not {LEVEL:.0%}"}
    if hi <= bound:
        return out | {"met": True, "reason": f"the interval's upper end {hi:.2f} <= {bound}"}
    if med > bound:
        return out | {"met": False, "reason": f"the median {med:.2f} > {bound}"}
    return out | {"met": None, "reason": f"the median {med:.2f} <= {bound} but the interval "
                                         f"reaches {hi:.2f}"}


def compare(c: Comparison, result: dict[str, Any]) -> dict[str, Any]:
    """One comparison at every load point where both cases ran, paired round by round."""
    runs, summary, ref = result["runs"], result["summary"], result.get("reference", {})
    points: dict[str, Any] = {}
    for pt in summary.get(c.a, {}):
        if not pt.startswith(c.at):
            continue
        b = _best_fixed(summary, pt) if c.b == BEST_FIXED else c.b
        if b is None or pt not in summary.get(b, {}):
            continue
        ra, rb = runs[c.a]["points"][pt], runs[b]["points"][pt]
        if c.kind == "gap":
            refs = ref.get("per_round_ms", {}).get(pt, [])
            values = [(x[c.stat] - y[c.stat]) / r for x, y, r in zip(ra, rb, refs, strict=False)
                      if r]
        else:
            values = [x[c.stat] / y[c.stat] for x, y in zip(ra, rb, strict=False) if y[c.stat]]
        if values:
            points[pt] = _judge(values, c.bound) | ({"against": b} if c.b == BEST_FIXED else {})
    return {"target": c.name, "a": c.a, "b": c.b, "stat": c.stat, "kind": c.kind,
            "bound": c.bound, "points": points,
            "met": _overall([p["met"] for p in points.values()]) if c.bound else None}


def _overall(mets: list[bool | None]) -> bool | None:
    """Met at every load point; missed if missed at any; else not resolved (or not run)."""
    if not mets:
        return None
    if any(m is False for m in mets):
        return False
    return True if all(mets) else None


def evaluate(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every comparison whose cases ran."""
    return [r for r in (compare(c, result) for c in COMPARISONS) if r["points"]]


def breakdown_rows(summary: dict[str, dict[str, Any]]) -> list[list[str]]:
    """A header and one row per case and load point that loaded from the store: requests (of
    them in-step), the mean store ms, and the mean ms of each phase."""
    rows = [["case", "load point", "requests (in-step)", "store ms", *TTFT_PHASES]]
    for case, pts in summary.items():
        for pt, v in pts.items():
            b = v.get("breakdown")
            if b:
                rows.append([case, pt, f"{b['requests']} ({b['requests_by_mode']['sync']})",
                             f"{b['store_ms']:.1f}",
                             *(f"{b['phases_ms'][p]:.1f}" for p in TTFT_PHASES)])
    return rows
