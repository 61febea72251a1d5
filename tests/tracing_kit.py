"""A span writer for the shutdown tests: a collector that does not answer, or an exporter
whose shutdown fails."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from connector.observability.tracing import SpanExporter

STUCK_S = 30.0  # how long a stuck collector holds each export and the shutdown


class CollectorStub:
    """Every export and the shutdown wait until `release` (STUCK_S at most), as an OTLP post
    waits for its timeout (10 s by default) and the SDK exporter's shutdown for its own; with
    `fail` the shutdown raises instead."""

    honours_ids = False

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.release = threading.Event()
        self.shut = threading.Event()  # shutdown() was called

    def job(self, *args: Any) -> None:
        """Spans are dropped: only the exports' and the shutdown's timing matter here."""

    def flush(self) -> None:
        if not self.fail:
            self.release.wait(STUCK_S)

    def shutdown(self) -> None:
        self.shut.set()
        if self.fail:
            raise RuntimeError("the span exporter's shutdown failed")
        self.release.wait(STUCK_S)


def trace_with(add: Callable[[Any], None], fail: bool) -> CollectorStub:
    """A span exporter writing to a new CollectorStub, given to `add` (a worker's or
    scheduler's add_subscriber, a Publisher's add)."""
    writer = CollectorStub(fail)
    add(SpanExporter(1.0, 0, "test", writer=writer))
    return writer


def timed_shutdown(shutdown: Callable[[], None], writer: CollectorStub) -> float:
    """Seconds `shutdown` took; the stub's collector answers after it, whatever happened."""
    t0 = time.monotonic()
    try:
        shutdown()
        return time.monotonic() - t0
    finally:
        writer.release.set()


def record_closes(store: Any, monkeypatch: Any) -> list[tuple]:
    """The calls of `store.close` from now on (each still closes)."""
    closes: list[tuple] = []
    close = store.close
    monkeypatch.setattr(store, "close", lambda *a: (closes.append(a), close(*a)))
    return closes
