"""Sharing the store across TP sizes in real `vllm serve` (float32, so outputs compare exactly):
a TP=2 engine fills the store, a fresh TP=1 engine takes most of its prompt tokens from it and
gives the greedy tokens of an engine without the connector; then the TP=1 engine fills and the
TP=2 engine that filled first loads (its local prefix cache reset, so its prefixes can only come
from the store; it stays up meanwhile instead of a second TP=2 start). Both sides run with
`store_tp_size: 2` (the in-tree setting: each block is two objects of half the KV heads,
whichever TP size wrote them). The two engines start together (`start_together`: a start is
mostly one process importing vLLM, on one core), and the reader waits idle until the writer's
saves are all reported.

Three models: a Llama with 8 heads and 4 KV heads (GQA: each TP=2 rank moves its own shard, the
TP=1 engine both), a Llama with sliding-window layers beside full attention (two KV cache
groups: the sliding one stores and loads only its window), and a DeepSeek-V2 with MLA (one
latent object per block, written by rank 0, read by every rank). With the GQA model also
`store_tp_size: 1`: a TP=1 engine stores one object per block and each TP=2 rank reads its
half of it.

The TP=2 engine also publishes the store's KV events (`--kv-events-config`, ZMQ) to a
subscriber decoding with vLLM's `KVEventBatch`: each block it fills is announced once, though
every rank wrote its own part of it (docs/kv-events.md), in every layout, and announced again
after vLLM's AllBlocksCleared (a prefix cache reset).

TP=2 on this 2-core host. Each rank's main thread busy-waits on vLLM's shared-memory step
queue (it spins for a second after each step, and the engine steps continuously while a
request waits for its KV). Bound one core per rank (`VLLM_CPU_OMP_THREADS_BIND=0|1`, as
these engines ran until the binding was measured to confine every thread of a rank, its
receive threads and Mooncake's, to the core of that spinning thread; they now run unbound,
tests/engines.py), with anything else busy on the host, a load was seen taking seconds
there (milliseconds on the TP=1 engine beside it), past the default `load_timeout_s` and
Mooncake's default lease (`LEASE_EXPIRED`), and in a serial run the whole host was seen to
stall for about a minute (every process's periodic log lines missing; a master RPC of the
TP=1 engine timed out with -901 after Mooncake's 60 s): so these engines and their master are
patient, two minutes for a lookup, a load, a save, a master call and a lease (CI saw a TP=2
engine find one of three stored prompts, the others missed; a lookup past the default 2 s is a
miss, and the assertion now shows the lookups by result; it happened again with patient
lookups, each a miss, so a writer now waits until its saves are reported and fails if a key
was not written, naming the cause). So loads here are all asynchronous
(`sync_load_ms: 0`): an in-step load's deadline is at most 10 s (with the default, 1 s, the TP=2
engine reading slices was seen failing its loads); the in-step path at TP=2 is
tests/e2e/test_save_guard_tp.py's. This test is about layouts; deadlines have their own
tests.

Each output is compared with the same prompts computed from scratch on an engine of each TP
size (salted: tests/engines.py), taken from the engines under test once their store checks
are done (a salted request is saved and announced too). Where those two agree, the engine must
give exactly their tokens. Where they disagree (a near-tie of the tiny random model that TP=2's
other summation order tips, seen with MLA: the outputs part from the second token of one
prompt), a reader of the other TP size's KV must give one of them: it was seen giving exactly
the writer's, as a bit-exact copy of the writer's prefix should.

This is also where the suite shows that a salted reference is the output of an engine without
the connector, once per layout the other files rely on it for: GQA, hybrid and MLA at TP=1 and
GQA at TP=2 (the fault matrix's rows use the same models), against engines without the
connector (`references`), started together after the connector's engines stopped.
"""

from __future__ import annotations

import random

import pytest

from devkit.local_cluster import local_pool
from devkit.tiny_model import make_tiny_llama, make_tiny_mla
from devkit.vllm_server import (
    VllmServer,
    connector_kv_config,
    engine_block_size,
    metric_sum,
    start_together,
)
from tests.conftest import engine_extra
from tests.e2e.kv_events_kit import Subscriber, blocks_of
from tests.e2e.store_kit import settled_keys, wait_for_saves
from tests.engines import TP_START_TIMEOUT_S, salted, tp_args, tp_env

pytestmark = pytest.mark.timed  # TP=2 engines: both cores (tests/conftest.py TIMING_MARKS)

LOAD_TIMEOUT_S = 120.0  # and the lease, below: see the module's docstring
MODELS = {
    "gqa": lambda d: make_tiny_llama(d, hidden=256, heads=8, kv_heads=4),
    "hybrid": lambda d: make_tiny_llama(d, heads=4, kv_heads=2, sliding_window=64),
    "mla": lambda d: make_tiny_mla(d),
}


@pytest.fixture(scope="module")
def patient_master():
    """A master that keeps an object leased for two minutes after a lookup, and its store
    node; and that waits as long for a client's heartbeat before it drops the client and
    unmounts its segment (Mooncake's `--client_ttl`, 10 s by default). Seen here with the
    default: the master's own 10-s log line came 10 s late, then it dropped the store node
    (alive all along) and the 11 saves of one prompt whose puts were in flight on its segment
    (`BatchPutEnd` OBJECT_NOT_FOUND); the segment was mounted again 10 s later."""
    with local_pool("512MB", extra_args=(
            f"--default_kv_lease_ttl={int(LOAD_TIMEOUT_S * 1000)}",
            f"--client_ttl={int(LOAD_TIMEOUT_S)}")) as (master, _node):
        yield master


def distinct_prompts(seed: int, n: int = 3, tokens: int = 368) -> list[list[int]]:
    """Prompts that share nothing, so every prompt's prefix can only come from the store."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(tokens)] for _ in range(n)]


def engine(model: str, tp: int, master, prefix: str, store_tp: int = 2,
           events: tuple[Subscriber, str] | None = None) -> VllmServer:
    """An engine with the connector (float32, VllmServer's default), `tp` ranks, not started
    (`start_together`); with `events` (a subscriber and a topic) it publishes the store's KV
    events there (no removal sweep: this store never evicts)."""
    extra = engine_extra(master, cache_prefix=prefix, store_tp_size=store_tp,
                         lookup_timeout_s=LOAD_TIMEOUT_S, load_timeout_s=LOAD_TIMEOUT_S,
                         save_timeout_s=LOAD_TIMEOUT_S, sync_load_ms=0)
    args = tp_args(tp)
    if events:
        sub, topic = events
        extra.update(kv_events="on", kv_events_sweep_s=0)
        args += sub.engine_args(topic)
    return VllmServer(model, connector_kv_config(extra), env=tp_env(tp), extra_args=args)


def delta(server: VllmServer, before: dict) -> dict:
    after = server.metrics()
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def serve(server: VllmServer, prompts: list[list[int]]) -> tuple[list[list[int]], dict]:
    before = server.metrics()
    outputs = [server.complete(p) for p in prompts]
    return outputs, delta(server, before)


def fill(server: VllmServer, prompts: list[list[int]]) -> list[list[int]]:
    """Serve `prompts` and wait until every save is stored (the local prefix cache reset:
    nothing is local after it) and reported, each block's keys written, found or failed; a
    key a save did not write fails here, naming the cause, rather than as a miss of the
    engine that reads (CI once saw two of three prompts miss)."""
    before, settled0 = server.metrics(), settled_keys(server)
    outputs = [server.complete(p) for p in prompts]
    server.reset_prefix_cache()
    blocks = sum(len(p) // engine_block_size(server.model) for p in prompts)
    wait_for_saves(server, settled0 + blocks, timeout=60)
    saves = {k: v for k, v in delta(server, before).items()
             if ("mooncake_pool_save" in k or "mooncake_pool_failures" in k) and v}
    assert metric_sum(saves, "vllm:mooncake_pool_save_error_keys_total") == 0, saves
    return outputs


def check_outputs(got: list, own: list, other: list) -> None:
    """`own`'s tokens, or `other`'s where the references of the two TP sizes disagree."""
    for g, a, b in zip(got, own, other, strict=True):
        assert g == a or (a != b and g == b), (g, a, b)


def check_from_store(delta: dict, prompts: list[list[int]], tp: int) -> None:
    """At least half of the prompt tokens came from the store, on every rank, without errors;
    the loads are counted under this engine's TP size and the stored layout's."""
    hit = metric_sum(delta, "vllm:external_prefix_cache_hits_total")
    failures = {k: v for k, v in delta.items() if "mooncake_pool_failures_total" in k and v}
    lookups = {k: v for k, v in delta.items() if "mooncake_pool_lookups_total" in k and v}
    assert hit >= 0.5 * sum(map(len, prompts)), (f"TP={tp} reader", hit, sum(map(len, prompts)),
                                                 lookups, failures)
    assert metric_sum(delta, "vllm:mooncake_pool_load_jobs_total", status="error") == 0, failures
    for rank in range(tp):
        assert metric_sum(delta, "vllm:mooncake_pool_layout_keys_total", op="load",
                          tp_rank=str(rank), tp_size=str(tp)) > 0


FULL_KINDS = ("full_attention", "mla_attention")  # groups that keep every block of a prompt


def check_one_event_per_block(sub: Subscriber, topic: str, server: VllmServer,
                              prompts: list[list[int]]) -> None:
    """Every block the TP=2 engine filled is announced once per full-attention KV cache group,
    whichever rank wrote which part: every full block, nothing twice, nothing else, and no
    sliding-window group (docs/kv-events.md). Then the engine's prefix cache is reset: vLLM's
    AllBlocksCleared empties a router's view of this engine, and the connector announces every
    block again right after it."""
    bs = engine_block_size(server.model)  # the connector's blocks, and events, are vLLM's
    want = blocks_of(prompts, bs)

    def full_groups(events: list) -> dict[int, list[tuple[int, ...]]]:
        groups: dict[int, list[tuple[int, ...]]] = {}
        for e in events:
            if e.kv_cache_spec_kind in FULL_KINDS:
                groups.setdefault(e.group_idx, []).append(tuple(e.token_ids))
        return groups

    t = sub.wait(topic, lambda t: bool(full_groups(t.stored)) and all(
        len(v) >= len(want) for v in full_groups(t.stored).values()),
        f"a BlockStored per filled block ({len(want)})", server)
    live = t.live
    server.reset_prefix_cache()  # every save stored: the last reports come in the next steps

    def published() -> float:
        return metric_sum(server.metrics(), "vllm:mooncake_pool_kv_events_total", kind="stored")

    # vLLM's publisher and its stats reach the subscriber and /metrics on their own paths:
    # wait (poking the engine) until both tell the same count, and the reset's AllBlocksCleared
    # and the announcements after it arrived.
    t = sub.wait(topic, lambda t: bool(t.clears) and published() == len(t.stored)
                 and t.live == live, "every event counted arrived, and the store's blocks "
                 "announced again after the reset", server)
    first = t.before_clear()
    kinds = {(e.group_idx, e.kv_cache_spec_kind) for e in first}
    print(f"{topic}: {len(first)} BlockStored for {len(want)} blocks, groups {kinds}; "
          f"{len(t.stored) - len(first)} again after the reset")
    assert t.violations == [] and t.removed == [], (t.violations[:5], t.removed[:5])
    assert all(e.kv_cache_spec_kind in FULL_KINDS for e in t.stored), kinds
    for blocks in full_groups(first).values():
        assert sorted(blocks) == sorted(want)  # each block once, though both ranks wrote
    announced = [(e.group_idx, e.block_hashes[0]) for e in first]
    assert len(set(announced)) == len(announced)
    assert {tuple(e.token_ids) for e in t.stored} <= set(want)
    assert all((e.medium, e.locality, e.block_size) == ("STORAGE", None, bs) for e in t.stored)


@pytest.mark.parametrize("kind", list(MODELS))
def test_tp2_and_tp1_engines_share_the_store(kind, tmp_path_factory, patient_master,
                                             references, sub):
    master = patient_master
    model = str(MODELS[kind](tmp_path_factory.mktemp(f"cross-tp-{kind}")))
    first, second = distinct_prompts(1), distinct_prompts(2)
    prefix = f"cross-tp-{kind}"

    # The TP=2 engine fills (each rank stores its objects) and announces each block once;
    # the TP=1 engine, started with it and idle meanwhile, loads those blocks, then fills.
    tp2 = engine(model, 2, master, prefix, events=(sub, kind))
    tp1 = engine(model, 1, master, prefix)
    try:
        start_together([tp2, tp1], TP_START_TIMEOUT_S)
        filled2, _ = serve(tp2, first)
        check_one_event_per_block(sub, kind, tp2, first)  # and then nothing is local

        got1, delta1 = serve(tp1, first)
        filled1 = fill(tp1, second)
        want1 = [salted(tp1, ps) for ps in (first, second)]
        tp1.stop()

        got2, delta2 = serve(tp2, second)  # and the reverse, on the engine that filled
        want2 = [salted(tp2, ps) for ps in (first, second)]
    finally:
        tp1.stop()
        tp2.stop()
    assert filled2 == want2[0] and filled1 == want1[1]
    check_outputs(got1, want1[0], want2[0])
    check_from_store(delta1, first, 1)
    check_outputs(got2, want2[1], want1[1])
    check_from_store(delta2, second, 2)
    salted_is_unconnected(references, model, {1: want1, 2: want2 if kind == "gqa" else None},
                          (first, second))
    if kind == "gqa":
        reads_slices(model, master, prefix + "-s1", distinct_prompts(3))


def salted_is_unconnected(references, model: str, salted_outputs: dict, prompt_sets: tuple
                          ) -> None:
    """The salted outputs of the connector's engines (per TP size; None: not checked at that
    size) are exactly the outputs of an engine without the connector of the same TP size."""
    references.start(model, [tp for tp, out in salted_outputs.items() if out is not None])
    for tp, outputs in salted_outputs.items():
        if outputs is None:
            continue
        plain = [references.outputs(model, ps, tp=tp) for ps in prompt_sets]
        assert outputs == plain, (f"TP={tp}: a salted reference differs from an engine "
                                  f"without the connector", outputs, plain)
    references.release(model)


def reads_slices(model: str, master, prefix: str, prompts: list) -> None:
    """store_tp_size 1: a TP=1 engine stores each block as one object; each rank of a TP=2
    engine (started with it, idle until then) reads only its half of it (ranged gets), and
    saves nothing."""
    tp1 = engine(model, 1, master, prefix, store_tp=1)
    tp2 = engine(model, 2, master, prefix, store_tp=1)
    try:
        start_together([tp1, tp2], TP_START_TIMEOUT_S)
        filled = fill(tp1, prompts)  # every save stored before the TP=2 engine looks
        want1 = salted(tp1, prompts)
        tp1.stop()
        got, delta = serve(tp2, prompts)
        want2 = salted(tp2, prompts)
    finally:
        tp1.stop()
        tp2.stop()
    assert filled == want1
    check_outputs(got, want2, want1)
    check_from_store(delta, prompts, 2)
    assert metric_sum(delta, "vllm:mooncake_pool_layout_keys_total", op="load",
                      layout="kv_heads_slice") > 0
    assert metric_sum(delta, "vllm:mooncake_pool_save_keys_total") == 0
