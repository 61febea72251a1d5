"""The demo's summary reads /metrics as an operator would: receive threads by number, the
in-step thread (numbered like the receive-thread count) on a line of its own, and a job that
expired in the queue (thread="queued") counted without breaking the summary."""

from __future__ import annotations

from devkit.demo import summary

P = "vllm:mooncake_pool_load_jobs_total"


def jobs(thread: str, status: str, n: float) -> dict[str, float]:
    return {f'{P}{{engine="0",status="{status}",thread="{thread}",tp_rank="0"}}': n}


def test_the_in_step_thread_and_queued_jobs_are_told_apart():
    after = {**jobs("0", "ok", 2), **jobs("10", "ok", 1), **jobs("2", "ok", 3),
             **jobs("12", "ok", 5), **jobs("queued", "error", 1)}
    lines = summary({}, after, 16, 1.0, 12).splitlines()
    assert "jobs per receive thread    t0=2, t2=3, t10=1" in lines
    assert "jobs in the engine step    5 (the in-step thread)" in lines
    assert "load jobs failed           1" in lines


def test_no_in_step_loads():
    lines = summary({}, jobs("1", "ok", 4), 4, 1.0, 4).splitlines()
    assert "jobs per receive thread    t1=4" in lines
    assert "jobs in the engine step    0 (the in-step thread)" in lines
