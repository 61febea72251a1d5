"""Connector statistics: the metrics subscriber, and the payload vLLM carries to the frontend.

Payload (msgpack-safe: str keys, builtin values, bounded size):

    {"c": {"load_bytes|0|2": 123456, "failures|0|load|-704": 3, ...},   # counters, summed
     "h": {"load_prepare_seconds|0|2": [0.0004, ...], ...},             # samples, capped
     "g": {"load_queue_depth|0": 3, "load_inflight|0|2": 1, ...},       # gauges, last value
     "x": {"load_job_seconds|0|2": [[0.012, "<trace id>", "<span id>"]]}}  # exemplars, capped

Exemplars are samples of traced jobs: a traced job's histogram samples move from "h" to "x"
with the ids of its `mooncake.load` span, so the frontend observes each sample once, and the
traced ones with their trace id as an OpenMetrics exemplar.

Each key is a family key from `metric_catalog` followed by that family's label values, in
order, joined by "|". Rank and thread identity live inside the key because vLLM's TP
aggregation merges all ranks into one object.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connector.observability.events import (
    QUEUED_THREAD,
    LoadEvent,
    LookupEvent,
    RequestEvent,
    SaveEvent,
    Subscriber,
)
from connector.observability.metric_catalog import (
    BY_KEY,
    EXEMPLAR_FAMILIES,
    TTFT_MODES,
    TTFT_PHASES,
    Family,
)

SAMPLE_CAP = 1024  # histogram samples per key per step; counters stay exact past it
EXEMPLAR_CAP = 4  # exemplars per key per step (Prometheus keeps the latest per bucket)
GAUGE_RESEND_S = 5.0  # unchanged gauges are re-sent this often so a fresh frontend sees them
_EWMA = 0.2


def stat_key(family: str, *labels: object) -> str:
    """Encode a payload key. Checked against the catalogue, so a misspelt family or a wrong
    label count fails where the key is made (keys are built once per thread or per code)."""
    fam = BY_KEY.get(family)
    if fam is None or len(labels) != len(fam.stats_labels):
        raise ValueError(f"stats key {family}{labels}: the catalogue has "
                         f"{(family, fam.stats_labels) if fam else 'no such family'}")
    return "|".join((family, *map(str, labels)))


def parse_key(key: str) -> tuple[Family, dict[str, str]] | None:
    """Decode a payload key into its family and label values (None: not in the catalogue)."""
    fam_key, *values = key.split("|")
    fam = BY_KEY.get(fam_key)
    if fam is None or len(values) != len(fam.stats_labels):
        return None
    return fam, dict(zip(fam.stats_labels, values, strict=True))


def family_of(key: str) -> str:
    """The family part of a payload key."""
    return key.split("|", 1)[0]


@dataclass(frozen=True)
class WorkerGauges:
    """What the worker's pools look like at a stats poll; the recorder names the series."""

    load_queue_depth: int  # peak since the last poll
    save_queue_depth: int
    recv_threads: int
    recv_threads_active: int
    load_inflight: tuple[int, ...]  # per receive thread: busy since the last poll
    threads_stuck: dict[str, int]  # by op: load, save
    staging_buffers: int
    preload_bytes: int
    layout: tuple[str, str, str] | None  # fingerprint, hash_algo, transfer (once registered)


@dataclass
class PooledStoreStats(KVConnectorStats):
    """What one step (or one logging interval, after aggregation) observed."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"c": {}, "h": {}, "g": {}, "x": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        c, h, g = self.data["c"], self.data["h"], self.data["g"]
        for k, v in other.data["c"].items():
            c[k] = c.get(k, 0) + v
        for k, v in other.data["h"].items():
            cur = h.setdefault(k, [])
            cur.extend(v[: max(0, SAMPLE_CAP - len(cur))])
        g.update(other.data["g"])
        x = self.data.setdefault("x", {})
        for k, v in other.data.get("x", {}).items():
            cur = x.setdefault(k, [])
            room = max(0, EXEMPLAR_CAP - len(cur))
            cur.extend(v[:room])
            if len(v) > room:  # past the cap they are plain samples again
                plain = h.setdefault(k, [])
                plain.extend(e[0] for e in v[room:room + max(0, SAMPLE_CAP - len(plain))])
        return self

    def is_empty(self) -> bool:
        d = self.data
        return not (d["c"] or d["h"] or d["g"] or d.get("x"))

    def reduce(self) -> dict[str, int | float]:
        """Totals and latency percentiles for vLLM's periodic "KV Transfer metrics" log line."""
        totals: dict[str, float] = defaultdict(float)
        for k, v in self.data["c"].items():
            totals[family_of(k)] += v
        out: dict[str, int | float] = {
            "load_jobs": int(totals["load_jobs"]),
            "load_MB": round(totals["load_bytes"] / 2**20, 3),
            "load_error_blocks": int(totals["load_error_blocks"]),
            "save_keys": int(totals["save_keys"]),
            "save_skipped_keys": int(totals["save_skipped_keys"]),
            "save_error_keys": int(totals["save_error_keys"]),
            "lookup_hit_tokens": int(totals["lookup_hit_tokens"]),
            "lookup_miss_tokens": int(totals["lookup_miss_tokens"]),
            "failures": int(totals["failures"]),
        }
        samples: dict[str, list[float]] = defaultdict(list)
        for k, v in self.data["h"].items():
            samples[family_of(k)].extend(v)
        for k, v in self.data.get("x", {}).items():
            samples[family_of(k)].extend(e[0] for e in v)
        for fam in ("load_queue_wait_seconds", "load_prepare_seconds",
                    "load_master_lookup_seconds", "load_transfer_seconds", "lookup_seconds",
                    "ttft_store_seconds"):
            vals = sorted(samples.get(fam, ()))
            if vals:
                name = fam.removesuffix("_seconds")
                out[f"{name}_p50_ms"] = round(vals[len(vals) // 2] * 1e3, 3)
                out[f"{name}_p99_ms"] = round(vals[min(len(vals) - 1, int(len(vals) * 0.99))]
                                              * 1e3, 3)
        return out


class StatsRecorder(Subscriber):
    """Metrics subscriber: folds events into counters and samples until vLLM polls.

    Called from the receive/save threads and the scheduler's lookup thread; the lock is held
    only for dictionary updates, never across a store call. Keys are precomputed per thread.
    """

    def __init__(self, tp_rank: int = 0, threads: int = 0,
                 gauges: Callable[[], WorkerGauges] | None = None,
                 counters: Callable[[], dict[str, float]] | None = None) -> None:
        self._lock = threading.Lock()
        self._c: dict[str, float] = defaultdict(int)
        self._h: dict[str, list[float]] = defaultdict(list)
        self._x: dict[str, list[list]] = defaultdict(list)
        # Per thread, and last the jobs no thread took (LoadEvent.thread None): the last load
        # event and the samples it added to the exemplar families.
        self._last: list[tuple[LoadEvent | None, tuple[float, float | None]]] = \
            [(None, (0.0, None))] * (threads + 1)
        self._gauges = gauges
        self._counters = counters  # increments polled at each snapshot (not event-driven)
        self._last_gauges: dict[str, int] = {}
        self._gauge_sent_at = 0.0
        self._rank = tp_rank
        self._lookup_ewma = [0.0] * (threads + 1)
        fams = ("load_queue_wait_seconds", "load_prepare_seconds", "load_master_lookup_seconds",
                "load_transfer_seconds", "load_job_seconds", "load_bytes", "load_keys",
                "load_busy_seconds")
        self._tkeys = [{f: stat_key(f, tp_rank, t) for f in fams}
                       | {"ok": stat_key("load_jobs", tp_rank, t, "ok"),
                          "error": stat_key("load_jobs", tp_rank, t, "error")}
                       for t in (*range(threads), QUEUED_THREAD)]
        self._rkeys = {f: stat_key(f, tp_rank) for f in (
            "load_error_blocks", "save_ready_wait_seconds", "save_put_seconds", "save_bytes",
            "save_keys", "save_skipped_keys", "save_error_keys")}
        self._ttft_keys = {m: stat_key("ttft_store_seconds", m) for m in TTFT_MODES} | {
            p: stat_key("ttft_store_phase_seconds", p) for p in TTFT_PHASES}

    def _sample(self, key: str, value: float) -> None:
        s = self._h[key]
        if len(s) < SAMPLE_CAP:
            s.append(value)

    def _slot(self, ev: LoadEvent) -> int:
        return len(self._tkeys) - 1 if ev.thread is None else ev.thread

    def on_load(self, ev: LoadEvent) -> None:
        slot = self._slot(ev)
        k = self._tkeys[slot]
        get_s = ev.t_end - ev.t_lookup_end
        if ev.lookup_sampled:
            lookup_s = ev.t_lookup_end - ev.t_prepared
            prev = self._lookup_ewma[slot]
            self._lookup_ewma[slot] = lookup_s if prev == 0 else \
                prev + _EWMA * (lookup_s - prev)
        # The batch get does its own master lookup before moving bytes; subtract the thread's
        # latest lookup estimate to report the data phase alone.
        transfer_s = max(0.0, get_s - self._lookup_ewma[slot])
        with self._lock:
            self._sample(k["load_queue_wait_seconds"], ev.t_start - ev.t_enqueue)
            if ev.phases:  # a preload's copy or an expired job would add zeros
                self._sample(k["load_prepare_seconds"], ev.t_prepared - ev.t_start)
            if ev.lookup_sampled:
                self._sample(k["load_master_lookup_seconds"], lookup_s)
            job_s = ev.t_end - ev.t_enqueue
            self._sample(k["load_job_seconds"], job_s)
            self._c[k["load_busy_seconds"]] += ev.t_end - ev.t_start
            timed = ev.ok and ev.phases
            self._last[slot] = (ev, (job_s, transfer_s if timed else None))
            if timed:
                self._sample(k["load_transfer_seconds"], transfer_s)
            if ev.ok:
                self._c[k["ok"]] += 1
            else:
                self._c[k["error"]] += 1
                self._c[stat_key("failures", ev.tp_rank, "load", ev.code)] += 1
                self._c[self._rkeys["load_error_blocks"]] += ev.failed_blocks
            self._c[k["load_bytes"]] += ev.nbytes
            self._c[k["load_keys"]] += ev.loaded_keys
            for tier, (tokens, nbytes) in (ev.tiers or {}).items():
                self._c[stat_key("load_tier_tokens", ev.tp_rank, tier)] += tokens
                self._c[stat_key("load_tier_bytes", ev.tp_rank, tier)] += nbytes

    def traced_load(self, ev: LoadEvent, trace_id: str, span_id: str) -> None:
        """`ev` was traced (called by the span exporter on the job's thread, after `on_load`):
        its samples become exemplars. Skipped when a snapshot already took them."""
        slot = self._slot(ev)
        last, values = self._last[slot]
        if last is not ev:
            return
        k = self._tkeys[slot]
        with self._lock:
            for fam, v in zip(EXEMPLAR_FAMILIES, values, strict=True):
                key, samples = k[fam], self._h.get(k[fam])
                if v is None or not samples or len(self._x[key]) >= EXEMPLAR_CAP:
                    continue
                for i in range(len(samples) - 1, -1, -1):  # it was appended last, or nearly
                    if samples[i] == v:
                        del samples[i]
                        self._x[key].append([v, trace_id, span_id])
                        break

    def on_save(self, ev: SaveEvent) -> None:
        k = self._rkeys
        with self._lock:
            if ev.ran:  # a lost save waited for nothing
                self._sample(k["save_ready_wait_seconds"], ev.t_ready - ev.t_start)
            if ev.keys:
                self._sample(k["save_put_seconds"], ev.t_end - ev.t_exists_end)
            self._c[k["save_bytes"]] += ev.nbytes
            self._c[k["save_keys"]] += ev.keys
            self._c[k["save_skipped_keys"]] += ev.skipped
            self._c[k["save_error_keys"]] += ev.failed_keys
            if ev.code:
                self._c[stat_key("failures", ev.tp_rank, ev.failed_op, ev.code)] += 1

    def on_lookup(self, ev: LookupEvent) -> None:
        with self._lock:
            self._sample("lookup_seconds", ev.seconds)
            self._c["lookup_keys"] += ev.keys
            self._c[stat_key("lookups", ev.result)] += 1
            self._c["lookup_hit_tokens"] += ev.hit_tokens
            self._c["lookup_miss_tokens"] += ev.miss_tokens
            if ev.code:
                self._c[stat_key("failures", self._rank, "lookup", ev.code)] += 1

    def on_request(self, ev: RequestEvent) -> None:
        k = self._ttft_keys
        with self._lock:
            self._sample(k[ev.mode], ev.seconds)
            for phase, seconds in ev.phases:
                self._sample(k[phase], seconds)

    def current_gauges(self) -> dict[str, int]:
        """The gauge series as the next poll would send them (peaks are consumed)."""
        return self._gauge_series(self._gauges()) if self._gauges is not None else {}

    def _gauge_series(self, w: WorkerGauges) -> dict[str, int]:
        r = self._rank
        g = {stat_key("load_queue_depth", r): w.load_queue_depth,
             stat_key("save_queue_depth", r): w.save_queue_depth,
             stat_key("recv_threads", r): w.recv_threads,
             stat_key("recv_threads_active", r): w.recv_threads_active,
             stat_key("staging_buffers", r): w.staging_buffers,
             stat_key("preload_bytes", r): w.preload_bytes}
        g |= {stat_key("threads_stuck", r, op): n for op, n in w.threads_stuck.items()}
        g |= {stat_key("load_inflight", r, t): v for t, v in enumerate(w.load_inflight)}
        if w.layout is not None:
            g[stat_key("layout_info", r, *w.layout)] = 1
        return g

    def count(self, family: str, *labels: object, n: int = 1) -> None:
        """Add `n` to a counter family outside the job events (pool and tuner health)."""
        with self._lock:
            self._c[stat_key(family, *labels)] += n

    def snapshot(self) -> PooledStoreStats | None:
        """Hand over everything recorded since the last call (None when nothing happened)."""
        polled = self._counters() if self._counters is not None else {}
        with self._lock:
            c, h, x = self._c, self._h, self._x
            self._c, self._h, self._x = defaultdict(int), defaultdict(list), defaultdict(list)
        for k, v in polled.items():
            c[k] += v
        g: dict[str, Any] = {}
        if self._gauges is not None:
            now = time.monotonic()
            cur = self._gauge_series(self._gauges())
            if cur != self._last_gauges or now - self._gauge_sent_at > GAUGE_RESEND_S:
                g, self._last_gauges, self._gauge_sent_at = cur, cur, now
        if not (c or h or g or x):
            return None
        return PooledStoreStats(data={"c": dict(c), "h": dict(h), "g": g, "x": dict(x)})
