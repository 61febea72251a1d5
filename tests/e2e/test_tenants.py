"""Tenants on a real master in multi-tenant mode (`--enable_multi_tenants`, a file quota policy):
two engines, each its own tenant (`tenant_id`), one flooding a small quota.

What must hold (issue 21):
- the flooding tenant's overflow is rejected or evicted within its quota: the master never
  charges it more than its effective quota, and counts its rejects / evictions;
- the other tenant's hit rate on its hot prefixes is the same before and after the flood;
- every request of both completes with the outputs computed from scratch (float32; salted on
  each tenant's engine once everything else is measured, tests/engines.py);
- a put rejected by the quota is on the flooding engine's /metrics with its code (-1700);
- the Tenants row of the dashboard shows all of it from a real Prometheus;
- an engine of one tenant sending another tenant's exact prompts takes no token from the
  store, on a master in multi-tenant mode and on one without it (which ignores the client's
  tenant: the tenant is part of the store keys, connector.store.keys).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from devkit.local_cluster import local_pool
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.e2e import store_kit as kit
from tests.engines import salted

pytestmark = [pytest.mark.side_by_side, pytest.mark.timeout(1800)]

FLOOD_QUOTA = "1MB"  # 32 blocks of 32 KiB (float32)
HOT, FLOOD = "hot", "flood"


def make(seed: int, n: int, blocks: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(blocks * BLOCK_SIZE + 5)] for _ in range(n)]


# The hot tenant's prefixes: 32 blocks in all. The flood: 12 prompts of 40 blocks, 15 MB against
# its 1 MB quota; each prompt's save (one put of 40 blocks) is larger than the whole quota.
HOT_PROMPTS, FLOOD_PROMPTS = make(1, 4, 8), make(2, 12, 40)


@pytest.fixture(scope="module")
def tenant_master():
    """A master in multi-tenant mode (the two tenants' quotas) and its store node."""
    with local_pool("256MB", tenants={HOT: "64MB", FLOOD: FLOOD_QUOTA}) as (master, _node):
        yield master


def tenant_engine(tiny_model, master, tenant: str) -> VllmServer:
    extra = master.store_config(global_segment_size=0, local_buffer_size="64MB",
                                tenant_id=tenant, cache_prefix="tenants")
    return VllmServer(tiny_model, connector_kv_config(extra))


def hit_rate(delta: dict[str, float], tenant: str) -> float:
    hit = metric_sum(delta, kit.PREFIX + "lookup_hit_tokens_total", tenant=tenant)
    miss = metric_sum(delta, kit.PREFIX + "lookup_miss_tokens_total", tenant=tenant)
    return hit / (hit + miss)


def test_two_tenants_one_floods_its_quota(tiny_model, tenant_master, tmp_path):
    hot = tenant_engine(tiny_model, tenant_master, HOT)
    flood = tenant_engine(tiny_model, tenant_master, FLOOD)
    prom = kit.watching([hot, flood], tenant_master, str(tmp_path)).start()
    try:
        hot.start()
        start = time.time()
        # The hot tenant stores its prefixes, then reads them back: the figure before.
        first, _ = kit.serve(hot, HOT_PROMPTS)
        kit.wait_for_saves(hot, kit.saved_blocks(HOT_PROMPTS))
        # The panels' rates span RATE_WINDOW_S: past it, a window holds the hits to come and
        # none of the first pass's misses, however fast the passes run (seen once engines
        # started faster: both passes in every window, the panel's peak below the real rate).
        time.sleep(kit.RATE_WINDOW_S + 1)
        before_out, before = kit.serve(hot, HOT_PROMPTS)
        rate_before = hit_rate(before, HOT)

        # The flood, 4 prompts at a time, twice, while the master's charge for the tenant is
        # sampled. The master admits each put within the quota by evicting the tenant's own
        # older blocks, and rejects what no eviction can make room for: the part of a 40-block
        # put beyond the 32-block quota.
        flood.start()
        over: list[tuple[float, float]] = []
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.2):
                m = kit.master_metrics(tenant_master)
                charged = metric_sum(m, "mooncake_tenant_quota_charged_bytes", tenant_id=FLOOD)
                quota = metric_sum(m, "mooncake_tenant_quota_effective_bytes", tenant_id=FLOOD)
                if charged > quota:
                    over.append((charged, quota))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ThreadPoolExecutor(4) as pool:
                flood.reset_prefix_cache()
                flood_first = list(pool.map(flood.complete, FLOOD_PROMPTS))
                flood.reset_prefix_cache()  # the second pass loads what the quota kept
                flood_second = list(pool.map(flood.complete, FLOOD_PROMPTS))
        finally:
            done.set()
            watcher.join()

        after_out, after = kit.serve(hot, HOT_PROMPTS)
        rate_after = hit_rate(after, HOT)
        crossed_out, crossed = kit.serve(flood, HOT_PROMPTS)  # the hot tenant's exact prompts
        # The Tenants row of "Mooncake pool / Errors and store", from a real Prometheus.
        panels, end = kit.scraped_row(prom, "errors-and-store.json", "Tenants", start)

        m = kit.master_metrics(tenant_master)
        fm, hm = flood.metrics(), hot.metrics()
        # Measured: now each tenant's prompts computed from scratch on its own engine (their
        # salted saves come after every figure above).
        want_hot, want_flood = salted(hot, HOT_PROMPTS), salted(flood, FLOOD_PROMPTS)

        print(f"hot tenant token hit rate: before the flood {rate_before:.3f}, "
              f"after {rate_after:.3f}")
        # Every request of both tenants: the outputs computed from scratch.
        assert first == before_out == after_out == crossed_out == want_hot
        assert metric_sum(crossed, "vllm:external_prefix_cache_hits_total") == 0
        assert metric_sum(crossed, kit.PREFIX + "lookup_miss_tokens_total") > 0  # it looked
        assert flood_first == want_flood and flood_second == want_flood
        # The hot tenant's hit rate is unchanged, and it is a real hit rate.
        assert rate_before == rate_after > 0.9
        # The flood stayed within its quota, and the master rejected or evicted its overflow.
        assert not over, f"the flooding tenant was charged above its quota: {over[:5]}"
        rejected = metric_sum(m, "mooncake_tenant_quota_reject_total", tenant_id=FLOOD)
        evicted = metric_sum(m, "mooncake_tenant_evict_bytes_total", tenant_id=FLOOD)
        assert rejected > 0 and evicted > 0
        assert metric_sum(m, "mooncake_tenant_quota_reject_total", tenant_id=HOT) == 0
        assert metric_sum(m, "mooncake_tenant_evict_bytes_total", tenant_id=HOT) == 0
        # The rejected puts, with their code, on the flooding engine's /metrics (and only there).
        refused = kit.PREFIX + "failures_total"
        print(f"flood tenant: {rejected:.0f} writes rejected and {evicted / 2**20:.1f} MB evicted "
              "by the master; save failures by code on its engine:",
              {k.split("code=")[1].split(",")[0]: v for k, v in fm.items()
               if k.startswith(refused) and 'op="save"' in k and v})
        assert metric_sum(fm, refused, op="save", code="-1700", tenant=FLOOD) > 0
        assert metric_sum(hm, refused, op="save", code="-1700") == 0

        # The Tenants row, as queried above.
        assert not kit.empty_targets(panels), "\n".join(kit.empty_targets(panels))
        assert kit.peak(panels, "Puts refused by the master, per tenant", FLOOD) > 0
        assert kit.peak(panels, "Token hit rate per tenant", HOT) > 0.9
        assert kit.peak(panels, "Tenant quota use (master)", FLOOD) > 0
    finally:
        for server in (flood, hot):
            server.stop()
        prom.stop()


def test_tenants_share_no_block_on_a_master_without_tenants(tiny_model, master, store_node,
                                                            prompts):
    """The session's master runs without --enable_multi_tenants, so it ignores tenant_id:
    tenant b, sending tenant a's exact prompts, still misses every block."""
    a, b = (VllmServer(tiny_model, connector_kv_config(master.store_config(
        global_segment_size=0, local_buffer_size="64MB", tenant_id=t,
        cache_prefix="plain-tenants"))) for t in ("team-a", "team-b"))
    try:
        a.start()
        truth = salted(a, prompts)
        assert kit.serve(a, prompts)[0] == truth
        # Blocks of the prompts' shared prefixes are computed (and saved) once.
        kit.wait_for_saves(a, len({tuple(p[:i + BLOCK_SIZE]) for p in prompts
                               for i in range(0, len(p) - BLOCK_SIZE + 1, BLOCK_SIZE)}))
        assert metric_sum(kit.serve(a, prompts)[1], "vllm:external_prefix_cache_hits_total") > 0
        b.start()
        out, delta = kit.serve(b, prompts)
        assert out == truth
        assert metric_sum(delta, kit.PREFIX + "lookup_miss_tokens_total") > 0  # it looked
        assert metric_sum(delta, "vllm:external_prefix_cache_hits_total") == 0
    finally:
        b.stop()
        a.stop()
