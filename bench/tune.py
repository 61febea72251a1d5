"""Pick `load_threads` for your own store: sweep receive-thread counts through the connector's
real load path against your Mooncake master, with your block size and request mix, and
recommend the smallest count within 5 % of the best throughput that had no load errors.

    python -m bench.tune --master 10.0.0.5:50051 \\
        --metadata-server http://10.0.0.5:8080/metadata --local-hostname 10.0.0.9 \\
        --block-kib 512 --mix 4:6,16:3,512:1 --threads 1,2,4,8,16 --plot tune.png

    python -m bench.tune --local --rtt-ms 1      # try it on a local master + store node

It writes `--source-blocks` blocks of its own under a fresh key prefix, reads them back in
the mix, and deletes them at the end. `--mix` is `blocks:weight,...` (requests of that many
blocks, in that proportion); `--concurrency` requests are kept outstanding, as the engine
would with that many waiting requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ERROR_HINT = (
    "load errors at some thread counts: with protocol tcp, Mooncake queues at most ~1024 "
    "transfers (key x KV region) per peer; raise MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and "
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER (e.g. 65535) in the engine's environment, or use "
    "fewer threads")


def parse_mix(text: str) -> tuple[int, ...]:
    """`4:6,16:3,512:1` -> a deterministic shuffled cycle of request sizes."""
    sizes: list[int] = []
    for part in text.split(","):
        blocks, _, weight = part.partition(":")
        sizes += [int(blocks)] * int(weight or 1)
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"bad --mix {text!r}; use blocks:weight,...")
    random.Random(0).shuffle(sizes)
    return tuple(sizes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_argument_group("store")
    where.add_argument("--master", help="Mooncake master host:port")
    where.add_argument("--metadata-server", help="e.g. http://host:8080/metadata")
    where.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    where.add_argument("--device-name", default="", help="RDMA device(s) for protocol rdma")
    where.add_argument("--local-hostname", default="127.0.0.1",
                       help="this host's address as the store nodes reach it")
    where.add_argument("--local", action="store_true",
                       help="start a local master + store node instead")
    p.add_argument("--rtt-ms", type=float, default=0.0,
                   help="add this master round trip through a delay proxy (emulation)")
    p.add_argument("--block-kib", type=int, default=128, help="KV block size across layers")
    p.add_argument("--layers", type=int, default=0,
                   help="KV regions per block (default: block-kib / 16)")
    p.add_argument("--mix", type=parse_mix, default=parse_mix("4:6,16:3,64:1"),
                   help="request sizes in blocks with weights (default 4:6,16:3,64:1)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per run")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions")
    p.add_argument("--source-blocks", type=int, default=256)
    p.add_argument("--cache-blocks", type=int, default=2048, help="destination KV blocks")
    p.add_argument("--plot", type=Path, default=Path("tune.png"))
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if not a.local and not (a.master and a.metadata_server):
        p.error("give --master and --metadata-server, or --local")
    a.threads = [int(x) for x in a.threads.split(",") if x.strip()]
    return a


@contextmanager
def _testbed(a: argparse.Namespace) -> Iterator[Any]:
    from bench.testbed import Testbed

    if a.local:
        with Testbed.local(segment="1GB") as tb:
            yield tb
    else:
        yield Testbed(a.master, a.metadata_server, a.protocol, a.device_name,
                      a.local_hostname, pids={"client": os.getpid()})


def recommend(rows: list[dict[str, Any]], tolerance: float = 0.05) -> dict[str, Any] | None:
    """Smallest thread count with no errors and throughput within `tolerance` of the best."""
    ok = [r for r in rows if r["error_blocks"] == 0 and r["gbps"] > 0]
    if not ok:
        return None
    best = max(r["gbps"] for r in ok)
    return min((r for r in ok if r["gbps"] >= best * (1 - tolerance)),
               key=lambda r: r["threads"])


def plot(rows: list[dict[str, Any]], rec: dict[str, Any] | None, title: str, path: Path
         ) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["threads"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, [r["gbps"] for r in rows], "o-", color="tab:blue", label="throughput")
    ax.set_xscale("log", base=2)
    ax.set_xticks(t, [str(x) for x in t])
    ax.set_xlabel("receive threads (load_threads)")
    ax.set_ylabel("load throughput (GB/s)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(t, [r["p99_ms"] for r in rows], "s--", color="tab:red", label="p99 latency")
    ax2.set_ylabel("p99 request load latency (ms)", color="tab:red")
    if rec is not None:
        ax.axvline(rec["threads"], color="gray", linestyle=":")
        ax.annotate(f"recommended: {rec['threads']}", (rec["threads"], rec["gbps"]),
                    textcoords="offset points", xytext=(8, -14))
    ax.set_title(title, fontsize=9)
    save_figure(fig, path, 110)


def save_figure(fig: Any, path: Path, dpi: int) -> None:
    """Lay out, write (creating the folder) and release a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("GLOG_minloglevel", "1")
    import torch

    from bench.drivers import OursDriver
    from bench.loop import run_workload
    from bench.testbed import fill_store, remove_source
    from bench.workloads import Geometry, Workload

    torch.set_num_threads(1)
    if a.layers:
        geometry = Geometry(layers=a.layers, num_blocks=a.cache_blocks,
                            head_size=a.block_kib * 1024 // (a.layers * 32 * 2 * 2))
    else:
        geometry = Geometry.for_block_bytes(a.block_kib * 1024, a.cache_blocks)
    workload = Workload("mix", a.mix, a.concurrency)
    caches = geometry.make_caches()
    runs: dict[int, list[Any]] = {t: [] for t in a.threads}
    with _testbed(a) as tb:
        master = tb.set_rtt(a.rtt_ms)
        source = fill_store(tb, geometry, a.source_blocks,
                            prefix=f"bench-tune-{uuid.uuid4().hex[:8]}", intree=False)
        try:
            drivers = {t: OursDriver(tb, master, geometry, caches, source, t, 0.0)
                       for t in a.threads}
            try:
                for d in drivers.values():
                    run_workload(d, workload, source, caches, geometry.block_bytes, 0.0, 2,
                                 verify=False)
                for rep in range(a.reps):
                    order = a.threads if rep % 2 == 0 else a.threads[::-1]
                    for t in order:
                        r = run_workload(drivers[t], workload, source, caches,
                                         geometry.block_bytes, a.duration, 10, tb.cpu_meter())
                        runs[t].append(r)
                        print(f"  T={t:<3} rep {rep}: {r.gbps:.3f} GB/s, "
                              f"p99 {r.percentile(99):.1f} ms, errors {r.error_blocks}",
                              file=sys.stderr)
            finally:
                for d in drivers.values():
                    d.close()
        finally:
            remove_source(tb, source)
            tb.set_rtt(0.0)

    rows = []
    for t in a.threads:
        rs = runs[t]
        lat = sorted(x for r in rs for x in r.latencies_ms)
        q = lambda f, lat=lat: lat[min(len(lat) - 1, int(f * len(lat)))] if lat else float("nan")
        rows.append({"threads": t, "gbps": round(statistics.median(r.gbps for r in rs), 4),
                     "p50_ms": round(q(0.5), 2), "p99_ms": round(q(0.99), 2),
                     "client_cpu": round(statistics.median(r.cpu.get("client", 0) for r in rs),
                                         2),
                     "error_blocks": sum(r.error_blocks for r in rs)})
    base = rows[0]["gbps"] or 1e-9
    rec = recommend(rows)
    title = (f"{geometry.block_bytes // 1024} KiB blocks ({geometry.layers} regions), mix "
             f"{sorted(set(a.mix))}, {a.concurrency} outstanding, master RTT +{a.rtt_ms:g} ms")
    print(f"\nload_threads sweep: {title}")
    print(f"{'threads':>7} {'GB/s':>7} {'x first':>7} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'client CPU':>10} {'errors':>6}")
    for r in rows:
        print(f"{r['threads']:>7} {r['gbps']:>7.3f} {r['gbps'] / base:>7.2f} {r['p50_ms']:>8.1f} "
              f"{r['p99_ms']:>8.1f} {r['client_cpu']:>10.2f} {r['error_blocks']:>6}")
    if any(r["error_blocks"] for r in rows):
        print(f"\nWARNING: {ERROR_HINT}")
    if rec is None:
        print("\nno thread count loaded without errors; no recommendation")
    else:
        print(f"\nrecommended: load_threads={rec['threads']} "
              f"(kv_connector_extra_config, or VLLM_MOONCAKE_LOAD_RECV_THREADS)")
    plot(rows, rec, title, a.plot)
    print(f"plot: {a.plot}")
    if a.json:
        a.json.write_text(json.dumps({"settings": {"title": title, "mix": list(a.mix),
                                                   "block_bytes": geometry.block_bytes},
                                      "rows": rows,
                                      "recommended": rec and rec["threads"]}, indent=1) + "\n")
    return 0 if rec is not None else 1


if __name__ == "__main__":
    sys.exit(main())
