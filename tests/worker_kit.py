"""Helpers to drive `MooncakeStoreWorker` directly: CPU KV tensors in vLLM's CPU layout, block
hashes, and a poll loop that submits a step and waits like vLLM until every request reports.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict

import pytest
import torch

from connector.config import load_config
from connector.metadata import StepMetadata
from connector.store.client import TIMEOUT_ENV
from connector.store.keys import KeyBuilder, Layout
from connector.worker.worker import MooncakeStoreWorker
from devkit.vllm_kv import vllm_caches  # noqa: F401 - re-exported for the tests

NUM_BLOCKS = 64
LAYERS = 2


def kv_caches(heads: int = 2, seed: int | None = 0) -> dict[str, torch.Tensor]:
    """CPU-layout caches: [2 (K/V), num_blocks, heads, block_size, head_size] per layer."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (2, NUM_BLOCKS, heads, 32, 32)
    return {f"layer.{i}": (torch.randn(shape, generator=g) if g else torch.zeros(shape))
            .to(torch.bfloat16) for i in range(LAYERS)}


def hashes(tag: str, n: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n))


@pytest.fixture
def make_worker_on(monkeypatch):
    """Workers on CPU KV tensors against a given master; shut down after the test. Mooncake's
    call timeouts are process-wide variables that the first worker to set them fixes: each
    test starts without them, so its own workers' configs decide."""
    for var in TIMEOUT_ENV:
        monkeypatch.delenv(var, raising=False)
    workers: list[MooncakeStoreWorker] = []

    def make(master, threads: int = 4, heads: int = 2, caches=None, prefix: str = "unit",
             kv_heads: int = 2, tp_size: int = 1, store_tp: int = 0,
             **extra) -> MooncakeStoreWorker:
        """`kv_heads`, `tp_size`, `store_tp`: the model's KV heads, the TP size (this is rank
        0) and store_tp_size in the key layout; `heads`: this rank's, in the test caches."""
        cfg = load_config(master.store_config(global_segment_size=0, local_buffer_size="32MB",
                                              load_threads=threads, **extra), environ={})
        layout = Layout("unit-model", "bfloat16", 32, kv_heads, 32, LAYERS, tp_size,
                        store_tp_size=store_tp)
        w = MooncakeStoreWorker(cfg, KeyBuilder(prefix, layout), 0, NUM_BLOCKS)
        w.register_kv_caches(caches if caches is not None else kv_caches(heads))
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.shutdown()


def wait_until(cond, timeout: float, what: str) -> None:
    """Poll `cond` until it holds; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def run_step(worker: MooncakeStoreWorker, meta: StepMetadata, timeout: float = 30.0
             ) -> tuple[set[str], set[int]]:
    """Submit a step's loads and saves, then poll like vLLM until every request reports."""
    worker.note_free_after(meta)
    worker.start_load(meta)
    worker.start_save(meta)
    want = {t.req_id for t in meta.loads} | set(meta.free_after_jobs)
    seen: set[str] = set()
    errors: set[int] = set()
    deadline = time.monotonic() + timeout
    while not want <= seen:
        assert time.monotonic() < deadline, f"requests never finished: {want - seen}"
        # As vLLM polls each step: completions first, then the failed blocks; both reach the
        # scheduler in the same step's output.
        sending, recving = worker.get_finished()
        errors |= worker.get_load_errors()
        seen |= (sending or set()) | (recving or set())
        time.sleep(0.005)
    time.sleep(0.02)
    late = worker.get_load_errors()
    assert not late, f"load errors reported after their request finished: {sorted(late)}"
    return seen, errors


def settled_saves(worker, keys: int, timeout: float = 10.0) -> dict[str, float]:
    """The worker's counters once its saves have accounted for exactly `keys` keys, written,
    found stored or lost (a save reports its event just after it lets its request finish)."""
    c: dict[str, float] = defaultdict(float)

    def settled() -> float:
        return sum(c[f"{f}|{worker.tp_rank}"]
                   for f in ("save_keys", "save_skipped_keys", "save_error_keys"))

    deadline = time.monotonic() + timeout
    while settled() < keys:
        assert time.monotonic() < deadline, dict(c)
        snap = worker.recorder.snapshot()
        for k, v in (snap.data["c"].items() if snap else ()):
            c[k] += v
        time.sleep(0.01)
    assert settled() == keys, dict(c)
    return c
