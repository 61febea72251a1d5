"""The store handle on its own, against a real master: bounded error labels, the breaker that
fails calls fast while the master is down and closes when it answers, and a close that waits
for calls still in flight."""

from __future__ import annotations

import threading
import time

from connector.config import load_config
from connector.store import ERROR_NAMES, StoreHandle, error_code_label, replicate_config


def handle(master) -> StoreHandle:
    cfg = load_config(master.store_config(), environ={})
    return StoreHandle(cfg.store, 0, 16 * 2**20, "fail", 2.0, probe_s=0.05)


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
