"""The scheduler's side of a store hit's TTFT, against a real master: a prefix of up to 64
blocks is looked up in one master round trip; a load goes inside the step once the workers'
timings say it fits, asynchronously otherwise; each request that loaded is published once with
its phases, through the calls vLLM makes in the order it makes them."""

from __future__ import annotations

from types import SimpleNamespace

from connector.metadata import WorkerReport
from connector.observability.events import RequestEvent, Subscriber
from connector.observability.metric_catalog import TTFT_PHASES
from connector.observability.ttft import LoadTimes, RankLoad
from tests.store.test_scheduler import BS, ask, blocks, make, request, step_output, store_blocks
from tests.worker_kit import hashes


class Requests(Subscriber):
    def __init__(self) -> None:
        self.seen: list[RequestEvent] = []

    def on_request(self, ev: RequestEvent) -> None:
        self.seen.append(ev)


def exist_rpcs(master) -> float:
    return sum(float(line.split()[-1]) for line in master.metrics_text().splitlines()
               if line.startswith("master_batch_exist_key_requests_total"))


def new_req(rid: str) -> SimpleNamespace:
    return SimpleNamespace(req_id=rid, block_ids=([],), num_computed_tokens=0)


class CountingExists:
    """A store client whose existence calls are counted, then made (each a master RPC)."""

    def __init__(self, client, calls: list[int]) -> None:
        self._client, self._calls = client, calls

    def batch_is_exist(self, keys):
        self._calls.append(len(keys))
        return self._client.batch_is_exist(keys)

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_a_long_prefix_is_looked_up_in_one_round_trip(master, store_node, store_client,
                                                       monkeypatch):
    """This scheduler's own calls are counted: the session's master also serves whatever
    other tests on this worker left running (seen once: 3 more existence RPCs in the window),
    so its counter only shows that the call reached it."""
    s = make(master)
    try:
        hs = hashes("one-rtt", 40)
        store_blocks(store_client, s, hs)
        calls: list[int] = []
        require = s._store.require
        monkeypatch.setattr(s._store, "require", lambda: CountingExists(require(), calls))
        before = exist_rpcs(master)
        assert ask(s, request("r", hs, 40 * BS + 1)) == (40 * BS, True)
        assert calls == [40 * 2]  # one call for every shard of both ranks
        assert exist_rpcs(master) - before >= 1
    finally:
        s.shutdown()


def test_loads_go_in_the_step_once_they_fit_and_each_request_is_published(
        master, store_node, store_client):
    s = make(master, sync_load_ms=10)
    published = Requests()
    s.add_subscriber(published)
    try:
        hs = hashes("instep-sched", 8)
        store_blocks(store_client, s, hs)
        # No transfer estimate yet: asynchronous, in WAITING_FOR_REMOTE_KVS.
        a = request("a", hs, 8 * BS + 1)
        s.prefetch(a)
        assert ask(s, a) == (8 * BS, True)
        s.update_state_after_alloc(a, blocks(list(range(9))), 8 * BS)
        meta = s.build_connector_meta(step_output())
        assert [t.req_id for t in meta.loads] == ["a"] and not meta.sync_loads
        # Both TP ranks report it done, with their timings: 1 ms per block.
        for rank_s in (0.006, 0.008):
            s.update_connector_output(SimpleNamespace(
                finished_sending=None, finished_recving={"a"} if rank_s == 0.008 else None,
                kv_connector_worker_meta=WorkerReport({}, LoadTimes(
                    {"a": RankLoad(0.001, 0.0, rank_s, 0.002, 8, False)}, in_step=True))))
        assert not published.seen  # its prefill is not scheduled yet
        s.build_connector_meta(step_output([new_req("a")], {"a": 1}))
        (ev,) = published.seen
        assert ev.mode == "async" and [p for p, _ in ev.phases] == list(TTFT_PHASES)
        assert dict(ev.phases)["load_transfer"] == 0.008  # the slower rank
        # Now 8 blocks are expected to take 8 ms: inside the step (10 ms budget), and not
        # held as an asynchronous load.
        b = request("b", hs, 8 * BS + 1)
        s.prefetch(b)
        assert ask(s, b) == (8 * BS, False)
        s.update_state_after_alloc(b, blocks(list(range(20, 29))), 8 * BS)
        meta = s.build_connector_meta(step_output([new_req("b")], {"b": 1}))
        assert [t.req_id for t in meta.sync_loads] == ["b"] and not meta.loads
        assert s.request_finished(b, list(range(20, 29))) == (False, None)
        # The step's budget is shared: a second 8-block load in one step stays asynchronous.
        c, d = request("c", hs, 8 * BS + 1), request("d", hs, 8 * BS + 1)
        assert ask(s, c) == (8 * BS, False) and ask(s, d) == (8 * BS, True)
        # b finished within its step; the workers' account comes with that step's output.
        s.update_connector_output(SimpleNamespace(
            finished_sending=None, finished_recving=None,
            kv_connector_worker_meta=WorkerReport({}, LoadTimes(
                {"b": RankLoad(0.0, 0.0, 0.007, 0.0, 8, False, in_step=True, ranks=2)}, True))))
        assert [e.mode for e in published.seen] == ["async", "sync"]
        assert [p for p, _ in published.seen[1].phases] == list(TTFT_PHASES[:6])
    finally:
        s.shutdown()
