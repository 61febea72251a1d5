"""load_threads: auto in a real worker against a real store: the active count moves and is
exported."""

from __future__ import annotations

from connector.metadata import BlockTransfer, StepMetadata
from tests.worker_kit import hashes, run_step


def test_worker_auto_exports_active_count(make_worker_on, master, store_node):
    w = make_worker_on(master, threads="auto", prefix="auto", load_threads_max=4)
    assert w.pool.size == 4
    g = w.recorder.current_gauges()
    assert g["recv_threads|0"] == 4 and 1 <= g["recv_threads_active|0"] <= 4
    hs = hashes("auto", 16)
    run_step(w, StepMetadata(saves=(BlockTransfer("seed", tuple(range(16)), hs),),
                             free_after_jobs=("seed",)))
    loads = tuple(BlockTransfer(f"r{i}", tuple(range(16)), hs) for i in range(300))
    done, errors = run_step(w, StepMetadata(loads=loads), timeout=120)
    assert len(done) == 300 and errors == set()
    assert w.recorder.current_gauges()["recv_threads_active|0"] == w.pool.active
