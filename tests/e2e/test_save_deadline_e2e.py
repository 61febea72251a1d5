"""A save past its deadline never stores another request's KV, end to end; and an idle engine
shows the stuck call's end on /metrics.

`staging: off`, the path GPUs take: every put is a zero-copy call that reads the KV blocks for
its whole duration. A store node of this module's own is frozen (SIGSTOP) until a save call
has outlived `save_timeout_s` and the engine has preempted, while it serves a burst that
preempts (a 40-block KV cache). Afterwards a fresh engine (started with the first, idle until
then) loads those prefixes from the store and must give the greedy tokens of the prompts
computed from scratch (salted, on that engine once it has loaded: tests/engines.py): no stored
block holds another request's KV. Engines run float32, `VllmServer`'s default.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from connector.observability.metric_catalog import PREFIX as P
from devkit.processes import freeze, thaw
from devkit.vllm_server import VllmServer, connector_kv_config, metric_sum, start_together
from tests.conftest import engine_extra, make_prompts
from tests.engines import salted

pytestmark = pytest.mark.timed

MAX_TOKENS = 48
# A put against the frozen node waits Mooncake's transfer timeout for each group of slices, so
# it outlives save_timeout_s by far; once the node is resumed it completes.
EXTRA = {"cache_prefix": "save-deadline-e2e", "staging": "off", "load_threads": 2,
         "save_timeout_s": 0.5, "transfer_timeout": 1}


@pytest.fixture(scope="module")
def cluster():
    from devkit.local_cluster import local_pool

    with local_pool("256MB") as pool:
        yield pool


def engine(model: str, master, *args: str) -> VllmServer:
    return VllmServer(model, connector_kv_config(engine_extra(master, **EXTRA)),
                      max_model_len=1024, extra_args=args)


def preemptions(m: dict[str, float]) -> float:
    return metric_sum(m, "vllm:num_preemptions_total")


def test_frozen_store_node_past_the_save_deadline_stores_only_right_blocks(tiny_model,
                                                                           cluster):
    master, node = cluster
    work = make_prompts(6, seed=25)

    a = engine(tiny_model, master, "--num-gpu-blocks-override", "40")
    b = engine(tiny_model, master)  # started with `a`, idle (nothing cached) until it loads
    try:
        start_together([a, b])
        before = a.metrics()
        freeze(node.proc)
        frozen_at = time.monotonic()
        try:
            with ThreadPoolExecutor(12) as pool:
                burst = [pool.submit(a.complete, p, MAX_TOKENS) for p in work * 2]
                # Frozen until a save call has outlived save_timeout_s (its thread counts as
                # stuck) and the engine has preempted meanwhile.
                stuck = False
                deadline = time.monotonic() + 120
                while True:
                    m = a.metrics()
                    stuck |= metric_sum(m, P + "threads_stuck", op="save") > 0
                    if stuck and preemptions(m) > preemptions(before):
                        break
                    assert time.monotonic() < deadline, "no stuck save and preemption seen"
                    time.sleep(0.2)
                thaw(node.proc)
                print(f"store node frozen {time.monotonic() - frozen_at:.1f}s, "
                      f"{preemptions(m) - preemptions(before):.0f} preemptions by then")
                served = [f.result(timeout=300) for f in burst]
        finally:
            thaw(node.proc)
        # Let the saves drain (the stuck puts return now the node answers) before the stop.
        deadline = time.monotonic() + 120
        while True:
            a.complete(work[0][:40], max_tokens=1)  # a step, so the gauges are sent
            m = a.metrics()
            if (metric_sum(m, P + "threads_stuck") == 0
                    and metric_sum(m, P + "save_queue_depth") == 0):
                break
            assert time.monotonic() < deadline, "saves never drained after the freeze"
            time.sleep(0.5)
        a.stop()
        again = [b.complete(p, MAX_TOKENS) for p in work]
        m = b.metrics()
        truth = salted(b, work, MAX_TOKENS)
    finally:
        a.stop()
        b.stop()
    assert served == truth * 2, "a request served during the freeze changed its output"
    assert again == truth, "a block loaded from the store holds another request's KV"
    assert metric_sum(m, P + "load_bytes_total") > 0, "nothing was loaded from the store"


def test_an_idle_engine_shows_a_stuck_save_end_on_metrics(tiny_model, cluster):
    """A worker's gauges reach /metrics only in an engine step's output, and an idle engine
    takes none. A staged save stuck on a frozen store node is expired at its deadline (its
    request then finishes: the engine goes idle) while its put still runs: the thread counts as
    stuck. Once the node answers, the put returns, and with no request meanwhile /metrics
    shows it (connector/scheduler/gauge_refresh.py); before, `threads_stuck` stayed at 1, and
    its critical alert fired on a healthy idle engine, until the next request."""
    master, node = cluster
    a = VllmServer(tiny_model, connector_kv_config(engine_extra(
        master, cache_prefix="idle-gauges", staging="on", save_timeout_s=0.5,
        transfer_timeout=30)), max_model_len=1024)
    try:
        a.start()
        freeze(node.proc)
        try:
            a.complete(make_prompts(1, seed=31)[0], max_tokens=1)
            deadline = time.monotonic() + 60
            while metric_sum(a.metrics(), P + "threads_stuck", op="save") == 0:
                assert time.monotonic() < deadline, "the save never counted as stuck"
                time.sleep(0.2)
        finally:
            thaw(node.proc)
        deadline = time.monotonic() + 60
        while metric_sum(m := a.metrics(), P + "threads_stuck") > 0:
            assert time.monotonic() < deadline, (
                f"threads_stuck stayed {metric_sum(m, P + 'threads_stuck')} on an idle engine")
            time.sleep(0.2)
        assert metric_sum(m, "vllm:request_success_total") == 1  # no request since
    finally:
        a.stop()
