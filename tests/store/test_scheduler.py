"""Scheduler side against a real master: lookups never stall or raise, hits are block-aligned
and capped, a failed load is never retried in a loop, and blocks are held while jobs run."""

from __future__ import annotations

import concurrent.futures as cf
import time
from types import SimpleNamespace

import pytest

from connector.config import load_config
from connector.observability.events import SHUTDOWN_S
from connector.scheduler.prefix_probe import FIRST_WINDOW
from connector.scheduler.scheduler import MooncakeStoreScheduler
from connector.store.client import StoreUnavailable
from connector.store.keys import KeyBuilder, Layout
from devkit.local_cluster import MooncakeMaster
from devkit.processes import freeze, thaw
from tests.client_kit import CallRecorder
from tests.tracing_kit import STUCK_S, record_closes, timed_shutdown, trace_with
from tests.worker_kit import hashes, wait_until

BS = 32


def request(rid: str, hs: tuple[bytes, ...], num_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, block_hashes=list(hs), num_tokens=num_tokens,
                           num_prompt_tokens=num_tokens)


def blocks(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def ask(sched, req, computed: int = 0, timeout: float = 10.0):
    """Call get_num_new_matched_tokens like vLLM: again each step while it answers None."""
    deadline = time.monotonic() + timeout
    while (res := sched.get_num_new_matched_tokens(req, computed))[0] is None:
        assert time.monotonic() < deadline, "lookup never resolved"
    return res


SIGNATURE = "CPU_ATTN;[2,B,2,32,32]o[0,1,2,3,4]bfloat16x2"


def make(master, **extra) -> MooncakeStoreScheduler:
    cfg = load_config(master.store_config(**extra), environ={})
    keys = KeyBuilder("sched", Layout("m", "bfloat16", BS, 2, 32, 2, 2))  # TP=2
    s = MooncakeStoreScheduler(cfg, keys, BS)
    s.add_layout({r: SIGNATURE for r in range(2)})  # both workers' WorkerReport
    return s


@pytest.fixture
def sched(master, store_node):
    s = make(master)
    yield s
    s.shutdown()


def store_blocks(client, sched, hs, ranks=(0, 1)):
    import numpy as np

    buf = np.zeros(64, dtype=np.uint8)
    client.register_buffer(buf.ctypes.data, buf.nbytes)
    keys = [k for r in ranks for k in sched._keys.keys(hs, r)]
    assert client.batch_put_from(keys, [buf.ctypes.data] * len(keys), [64] * len(keys)) == \
        [0] * len(keys)


def test_hit_needs_every_rank_and_is_capped(sched, store_client):
    hs = hashes("cap", 8)
    store_blocks(store_client, sched, hs[:6])           # blocks 0-5 on both ranks
    store_blocks(store_client, sched, hs[6:7], ranks=(0,))  # block 6 on rank 0 only
    assert ask(sched, request("a", hs, 8 * BS + 5)) == (6 * BS, True)
    # A prompt that ends exactly on a block boundary keeps its last token to compute.
    assert ask(sched, request("b", hs[:6], 6 * BS)) == (5 * BS, True)
    # Tokens vLLM already has locally are not loaded again.
    assert ask(sched, request("c", hs, 8 * BS + 5), computed=4 * BS) == (2 * BS, True)
    assert ask(sched, request("d", hashes("none", 4), 4 * BS + 1)) == (0, False)


def lookup_keys(sched: MooncakeStoreScheduler) -> int:
    return sched.recorder.snapshot().data["c"]["lookup_keys"]


def test_a_gap_deep_in_a_later_window_ends_the_hit_there(sched, store_client):
    """The lookup reads each window's answers in one scan: a block missing far inside the
    second window ends the hit at that block, one missing on one rank too, and with the
    prompt's last block not stored, no window past the gap is asked for."""
    hs = hashes("gap", 400)
    store_blocks(store_client, sched, hs[:150] + hs[151:399])  # all but blocks 150 and 399
    store_blocks(store_client, sched, hs[150:151], ranks=(0,))  # block 150: rank 0 only
    assert ask(sched, request("g", hs, 400 * BS + 1)) == (150 * BS, True)
    # Two windows, the first with the last block; two ranks' keys.
    assert lookup_keys(sched) == (FIRST_WINDOW + 1 + 4 * FIRST_WINDOW) * 2


def store_client_calls(sched: MooncakeStoreScheduler):
    """Count the scheduler's existence checks from now on; returns the count so far."""
    calls: list[int] = []

    class Counting(CallRecorder):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            calls.append(len(keys))
            return self._client.batch_is_exist(keys)

    sched._store.client = Counting(sched._store.require())
    return lambda: len(calls)


def test_a_stored_last_block_asks_for_the_rest_at_once(sched, store_client):
    """A long prompt whose last block is stored is a hit in two store calls (the first window
    with the last block, then the rest), every block asked once; a gap in the rest still ends
    the hit there."""
    hs = hashes("whole", 400)  # windows alone: 64, 256, then the rest
    store_blocks(store_client, sched, hs)
    calls = store_client_calls(sched)
    assert ask(sched, request("w", hs, 400 * BS + 1)) == (400 * BS, True)
    assert lookup_keys(sched) == 400 * 2 and calls() == 2
    gap = hashes("whole-gap", 400)
    store_blocks(store_client, sched, gap[:300] + gap[301:])
    calls = store_client_calls(sched)
    assert ask(sched, request("g", gap, 400 * BS + 1)) == (300 * BS, True)
    assert lookup_keys(sched) == 400 * 2 and calls() == 2  # counted since the last read


class AnsweredJustLate(cf.Future):
    """A lookup whose answer arrives just after the scheduler's wait for it gave up: the
    first `result` raises TimeoutError with the future already done."""

    def __init__(self, real: cf.Future) -> None:
        super().__init__()
        self._real = real

    def result(self, timeout: float | None = None):
        if not self.done():
            self.set_result(self._real.result())
            raise cf.TimeoutError
        return super().result(timeout)


class CountingSubmits:
    def __init__(self, executor: cf.Executor) -> None:
        self.executor, self.submits = executor, 0

    def submit(self, fn, *args):
        self.submits += 1
        return AnsweredJustLate(self.executor.submit(fn, *args))

    def shutdown(self, **kw) -> None:
        self.executor.shutdown(**kw)


def test_an_answer_that_comes_just_after_the_wait_is_used_not_asked_again(sched, store_client):
    """A CI run under load asked the master twice for one lookup: the answer came between
    the step's wait giving up and the scheduler's check, and was thrown away."""
    hs = hashes("late", 70)
    store_blocks(store_client, sched, hs)
    sched._executor = CountingSubmits(sched._executor)
    calls = store_client_calls(sched)
    assert ask(sched, request("l", hs, 70 * BS + 1), timeout=2.0) == (70 * BS, True)
    assert sched._executor.submits == 1 and calls() == 2
    assert lookup_keys(sched) == 70 * 2


@pytest.mark.parametrize("aged", [False, True])
def test_failed_load_is_not_retried(master, store_node, store_client, aged):
    """`aged`: the load failed at its deadline (load_timeout_s, 5 s), past the answer's own
    (lookup_answer_ttl_s, 5 s): "nothing more" does not age into a fresh lookup, or a store
    node that fails every load would have each request load, fail and load again."""
    sched = make(master, lookup_answer_ttl_s=0.2)
    try:
        hs = hashes("retry", 4)
        store_blocks(store_client, sched, hs)
        req = request("r", hs, 4 * BS + 1)
        assert ask(sched, req) == (4 * BS, True)
        sched.update_state_after_alloc(req, blocks([10, 11, 12, 13, 14]), 4 * BS)
        meta = sched.build_connector_meta(SimpleNamespace(
            preempted_req_ids=set(), scheduled_new_reqs=[], num_scheduled_tokens={},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                  new_block_ids=[], num_computed_tokens=[])))
        assert [(t.req_id, t.block_ids) for t in meta.loads] == [("r", (10, 11, 12, 13))]
        if aged:
            time.sleep(0.3)
        # The load failed; vLLM recomputes and asks again: the answer is now "nothing".
        sched.update_connector_output(SimpleNamespace(finished_sending=None,
                                                      finished_recving={"r"}))
        if aged:
            time.sleep(0.3)
        assert ask(sched, req) == (0, False)
    finally:
        sched.shutdown()


def test_another_members_finished_load_leaves_this_ones_hit(sched, store_client):
    """In a MultiConnector vLLM hands every member the finished loads of all: another
    member's load of a request (its P/D transfer, failed) must not erase this connector's
    store hit, which vLLM asks for again when it recomputes."""
    hs = hashes("other-member", 4)
    store_blocks(store_client, sched, hs)
    req = request("o", hs, 4 * BS + 1)
    assert ask(sched, req) == (4 * BS, True)
    sched.update_state_after_alloc(req, blocks([]), 0)  # another member's hit was taken
    sched.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"o"}))
    assert ask(sched, req) == (4 * BS, True)


def step_output(new=(), num_scheduled=None, resumed=(), preempted=()):
    """A SchedulerOutput: `new` requests, and `resumed` ones as vLLM's V1 model runner gets a
    request preempted before ((req_id, block_ids, num_computed_tokens) each)."""
    return SimpleNamespace(
        preempted_req_ids=set(preempted), scheduled_new_reqs=list(new),
        num_scheduled_tokens=num_scheduled or {},
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in resumed], resumed_req_ids={r for r, _, _ in resumed},
            new_block_ids=[ids for _, ids, _ in resumed],
            num_computed_tokens=[n for _, _, n in resumed]))


def scheduled(rid: str, ids: list[int], computed: int, num_scheduled: int, resumed: bool,
              preempted: tuple[str, ...] = ()) -> SimpleNamespace:
    """A step scheduling request `rid` on blocks `ids` from `computed` tokens: as a new request,
    or as a resumed one (a request preempted before, on vLLM's V1 model runner; its V2 runner
    lists those as new)."""
    if resumed:
        return step_output(num_scheduled={rid: num_scheduled}, resumed=[(rid, (ids,), computed)],
                           preempted=preempted)
    return step_output([SimpleNamespace(req_id=rid, block_ids=(ids,),
                                        num_computed_tokens=computed)],
                       {rid: num_scheduled}, preempted=preempted)


@pytest.mark.parametrize("resumed", [False, True])
@pytest.mark.parametrize("valid", [0, 2])
def test_blocks_a_failed_load_left_to_recompute_are_saved_again(sched, store_client, valid,
                                                                 resumed):
    """An async load fails past its first `valid` blocks (evicted since the lookup): vLLM
    recomputes from there, and those blocks go back to the store. With none valid vLLM frees
    the blocks and asks again (the answer: nothing); else it schedules the request from the
    valid prefix: as a new request, or a resumed one where it was preempted before (V1
    model runner). Before, the save began where the hit ended, so the store never got back
    what it had lost (for a resumed request, until this stop's fix)."""
    hs = hashes(f"reload-{valid}-{resumed}", 4)
    store_blocks(store_client, sched, hs)
    req = request("f", hs, 4 * BS + 5)
    assert ask(sched, req) == (4 * BS, True)
    sched.update_state_after_alloc(req, blocks([10, 11, 12, 13, 14]), 4 * BS)
    assert [t.req_id for t in sched.build_connector_meta(step_output()).loads] == ["f"]
    sched.update_connector_output(SimpleNamespace(finished_sending=None,
                                                  finished_recving={"f"}))
    ids = [10, 11, 12, 13, 14]
    if not valid:
        assert ask(sched, req) == (0, False)
        ids = [20, 21, 22, 23, 24]
        sched.update_state_after_alloc(req, blocks(ids), 0)
    meta = sched.build_connector_meta(scheduled("f", ids, valid * BS, (4 - valid) * BS + 5,
                                                resumed))
    assert [(t.req_id, t.block_ids, t.block_hashes) for t in meta.saves] == [
        ("f", tuple(ids[valid:4]), hs[valid:4])]


@pytest.mark.parametrize("resumed", [False, True])
def test_a_request_preempted_by_a_cache_reset_and_admitted_again_at_once_saves(
        sched, store_client, resumed):
    """vLLM's reset_prefix_cache(reset_running_requests=True) preempts every running request
    outside a step and admits them again in the very next one, whose output lists each as
    preempted and as scheduled: that step's admission (lookup and allocation) is kept, and
    what the request computes from then on is saved. Before, the preemption dropped it, and
    the request saved nothing more in its life."""
    hs = hashes(f"reset-{resumed}", 4)
    req = request("z", hs, 4 * BS + 5)
    assert ask(sched, req) == (0, False)
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    first = sched.build_connector_meta(scheduled("z", [1, 2, 3, 4, 5], 0, 2 * BS, False))
    assert [(t.block_ids, t.block_hashes) for t in first.saves] == [((1, 2), hs[:2])]
    # The reset: preempted, its blocks freed; the next step asks and allocates again.
    assert ask(sched, req) == (0, False)
    ids = [11, 12, 13, 14, 15]
    sched.update_state_after_alloc(req, blocks(ids), 0)
    meta = sched.build_connector_meta(scheduled("z", ids, 0, 4 * BS + 5, resumed,
                                                preempted=("z",)))
    assert meta.preempted == ("z",)
    assert [(t.block_ids, t.block_hashes) for t in meta.saves] == [(tuple(ids[:4]), hs)]


@pytest.mark.parametrize("resumed", [False, True])
def test_a_request_preempted_by_a_cache_reset_looks_up_again_and_loads(sched, store_client,
                                                                       resumed):
    """The same reset, where the store holds the request's first blocks since its first
    admission (its saves landed): the admission after the reset looks up again, loads them
    (asynchronously: the step lists the request as preempted only, as it waits for its load),
    and saves the rest. Before, it was answered from its first admission (a miss) and
    recomputed what the store held; and the preemption dropped the state of its load."""
    hs = hashes(f"reset-load-{resumed}", 4)
    req = request("y", hs, 4 * BS + 5)
    req.num_preemptions = 0
    assert ask(sched, req) == (0, False)
    sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    first = sched.build_connector_meta(scheduled("y", [1, 2, 3, 4, 5], 0, 2 * BS, False))
    assert [t.block_ids for t in first.saves] == [(1, 2)]
    store_blocks(store_client, sched, hs[:2])  # what the save wrote
    req.num_preemptions = 1  # the reset
    assert ask(sched, req) == (2 * BS, True)
    ids = [11, 12, 13, 14, 15]
    sched.update_state_after_alloc(req, blocks(ids), 2 * BS)
    meta = sched.build_connector_meta(step_output(preempted=("y",)))
    assert [(t.req_id, t.block_ids) for t in meta.loads] == [("y", (11, 12))]
    sched.update_connector_output(SimpleNamespace(finished_sending=None,
                                                  finished_recving={"y"}))
    meta = sched.build_connector_meta(scheduled("y", ids, 2 * BS, 2 * BS + 5, resumed))
    assert [(t.block_ids, t.block_hashes) for t in meta.saves] == [(tuple(ids[2:4]), hs[2:4])]


def test_blocks_held_while_loading_or_saved(sched, store_client):
    hs = hashes("hold", 2)
    store_blocks(store_client, sched, hs)
    req = request("h", hs, 2 * BS + 1)
    ask(sched, req)
    sched.update_state_after_alloc(req, blocks([1, 2, 3]), 2 * BS)
    assert sched.request_finished(req, [1, 2, 3]) == (True, None)  # load still in flight
    idle = request("i", hashes("idle", 1), 10)
    assert sched.request_finished(idle, []) == (False, None)
    # A request whose blocks are being saved is held until every rank reports the save done.
    saved = request("s", hashes("saved", 3), 3 * BS + 1)
    assert ask(sched, saved) == (0, False)
    sched.update_state_after_alloc(saved, blocks([7, 8, 9, 10]), 0)
    meta = sched.build_connector_meta(step_output(
        [SimpleNamespace(req_id="s", block_ids=([7, 8, 9, 10],), num_computed_tokens=0)],
        {"s": 3 * BS + 1}))
    assert [(t.req_id, t.block_ids) for t in meta.saves] == [("s", (7, 8, 9))]
    assert sched.request_finished(saved, [7, 8, 9, 10]) == (True, None)
    assert sched.build_connector_meta(step_output()).free_after_jobs == ("s",)


BUDGET_MS, ARRIVALS = 20.0, 200


def test_lookup_wait_is_a_budget_per_step(master, store_node):
    """vLLM asks about every waiting request in the same step: against a master slower than
    a step (1 s round trips, so no lookup answers within one), a burst of 200 arrivals holds
    the step for one budget of 20 ms, not 200 budgets (4 s). The bounds sit 4-8x below the
    wait per request (which fails them) and 25-50x above one budget: a loaded host's timer
    wake-ups overshot a 20 ms wait to 108 ms in a suite run with 40 arrivals."""
    from bench.proxy import DelayProxy

    proxy = DelayProxy(master.address, rtt_ms=1000.0).start()
    try:
        s = make(master, master_server_address=proxy.address, lookup_wait_ms=BUDGET_MS)
        reqs = [request(f"b{i}", hashes(f"budget{i}", 4), 4 * BS + 1) for i in range(ARRIVALS)]
        for r in reqs:
            s.prefetch(r)  # on_new_request
        per_request_s = ARRIVALS * BUDGET_MS / 1e3
        for _ in range(3):  # three engine steps
            t0 = time.perf_counter()
            answers = [s.get_num_new_matched_tokens(r, 0)[0] for r in reqs]
            took = time.perf_counter() - t0
            assert answers == [None] * ARRIVALS  # nothing answered: every request waited
            assert s.step_waited_s < per_request_s / 8, s.step_waited_s  # the scheduler's clock
            assert took < per_request_s / 4, f"one step spent {took * 1e3:.0f} ms in lookups"
            s.build_connector_meta(step_output())
        s.shutdown()
    finally:
        proxy.stop()


def test_unreachable_master_at_startup_names_the_field():
    with pytest.raises(StoreUnavailable,
                       match=r"^master_server_address: Mooncake master \S+ is unreachable"):
        make(MooncakeMaster())  # never started


def lookup_counts(s) -> dict[str, float]:
    return {k: v for k, v in s.recorder.snapshot().data["c"].items()
            if k.startswith(("lookups|", "failures|"))}


def test_lookup_on_a_dead_master_is_an_error_miss():
    """The master dies after startup: the first call fails at once with -900 (connection
    refused), the lookup is an error miss counted under that code, and the breaker opens."""
    live = MooncakeMaster().start()
    try:
        s = make(live, lookup_timeout_s=5.0, lookup_wait_ms=1)
        live.stop()
        assert ask(s, request("x", hashes("x", 4), 4 * BS + 1)) == (0, False)
        assert lookup_counts(s) == {"lookups|error": 1, "failures|0|lookup|-900": 1}
        assert s._store.down_code == "-900"
        s.shutdown()
    finally:
        live.stop()


def test_lookups_wait_for_the_layout_of_every_rank(master, store_node, store_client):
    """The keys carry the KV layout the workers registered: until every rank's WorkerReport
    arrived, lookups wait (None: vLLM asks again next step, and that step's metadata asks the
    workers for it); a bounded wait, then misses."""
    cfg = load_config(master.store_config(lookup_timeout_s=0.5), environ={})
    s = MooncakeStoreScheduler(cfg, KeyBuilder("sched", Layout("m", "bfloat16", BS, 2, 32, 2, 2)),
                               BS)
    try:
        hs = hashes("layout", 3)
        req = request("w", hs, 3 * BS + 1)
        assert s.get_num_new_matched_tokens(req, 0) == (None, False)
        assert s.build_connector_meta(step_output()).need_layout
        s.add_layout({0: SIGNATURE})  # one rank of two: still waiting
        assert s.get_num_new_matched_tokens(req, 0) == (None, False)
        s.add_layout({1: SIGNATURE})
        assert not s.build_connector_meta(step_output()).need_layout
        store_blocks(store_client, s, hs)  # keys of the reported layout
        assert ask(s, req) == (3 * BS, True)
    finally:
        s.shutdown()
    late = MooncakeStoreScheduler(cfg, KeyBuilder("sched", Layout("m", "bfloat16", BS, 2, 32, 2,
                                                                  2)), BS)
    try:
        assert late.get_num_new_matched_tokens(req, 0) == (None, False)
        time.sleep(0.6)  # past lookup_timeout_s without a report: a miss, not a stuck request
        assert late.get_num_new_matched_tokens(req, 0) == (0, False)
        late.add_layout({0: SIGNATURE, 1: SIGNATURE + "x"})  # ranks disagree: never load
        x = request("x", hs, 3 * BS + 1)
        assert late.get_num_new_matched_tokens(x, 0) == (0, False)
        # ... nor save: each rank would write under its own signature, objects no engine reads
        late.update_state_after_alloc(x, blocks([4, 5, 6, 7]), 0)
        assert not late.saves and not late.build_connector_meta(step_output(
            [SimpleNamespace(req_id="x", block_ids=([4, 5, 6, 7],), num_computed_tokens=0)],
            {"x": 3 * BS + 1})).saves
    finally:
        late.shutdown()


def test_frozen_master_lookup_times_out_and_shutdown_waits_for_its_call(monkeypatch):
    """A frozen master (SIGSTOP: TCP open, nothing answers) holds the lookup's call: the
    request is a timeout miss after lookup_timeout_s, and shutdown() closes the client only
    once that call has returned, although the lookup was already given up on. The call starts
    on arrival, awaited before vLLM asks: asked first, a lookup thread not scheduled within
    lookup_timeout_s started past its deadline and made no call, and the test failed."""
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "60000")  # the call waits until SIGCONT
    live = MooncakeMaster().start()
    try:
        s = make(live, lookup_timeout_s=0.3, lookup_wait_ms=1)
        client = s._store.client = CallRecorder(s._store.client)
        freeze(live.proc)
        req = request("x", hashes("x", 4), 4 * BS + 1)
        s.prefetch(req)  # no deadline until vLLM asks
        wait_until(lambda: client.in_flight == 1, 10, "the lookup's call never started")
        t0 = time.monotonic()
        assert ask(s, req) == (0, False)
        assert 0.3 <= time.monotonic() - t0 < 10
        assert lookup_counts(s) == {"lookups|timeout": 1}
        assert client.in_flight == 1  # its call still waits on the frozen master
        s.shutdown(timeout=0.2)
        time.sleep(0.2)
        assert client.in_flight_at_close is None, "the client was closed under a running call"
        thaw(live.proc)  # the call returns, then the client closes
        assert client.wait_closed(30) == 0
        # The keys it asked the master count although its answer went unused.
        assert lookup_keys(s) == 4 * 2
    finally:
        thaw(live.proc)
        live.stop()


def test_a_lookup_queued_behind_others_has_its_deadline_from_when_vllm_asks(monkeypatch):
    """Lookups start when requests arrive. Two lookups hold both lookup threads (their
    master frozen) while a third request arrives and its lookup queues for longer than
    lookup_timeout_s; vLLM has not asked about it yet. Once the master answers and vLLM asks,
    the queued lookup runs and finds the request's stored prefix. (With the deadline counted
    from arrival it started late, made no store call and was a timeout: a stored prefix
    recomputed.)"""
    from devkit.local_cluster import local_pool

    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "60000")  # the blockers' calls wait until SIGCONT
    with local_pool() as (master, _node):
        s = make(master, lookup_timeout_s=0.3, lookup_wait_ms=1)
        try:
            hs = hashes("queued", 4)
            store_blocks(s._store.client, s, hs)
            freeze(master.proc)
            try:
                blockers = [request(f"b{i}", hashes(f"blocker{i}", 4), 4 * BS + 1)
                            for i in range(2)]
                for r in blockers:
                    s.prefetch(r)
                wait_until(lambda: all(s._lookups[r.request_id].future.running()
                                       for r in blockers), 10, "the blockers never started")
                target = request("t", hs, 4 * BS + 1)
                s.prefetch(target)
                time.sleep(0.6)  # twice lookup_timeout_s, queued behind the frozen calls
            finally:
                thaw(master.proc)
            assert ask(s, target) == (4 * BS, True)
            assert lookup_counts(s) == {"lookups|hit": 1}
        finally:
            s.shutdown()


def test_timed_out_lookups_do_not_hold_up_new_ones(master, store_node, store_client):
    """A master that is slow but answers (100 ms round trips: two lookup threads serve about
    20 lookups a second) and a burst of 100 requests: most time out. Those are cancelled (or
    skip their call when they start late), so a new request's lookup right after the burst
    runs at once and hits, instead of queueing behind about 90 dead lookups (~4.5 s)."""
    from bench.proxy import DelayProxy

    proxy = DelayProxy(master.address, rtt_ms=100.0).start()
    try:
        s = make(master, master_server_address=proxy.address, lookup_timeout_s=1.0,
                 lookup_wait_ms=1)
        burst = [request(f"o{i}", hashes(f"overload{i}", 4), 4 * BS + 1) for i in range(100)]
        for r in burst:
            s.prefetch(r)
        waiting = list(burst)
        while waiting:  # vLLM asks again each step until every request has its answer
            waiting = [r for r in waiting if s.get_num_new_matched_tokens(r, 0)[0] is None]
            s.build_connector_meta(step_output())
            time.sleep(0.01)
        counts = lookup_counts(s)
        assert counts.get("lookups|timeout", 0) >= 50, counts  # the master really was too slow
        hs = hashes("after-burst", 4)
        store_blocks(store_client, s, hs)
        t0 = time.monotonic()
        assert ask(s, request("fresh", hs, 4 * BS + 1)) == (4 * BS, True), lookup_counts(s)
        assert time.monotonic() - t0 < 1.0
        s.shutdown()
    finally:
        proxy.stop()


def test_a_flood_of_arrivals_looks_ahead_a_bounded_way(master, store_node, store_client):
    """300 requests arrive at once against a master 20 ms away, and vLLM asks first about the
    last one (a priority, or a queue it reaches out of order): its lookup waits behind at most
    `lookup_ahead` (16 by default) lookups of requests not asked about yet, not behind all 300
    (two lookup threads: about 3 s, past its 1 s deadline, a stored prefix recomputed). The
    others start theirs in arrival order as earlier ones are asked about or finish.

    What is checked is how many lookups' store calls began before the target's (at most
    `lookup_ahead`), not the 1 s deadline it used to meet: its lookup took up to 0.6 s here,
    and a busy host made it a timeout. The deadline is far, so no lookup times out."""
    from bench.proxy import DelayProxy

    proxy = DelayProxy(master.address, rtt_ms=20.0).start()
    s = make(master, master_server_address=proxy.address, lookup_timeout_s=30.0,
             lookup_wait_ms=1)
    try:
        flood = [request(f"f{i}", hashes(f"flood{i}", 4), 4 * BS + 1) for i in range(300)]
        hs = hashes("asked-first", 4)
        store_blocks(store_client, s, hs)
        target_keys, calls = set(s._keys.keys(hs, 0)), []  # calls: each one the target's?

        class Ordered(CallRecorder):
            def batch_is_exist(self, keys: list[str]) -> list[int]:
                calls.append(not target_keys.isdisjoint(keys))
                return self._client.batch_is_exist(keys)

        s._store.client = Ordered(s._store.require())
        target = request("first", hs, 4 * BS + 1)
        for r in (*flood, target):
            s.prefetch(r)
        assert len(s._lookups) == s.config.lookup_ahead == 16  # the rest wait for a turn
        assert s.recorder.snapshot().data["c"]["lookups_deferred"] == 301 - 16  # on /metrics
        assert ask(s, target) == (4 * BS, True), lookup_counts(s)
        assert calls.index(True) <= s.config.lookup_ahead, calls.index(True)  # lookups ahead
        for r in flood[:20]:  # vLLM reaches the head of the queue: turns pass down it
            ask(s, r)
        assert set(s._lookups) >= {r.request_id for r in flood[20:36]}, sorted(s._lookups)
        assert lookup_counts(s).get("lookups|timeout", 0) == 0, lookup_counts(s)
    finally:
        s.shutdown()
        proxy.stop()


def test_every_lookup_started_counts_once_abandoned_ones_included(sched):
    """A look-ahead lookup whose request finishes (a client abort while queued) before vLLM
    asks, or is still out when the store is turned off, counts as abandoned; one whose answer
    was used counts by its result and not again when its request finishes."""
    used, aborted, cut = (request(r, hashes(r, 4), 4 * BS + 1) for r in ("used", "ab", "cut"))
    for r in (used, aborted, cut):
        sched.prefetch(r)
    assert ask(sched, used) == (0, False)
    for r in (used, aborted):
        sched.request_finished(r, [])
    assert lookup_counts(sched) == {"lookups|miss": 1, "lookups|abandoned": 1}
    sched.forget_store(routers_cleared=False)
    assert lookup_counts(sched) == {"lookups|abandoned": 1}


def test_a_prefix_in_vllms_own_cache_ends_its_lookup_abandoned(sched, store_client):
    """A repeated prompt whose full blocks vLLM's own prefix cache holds: looked up on arrival,
    never asked about, so the lookup ends abandoned when the request finishes, with nothing to
    load. Alerts MooncakePoolNoSuccessfulStoreOps and MooncakePoolStoreHitRateZero leave such
    lookups out, or a healthy engine serving repeated prompts pages."""
    hs = hashes("local", 4)
    store_blocks(store_client, sched, hs)
    r = request("r", hs, 4 * BS + 5)
    sched.prefetch(r)
    assert ask(sched, r, computed=4 * BS) == (0, False)
    sched.request_finished(r, [])
    assert lookup_counts(sched) == {"lookups|abandoned": 1}


def test_a_look_ahead_hit_is_sent_as_a_preload_once(sched, store_client):
    """A request vLLM has not reached is looked up on arrival; once the answer is a hit, the
    next step's metadata carries its prefix (the hit's blocks) for the workers to read into
    host memory while it waits, once; a miss and a request vLLM already asked about are not
    sent."""
    from connector.metadata import Preload

    hs = hashes("preload", 6)
    store_blocks(store_client, sched, hs[:4])
    queued, cold = request("q", hs, 6 * BS + 1), request("c", hashes("cold", 3), 3 * BS + 1)
    for r in (queued, cold):
        sched.prefetch(r)
    wait_until(lambda: all(lk.future.done() for lk in sched._lookups.values()), 10,
               "the look-ahead lookups never answered")
    assert sched.build_connector_meta(step_output()).preloads == (Preload("q", hs[:4]),)
    assert sched.build_connector_meta(step_output()).preloads == ()
    asked = request("a", hs, 6 * BS + 1)
    sched.prefetch(asked)
    assert ask(sched, asked) == (4 * BS, True)
    assert sched.build_connector_meta(step_output()).preloads == ()
    assert ask(sched, queued) == (4 * BS, True)  # vLLM reaches it: its hit stands


def test_a_load_every_rank_holds_in_a_preload_runs_in_the_step(sched, store_client):
    """Store reads took 100 ms per load here, over the 50-ms step budget: loads read from the
    store stay asynchronous. A queued request whose preload both TP ranks report read whole is
    charged the copies' estimate (1 ms) and loads inside the step; one rank's report is not
    enough (the other rank would read the store in the step)."""
    from connector.metadata import WorkerReport
    from connector.observability.ttft import LoadTimes, RankLoad

    hs = hashes("inpreload", 6)
    store_blocks(store_client, sched, hs[:4])
    both, one = request("both", hs, 6 * BS + 1), request("one", hs, 6 * BS + 1)
    for r in (both, one):
        sched.prefetch(r)
    wait_until(lambda: all(lk.future.done() for lk in sched._lookups.values()), 10,
               "the look-ahead lookups never answered")
    assert len(sched.build_connector_meta(step_output()).preloads) == 2
    times = LoadTimes({"read": RankLoad(0.0, 0.0, 0.100, 0.0, 4, False),
                       "copy": RankLoad(0.0, 0.0, 0.001, 0.0, 4, False, in_step=True,
                                        preloaded=True)}, True)
    for ranks in ({"both": 1, "one": 1}, {"both": 1}):  # rank 0's report, then rank 1's
        sched.update_connector_output(SimpleNamespace(
            finished_sending=(), finished_recving=(),
            kv_connector_worker_meta=WorkerReport({}, times, ranks)))
        times = None
    assert ask(sched, both) == (4 * BS, False)  # in the step
    assert ask(sched, one) == (4 * BS, True)


@pytest.mark.parametrize("fail", [False, True], ids=["collector_stuck", "shutdown_fails"])
def test_shutdown_stops_tracing_within_its_bound_then_closes_the_client(master, monkeypatch,
                                                                         fail):
    """The scheduler's tracer (request spans) is shut down, so its last spans are exported,
    within SHUTDOWN_S of the lookups' wait; a failing one is logged, and the store client
    closes either way. Before, its tracer was never shut down."""
    s = make(master)
    writer = trace_with(s.add_subscriber, fail)
    closes = record_closes(s._store, monkeypatch)
    took = timed_shutdown(lambda: s.shutdown(timeout=0.1), writer)
    assert took < 0.1 + SHUTDOWN_S + (STUCK_S - SHUTDOWN_S) / 2, took
    assert len(closes) == 1
    if fail:  # a stuck one never got there: its exports wait for the collector
        assert writer.shut.is_set()


def test_an_answer_past_its_lease_is_looked_up_again(master, store_node, store_client):
    """A lookup's answer stands for lookup_answer_ttl_s: the master leases what a lookup
    found only that long (--default_kv_lease_ttl), then may evict it. A request vLLM reaches
    later than that (a long queue), or asks about again (not admitted), is looked up afresh:
    blocks gone since are not loaded (a failed load recomputes the whole prefix), blocks
    stored since are. Before, the first answer stood however old."""
    s = make(master, lookup_answer_ttl_s=0.2)
    try:
        hs = hashes("aged", 4)
        store_blocks(store_client, s, hs)
        r = request("aged", hs, 4 * BS + 5)
        s.prefetch(r)  # looked up on arrival: a hit
        wait_until(lambda: s._lookups["aged"].future.done(), 10, "the look-ahead lookup")
        keys = [k for rank in (0, 1) for k in s._keys.keys(hs, rank)]
        assert [store_client.remove(k, True) for k in keys] == [0] * len(keys)  # evicted
        time.sleep(0.3)
        assert ask(s, r) == (0, False), "an answer older than its lease was loaded"
        store_blocks(store_client, s, hs)  # stored since; vLLM asks again later
        time.sleep(0.3)
        assert ask(s, r) == (4 * BS, True)
        assert lookup_counts(s) == {"lookups|abandoned": 1, "lookups|miss": 1,
                                    "lookups|hit": 1}
    finally:
        s.shutdown()
