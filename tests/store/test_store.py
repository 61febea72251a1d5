"""The store handle on its own, against a real master: bounded error labels, the breaker that
fails calls fast while the master is down and closes when it answers, and a close that waits
for calls still in flight."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from bench.proxy import GARBAGE
from connector.config import load_config
from connector.store.client import (
    ERROR_NAMES,
    PROBE_KEY,
    StoreHandle,
    StoreUnavailable,
    error_code_label,
    replicate_config,
)
from devkit.ha_cluster import HaCluster
from devkit.local_cluster import MooncakeMaster, free_port
from tests.client_kit import CallRecorder
from tests.conftest import ha_group


def handle(master, mode: str = "fail", retry_s: float = 5.0, **fields) -> StoreHandle:
    cfg = load_config(master.store_config(**fields), environ={})
    return StoreHandle(cfg.store, 0, 16 * 2**20, mode, 2.0, retry_s=retry_s, probe_s=0.05)


def wait_until(pred, timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, why
        time.sleep(0.02)


def test_error_labels_are_bounded():
    assert {error_code_label(c) for c in ERROR_NAMES} == {str(c) for c in ERROR_NAMES}
    assert error_code_label(-12345) == "other"


def test_replicate_config_carries_the_replica_count():
    assert replicate_config(3).replica_num == 3


def test_breaker_fails_fast_then_closes_when_the_master_answers(master):
    h = handle(master)
    try:
        assert h.ready() is not None
        h.trip(-900)
        assert h.ready() is None and h.down_code == "-900"
        deadline = time.monotonic() + 10
        while h.ready() is None:  # the master is up: the probe closes the breaker
            assert time.monotonic() < deadline, "the breaker never closed"
            time.sleep(0.05)
    finally:
        h.close()


def test_close_waits_for_calls_in_flight(master):
    h = handle(master)
    client, release = h.client, threading.Event()
    h.close([release.wait])
    assert h.client is None and h.ready() is None
    time.sleep(0.1)
    assert client.batch_is_exist(["k"]) == [0]  # still open: a call may be inside it
    release.set()
    deadline = time.monotonic() + 5
    while any(t.name == "mcpool-close" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.02)


# ---- the breaker under faults: a stale failure, a probe call at close, degrade-mode races ----
def test_stale_rpc_failure_does_not_reopen_a_closed_breaker(master, monkeypatch):
    """A call sent into a black hole (a proxy that drops its bytes: no retransmission) is in
    flight through an outage; the probe closes the breaker; then the call returns its -901.
    That failure predates the recovery: the breaker stays closed. The outage begins once the
    proxy has dropped the call's request: after a fixed 0.3 s, a call not sent by then (a busy
    host) went through on `forward` and answered, and the test failed."""
    from bench.proxy import DelayProxy

    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "3000")
    proxy = DelayProxy(master.address, rtt_ms=0.0).start()
    h = None
    try:
        h = handle(master, master_server_address=proxy.address)
        proxy.set_mode("drop")
        got: list[int] = []

        def old_call() -> None:
            client = h.require()
            got.extend(client.batch_is_exist([PROBE_KEY]))
            h.check(got)

        caller = threading.Thread(target=old_call)
        caller.start()
        wait_until(lambda: proxy.dropped() > 0, 10, "the call's request never reached the proxy")
        h.trip(-901)  # another call failed meanwhile: the outage
        proxy.set_mode("forward")
        wait_until(lambda: h.ready() is not None, 10, "the probe never closed the breaker")
        assert caller.is_alive(), "the old call returned before the recovery: nothing tested"
        caller.join(30)
        assert got == [-901], got  # it failed, after the breaker closed
        assert h.ready() is not None and h.down_code == "", "a stale -901 reopened the breaker"
    finally:
        if h is not None:
            h.close()
        proxy.stop()


def test_close_never_frees_the_client_under_a_probe_call(master, monkeypatch):
    """close() while the probe's store call hangs (its request dropped: a master that froze
    after the probe found it answering, which the proxy stands for with the liveness check
    left to a connect): the client is closed only once that call has returned."""
    import connector.store.client as store_client
    from bench.proxy import DelayProxy

    monkeypatch.setattr(store_client, "_probe_answers", store_client._probe_tcp)
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "2000")
    proxy = DelayProxy(master.address, rtt_ms=0.0).start()
    try:
        h = handle(master, master_server_address=proxy.address)
        client = h.client = CallRecorder(h.client)
        proxy.set_mode("drop")
        h.trip(-901)
        wait_until(lambda: client.in_flight == 1, 10, "the probe made no store call")
        h.close()
        assert client.wait_closed(30) == 0, "the client was closed under the probe's call"
    finally:
        proxy.stop()


def test_reconnect_during_close_leaves_no_client(master):
    """degrade mode: close() runs while a reconnect is setting up its new client (here: while
    an on_connect callback registers buffers). The new client is not installed after close:
    close() waits for it and closes it."""
    late = MooncakeMaster()  # not started yet: the handle starts in degrade mode
    try:
        h = handle(late, mode="degrade", retry_s=0.1)
        assert h.client is None
        registering, release = threading.Event(), threading.Event()
        h.on_connect(lambda c: (registering.set(), release.wait(30)))
        late.start()
        assert registering.wait(30), "the handle never reconnected"
        closer = threading.Thread(target=h.close)
        closer.start()
        time.sleep(0.2)  # close() runs while the callback still holds up the reconnect
        release.set()
        closer.join(30)
        wait_until(lambda: not any(t.name == "mcpool-reconnect" for t in threading.enumerate()),
                   10, "the reconnect thread never ended")
        assert h.client is None, "a reconnect installed a client after close()"
    finally:
        late.stop()


class _HookAfterLast(list):
    """A callback list that runs `hook` when an iteration has passed the last callback: the
    moment between the reconnect's callbacks and its installing the client."""

    def __init__(self, hook) -> None:
        super().__init__()
        self.hook = hook

    def __iter__(self):
        yield from list.__iter__(self)
        self.hook()


def test_on_connect_never_misses_a_reconnect():
    """degrade mode: on_connect is called just as a reconnect has run the callbacks it knew
    but not yet installed the client. The new callback still runs, exactly once."""
    late = MooncakeMaster()
    try:
        h = handle(late, mode="degrade", retry_s=0.1)
        got: list = []
        racer: list[threading.Thread] = []

        def register_now() -> None:  # on the reconnect thread, between callbacks and install
            if not racer:
                racer.append(threading.Thread(target=h.on_connect, args=(got.append,)))
                racer[0].start()
                racer[0].join(0.5)  # returns at once unless on_connect waits for the install

        h._callbacks = _HookAfterLast(register_now)
        late.start()
        wait_until(lambda: h.client is not None, 30, "the handle never reconnected")
        racer[0].join(10)
        assert got == [h.client], "on_connect missed the reconnect: buffers never registered"
        h.close()
    finally:
        late.stop()


# ---- a real HA group behind a proxy that can make etcd answer garbage ------------------------
def ha_config(cluster: HaCluster, proxy):
    """The group's connector config, with etcd read through the proxy."""
    address = f"etcd://{proxy.address}"
    return load_config(cluster.store_config(master_server_address=address,
                                            metadata_server=address), environ={}).store


@pytest.fixture(scope="module")
def ha_etcd_proxy(ha_etcd):
    """(group, the session's proxy in front of its etcd, a handle reading through it, its
    probe errors). One handle for the module (scripts/test.sh hands out a file at a time, so
    one worker runs them all): closing an HA client takes Mooncake up to 30 s
    (docs/reliability-bounds.md)."""
    cluster = ha_group(ha_etcd, "garbage", segment_size="64MB").start()
    proxy = ha_etcd[1]
    errors: list[float] = []
    with pytest.MonkeyPatch.context() as env:
        for k, v in cluster.env.items():
            env.setenv(k, v)
        h = StoreHandle(ha_config(cluster, proxy), 0, 16 * 2**20, "fail", 2.0, probe_s=0.05,
                        on_probe_error=lambda: errors.append(time.monotonic()))
        yield cluster, proxy, h, errors
        h.close()
    cluster.stop()


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_probe_survives_etcd_answering_garbage(ha_etcd_proxy, kind):
    """While the breaker is open, etcd's gateway answers garbage (no HTTP status line, a body
    cut short, JSON of another shape, a leader that is not host:port): each probe round
    fails, is counted, and the probe goes on; once etcd answers again the breaker closes."""
    _, proxy, h, errors = ha_etcd_proxy
    counted = len(errors)
    try:
        proxy.set_mode(f"garbage:{kind}")
        h.trip(-900)
        wait_until(lambda: len(errors) >= counted + 3, 30, "the probe counted no error")
        assert h.ready() is None
        proxy.set_mode("forward")
        wait_until(lambda: h.ready() is not None, 30,
                   "the breaker never closed: the probe died on etcd's garbage")
    finally:
        proxy.set_mode("forward")


def test_the_leader_is_read_from_the_first_etcd_member_that_answers(ha_etcd, monkeypatch):
    """An etcd member that accepts connections but never answers (frozen, or cut off from the
    others in the very failure that moves the master) listed first: the leader is read from
    the next member. Before, only the first member that accepted a connection was asked, so
    neither startup nor the breaker's probe could find the master while it hung. And the
    read goes to etcd directly, not through the pod's HTTP proxy (here a dead one): before,
    an `http_proxy` set for downloads hid the leader."""
    import base64
    import json
    import socket
    import urllib.request
    import uuid

    from connector.config import CLUSTER_ID_ENV
    from connector.store.client import etcd_leader

    monkeypatch.delenv(CLUSTER_ID_ENV, raising=False)
    etcd, cid = ha_etcd[0], f"first-member-{uuid.uuid4().hex[:8]}"
    view = {"key": base64.b64encode(f"mooncake-store/{cid}/master_view".encode()).decode(),
            "value": base64.b64encode(b"127.0.0.1:4242").decode()}
    urllib.request.urlopen(urllib.request.Request(
        f"http://{etcd.endpoint}/v3/kv/put", data=json.dumps(view).encode()), timeout=10).read()
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen reads the env afresh
    silent = socket.socket()
    try:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes connections; nothing ever answers
        address = f"etcd://127.0.0.1:{silent.getsockname()[1]},{etcd.endpoint}"
        cfg = load_config({"master_server_address": address, "metadata_server": address,
                           "cluster_id": cid}, environ={}).store
        assert etcd_leader(cfg, 0.5) == ("127.0.0.1:4242", None)
    finally:
        silent.close()


def test_startup_with_etcd_answering_garbage_names_the_field(ha_etcd_proxy):
    cluster, proxy, _, _ = ha_etcd_proxy
    proxy.set_mode("garbage:status")
    try:
        with pytest.raises(StoreUnavailable, match=r"^master_server_address: etcd \S+ "
                                                   r"answered a read of the master view"):
            StoreHandle(ha_config(cluster, proxy), 0, 16 * 2**20, "fail", 2.0)
    finally:
        proxy.set_mode("forward")


FROZEN_START = """
import json, sys, time
from connector.config import load_config
from connector.store.client import StoreHandle, StoreUnavailable
cfg = load_config(json.loads(sys.argv[1]), environ={}).store
t = time.monotonic()
try:
    StoreHandle(cfg, 0, 16 * 2**20, "fail", 1.0)
    print("started")
except StoreUnavailable as e:
    print(f"{time.monotonic() - t:.1f}s {e}")
h = StoreHandle(cfg, 0, 16 * 2**20, "degrade", 1.0, retry_s=0.2)
print("degrade ready" if h.ready() is not None else "degrade waiting")
time.sleep(1.0)  # its reconnect rounds must not hold the process either
print(f"alive after {time.monotonic() - t:.1f}s")
h.close()
"""


def test_a_frozen_master_at_startup_is_an_outage_found_at_once():
    """A master that accepts connections but does not answer (SIGSTOP, a wedged process):
    its kernel completes TCP connects, so a connect alone passed, and Mooncake's setup() then
    retried its RPC 20 times holding the GIL, freezing the whole engine process for minutes
    (again at each reconnect in degrade mode). Now startup names the field at once, and
    degrade mode serves without the cache. Run in a subprocess: on the code before it hangs."""
    import json
    import subprocess
    import sys

    from devkit.local_cluster import local_pool
    from devkit.processes import freeze, thaw

    with local_pool("64MB") as (master, _node):
        freeze(master.proc)
        try:
            out = subprocess.run(
                [sys.executable, "-c", FROZEN_START, json.dumps(master.store_config())],
                capture_output=True, text=True, timeout=60,
                cwd=str(Path(__file__).resolve().parents[2])).stdout
        finally:
            thaw(master.proc)
    lines = out.splitlines()
    assert len(lines) == 3, out
    assert "master_server_address: Mooncake master" in lines[0], out
    assert "does not answer within 1s" in lines[0], out
    assert lines[1] == "degrade waiting" and lines[2].startswith("alive after"), out
    assert float(lines[0].split("s ", 1)[0]) < 10, out
