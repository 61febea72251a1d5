"""The events the connector publishes, and the subscriber interface.

Load and save jobs, scheduler lookups, and requests that loaded from the store each end with one
event that carries every timestamp and size. Metrics (`stats.StatsRecorder`) and tracing
(`tracing.SpanExporter`) are separate subscribers of these events, so either can be switched
off without touching the data path.
Timestamps are `time.perf_counter()` seconds.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level
# The thread label of a load job that expired (or was failed at shutdown) before any thread
# took it: its queue wait and error count, never a thread's.
QUEUED_THREAD = "queued"
# What the subscribers' shutdown (the tracer's last export) may add to the connector's
# (docs/reliability-bounds.md, A graceful stop).
SHUTDOWN_S = 1.0


def request_hash(req_id: str) -> str:
    """A short stable digest of a request id, for span attributes and logs (never labels)."""
    return hashlib.blake2b(req_id.encode(), digest_size=8).hexdigest()


@dataclass(slots=True)
class LoadEvent:
    """One finished load job (one request on one TP rank)."""

    thread: int | None  # the receive thread's slot; None: the job expired before one took it
    tp_rank: int
    request_hash: str  # a digest of the request id: span attribute, never a metric label
    keys: int  # blocks the job asked for
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
    # With tier_metrics: tier (memory, disk, unknown) -> (prompt tokens, bytes) loaded from it.
    tiers: dict[str, tuple[int, int]] | None = None
    loaded_keys: int = 0  # store objects read whole (one per block and shard): load_keys
    group: int = 0  # the KV cache group of `keys` blocks (hybrid models: one job per group)
    # Copied from the request's preload (connector.worker.preload), not read from the store
    # by this job: its nbytes are 0, and its time is no transfer estimate.
    preloaded: bool = False
    # Its preparation and store call were timed: not a preload's copy, nor a job the watchdog
    # or a shutdown expired (its phases unknown). Only such jobs feed the phase histograms.
    phases: bool = True

    @property
    def ok(self) -> bool:
        return not self.code


@dataclass(slots=True)
class SaveEvent:
    """One finished save job."""

    tp_rank: int
    request_hash: str
    keys: int
    skipped: int
    failed_keys: int  # offered but neither written nor already stored
    nbytes: int
    code: str
    failed_op: str  # "save" or "save_exists" when code is set
    t_enqueue: float
    t_start: float
    t_ready: float
    t_exists_end: float
    t_end: float
    trace_parent: Any = None
    ran: bool = True  # False: lost before it ran (or while running): no phase was timed


@dataclass(slots=True)
class LookupEvent:
    """One scheduler-side prefix lookup."""

    result: str  # hit | miss | error | timeout
    keys: int
    hit_tokens: int
    miss_tokens: int
    seconds: float
    code: str = ""
    t_end: float = 0.0  # when the answer was in (perf_counter), for the request timeline


@dataclass(slots=True)
class RequestEvent:
    """One request that loaded its prefix from the store: where the store's share of its time
    to first token went, from its arrival at the scheduler until its prefill could run
    (`connector.observability.ttft`). Published by the scheduler once every phase is known."""

    request_hash: str
    mode: str  # "async": waited in WAITING_FOR_REMOTE_KVS; "sync": loaded inside the step
    blocks: int
    failed: bool  # some blocks failed to load (vLLM recomputed them)
    t_arrival: float  # perf_counter on the scheduler
    phases: tuple[tuple[str, float], ...]  # (phase, seconds), consecutive from t_arrival
    trace_headers: Mapping[str, str] | None = None  # the request's incoming trace context

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.phases)


class Subscriber:
    """Receives every event; override what you need (the rest do nothing). Called on the
    thread that finished the job: keep it short, and never raise into the data path."""

    def on_load(self, ev: LoadEvent) -> None:
        """A load job ended (receive thread, or the watchdog for an expired one)."""

    def on_save(self, ev: SaveEvent) -> None:
        """A save job ended."""

    def on_lookup(self, ev: LookupEvent) -> None:
        """A scheduler lookup's answer was used."""

    def on_request(self, ev: RequestEvent) -> None:
        """A request's store load is behind it and its prefill was scheduled (scheduler)."""


class Publisher:
    """The subscribers of one side (worker or scheduler), and the one way events reach them:
    a subscriber that raises is logged, never allowed to break the job that published."""

    def __init__(self, *subscribers: Subscriber) -> None:
        self.subscribers: list[Subscriber] = list(subscribers)

    def add(self, sub: Subscriber) -> None:
        self.subscribers.append(sub)

    def _each(self, method: str, ev: Any) -> None:
        for sub in self.subscribers:
            try:
                getattr(sub, method)(ev)
            except Exception:  # observability must never break the data path
                logger.exception("subscriber %r failed", sub)

    def load(self, ev: LoadEvent) -> None:
        self._each("on_load", ev)

    def save(self, ev: SaveEvent) -> None:
        self._each("on_save", ev)

    def lookup(self, ev: LookupEvent) -> None:
        self._each("on_lookup", ev)

    def request(self, ev: RequestEvent) -> None:
        self._each("on_request", ev)

    def shutdown(self, timeout: float = SHUTDOWN_S) -> None:
        """Shut every subscriber that has a `shutdown` down, on a thread of its own joined for
        `timeout` seconds at most, each one's error logged: the tracer's last export waits for
        its collector (an OTLP post or the SDK exporter's shutdown, seconds each, per batch),
        and the connector closes the store client after this. Past the bound the spans not
        yet exported are lost with the process (the thread is a daemon)."""
        def run() -> None:
            for sub in self.subscribers:
                if hasattr(sub, "shutdown"):
                    try:
                        sub.shutdown()
                    except Exception:  # observability must never keep the store client open
                        logger.exception("subscriber %r failed to shut down", sub)

        stopping = threading.Thread(target=run, name="mcpool-events-stop", daemon=True)
        stopping.start()
        stopping.join(timeout)
        if stopping.is_alive():
            logger.warning("shutdown: observability subscribers still stopping after %.0fs "
                           "(tracing's last spans not exported yet are lost)", timeout)
