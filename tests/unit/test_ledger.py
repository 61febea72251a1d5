"""Request lifetimes on the worker, on their own: loads and saves counted apart, errors before
completions, frees only when nothing is in flight, preemption waits that give up and mark."""

from __future__ import annotations

import threading
import time

from connector.worker.ledger import RequestLedger


def test_a_load_is_reported_even_while_an_old_save_runs():
    led = RequestLedger()
    led.add_saves(["r"])          # an old save, still running
    led.add_loads(["r"])          # the resumed request's load
    led.finish_load("r", [4, 5])
    assert led.take_finished() == (set(), {"r"}, {"r"}) and led.take_load_errors() == {4, 5}
    led.finish_save("r")
    assert led.idle()


def test_split_load_reports_once_after_its_last_part():
    led = RequestLedger()
    led.add_loads(["r", "r", "r"])
    led.finish_load("r", [])
    led.finish_load("r", [7])
    assert led.take_finished() == (set(), set(), set())
    led.finish_load("r", [])  # its last part loaded, an earlier one failed: the load failed
    assert led.take_finished() == (set(), {"r"}, {"r"}) and led.take_load_errors() == {7}


def test_free_waits_for_every_job():
    led = RequestLedger()
    led.add_saves(["s"])
    led.add_loads(["s"])
    led.free_after(["s"])
    led.finish_save("s")
    assert not led.take_finished()[0]  # its load still runs
    led.finish_load("s", [])
    assert led.take_finished() == ({"s"}, {"s"}, set())


def test_preemption_wait_returns_when_saves_end_or_says_which_are_busy():
    led = RequestLedger()
    led.add_saves(["a", "b"])
    threading.Timer(0.1, led.finish_save, args=("a",)).start()
    t0 = time.monotonic()
    assert led.wait_idle(("a",), 5.0) == set() and time.monotonic() - t0 < 2
    assert led.wait_idle(("b",), 0.1) == {"b"}
    led.finish_save("b")
    assert led.wait_idle(("b",), 0.1) == set()
