"""The disk tier (`enable_offload`): a store node with a small memory segment and a disk tier,
and a working set three times the memory. The same run twice, on two pools that differ only in
the tier:
- with it, blocks evicted from memory still hit (from disk), where without it they miss;
- outputs equal recompute (float32: each run's engine computes the prompts under cache salts
  once its figures are taken, tests/engines.py) in both runs;
- the per-tier series move (tokens and bytes served from memory and from disk), and the Disk
  tier row of the dashboard shows them from a real Prometheus.

The masters lease blocks for 0.5 s after their last use instead of 10 s, so the small segment
evicts (and the disk tier receives) within the test.
"""

from __future__ import annotations

import random
import time
from typing import Any, NamedTuple

import pytest

from devkit.local_cluster import MooncakeMaster, StoreNode
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.e2e.fault_matrix_kit import series
from tests.e2e.store_kit import (
    PREFIX,
    empty_targets,
    master_metrics,
    peak,
    saved_blocks,
    scraped_row,
    serve,
    store_hits,
    wait_for_saves,
    watching,
)
from tests.engines import salted

pytestmark = [pytest.mark.side_by_side, pytest.mark.timeout(1800)]

BLOCKS = 8  # full blocks per prompt
LAYERS = 8  # a float32 block of this model is 128 KiB (Mooncake's smallest segment is 16 MB)
BLOCK_BYTES = LAYERS * 2 * 2 * 32 * BLOCK_SIZE * 4  # K and V, 2 KV heads of 32, float32
SEGMENT = "16MB"  # 128 blocks in memory
_rng = random.Random(48)
# 384 distinct blocks: three times the memory. Each token drawn from one generator: a fresh
# generator per prompt token made every prompt one token repeated, and two of the 48 the same
# prompt, whose second copy hit vLLM's own cache (store hits could reach only 46/48 of
# LOOKED_UP, which ate half the 10 % the bound below allows).
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(BLOCKS * BLOCK_SIZE + 5)] for _ in range(48)]
assert len({tuple(p[:BLOCK_SIZE]) for p in PROMPTS}) == len(PROMPTS), "prompts share a block"
LOOKED_UP = len(PROMPTS) * BLOCKS * BLOCK_SIZE  # tokens the second pass looks up
FILL_ROUND = 8  # prompts per round of the disk-tier fill: 64 blocks, half the memory
# Leases of 0.5 s (module docstring); and a minute, not Mooncake's 10 s, before the master
# drops a client whose heartbeats stop and unmounts its segment with every block on it: a
# master stalled 10 s on a starved host did that to a live store node (tests/e2e/test_cross_tp.py,
# patient_master), and this test is about the tier, not heartbeats.
MASTER_ARGS = ("--default_kv_lease_ttl=500", "--client_ttl=60")
TOP_UPS = 2  # times a fill round the store refused puts of is served again (fill)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> str:
    from devkit.tiny_model import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("deep-llama"), layers=LAYERS))


def wait_until_on_disk(master: MooncakeMaster, server: VllmServer, stalled_s: float = 30.0
                       ) -> dict[str, float]:
    """Until the disk tier holds every key the engine wrote (`save_keys_total`), or no key
    reached it for `stalled_s`: what the master and the engine count. The master pins a memory
    replica while its offload task is queued (Mooncake's `offloading_tasks` hold a refcount),
    so nearly every accepted put reaches disk, however slowly the store node offloads; but not
    all (seen once: a few written keys stayed in memory only, in a run whose puts the master
    had partly refused for space), and a put the store refused (memory full of pinned
    replicas) is counted in `save_error_keys_total`. Either kind misses later if it is
    evicted, and the hit counts judge those, so a stalled offload ends the wait, not the
    test."""
    last, since = -1.0, time.monotonic()
    while True:
        m, e = master_metrics(master), server.metrics()
        seen = {name: metric_sum(m, name) for name in
                ("master_key_count", "file_cache_nums_", "mem_cache_nums_",
                 "master_evicted_key_count")}
        seen |= {f: metric_sum(e, f"{PREFIX}{f}_total")
                 for f in ("save_keys", "save_skipped_keys", "save_error_keys")}
        if seen["file_cache_nums_"] >= seen["save_keys"]:
            return seen
        if seen["file_cache_nums_"] > last:  # progress: the stall clock restarts
            last, since = seen["file_cache_nums_"], time.monotonic()
        elif time.monotonic() - since > stalled_s:
            print(f"offload stalled for {stalled_s:g} s short of the keys written: {seen}")
            return seen
        time.sleep(0.5)


def fill(server: VllmServer, master: MooncakeMaster, offload: bool
         ) -> tuple[list[list[int]], dict[str, float]]:
    """Serve every prompt once, so the store holds their blocks: (the outputs, what the last
    wait saw, with `top_ups`). With the disk tier, in rounds of half the memory, each one on
    disk (or its offload stalled) before the next: a round's puts then find the earlier
    rounds' replicas unpinned (offloaded) and evictable, so they rarely meet a full memory.
    Rarely is not never: a round some of whose puts the store refused for space
    (save_error_keys; Mooncake's admission while its memory is full, as of replicas still
    queued for offload, not the tier's doing) is served again from a reset local cache, up to
    TOP_UPS times. Its stored blocks load, the refused ones are computed and put again, and
    its outputs must not change.
    The judged pass then measures what the tier serves of blocks the store took. Each refused
    block of a prompt had cost every block after it too (a hit is a prefix)."""
    rounds = range(0, len(PROMPTS), FILL_ROUND if offload else len(PROMPTS))
    first: list[list[int]] = []
    seen = {"save_error_keys": 0.0, "top_ups": 0.0}
    for i in rounds:
        batch = PROMPTS[i:i + FILL_ROUND if offload else None]
        first += [server.complete(p) for p in batch]
        wait_for_saves(server, saved_blocks(PROMPTS[:len(first)]))
        if not offload:
            continue
        refused, top_ups = seen["save_error_keys"], seen["top_ups"]
        seen = wait_until_on_disk(master, server) | {"top_ups": top_ups}
        for _ in range(TOP_UPS):
            if seen["save_error_keys"] == refused:
                break
            refused = seen["save_error_keys"]
            server.reset_prefix_cache()  # so the round's prompts ask the store
            assert [server.complete(p) for p in batch] == first[i:], "a top-up changed outputs"
            server.reset_prefix_cache()  # returns once the round's new saves are stored
            seen = wait_until_on_disk(master, server) | {"top_ups": seen["top_ups"] + 1}
    if offload:
        print(f"on disk after the fill: {seen}")
    return first, seen


class Run(NamedTuple):
    """One engine's run on one pool."""

    first: list[list[int]]  # outputs of the fill
    second: list[list[int]]  # outputs of the judged pass, from a reset local cache
    delta: dict[str, float]  # how every series moved in the judged pass
    panels: list[Any]  # the Disk tier row, from a real Prometheus (with the tier)
    truth: list[list[int]]  # the prompts computed from scratch afterwards
    filled: dict[str, float]  # what the fill's last wait saw (fill)

    def story(self) -> str:
        """What the store did, for a failed assertion: the fill, then the judged pass's lookups
        and failures."""
        return (f"fill: {self.filled}; lookups: {series(self.delta, 'lookups_total')}; "
                f"failures: {series(self.delta, 'failures_total')}")


def run(model, master: MooncakeMaster, offload: bool, prom_dir=None) -> Run:
    """Fill the store with every prompt, then serve them all again from a reset local cache."""
    extra = master.store_config(global_segment_size=0, local_buffer_size="64MB",
                                cache_prefix="disk", enable_offload=offload)
    server = VllmServer(model, connector_kv_config(extra))
    prom = None
    if prom_dir is not None:
        prom = watching([server], master, str(prom_dir)).start()
    try:
        server.start()
        start = time.time()
        first, filled = fill(server, master, offload)
        second, delta = serve(server, PROMPTS)
        panels = []
        if prom:  # once Prometheus holds what /metrics said after the second pass
            panels, _ = scraped_row(prom, "load-pipeline.json", "Disk tier", start)
        return Run(first, second, delta, panels, salted(server, PROMPTS), filled)
    finally:
        server.stop()
        if prom:
            prom.stop()


def test_evicted_blocks_hit_from_disk_where_memory_alone_misses(deep_model, tmp_path):
    m = MooncakeMaster(offload=True, extra_args=MASTER_ARGS).start()
    try:
        node = StoreNode(m, segment_size=SEGMENT, offload_path=str(tmp_path / "offload")).start()
        try:
            tiered = run(deep_model, m, True, tmp_path)
        finally:
            node.stop()
    finally:
        m.stop()
    plain = MooncakeMaster(extra_args=MASTER_ARGS).start()
    try:
        node = StoreNode(plain, segment_size=SEGMENT).start()
        try:
            alone = run(deep_model, plain, False)
        finally:
            node.stop()
    finally:
        plain.stop()

    delta = tiered.delta
    with_tier, without = store_hits(delta), store_hits(alone.delta)
    print(f"store-hit tokens of {LOOKED_UP} looked up: {with_tier:.0f} with the disk tier, "
          f"{without:.0f} with memory alone ({SEGMENT}: {128 * BLOCK_SIZE} tokens)")
    truth = tiered.truth
    assert tiered.first == tiered.second == truth
    assert alone.first == alone.second == alone.truth == truth
    # Memory alone holds at most 128 blocks of the 384: the rest misses. With the tier
    # nearly everything hits, most of it from disk.
    assert without <= 128 * BLOCK_SIZE, alone.story()
    assert with_tier >= 0.9 * LOOKED_UP > without, tiered.story()
    tier = {t: metric_sum(delta, PREFIX + "load_tier_tokens_total", tier=t)
            for t in ("memory", "disk", "unknown")}
    assert tier["disk"] > with_tier / 2 and tier["memory"] > 0, tier
    assert sum(tier.values()) == with_tier  # every loaded token is attributed to a tier
    assert metric_sum(delta, PREFIX + "load_tier_bytes_total", tier="disk") == \
        tier["disk"] // BLOCK_SIZE * BLOCK_BYTES
    assert metric_sum(delta, PREFIX + "load_jobs_total", status="error") == 0, tiered.story()
    assert metric_sum(alone.delta, PREFIX + "load_tier_tokens_total") == 0  # no tier, no series
    # The Disk tier row of "Mooncake pool / Load pipeline", from a real Prometheus.
    panels = tiered.panels
    assert not empty_targets(panels), "\n".join(empty_targets(panels))
    assert peak(panels, "Prompt tokens served per tier", "disk") > 0
    assert peak(panels, "Disk share of tokens served from the store") > 0.5
    assert peak(panels, "Gets served from disk (master)") > 0
