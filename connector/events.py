"""The events the connector publishes, and the subscriber interface.

Load and save jobs, and scheduler lookups, each end with one event that carries every timestamp
and size. Metrics (`stats.StatsRecorder`) and tracing (`tracing.SpanExporter`) are separate
subscribers of these events, so either can be switched off without touching the data path.
Timestamps are `time.perf_counter()` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True)
class LoadEvent:
    """One finished load job (one request on one TP rank)."""

    thread: int
    tp_rank: int
    trace_id: str
    keys: int
    nbytes: int
    failed_blocks: int
    code: str  # "" on success, else a Mooncake error code or "exception"
    t_enqueue: float
    t_start: float
    t_prepared: float
    t_lookup_end: float  # == t_prepared when the master lookup was not sampled
    t_end: float
    lookup_sampled: bool
    trace_parent: Any = None  # OpenTelemetry context captured at enqueue

    @property
    def ok(self) -> bool:
        return not self.code


@dataclass(slots=True)
class SaveEvent:
    """One finished save job."""

    tp_rank: int
    trace_id: str
    keys: int
    skipped: int
    nbytes: int
    code: str
    failed_op: str  # "save" or "save_exists" when code is set
    t_enqueue: float
    t_start: float
    t_ready: float
    t_exists_end: float
    t_end: float
    trace_parent: Any = None


@dataclass(slots=True)
class LookupEvent:
    """One scheduler-side prefix lookup."""

    result: str  # hit | miss | error | timeout
    keys: int
    hit_tokens: int
    miss_tokens: int
    seconds: float
    code: str = ""


class Subscriber(Protocol):
    def on_load(self, ev: LoadEvent) -> None: ...

    def on_save(self, ev: SaveEvent) -> None: ...

    def on_lookup(self, ev: LookupEvent) -> None: ...
