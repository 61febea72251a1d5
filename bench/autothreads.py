"""`load_threads: auto` against every fixed thread count, on workloads whose best fixed
setting differs (CPU-bound with no master delay: few threads; a slow master: many).

Per cell: workers with T = 1, 2, 4, 8 and one with auto (at most 8), the auto one first run
for `warmup_s` so its tuner has settled (steady state is what an engine runs in), then all
configurations alternate in rounds like the overhead comparison. The target: auto's median
throughput within 10 % of the best fixed setting's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from bench.drivers import OursDriver
from bench.loop import Guard, run_workload
from bench.overhead import Comparison, alternate
from bench.testbed import Source, Testbed
from bench.workloads import Geometry, Workload


def auto_vs_fixed(testbed: Testbed, geometry: Geometry, caches: dict[str, torch.Tensor],
                  source: Source, cells: Sequence[tuple[float, Workload]],
                  threads: Sequence[int], rounds: int, duration_s: float, warmup_s: float,
                  lookup_ratio: float, guard: Guard) -> list[dict[str, Any]]:
    out = []
    for rtt, workload in cells:
        master = testbed.set_rtt(rtt)
        drivers = {f"T{t}": OursDriver(testbed, master, geometry, caches, source, t,
                                       lookup_ratio) for t in threads}
        try:
            drivers["auto"] = auto = OursDriver(testbed, master, geometry, caches, source,
                                                max(threads), lookup_ratio, label="auto",
                                                auto=True)
            run_workload(auto, workload, source, caches, geometry.block_bytes, warmup_s, 1,
                         verify=False)
            settled = auto.worker.pool.active
            comp = Comparison(workload.name, max(threads), rtt, "auto")
            alternate(drivers, workload, rounds, duration_s, 10, testbed, source, caches,
                       geometry.block_bytes, comp, guard)
            s = comp.summary()
            fixed = {k: v["gbps_median"] for k, v in s["configs"].items() if k != "auto"}
            best = max(fixed, key=fixed.get)
            out.append({"workload": workload.name, "master_rtt_ms": rtt,
                        "blocks_per_job": workload.sizes[0], "max_threads": max(threads),
                        "gbps": {k: v["gbps_median"] for k, v in s["configs"].items()},
                        "best_fixed": best,
                        "auto_over_best_fixed": round(s["configs"]["auto"]["gbps_median"]
                                                      / fixed[best], 3),
                        "auto_threads_after_warmup": settled,
                        "auto_threads_at_end": auto.worker.pool.active,
                        "rounds": rounds, "warmup_s": warmup_s})
        finally:
            for d in drivers.values():
                d.close()
    testbed.set_rtt(0.0)
    return out


def format_auto(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["load_threads auto vs fixed (median GB/s of alternating rounds)"]
    for r in rows:
        fixed = "  ".join(f"{k} {v:.3f}" for k, v in r["gbps"].items() if k != "auto")
        lines.append(f"  {r['workload']:<9} RTT {r['master_rtt_ms']:g} ms: {fixed}  | auto "
                     f"{r['gbps']['auto']:.3f} (threads {r['auto_threads_after_warmup']} after "
                     f"warm-up, {r['auto_threads_at_end']} at end) = "
                     f"{r['auto_over_best_fixed']:.2f}x best fixed ({r['best_fixed']})")
    return "\n".join(lines)
