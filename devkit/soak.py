"""Soak test (not in CI): mixed load at a steady rate for a bounded time against a real engine
with the connector, then a report: RSS growth of the engine processes, queue depth and
in-flight jobs back to 0, KV blocks released, and the error counters.

    python -m devkit.soak --minutes 10 --rate 4 --threads 4
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from connector.observability.metric_catalog import PREFIX as P
from devkit.stack import local_stack
from devkit.vllm_server import VllmServer, metric_sum


def engine_rss(server: VllmServer) -> int:
    """Resident bytes of the API server, engine core and worker processes together."""
    root = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def request_mix(rng: random.Random, prefixes: list[list[int]]) -> tuple[list[int], int]:
    """70 % shared-prefix requests (store hits), 30 % unique prompts (misses and saves)."""
    if rng.random() < 0.7:
        prompt = rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randint(8, 96))]
    else:
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(64, 900))]
    return prompt, rng.randint(1, 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rss-bound-mib", type=float, default=256.0,
                    help="allowed RSS growth between warm-up and the end")
    ap.add_argument("--reset-every", type=float, default=5.0,
                    help="drop vLLM's local prefix cache this often (s) so shared prefixes "
                         "come from the store")
    args = ap.parse_args()

    with local_stack(args.threads) as server:
        report, errors = run_load(server, args)
    growth = report["rss_growth_mib"]
    ok = (not errors and report["store_failures"] == 0 and growth <= args.rss_bound_mib
          and report["load_jobs"] > 0 and report["queue_depth_end"] == 0
          and report["inflight_end"] == 0 and report["kv_cache_usage_end"] == 0)
    print("soak report:")
    for k, v in report.items():
        print(f"  {k:20} {v}")
    verdict = "PASS" if ok else "FAIL"
    print(f"  {'verdict':20} {verdict} (RSS bound {args.rss_bound_mib} MiB)")
    if errors:
        print("  first errors:", errors[:3])


def run_load(server: VllmServer, args: argparse.Namespace) -> tuple[dict, list[str]]:
    """Steady open-loop load for args.minutes; returns the report and any request errors."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.choice((256, 512, 768)))]
                for _ in range(16)]
    errors: list[str] = []
    done = 0
    lock = threading.Lock()

    def one(req: tuple[list[int], int]) -> None:
        nonlocal done
        try:
            server.complete(req[0], max_tokens=req[1])
            with lock:
                done += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported at the end
            errors.append(repr(e))

    def reset() -> None:
        try:
            server.reset_prefix_cache(wait_s=0)  # refused while requests run; the next will do
        except OSError:  # an HTTP error under load: the next one will do
            pass

    pool = ThreadPoolExecutor(32)
    warm_until = time.monotonic() + 60
    end = time.monotonic() + args.minutes * 60
    rss_warm = None
    next_at = next_reset = time.monotonic()
    while time.monotonic() < end:
        pool.submit(one, request_mix(rng, prefixes))
        if time.monotonic() > next_reset:
            next_reset += args.reset_every
            pool.submit(reset)
        if rss_warm is None and time.monotonic() > warm_until:
            rss_warm = engine_rss(server)
        next_at += 1.0 / args.rate
        time.sleep(max(0.0, next_at - time.monotonic()))
    pool.shutdown(wait=True)
    time.sleep(2.0)
    m = server.metrics()
    rss_end = engine_rss(server)
    return {
        "minutes": args.minutes, "rate_rps": args.rate, "threads": args.threads,
        "requests_ok": done, "request_errors": len(errors),
        "rss_growth_mib": round((rss_end - (rss_warm or rss_end)) / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "queue_depth_end": metric_sum(m, P + "load_queue_depth"),
        "inflight_end": metric_sum(m, P + "load_inflight"),
        "kv_cache_usage_end": metric_sum(m, "vllm:kv_cache_usage_perc"),
        "store_failures": metric_sum(m, P + "failures_total"),
        "load_jobs": metric_sum(m, P + "load_jobs_total"),
        "load_GiB": round(metric_sum(m, P + "load_bytes_total") / 2**30, 3),
        "hit_tokens": metric_sum(m, "vllm:external_prefix_cache_hits_total"),
    }, errors

if __name__ == "__main__":
    main()
