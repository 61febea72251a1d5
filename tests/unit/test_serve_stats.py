"""The serving benchmark's judgement (bench.serve_stats): per-round paired comparisons, the
store-hit gap over the reference get, a target met only when the whole interval is on its
side, and the TTFT breakdown from the engines' histograms."""

from __future__ import annotations

import pytest

from bench import serve_stats
from bench.serve_stats import BEST_FIXED, Comparison, breakdown_of, compare, summarize


def run(p50: float, p99: float | None = None, breakdown: dict | None = None) -> dict:
    r = {"ttft_p50_ms": p50, "ttft_p99_ms": p99 or 2 * p50, "itl_p50_ms": 1.0,
         "itl_p99_ms": 2.0, "request_throughput": 1.0, "store_hit_tokens": 0,
         "local_hit_tokens": 0, "prompt_tokens": 0, "loadavg_1m": [0.5, 0.5], "failed": 0}
    return r | ({"breakdown": breakdown} if breakdown else {})


def result(cases: dict[str, list[float]], ref: list[float] | None = None) -> dict:
    runs = {c: {"points": {"pt": [run(v) for v in vals]}} for c, vals in cases.items()}
    return {"runs": runs,
            "summary": {c: {"pt": summarize(r["points"]["pt"])} for c, r in runs.items()},
            "reference": {"per_round_ms": {"pt": ref or []}}}


def test_ratio_is_paired_round_by_round():
    # Round drift hits both cases alike: each round's ratio is 0.5, whatever the round.
    res = result({"a": [10, 40, 20, 80, 30, 60], "b": [20, 80, 40, 160, 60, 120]})
    out = compare(Comparison("a vs b", "a", "b", bound=0.6), res)
    pt = out["points"]["pt"]
    assert pt["per_round"] == [0.5] * 6 and pt["interval"] == [0.5, 0.5]
    assert pt["coverage"] > 0.95 and pt["met"] is True and out["met"] is True


def test_met_only_when_the_whole_interval_is_inside():
    res = result({"a": [9, 9, 9, 9, 9, 12], "b": [10] * 6})
    straddles = compare(Comparison("t", "a", "b", bound=1.0), res)["points"]["pt"]
    assert straddles["median"] == 0.9 and straddles["met"] is None  # not resolved
    assert "reaches 1.20" in straddles["reason"]
    missed = compare(Comparison("t", "a", "b", bound=0.8), res)["points"]["pt"]
    assert missed["met"] is False and "median" in missed["reason"]


def test_too_few_rounds_never_meet_a_target():
    res = result({"a": [1, 1], "b": [10, 10]})
    pt = compare(Comparison("t", "a", "b", bound=0.5), res)["points"]["pt"]
    assert pt["median"] == 0.1 and pt["met"] is None and "2 rounds" in pt["reason"]


def test_gap_is_over_each_rounds_reference_get():
    res = result({"store": [30, 40, 30, 40, 30, 40], "local": [20, 20, 20, 20, 20, 20]},
                 ref=[10, 20, 10, 20, 10, 20])
    out = compare(Comparison("gap", "store", "local", kind="gap", bound=1.5), res)
    assert out["points"]["pt"]["per_round"] == [1.0] * 6 and out["met"] is True


def test_auto_is_judged_against_the_better_fixed_setting():
    res = result({"ours-auto": [11] * 6, "ours-1t": [20] * 6, "ours-4t": [10] * 6})
    out = compare(Comparison("auto", "ours-auto", BEST_FIXED, bound=1.05), res)
    assert out["points"]["pt"]["against"] == "ours-4t"
    assert out["points"]["pt"]["median"] == pytest.approx(1.1) and out["met"] is False


def test_a_comparison_whose_cases_did_not_run_is_left_out():
    res = result({"ours-4t": [1] * 6})
    assert all(t["a"] == "ours-4t" and t["b"] in res["runs"] for t in serve_stats.evaluate(res))


def test_breakdown_phases_add_up_to_the_mean_store_time():
    before = {'vllm:mooncake_pool_ttft_store_phase_seconds_sum{phase="lookup"}': 1.0,
              'vllm:mooncake_pool_ttft_store_phase_seconds_count{phase="lookup"}': 5}
    after = {'vllm:mooncake_pool_ttft_store_phase_seconds_sum{engine="0",phase="lookup"}': 1.3,
             'vllm:mooncake_pool_ttft_store_phase_seconds_count{engine="0",phase="lookup"}': 8,
             'vllm:mooncake_pool_ttft_store_phase_seconds_sum{engine="0",phase="handoff"}': 0.1,
             'vllm:mooncake_pool_ttft_store_phase_seconds_count{engine="0",phase="handoff"}': 1,
             'vllm:mooncake_pool_ttft_store_seconds_sum{engine="0",mode="async"}': 0.2,
             'vllm:mooncake_pool_ttft_store_seconds_count{engine="0",mode="async"}': 1,
             'vllm:mooncake_pool_ttft_store_seconds_sum{engine="0",mode="sync"}': 0.2,
             'vllm:mooncake_pool_ttft_store_seconds_count{engine="0",mode="sync"}': 2}
    b = breakdown_of(before, after)
    assert b["phases"]["lookup"] == [pytest.approx(0.3), 3]
    s = summarize([run(1, breakdown=b)])["breakdown"]
    assert s["requests"] == 3 and s["requests_by_mode"] == {"async": 1, "sync": 2}
    assert s["store_ms"] == pytest.approx(133.33, abs=0.01)
    assert s["phases_ms"]["lookup"] == 100.0 and s["phases_ms"]["handoff"] == pytest.approx(33.33)
    assert s["store_ms_by_mode"] == {"async": 200.0, "sync": 100.0}
