"""The single list of Prometheus families the connector exports.

`prom.py` builds the metric objects from it, the dashboards and alert rules are checked
against it, and the docs' table (docs/observability.md) is generated from it, so a name cannot drift between them.
Every family also carries vLLM's own `model_name` and `engine` labels. `cache_prefix` (the key
namespace) and `tenant` (the Mooncake tenant_id) are filled in by the frontend from the
connector's config, not carried in the stats.
`known_series` lists the series exported as 0 from startup.
"""

from __future__ import annotations

from dataclasses import dataclass

from connector.docsync import sync_block

PREFIX = "vllm:mooncake_pool_"

# 50 us .. 20 s: master lookups on RDMA fabrics take ~100 us, TCP loads of long prompts seconds.
LATENCY_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
)
# Time to first token: a queued request waits for a sequence slot far past 20 s under
# overload, so these go on as vLLM's own time_to_first_token_seconds does (to 2,560 s), and
# the two compare bucket for bucket above 20 s.
TTFT_BUCKETS = (*LATENCY_BUCKETS, 40.0, 80.0, 160.0, 640.0, 2560.0)


@dataclass(frozen=True)
class Family:
    """One exported family. `key` is the short name used inside the stats payload."""

    key: str
    kind: str  # "counter" | "gauge" | "histogram"
    labels: tuple[str, ...]
    help: str
    question: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS  # a histogram's

    @property
    def name(self) -> str:
        """The name as registered (prometheus_client adds `_total` to counters on export)."""
        return PREFIX + self.key

    @property
    def exported(self) -> str:
        return self.name + ("_total" if self.kind == "counter" else "")

    @property
    def stats_labels(self) -> tuple[str, ...]:
        """The labels whose values the stats keys carry (the rest come from the config)."""
        return tuple(label for label in self.labels if label not in CONFIG_LABELS)


CONFIG_LABELS = ("cache_prefix", "tenant", "medium", "locality")


_T = ("tp_rank", "thread")
_R = ("tp_rank",)

FAMILIES: tuple[Family, ...] = (
    # Receive pool, per thread.
    Family("recv_threads", "gauge", _R, "Receive threads in the pool (VLLM_MOONCAKE_LOAD_RECV_THREADS; with auto, the maximum).",
           "Which thread count is each deployment running?"),
    Family("recv_threads_active", "gauge", _R, "Receive threads taking jobs now: the configured count, or the current choice of load_threads: auto.",
           "What thread count did auto settle on?"),
    Family("layout_info", "gauge", ("tp_rank", "fingerprint", "hash_algo", "transfer"), "Always 1; labels give the key-namespace fingerprint, block-hash algorithm and transfer mode (staged or multibuffer).",
           "Do two engines that should share blocks use the same key namespace?"),
    Family("load_queue_depth", "gauge", _R, "Peak number of load jobs waiting in the shared receive queue during the last engine step.",
           "Are the receive threads keeping up?"),
    Family("load_inflight", "gauge", _T, "1 if the receive thread worked on a load job during the last engine step, else 0.",
           "Which threads are busy right now?"),
    Family("load_queue_wait_seconds", "histogram", _T, "Time a load job waited in the shared queue before a thread took it.",
           "Would more threads cut load latency?"),
    Family("load_prepare_seconds", "histogram", _T, "Python preparation of a load job (keys, addresses) before any store call (jobs that made their own: not a preload's copy, nor one expired by the watchdog or at shutdown).",
           "Is preparation (GIL) the bottleneck? (High on long prompts: does address_cache_size "
           "cover the KV cache's blocks? The worker's startup log says.)"),
    Family("load_master_lookup_seconds", "histogram", _T, "Master replica lookup for a load job's keys (sampled jobs).",
           "Is the Mooncake master slow?"),
    Family("load_transfer_seconds", "histogram", _T, "Data phase of a load: the batch get minus the master lookup (successful jobs that read the store themselves: not a preload's copy).",
           "Is the network / transfer engine slow?"),
    Family("load_job_seconds", "histogram", _T, "Whole load job, from enqueue to completion.",
           "How long do requests wait for KV from the store?"),
    Family("load_bytes", "counter", _T + ("tenant",), "Bytes loaded from the store into the KV cache.",
           "What bandwidth does each thread achieve?"),
    Family("load_keys", "counter", _T, "Store keys (one per block and TP rank) loaded.",
           "How many blocks does each thread move?"),
    Family("load_jobs", "counter", _T + ("status",), "Load jobs finished, by status (ok or error); thread=\"queued\" counts jobs that expired before any thread took them.",
           "How is work spread across threads, and how much fails?"),
    Family("load_busy_seconds", "counter", _T, "Time a receive thread spent working on jobs; its rate is utilisation.",
           "Are threads saturated or idle?"),
    Family("load_error_blocks", "counter", _R, "KV blocks reported to vLLM as failed loads (vLLM recomputes them).",
           "How much prefill is recomputed because loads failed?"),
    # Save path.
    Family("save_queue_depth", "gauge", _R, "Save jobs waiting for the save thread (sampled each step).",
           "Is the save thread falling behind?"),
    Family("save_ready_wait_seconds", "histogram", _R, "Wait for the step's KV to be ready (CUDA event) before a put (saves that ran: not one dropped or expired before it did).",
           "Do saves stall on the forward pass?"),
    Family("save_put_seconds", "histogram", _R, "Store put of a save job's new blocks.",
           "How long do puts take?"),
    Family("save_bytes", "counter", _R + ("tenant",), "Bytes written to the store.",
           "What write bandwidth does the store see?"),
    Family("save_keys", "counter", _R, "Store keys written.",
           "How many blocks are being stored?"),
    Family("save_skipped_keys", "counter", _R, "Keys not written because the store already holds them.",
           "How much is deduplicated?"),
    Family("save_error_keys", "counter", _R, "Store keys a save did not write: its put or existence check failed (a full store, a master outage), or it was dropped, expired or shut down first. Those blocks miss later. Keys written + skipped + failed = keys each finished request offered, once its saves reported (one expired while its put ran reports when the put returns, at the latest at shutdown).",
           "How much of what the engine computed never reaches the store?"),
    Family("layout_keys", "counter", ("tp_rank", "op", "layout", "group", "store_tp_size", "tp_size"),
           "Store objects this rank loaded or saved (op), by stored layout: kv_heads (a block's KV heads in store_tp_size shards, each object read whole), kv_heads_slice (part of a shard read by a rank of a larger TP size), latent (MLA: one object per block every rank reads); the KV cache group kind (full or sliding_window), and this engine's tp_size.",
           "Do engines of different TP sizes share blocks (loads where tp_size differs from store_tp_size)?"),
    # Scheduler lookup.
    Family("lookup_seconds", "histogram", (), "Scheduler-side prefix lookup in the store (all TP namespaces).",
           "Does the lookup slow the scheduler?"),
    Family("lookup_keys", "counter", (), "Keys the scheduler's lookups asked the master, those of lookups given up on included (timed out, or their request finished first: counted when their call returns).",
           "How much lookup traffic does the master get?"),
    Family("lookups", "counter", ("cache_prefix", "result", "tenant"), "Scheduler lookups by result: hit, miss, error or timeout (counted when vLLM asks about the request), or abandoned (its request finished, or the connector cache was reset, before vLLM used the answer: a look-ahead lookup of a request aborted while queued; or it answered more than lookup_answer_ttl_s before vLLM asked, and a fresh lookup replaced it); each lookup started counts once. cache_prefix is the tenant's key prefix.",
           "Does the store find prefixes at all, for each tenant?"),
    Family("lookups_deferred", "counter", (), "Arriving requests whose lookup waited for a turn: lookup_ahead lookups of requests vLLM had not asked about were running or answered already (it starts in arrival order as those are asked about or finish, or when vLLM asks about it).",
           "Does the look-ahead bound hold lookups back (raise lookup_ahead)?"),
    Family("lookup_hit_tokens", "counter", ("cache_prefix", "tenant"), "Prompt tokens found in the store.",
           "How much prefill does the store save?"),
    Family("lookup_miss_tokens", "counter", ("cache_prefix", "tenant"), "Prompt tokens looked up but not found (tokens queried = hit + miss).",
           "What is the token hit rate per deployment and tenant?"),
    # Deadlines and thread health.
    Family("threads_stuck", "gauge", ("tp_rank", "op"), "Job threads (op load or save) retired while stuck in a store call past their deadline, still waiting for the call to return (bounded by the pool size).",
           "Is a store node or the master frozen under in-flight calls?"),
    Family("threads_replaced", "counter", ("tp_rank", "op"), "Job threads replaced by a fresh thread (and staging buffer) because their call outlived load_timeout_s or save_timeout_s.",
           "How often do store calls hang?"),
    Family("staging_buffers", "gauge", _R, "Registered staging buffers: one per live job thread and KV cache group plan (those of the receive threads taking jobs and of the in-step thread from startup, the save thread's from its first save), plus those held by stuck threads until their calls return.",
           "Is staging memory bounded while calls hang?"),
    Family("preload_keys", "counter", ("tp_rank", "outcome"), "Store objects of queued requests' prefixes read into host memory before vLLM scheduled them (preload_buffer_size), by outcome: used (a load copied them into the KV cache instead of reading the store), unused (freed first: the request finished or aged out, its load read the store, or it needed only some), failed (not read whole), no_room (not preloaded: the buffer was full).",
           "Do preloads hide load time (used), or waste reads (unused) or lack room (no_room)?"),
    Family("preload_bytes", "gauge", _R, "Bytes of preload_buffer_size held by preloads now (read or being read, not yet used or freed).",
           "Is the preload buffer big enough for the queue?"),
    Family("autotune_errors", "counter", _R, "Windows the load_threads: auto tuner could not judge (logged; tuning goes on).",
           "Is the auto tuner healthy?"),
    # The store's share of time to first token (scheduler; requests that load from the store).
    Family("ttft_store_seconds", "histogram", ("mode",), "Time a request that loads from the store spends before its prefill runs: from its arrival at the scheduler until its prefill is scheduled with the loaded prefix; mode async (it waited in WAITING_FOR_REMOTE_KVS) or sync (loaded inside the engine step, which waited for it). Compare with vllm:time_to_first_token_seconds.",
           "How much time to first token does a store hit cost?", buckets=TTFT_BUCKETS),
    Family("ttft_store_phase_seconds", "histogram", ("phase",), "The phases of ttft_store_seconds, per request, in order: lookup (arrival to the store lookup's answer), admit (to the load sent to the workers), load_start (to the load queued on the worker), load_queue (to a receive thread taking it), load_transfer (store get and copies), load_report (to vLLM hearing of it, at a step's end), handoff (the rest of the round trip from the scheduler to the workers and back), reschedule (to the prefill scheduled).",
           "Where does a store hit's extra time to first token go?", buckets=TTFT_BUCKETS),
    Family("ttft_store_dropped", "counter", (), "Request timelines the scheduler dropped before they were published, because 4096 were open (one per request looked up and not finished; the oldest arrival's goes first) or 4096 finished requests' in-step loads still waited for the workers' account. Those that loaded from the store are missing from ttft_store_seconds and ttft_store_phase_seconds, and they are the longest-waiting ones.",
           "Does the TTFT breakdown miss requests (more requests in flight than it follows)?"),
    # Failures.
    Family("failures", "counter", ("tp_rank", "op", "code", "tenant"),
           "Failed store operations by operation (load, save, save_exists, lookup) and Mooncake error code; non-numeric codes: exception, timeout (past load_timeout_s or save_timeout_s: recomputed or abandoned), shutdown (queued at close), abandoned (a save dropped before it read its blocks: its request was preempted, or finished while saves fail), short_read (a stored object smaller than a block), unsafe (a save not made: its request shared a step with an in-step load that failed, or computed on blocks of such a request, so its blocks may be wrong), unavailable (no client), other.",
           "What is failing, and why (-704 not found, -600 buffer, -800 transfer, -900 RPC ...)?"),
    # Master outages and HA failovers, as this rank's store client rode through them.
    Family("master_failovers", "counter", _R, "HA master failovers this rank's store client rode through: its circuit breaker opened on an RPC failure and closed on a different leader.",
           "Did the master group fail over, and did every engine follow the new leader?"),
    Family("master_down_seconds", "counter", _R, "Time this rank's store client had no master answering (circuit breaker open: store jobs fail fast and vLLM recomputes); counted while it lasts.",
           "How long was the cache unavailable during a master outage or failover?"),
    Family("master_probe_errors", "counter", _R, "Rounds of the circuit breaker's probe that failed with an error (etcd answering garbage, an exception from the store client) instead of finding the master still down; logged, and the probe goes on.",
           "Is something broken besides the outage itself (etcd, a proxy, the client)?"),
    # The disk tier (tier_metrics, on with enable_offload): what each tier served.
    Family("load_tier_tokens", "counter", ("tp_rank", "tier", "tenant"), "Prompt tokens loaded from the store, by the tier that held their blocks (memory, disk; unknown: the master named no replica just before the get). Every rank loads its share of the same tokens: read one rank.",
           "How much of the prefill does the disk tier serve?"),
    Family("load_tier_bytes", "counter", ("tp_rank", "tier", "tenant"), "Bytes loaded from the store, by the tier that held them.",
           "What bandwidth does each tier deliver?"),
    # KV events for routers (kv_events on: connector/observability/kv_events.py, docs/kv-events.md).
    Family("kv_events", "counter", ("kind", "medium", "locality"), "Blocks announced in the store KV events published into vLLM's KV event stream, by kind: stored (in a BlockStored, which carries a run of a request's blocks: every TP rank's shards of each are in the store, or this engine found it there) or removed (BlockRemoved: an announced block left the store); medium and locality are what the events carry (kv_events_medium, kv_events_locality: none is unset), which decide whether a router takes them.",
           "Does the router hear of the store's blocks, and of the ones it loses?"),
    Family("kv_events_dropped", "counter", ("kind",), "Blocks dropped from the store KV events because a bounded queue was full, by kind: stored, landed (a worker's report of a saved block, so it was never announced; counted by TP rank 0, once per block), or removed (a removal held back: its block stays live until a later query or step finds room; each block counted once); none is ever waited for.",
           "Does the router's view of the store have holes?"),
    Family("kv_events_sweeps", "counter", ("result",), "Rounds of the removal sweep (the query of the master's HTTP admin port for the announced blocks), by result: ok, error (the master's port did not answer, or answered garbage: removals then come from lookups only until a round succeeds), off (counted once at startup: the sweep cannot work here, a tenant other than default).",
           "Are removals found while the engine is idle, or only when a lookup misses?"),
    Family("kv_events_sweep_keys", "counter", (), "Store keys the removal sweep asked of the master's HTTP admin port and had answered (every store shard of every live block, each round): summed over the engines, what their sweeps ask of the master; docs/performance.md gives the master's CPU per 1,000 of them.",
           "How much master CPU do the engines' sweeps take (a longer kv_events_sweep_s or a smaller kv_events_max_live asks less)?"),
    Family("kv_events_sweep_seconds", "counter", (), "Wall time the removal sweep spent in its rounds, ok or failed: divided by kv_events_sweeps_total, a round's mean length. A removal reaches the router within kv_events_sweep_s plus one round.",
           "How stale can the router's view of the store get (kv_events_sweep_s plus a round)?"),
    Family("kv_events_removals", "counter", ("source",), "BlockRemoved events by what found the block gone: sweep (the periodic query of the master), lookup (a scheduler lookup missed it), live_limit (kv_events_max_live reached: the oldest announced block is withdrawn), reset (the connector cache was reset: this engine stopped using the store and withdraws every block).",
           "Which path detects the store's evictions?"),
)

BY_KEY = {f.key: f for f in FAMILIES}

# Histograms whose samples of traced jobs carry OpenMetrics exemplars with these labels (the
# ids of the job's `mooncake.load` span).
EXEMPLAR_FAMILIES = ("load_job_seconds", "load_transfer_seconds")
EXEMPLAR_LABELS = ("trace_id", "span_id")

LOOKUP_RESULTS = ("hit", "miss", "error", "timeout", "abandoned")
TIERS = ("memory", "disk", "unknown")
# Values of ttft_store_phase_seconds' phase label, in the order a request goes through them.
TTFT_PHASES = ("lookup", "admit", "load_start", "load_queue", "load_transfer", "load_report",
               "handoff", "reschedule")
TTFT_MODES = ("async", "sync")
KV_EVENT_KINDS = ("stored", "removed", "landed")
KV_REMOVAL_SOURCES = ("sweep", "lookup", "live_limit", "reset")
KV_SWEEP_RESULTS = ("ok", "error", "off")
# (op, code) pairs a deployment can meet (codes from connector.store.client: Mooncake's ErrorCode
# values, "unavailable" while the store is not connected, timeout and shutdown from the job
# pools' watchdog, exception, abandoned, short_read, other).
_RPC = ("-900", "-901")
KNOWN_FAILURES: tuple[tuple[str, str], ...] = (
    *(("load", c) for c in ("-704", "-600", "-800", *_RPC, "unavailable", "timeout",
                            "shutdown", "exception", "other", "short_read", "-10")),
    *(("save", c) for c in ("-200", "-800", *_RPC, "unavailable", "timeout", "shutdown",
                            "exception", "abandoned", "other", "-1700", "-1701")),
    *(("save_exists", c) for c in _RPC),
    *(("lookup", c) for c in (*_RPC, "unavailable", "exception")),
)


def known_series(tp_size: int, tiers: bool = False) -> list[str]:
    """Stats keys exported as 0 from startup, so dashboards show 0 rather than "No data" and
    rate() alerts work from the first scrape. Lookups run on the scheduler (rank 0 labels).
    `tiers`: the per-tier series too (tier_metrics is on)."""
    keys = [f"lookups|{r}" for r in LOOKUP_RESULTS] + ["lookup_hit_tokens", "lookup_miss_tokens",
                                                       "lookups_deferred", "ttft_store_dropped"]
    keys += [f"kv_events|{k}" for k in KV_EVENT_KINDS[:2]]
    keys += [f"kv_events_dropped|{k}" for k in KV_EVENT_KINDS]
    keys += [f"kv_events_removals|{s}" for s in KV_REMOVAL_SOURCES]
    keys += [f"kv_events_sweeps|{r}" for r in KV_SWEEP_RESULTS] + ["kv_events_sweep_keys",
                                                                 "kv_events_sweep_seconds"]
    for rank in range(tp_size):
        keys += [f"load_error_blocks|{rank}", f"save_error_keys|{rank}", f"autotune_errors|{rank}",
                 f"threads_replaced|{rank}|load", f"threads_replaced|{rank}|save",
                 f"master_failovers|{rank}", f"master_down_seconds|{rank}",
                 f"master_probe_errors|{rank}", f"preload_keys|{rank}|used",
                 f"preload_keys|{rank}|unused"]
        keys += [f"failures|{rank}|{op}|{code}" for op, code in KNOWN_FAILURES
                 if op != "lookup" or rank == 0]
        keys += [f"load_tier_{what}|{rank}|{tier}" for what in ("tokens", "bytes")
                 for tier in TIERS if tiers]
    return keys


def markdown_table() -> str:
    """The docs' table of every family (docs/observability.md)."""
    rows = ["| name | type | labels | meaning | question it answers |", "|---|---|---|---|---|"]
    for f in FAMILIES:
        labels = ", ".join(("model_name", "engine") + f.labels)
        rows.append(f"| `{f.exported}` | {f.kind} | {labels} | {f.help} | {f.question} |")
    return "\n".join(rows)


METRICS_PAGE = "docs/observability.md"


def sync_docs(path: str = METRICS_PAGE, check: bool = False) -> bool:
    """Write the family table between the observability page's markers; with check, only
    compare."""
    return sync_block(path, "metric-table", markdown_table(), check)


if __name__ == "__main__":
    import sys

    ok = sync_docs(check="--check" in sys.argv)
    sys.exit(0 if ok or "--check" not in sys.argv else 1)
