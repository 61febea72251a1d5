"""Every dashboard query against real data: a real Prometheus (the Debian binary, 1 s scrapes)
scrapes a real `vllm serve` with the connector (4 receive threads over a filled store, from
conftest's `pooled_server`) and the real Mooncake master while a workload runs. Each panel target
must return data, unless it is listed in EXPECTED_EMPTY with the reason; the alert expressions
must stay quiet on this healthy engine. The panels are rendered to PNG on the way
(UPDATE_DASHBOARD_PNGS=1 also writes them to docs/img/ for the docs site).
"""

from __future__ import annotations

import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dashboards import render  # noqa: E402
from dashboards.local_prometheus import LocalPrometheus  # noqa: E402
from dashboards.promql import substitute  # noqa: E402
from tests.e2e.store_kit import RATE_WINDOW_S, wait_for_scrapes  # noqa: E402

pytestmark = [pytest.mark.side_by_side, pytest.mark.timeout(1500)]

POD = "vllm-pooled"

# (dashboard file, panel title, target legend) -> why it is empty on a healthy run. The failure
# and load-error series are exported as 0 from startup, so their totals have data.
EXPECTED_EMPTY: dict[tuple[str, str, str], str] = {
    ("errors-and-store.json", "Store failures by op and code", "{{op}} {{code}}"):
        "healthy run: no store operation fails, and this target draws only non-zero codes "
        "(its 'all ops and codes' target reads 0)",
    ("errors-and-store.json", "Failovers", "HA state changes {{instance}}"):
        "this run's master has no HA (a single master exports no ha_state_transitions_total); "
        "tests/e2e/test_ha_failover.py checks the HA families on a live HA group",
    **{("errors-and-store.json", title, legend):
       "this run's master is not in multi-tenant mode (no mooncake_tenant_* families); "
       "tests/e2e/test_tenants.py checks the Tenants row against a multi-tenant master"
       for title, legend in (("Tenant quota use (master)", "used {{tenant_id}}"),
                             ("Tenant quota use (master)", "quota {{tenant_id}}"),
                             ("Quota rejects per tenant (master)", "{{tenant_id}} {{reason}}"),
                             ("Evicted to make room, per tenant (master)", "{{tenant_id}}"))},
    ("errors-and-store.json", "Sweep round length (mean)", "{{pod}}"):
        "this run's engine has no store KV events, so no sweep rounds to average (0 / 0); "
        "tests/e2e/test_kv_events.py checks kv_events_sweep_seconds on engines with them",
    **{("load-pipeline.json", title, legend):
       "this run's engine has no disk tier (no enable_offload: no tier series); "
       "tests/e2e/test_disk_tier.py checks the Disk tier row against a store with one"
       for title, legend in (("Prompt tokens served per tier", "{{tier}}"),
                             ("Disk share of tokens served from the store", "disk"),
                             ("Load bandwidth per tier", "{{tier}}"))},
}

# Alerts whose condition this test machine may meet on a healthy run -> why.
MAY_FIRE: dict[str, str] = {
    "MooncakePoolMasterLookupSlow":
        "the 20 ms p99 threshold is meant for a master on its own cores; here vLLM's CPU engine, "
        "the master and the store node share 2 vCPUs and the p99 lookup reaches ~30 ms",
}


def _prompts(seed: int, n: int, prefix_len: int = 256, suffix_len: int = 64) -> list[list[int]]:
    """`n` prompts in pairs that share a `prefix_len`-token prefix (so saves dedup)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            prefix = [rng.randrange(3, 1000) for _ in range(prefix_len)]
        out.append(prefix + [rng.randrange(3, 1000) for _ in range(suffix_len)])
    return out


def _drive(server, stored_prompts: list[list[int]], rounds: int) -> None:
    """Rounds of concurrent requests: prompts the store already holds (loads), fresh prompts
    (lookup misses and saves; pairs sharing a prefix make the second save a dedup skip), and the
    previous round's fresh prompts (loads of blocks this engine saved). The local prefix cache is
    reset before each round so that repeats go to the store."""
    previous: list[list[int]] = []
    with ThreadPoolExecutor(12) as pool:
        for r in range(rounds):
            server.reset_prefix_cache()
            fresh = _prompts(1000 + r, 6)
            batch = stored_prompts + fresh + previous
            list(pool.map(lambda p: server.complete(p, max_tokens=4), batch))
            previous = fresh
            time.sleep(2.0)


@pytest.fixture(scope="module")
def live(pooled_server, master, prompts, tmp_path_factory):
    """A Prometheus that watched the engine and the master through a workload, and the window."""
    host, port = pooled_server.url.removeprefix("http://").split(":")
    prom = LocalPrometheus({
        "vllm": ([f"{host}:{port}"], {"pod": POD}),
        "mooncake-master": [f"127.0.0.1:{master.metrics_port}"],
    }, scrape_interval="1s", workdir=str(tmp_path_factory.mktemp("prometheus"))).start()
    try:
        prom.wait_for_targets(timeout=30)
        start = wait_for_scrapes(prom, time.time())  # every series sampled before the workload
        # More rounds give fuller screenshots (UPDATE_DASHBOARD_PNGS=1 LIVE_DASHBOARD_ROUNDS=40).
        _drive(pooled_server, prompts, int(os.environ.get("LIVE_DASHBOARD_ROUNDS", "8")))
        end = wait_for_scrapes(prom, time.time())  # Prometheus holds what /metrics said
        yield prom, start - 2, end
    finally:
        prom.stop()


@pytest.fixture(scope="module")
def results(live) -> dict[str, list[render.PanelResult]]:
    prom, start, end = live
    return {name: render.query_dashboard(prom.url, dash, start, end, 1.0, f"{RATE_WINDOW_S}s")
            for name, dash in render.load_dashboards().items()}


def test_scrape_sees_the_connector_and_the_master(live):
    prom, _, _ = live
    up = {r["metric"]["job"]: r["value"][1] for r in prom.query("up")}
    assert up == {"vllm": "1", "mooncake-master": "1"}
    # Colons restored by the relabelling (prometheus/client_python#1177 on Prometheus 2.x).
    assert prom.query(f'vllm:mooncake_pool_recv_threads{{pod="{POD}"}}')
    assert prom.query("master_key_count")[0]["value"][1] != "0"


def test_every_panel_query_returns_data(results):
    missing, stale, errors = [], [], []
    for name, panels in results.items():
        for p in panels:
            for t in p.targets:
                key = (name, p.title, t.legend)
                if t.error:
                    errors.append(f"{key}: {t.error}\n    {t.expr}")
                elif key in EXPECTED_EMPTY:
                    if t.has_data:
                        stale.append(f"{key} has data now; drop it from EXPECTED_EMPTY")
                elif not t.has_data:
                    missing.append(f"{key}: no data\n    {t.expr}")
    assert not errors, "\n".join(errors)
    assert not missing, "\n".join(missing)
    assert not stale, "\n".join(stale)
    known = {(n, p.title, t.legend) for n, ps in results.items() for p in ps for t in p.targets}
    assert set(EXPECTED_EMPTY) <= known, set(EXPECTED_EMPTY) - known


def test_panels_show_the_workload(results, live):
    """Not just any data: the numbers that prove the pipeline ran are non-zero."""
    prom = live[0]

    def peak(dash: str, title: str) -> float:
        panel = next(p for p in results[dash] if p.title == title)
        vals = [v for t in panel.targets for s in t.series for v in s.values if v == v]
        return max(vals, default=0.0)

    assert peak("load-pipeline.json", "Load bandwidth per thread and total") > 0
    assert peak("load-pipeline.json", "Load jobs per second") > 0
    assert peak("load-pipeline.json", "Master lookup") > 0
    assert peak("load-pipeline.json", "Receive thread utilisation") > 0
    assert peak("errors-and-store.json", "Keys saved, skipped (already stored) and failed") > 0
    assert peak("errors-and-store.json", "Token hit rate") > 0
    assert peak("errors-and-store.json", "Keys in the store") > 0
    # More than one receive thread did work.
    threads = prom.query('sum by (thread) (vllm:mooncake_pool_load_jobs_total{status="ok"}) > 0')
    assert len(threads) >= 2, threads


def test_alerts_are_quiet_on_a_healthy_engine(live):
    prom, _, _ = live
    rules = [r for g in yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())["groups"]
             for r in g["rules"]]
    assert set(MAY_FIRE) <= {r["alert"] for r in rules}
    firing = {r["alert"]: res for r in rules
              if r["alert"] not in MAY_FIRE and (res := prom.query(r["expr"]))}
    assert not firing, firing
    # The saturation rule's vector match works on the real label sets (both sides pair up).
    paired = prom.query("avg_over_time(vllm:mooncake_pool_load_queue_depth[5m]) "
                        ">= bool vllm:mooncake_pool_recv_threads")
    assert paired, "load_queue_depth and recv_threads do not match label for label"


def test_variable_queries_list_the_engine(live):
    """The template variables' label_values() selectors find the engine's label values."""
    prom, _, _ = live
    for name, dash in render.load_dashboards().items():
        for v in dash["templating"]["list"]:
            if v["type"] != "query":
                continue
            q = v["query"]["query"]
            selector, label = q.removeprefix("label_values(").removesuffix(")").rsplit(",", 1)
            res = prom.query(f"count by ({label.strip()}) ({substitute(selector)})")
            assert res, f"{name}: variable ${v['name']} ({q}) lists nothing"


def test_render_pngs(results, live, tmp_path):
    _, start, end = live
    out_dir = ROOT / "docs" / "img" if os.environ.get("UPDATE_DASHBOARD_PNGS") else tmp_path
    for name, dash in render.load_dashboards().items():
        out = render.render_dashboard(dash, results[name], out_dir / name.replace(".json", ".png"),
                                      start, end)
        assert out.stat().st_size > 50_000, out
