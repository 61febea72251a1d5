"""At TP=2, an in-step load that fails on one rank stores no shard of what its step computed,
in a real `vllm serve` (float32) with in-step loads (connector.worker.rank_agreement).

A prompt P is stored (each rank its shard of every block: store_tp_size 2); then rank 1's
shard of one of P's blocks is replaced by an object of the wrong size, so the lookup hits and
only rank 1's load fails (-600). A request Q extending P by new blocks loads P inside the step
whose forward computes Q's new blocks: rank 0's heads of P are filled, rank 1's are not, and
the forward mixes both into every rank's KV of Q's new blocks. Neither rank may save them.
Had rank 0 saved its shard (as before the ranks agreed), the next computation of Q would write
only rank 1's missing shard and skip rank 0's: the store would hold Q's new blocks with a wrong
shard, and every engine would load them. So after the faulty object is gone and Q was served
again (its blocks from P's third on computed, saved by each rank where missing), Q read wholly
from the store must give the log-probabilities of Q computed from scratch (salted), not only
its greedy tokens: wrong KV that moves no greedy token of the tiny model still moves those.
"""

from __future__ import annotations

import random

import pytest

from connector.observability.metric_catalog import PREFIX as P
from devkit.local_cluster import local_pool
from devkit.tiny_model import make_tiny_llama
from devkit.vllm_server import BLOCK_SIZE, VllmServer, connector_kv_config, metric_sum
from tests.conftest import corrupt_stored_block, engine_extra, plain_client
from tests.e2e.fault_matrix_kit import series
from tests.engines import (
    TP_START_TIMEOUT_S,
    bound_threads,
    from_scratch,
    salt,
    tp_args,
    tp_env,
)

pytestmark = pytest.mark.timed  # TP=2 engines: both cores (tests/conftest.py TIMING_MARKS)

PREFIX = "guard-tp2"
# Loads run in the step (staged, host KV) once the first one gave an estimate: every load of
# these prompts fits a budget of 1 s (the most sync_load_ms takes), and its deadline is 10 s.
EXTRA = {"cache_prefix": PREFIX, "store_tp_size": 2, "staging": "on", "sync_load_ms": 1000,
         "load_threads": 2, "load_timeout_s": 30.0}
IN_STEP = str(EXTRA["load_threads"])  # the in-step thread counts its jobs under this label
WARM_PASSES = 6
LOGPROB_TOL = 1e-4  # float32 logits of the same KV; a wrong shard moves them by far more


def served(server: VllmServer, prompt: list[int]) -> tuple[list, list[float], dict]:
    """`prompt` with its local prefix cache dropped first: (tokens, logprobs, metric deltas
    once its saves ended and a step shipped the workers' counts: saves run after the reply,
    and a slow host was seen to answer before they were counted)."""
    server.reset_prefix_cache()  # every save so far is stored, and nothing is local
    before = server.metrics()
    tokens, logprobs = server.logprobs(prompt)
    server.reset_prefix_cache()  # its saves ended: the connector holds its blocks until then
    server.complete([5, 6, 7], max_tokens=1)  # under a block: no lookup, load or save
    after = server.metrics()
    return tokens, logprobs, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def warmed(server: VllmServer, prompt: list[int]) -> None:
    """`prompt`, stored, served until its load ran inside the step on both ranks: then the
    scheduler expects a load of as many blocks to fit the budget. The first load of a
    process is asynchronous (no estimate yet), and one slowed by a host stall (seen in CI:
    Q's load then stayed asynchronous) is outweighed by the newer ones."""
    for _ in range(WARM_PASSES):
        *_, d = served(server, prompt)
        assert metric_sum(d, P + "load_bytes_total") > 0, "the prompt was not stored"
        if metric_sum(d, P + "load_jobs_total", thread=IN_STEP) == 2:
            return
    raise AssertionError(f"no load of the stored prompt ran in the step in {WARM_PASSES} "
                         f"passes: {series(d, 'load_jobs')}")


def test_a_load_failed_on_one_rank_stores_no_shard_of_its_step(tmp_path_factory):
    model = str(make_tiny_llama(tmp_path_factory.mktemp("guard-tp2"), hidden=256, heads=8,
                                kv_heads=4))
    rng = random.Random(38)
    p = [rng.randrange(3, 1000) for _ in range(8 * BLOCK_SIZE + 5)]
    q = p[:8 * BLOCK_SIZE] + [rng.randrange(3, 1000) for _ in range(6 * BLOCK_SIZE + 5)]
    with local_pool("256MB") as (master, _node):
        server = VllmServer(model, connector_kv_config(engine_extra(master, **EXTRA)),
                            env=tp_env(2), extra_args=tp_args(2)).start(timeout=TP_START_TIMEOUT_S)
        try:
            # No rank's receive threads share one core with its spinning main thread.
            bound = bound_threads(server)
            assert not bound, f"threads bound to CPUs: {bound}"
            served(server, p)  # computed and stored
            warmed(server, p)  # loaded until in-step: Q's load of P runs in the step
            client = plain_client(master)
            try:
                junk = corrupt_stored_block(server, client, PREFIX, p, 3, shard=1, shards=2)
                _, _, faulted = served(server, q)  # P in-step: rank 1's load fails
                assert client.remove(junk, True) == 0  # P's block 3 is rank 0's shard only now
            finally:
                client.close()
            _, _, again = served(server, q)  # computes from block 3 on; each rank saves its part
            tokens, logprobs, read = served(server, q)  # Q from the store alone
            with from_scratch(server):
                truth, truth_logprobs = server.logprobs(q, cache_salt=salt())
        finally:
            server.stop()

    # The fault landed as designed: the load ran in the step, and failed on rank 1 only.
    assert metric_sum(faulted, P + "load_jobs_total", thread=IN_STEP) == 2, \
        f"Q's load did not run in the step on both ranks: {series(faulted, 'load_jobs')}"
    assert metric_sum(faulted, P + "failures_total", op="load", code="-600", tp_rank="1") > 0
    assert metric_sum(faulted, P + "failures_total", op="load", tp_rank="0") == 0
    # Neither rank saved what that step computed: every one of its saves was refused.
    for rank in ("0", "1"):
        assert metric_sum(faulted, P + "failures_total", op="save", code="unsafe",
                          tp_rank=rank) > 0, f"rank {rank} saved the faulted step's blocks"
        assert metric_sum(faulted, P + "save_keys_total", tp_rank=rank) == 0
    assert metric_sum(again, P + "save_keys_total") > 0, \
        f"the recomputation stored nothing of Q: {series(again, 'save')}"
    # Q read from the store: all of it, with the log-probabilities of Q computed.
    assert metric_sum(read, "vllm:external_prefix_cache_hits_total") >= 14 * BLOCK_SIZE
    assert metric_sum(read, P + "load_jobs_total", status="error") == 0
    assert tokens == truth
    worst = max(abs(a - b) for a, b in zip(logprobs, truth_logprobs, strict=True))
    print(f"Q from the store: greedy tokens equal, log-probabilities within {worst:.3g}")
    assert worst <= LOGPROB_TOL, (f"Q loaded from the store is off by {worst:.3g} in "
                                  f"log-probability: a stored shard was computed on a failed "
                                  f"load ({logprobs} vs {truth_logprobs})")

