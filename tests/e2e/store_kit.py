"""Helpers for the tests that start engines configured the way operators configure them: by
connector name, with the in-tree connector's settings, tenants, a disk tier or MultiConnector."""

from __future__ import annotations

import random
import time
from datetime import datetime
from typing import Any

from devkit.vllm_server import BLOCK_SIZE, VllmServer, metric_sum, parse_metrics

PREFIX = "vllm:mooncake_pool_"


def by_name(role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """A kv-transfer-config naming the connector only, as vLLM's usage doc names its own."""
    cfg: dict[str, Any] = {"kv_connector": "PooledMooncakeStoreConnector", "kv_role": role}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


def master_metrics(master) -> dict[str, float]:
    """A Mooncake master's own /metrics samples."""
    return parse_metrics(master.metrics_text())


def random_prompts(seed: int, n: int = 8) -> list[list[int]]:
    """`n` prompts of 10 full blocks and 7 tokens that share nothing."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(10 * BLOCK_SIZE + 7)] for _ in range(n)]


def wait_for_cache(server: VllmServer, seed: int, timeout: float = 60.0) -> None:
    """The cache works again (after a fault): a new prompt is saved, then loaded back from the
    store with the same output."""
    deadline = time.monotonic() + timeout
    while True:
        prompt = random_prompts(seed + int(time.monotonic() * 1000), 1)[0]
        first = server.complete(prompt)
        server.reset_prefix_cache()  # waits for the prompt's saves
        before = server.metrics()
        assert server.complete(prompt) == first
        moved = metric_sum(server.metrics(), PREFIX + "load_bytes_total") - metric_sum(
            before, PREFIX + "load_bytes_total")
        if moved > 0:
            return
        assert time.monotonic() < deadline, "the cache never came back after the fault"
        time.sleep(1.0)


def saved_blocks(prompts: list[list[int]]) -> int:
    """Blocks the prompts fill (each is stored once, or skipped if already stored)."""
    return sum(len(p) // BLOCK_SIZE for p in prompts)


SETTLED = ("save_keys", "save_skipped_keys", "save_error_keys")


def settled_keys(server: VllmServer, families: tuple[str, ...] = SETTLED) -> float:
    """Keys the engine's saves settled so far (written, found stored, or failed)."""
    m = server.metrics()
    return sum(metric_sum(m, f"{PREFIX}{fam}_total") for fam in families)


def wait_for_saves(server: VllmServer, blocks: int, timeout: float = 120.0,
                   families: tuple[str, ...] = SETTLED) -> None:
    """Until the engine's saves settled `blocks` blocks: wrote them, found them already stored,
    or failed them (a store whose memory is full refuses puts until it evicts; those blocks
    miss later, and the test's hit counts judge how many). With families=("save_keys",):
    until it wrote that many. Raises with the count it saw after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        done = settled_keys(server, families)
        if done >= blocks:
            return
        assert time.monotonic() < deadline, (
            f"saves did not finish within {timeout} s: {done:.0f} of {blocks} blocks "
            f"({' + '.join(families)})")
        time.sleep(0.3)


def serve(server: VllmServer, prompts: list[list[int]], max_tokens: int = 8
          ) -> tuple[list[list[int]], dict[str, float]]:
    """Outputs of the prompts (the local prefix cache reset first, so hits come from the
    store), and how every series moved meanwhile."""
    server.reset_prefix_cache()
    before = server.metrics()
    outputs = [server.complete(p, max_tokens=max_tokens) for p in prompts]
    after = server.metrics()
    return outputs, {k: after.get(k, 0) - before.get(k, 0) for k in after}


def store_hits(delta: dict[str, float], **labels: str) -> float:
    """Prompt tokens the engine loaded from the store during `delta` (vLLM's own counter)."""
    return metric_sum(delta, "vllm:external_prefix_cache_hits_total", **labels)


def watching(engines: list[VllmServer], master, workdir: str):
    """A Prometheus (not started) scraping the engines and the master, each second."""
    from dashboards.local_prometheus import LocalPrometheus

    return LocalPrometheus({
        "vllm": [e.url.removeprefix("http://") for e in engines],
        "mooncake-master": [f"127.0.0.1:{master.metrics_port}"],
    }, workdir=workdir)


RATE_WINDOW_S = 15  # the panels' $__rate_interval here, as Grafana's floor for 1-s scrapes


def row_panels(prometheus: str, dash_file: str, row_title: str, start: float, end: float
               ) -> list[Any]:
    """The panels of one dashboard row, each target queried over [start, end] as Grafana would
    (variables "All"), like tests/e2e/test_dashboards_live.py does for the whole dashboards."""
    from dashboards import render

    dash = render.load_dashboards((dash_file,))[dash_file]
    in_row, out = False, []
    for p in dash["panels"]:
        if p.get("type") == "row":
            in_row = p["title"] == row_title
        elif in_row:
            out.append(render.query_panel(prometheus, p, start, end, 1.0, f"{RATE_WINDOW_S}s"))
    assert out, f"{dash_file} has no row {row_title!r}"
    return out


def scraped_row(prom, dash_file: str, row_title: str, start: float) -> tuple[list[Any], float]:
    """A dashboard row's panels over [start - 2 s, now] once Prometheus has scraped what the
    engines' /metrics say now (`wait_for_scrapes`), and that end time."""
    end = wait_for_scrapes(prom, time.time())
    return row_panels(prom.url, dash_file, row_title, start - 2, end), end


def empty_targets(panels: list[Any]) -> list[str]:
    """`panel: legend` of every target that returned no data (or an error)."""
    return [f"{p.title}: {t.legend} ({t.error or 'no data'})\n    {t.expr}"
            for p in panels for t in p.targets if t.error or not t.has_data]


def peak(panels: list[Any], title: str, legend_part: str = "") -> float:
    """The largest value a panel's series reached (series whose labels contain legend_part)."""
    panel = next(p for p in panels if p.title == title)
    vals = [v for t in panel.targets for s in t.series for v in s.values
            if v == v and legend_part in " ".join(s.labels.values())]
    return max(vals, default=0.0)


def wait_for_scrapes(prom, since: float, scrapes: int = 2, timeout: float = 120.0) -> float:
    """Until Prometheus (`LocalPrometheus`) has scraped every target `scrapes` times after
    `since` (a time.time()), so its series hold what the engines' /metrics said by then (a rate
    panel needs two samples); returns the time it saw that. Raises with each target's last
    scrape if it does not happen within `timeout`."""
    interval = float(prom.scrape_interval.removesuffix("s"))
    want = since + (scrapes - 1) * interval
    deadline = time.monotonic() + timeout
    while True:
        targets = prom.api("targets")["activeTargets"]
        last = {t["scrapeUrl"]: (datetime.fromisoformat(t["lastScrape"]).timestamp(),
                                 t["health"]) for t in targets}
        if targets and all(at >= want and health == "up" for at, health in last.values()):
            return time.time()
        assert time.monotonic() < deadline, (
            f"Prometheus did not scrape every target {scrapes} times after {since:.1f} within "
            f"{timeout} s: {last}")
        time.sleep(0.2)
