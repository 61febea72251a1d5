"""The demo: a local Mooncake master and store node, `vllm serve` with the connector on a tiny
locally made model, a workload that fills the store and then reads it back, and a summary.

    python -m devkit.demo [--threads 4] [--requests 16] [--keep-running] [--ha]

With --ha the store is an HA master group (etcd, two masters with the oplog, a store node) and
the leader is killed between the passes: pass 2 still reads the prefixes from the store.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections import defaultdict

from connector.observability.metric_catalog import PREFIX as P
from devkit.ha_cluster import HaCluster
from devkit.local_cluster import _wait_segment_mounted
from devkit.stack import local_stack
from devkit.vllm_server import metric_sum


def workload(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts over 4 shared 512-token prefixes (a system prompt / RAG document each)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(512)] for _ in range(4)]
    return [prefixes[i % 4] + [rng.randrange(3, 1000) for _ in range(64)] for i in range(n)]


def per_thread(samples: dict[str, float], name: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for key, v in samples.items():
        if key.startswith(name + "{") and 'thread="' in key:
            out[key.split('thread="')[1].split('"')[0]] += v
    # Thread numbers in order; thread="queued" (jobs that expired before a thread took one) last.
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].isdigit(), kv[0].zfill(9))))


def mean_ms(samples: dict[str, float], family: str) -> str:
    total = metric_sum(samples, f"{P}{family}_seconds_sum")
    count = metric_sum(samples, f"{P}{family}_seconds_count")
    return f"{1e3 * total / count:7.3f} ms" if count else "    n/a"


def summary(before: dict[str, float], after: dict[str, float], n: int, secs: float,
            threads: int) -> str:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    jobs = per_thread(d, f"{P}load_jobs_total")
    lines = [
        "", "=== mooncake-pooled-connector demo: second pass (prefixes from the store) ===",
        f"requests served            {n} in {secs:.1f} s",
        f"prompt tokens hit in store {metric_sum(d, 'vllm:external_prefix_cache_hits_total'):.0f}"
        f" of {metric_sum(d, 'vllm:external_prefix_cache_queries_total'):.0f} queried",
        f"bytes loaded from store    {metric_sum(d, P + 'load_bytes_total') / 2**20:.2f} MiB "
        f"({metric_sum(d, P + 'load_keys_total'):.0f} blocks)",
        f"load jobs failed           {metric_sum(d, P + 'load_jobs_total', status='error'):.0f}",
        f"receive threads            {threads}",
        # thread="<receive threads>" is the in-step load thread (docs/observability.md).
        "jobs per receive thread    " + (", ".join(
            f"t{t}={v:.0f}" for t, v in jobs.items() if t.isdigit() and int(t) < threads)
            or "none"),
        f"jobs in the engine step    {jobs.get(str(threads), 0):.0f} (the in-step thread)",
        "mean time per load job:    queue wait " + mean_ms(d, "load_queue_wait")
        + " | prepare " + mean_ms(d, "load_prepare")
        + " | master lookup " + mean_ms(d, "load_master_lookup")
        + " | transfer " + mean_ms(d, "load_transfer"),
        f"scheduler lookup           {mean_ms(d, 'lookup')} mean",
        f"blocks saved (first pass)  {metric_sum(after, P + 'save_keys_total'):.0f}, "
        f"skipped as already stored {metric_sum(after, P + 'save_skipped_keys_total'):.0f}",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=4, help="VLLM_MOONCAKE_LOAD_RECV_THREADS")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--keep-running", action="store_true",
                    help="leave the stack up until Ctrl-C (scrape /metrics yourself)")
    ap.add_argument("--ha", action="store_true",
                    help="HA master group; SIGKILL the leader between the passes")
    args = ap.parse_args()

    ha = HaCluster() if args.ha else None
    with local_stack(args.threads, ha=ha, master_lookup_sample_ratio=1.0) as server:
        prompts = workload(args.requests)
        print(f"demo: pass 1, {len(prompts)} requests: compute and save to the store")
        first = [server.complete(p) for p in prompts]
        time.sleep(1.5)  # let the save thread drain (and the standby apply the oplog)
        if ha is not None:
            old = ha.leader()
            t0 = time.monotonic()
            old.kill()
            new = ha.wait_serving(60, exclude=old)
            _wait_segment_mounted(ha)
            print(f"demo: leader {old.address} killed; {new.address} serves "
                  f"{time.monotonic() - t0:.1f} s later with the metadata")
        server.reset_prefix_cache()  # forget the local copy: pass 2 must read the store
        before = server.metrics()
        print("demo: pass 2, same requests after dropping vLLM's local prefix cache")
        t0 = time.monotonic()
        second = [server.complete(p) for p in prompts]
        secs = time.monotonic() - t0
        time.sleep(0.5)  # one more stats interval reaches /metrics
        print(summary(before, server.metrics(), len(prompts), secs, args.threads))
        print(f"outputs identical to pass 1: {first == second} ({server.dtype})")
        print(f"metrics: {server.url}/metrics  (families vllm:mooncake_pool_*)")
        if args.keep_running:
            print("demo: running; Ctrl-C to stop")
            with contextlib.suppress(KeyboardInterrupt):
                while True:
                    time.sleep(3600)

if __name__ == "__main__":
    main()
