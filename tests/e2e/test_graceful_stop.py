"""A graceful stop loses no save silently: engines stopped with SIGTERM right after their last
request, with `--shutdown-timeout 30`, the connector alone and second inside vLLM's
MultiConnector (where a stop was once seen to leave the prompts out of the store).

vLLM (0.32) drains for --shutdown-timeout after SIGTERM, then EngineCore's shutdown runs the
connector's: queued saves go on for SHUTDOWN_SAVE_DRAIN_S, and what is left is counted and
logged ("shutdown: N store keys ...; took Ts"). So for each engine: the connector's shutdown ran
and took SHUTDOWN_BOUND_S at most, keys the store gained + keys counted as lost == keys the
prompts offered; and a fresh engine (started with them, idle until then, so nothing of its
own is cached) then takes the stored prefixes from the store, with the outputs the stopped
engines gave (all float32).
SIGTERM goes to the API server only, as Kubernetes sends it to the container's first process.
The stops here find little or nothing still queued (the store is healthy and fast), so they
check the accounting and the bound, not the drain itself (tests/store/test_deadlines.py's
shutdown tests do, with saves queued on a healthy and on a frozen store node). Nor do they
show what the default --shutdown-timeout 0 loses: an idle engine stopped at 0 was seen to log
the connector's account (0 keys, 0.00 s) before vLLM's kill, and would pass them too.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from connector.worker.worker import SHUTDOWN_BOUND_S
from devkit.vllm_server import BLOCK_SIZE, VllmServer, metric_sum, parse_metrics, start_together
from tests.conftest import engine_extra
from tests.e2e.store_kit import PREFIX, saved_blocks, store_hits

pytestmark = [pytest.mark.timed, pytest.mark.timeout(1800)]
CACHE_PREFIX = "graceful-stop"
SHUTDOWN = ("--shutdown-timeout", "30")
# Keys of saves still queued, then (if any) of saves still in a store call; the time it took.
LOST = re.compile(r"shutdown: (\d+) store keys(?:.*?, nor (\d+) of saves)?.*; took ([\d.]+)s")


def ours(master) -> dict:
    return {"kv_connector": "PooledMooncakeStoreConnector", "kv_connector_module_path": "connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": engine_extra(master, cache_prefix=CACHE_PREFIX)}


def in_multi(master, path: Path) -> dict:
    example = {"kv_connector": "HandshakeExampleConnector",
               "kv_connector_module_path": "tests.e2e.handshake_connector",
               "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(path)}}
    member = {k: v for k, v in ours(master).items() if k != "kv_load_failure_policy"}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [example, member]}}


def distinct_prompts(n: int = 6, tokens: int = 360) -> list[list[int]]:
    """Prompts that share no block (so every full block is a new key: 11 each), unlike the
    suite's, whose shared prefixes are stored once."""
    rng = random.Random(29)
    return [[rng.randrange(3, 1000) for _ in range(tokens)] for _ in range(n)]


def key_count(master) -> float:
    return metric_sum(parse_metrics(master.metrics_text()), "master_key_count")


def serve_then_stop(server: VllmServer, master, prompts: list[list[int]]) -> dict:
    """Serve the prompts, SIGTERM the API server at once after the last answer, wait for the
    engine to exit; what the store gained and what the connector counted as lost."""
    before = key_count(master)
    outputs = [server.complete(p) for p in prompts]
    os.kill(server.proc.pid, signal.SIGTERM)
    t0 = time.monotonic()
    server.proc.wait(timeout=120)
    took = time.monotonic() - t0
    log = Path(server.log_path).read_text(errors="replace")
    found = LOST.findall(log)
    counts = [int(queued) + int(in_calls or 0) for queued, in_calls, _ in found]
    # The store node settles its puts a moment after the client returned.
    stored, deadline = key_count(master) - before, time.monotonic() + 10
    while stored + sum(counts) < saved_blocks(prompts) and time.monotonic() < deadline:
        time.sleep(0.2)
        stored = key_count(master) - before
    seen = {"outputs": outputs, "stored": stored, "lost": sum(counts), "lines": len(counts),
            "offered": saved_blocks(prompts), "exit_s": round(took, 1),
            "shutdown_s": max((float(s) for *_, s in found), default=None)}
    print({k: v for k, v in seen.items() if k != "outputs"})
    return seen


def test_a_stopped_engine_saves_or_counts_every_key(tiny_model, master, store_node, tmp_path):
    prompts = distinct_prompts()
    half = len(prompts) // 2
    runs = {}
    alone = VllmServer(tiny_model, ours(master), env={"VLLM_PLUGINS": ""}, extra_args=SHUTDOWN)
    multi = VllmServer(tiny_model, in_multi(master, tmp_path / "example"),
                       env={"VLLM_PLUGINS": ""}, extra_args=SHUTDOWN)
    fresh = VllmServer(tiny_model, ours(master), env={"VLLM_PLUGINS": ""})
    try:
        # All three start together and wait idle for their turn: an idle engine beside a
        # stopping one takes no CPU from its shutdown, and saves or loads nothing.
        start_together([alone, multi, fresh])
        runs["alone"] = serve_then_stop(alone, master, prompts[:half])
        runs["multi"] = serve_then_stop(multi, master, prompts[half:])
        for name, run in runs.items():
            # The connector's shutdown ran (it logs its account once per worker) ...
            assert run["lines"] == 1, (f"{name}: no connector shutdown ran (vLLM killed "
                                       f"EngineCore?)")
            # ... within its stated bound ...
            assert run["shutdown_s"] <= SHUTDOWN_BOUND_S, (name, run)
            # ... and every key the prompts offered is in the store or counted as lost.
            assert run["stored"] + run["lost"] == run["offered"], (name, run)
        fresh.reset_prefix_cache()
        before = fresh.metrics()
        outputs = [fresh.complete(p) for p in prompts]
        after = fresh.metrics()
    finally:
        for server in (alone, multi, fresh):
            server.stop()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert outputs == runs["alone"]["outputs"] + runs["multi"]["outputs"]
    hits = store_hits(delta)
    print(f"fresh engine: {hits:.0f} prompt tokens from the store")
    if runs["alone"]["lost"] + runs["multi"]["lost"] == 0:  # everything stored: full hits
        assert hits >= len(prompts) * ((len(prompts[0]) - 1) // BLOCK_SIZE) * BLOCK_SIZE
    else:
        assert hits > 0
    assert metric_sum(delta, PREFIX + "load_jobs_total", status="error") == 0
