"""Generate the Grafana dashboards from code (grafana-foundation-sdk, Grafana 11.6 flavour).

    python -m dashboards.generate            # rewrite dashboards/*.json
    python -m dashboards.generate --check    # exit 1 if the committed JSON is out of date

Every panel is one row of the tables below: (title, unit, [(expr, legend), ...]) plus options.
Metric names come from `connector/observability/metric_catalog.py` through `dashboards.promql`, so a
renamed family breaks generation (KeyError) instead of leaving a silent "No data" panel.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from dashboards.promql import master, quantile, quantile_of, rate, series, vllm

HERE = Path(__file__).resolve().parent
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")


@dataclass(frozen=True)
class P:
    """One panel: title, Grafana unit, targets as (PromQL, legend) pairs."""

    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]
    description: str = ""
    kind: str = "timeseries"  # timeseries | stat | table
    width: int = 8
    height: int = 8
    min: float | None = None
    max: float | None = None
    table_value: str | None = "value"  # tables: header of the Value column (None: hide it)
    exemplars: bool = False  # show the series' exemplars (trace ids of traced jobs)
    stack: bool = False  # timeseries: stack the series (parts of one whole)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[P, ...]
    collapsed: bool = False


@dataclass(frozen=True)
class Dash:
    uid: str
    file: str
    title: str
    description: str
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = field(default=("vllm", "mooncake", "kv-connector"))


def p50_p99(key: str, by: str = "thread",
            who: str = "thread {{thread}}") -> tuple[tuple[str, str], ...]:
    """p99 (solid) and p50 (dashed) of a connector histogram, per `by`."""
    who = f" {who}" if who else ""
    return ((quantile(0.99, key, by), f"p99{who}"), (quantile(0.5, key, by), f"p50{who}"))


def vllm_p50_p99(bucket: str, what: str) -> tuple[tuple[str, str], ...]:
    sel = vllm(bucket)
    return ((quantile_of(0.99, sel), f"p99 {what}"), (quantile_of(0.5, sel), f"p50 {what}"))


def per_thread_and_total(key: str, **extra: str) -> tuple[tuple[str, str], ...]:
    return (
        (rate(series(key, **extra), "thread"), "thread {{thread}}"),
        (rate(series(key, **extra)), "total"),
    )


def hit_ratio(hits: str, queries: str) -> str:
    return f"{rate(hits)} / {rate(queries)}"


EXEMPLAR_HINT = ("Dots are exemplars: traced jobs; click one to open its mooncake.load trace "
                 "(the Prometheus data source links trace_id to the traces data source, see "
                 "dashboards/grafana-datasources.yaml).")


def tenant_hit_rate() -> P:
    """Token hit rate per deployment (vllm_deployment, from the Helm chart's monitors; model
    without it) and tenant (cache_prefix): the store's value to each tenant."""
    by = "vllm_deployment, model_name, cache_prefix"
    hit = rate(series("lookup_hit_tokens"), by)
    miss = rate(series("lookup_miss_tokens"), by)
    return P("Token hit rate per deployment and tenant", "percentunit", (
        (f"{hit} / ({hit} + {miss})", "{{vllm_deployment}} {{model_name}} / {{cache_prefix}}"),
    ), "Prompt tokens found in the store / tokens looked up, per deployment and tenant "
       "(cache_prefix). A drop while traffic holds: alert MooncakePoolStoreHitRateCollapsed.",
      min=0, max=1, width=24)


def store_ttft_panel() -> P:
    """The store's share of TTFT next to vLLM's own TTFT."""
    return P("TTFT added by the store", "s", (
        (quantile(0.99, "ttft_store_seconds", "mode"), "p99 {{mode}} loads"),
        (quantile(0.5, "ttft_store_seconds", "mode"), "p50 {{mode}} loads"),
        (quantile_of(0.5, vllm("vllm:time_to_first_token_seconds_bucket")),
         "p50 vLLM TTFT (all requests)"),
    ), "Time a request that loads from the store spends before its prefill runs (arrival at "
       "the scheduler to prefill scheduled), by how its load ran: async (it waited for a "
       "later step) or sync (inside the step, within sync_load_ms). Against vLLM's TTFT of "
       "all requests: does the store pay for itself?")


def store_ttft_phases_panel() -> P:
    """Mean time per phase of a store hit, stacked: the phases add up to the mean store time.
    Requests are counted by their lookup phase, which every one has: counting the total by
    mode would read 0 in a window where only a mode's new series moved (a division by 0)."""
    per_request = f"scalar({rate(series('ttft_store_phase_seconds', '_count', phase='lookup'))})"
    return P("Where a store hit's TTFT goes (mean per request)", "s", (
        (f"{rate(series('ttft_store_phase_seconds', '_sum'), 'phase')} / {per_request}",
         "{{phase}}"),
    ), "Mean seconds per request that loaded from the store, by phase: lookup (to the store's "
       "answer), admit (to the load sent to the workers), load_start (to queued on the "
       "worker), load_queue, load_transfer, load_report (to vLLM hearing of it at a step's "
       "end), handoff (scheduler-worker round trip), reschedule (to the prefill scheduled). "
       "In-step loads have no report wait, handoff or reschedule.", stack=True)


def failures_panel() -> P:
    """Failures by op and code, drawn only where non-zero (every known code is exported as 0
    from startup: a legend of some thirty flat lines would bury the one that matters), and the
    total, which reads 0 on a healthy deployment."""
    return P("Store failures by op and code", "ops", (
        (f"{rate(series('failures'), 'op, code')} > 0", "{{op}} {{code}}"),
        (rate(series("failures")), "all ops and codes"),
    ), "Failed store operations per second by operation (load, save, save_exists, lookup) "
       "and Mooncake error code (-704 not found, -600 buffer, -800 transfer, -900 RPC), "
       "drawn where non-zero.")


def token_hit_ratio() -> str:
    """hit / (hit + miss); a family nothing has incremented yet counts as 0, so a store that
    never hits reads 0% instead of "No data"."""
    hit = f"({rate(series('lookup_hit_tokens'))} or vector(0))"
    miss = f"({rate(series('lookup_miss_tokens'))} or vector(0))"
    return f"{hit} / ({hit} + {miss})"


# Mooncake master RPCs the connector drives (lookups, exists checks, puts) plus segment mounts.
MASTER_RPCS = (
    "batch_get_replica_list",
    "batch_exist_key",
    "batch_put_start",
    "batch_put_end",
    "batch_put_revoke",
    "get_replica_list",
    "mount_segment",
)


def rate_m(name: str) -> str:
    return f"rate({master(name)}[$__rate_interval])"


_BY_RANK = "pod, tp_rank"
_RANK = "{{pod}} rank {{tp_rank}}"


def master_ha_row() -> Row:
    """Leader, standby lag and failovers of an HA master group (--enable_ha, etcd), from each
    master's own metrics (scrape every master) and from the engines' store clients."""
    state = master("ha_standby_state")
    return Row("Mooncake master HA", (
        P("Serving leader and following standbys", "short", (
            (f"count({state} == 0) or vector(0)", "leader"),
            (f"count({state} == 3) or vector(0)", "following standbys"),
        ), "Masters that are not standbys (the leader; a master without HA counts too) and "
           "standbys following the leader's oplog (state WATCHING). Healthy HA group: 1 and 1 "
           "(alerts MooncakeMasterNoServingLeader, MooncakeMasterStandbyNotFollowing).",
          kind="stat", width=6),
        P("HA state per master", "short", ((f"max by (instance) ({state})", "{{instance}}"),),
          "ha_standby_state: 0 leader (not a standby), 1 connecting, 2 syncing, 3 watching "
          "(following), 4 recovering, 5 reconnecting, 6 promoting, 7 promoted, 8 failed. A "
          "failover shows as the standby's line dropping from 3 to 0.", width=6, min=0),
        P("Standby lag and applied oplog", "short", (
            (f"max by (instance) ({master('ha_oplog_standby_lag')})", "lag {{instance}}"),
            (f"max by (instance) (deriv({master('ha_oplog_applied_sequence_id')}"
             f"[$__rate_interval]))", "applied/s {{instance}}"),
        ), "Oplog entries each standby is behind the log it has read, and the rate at which it "
           "applies entries. The leader of this Mooncake release exports no sequence of its own "
           "(ha_oplog_last_sequence_id stays 0), so a standby that stopped following shows as "
           "a flat applied line while the leader takes puts.", width=6),
        P("Failovers", "short", (
            (f"sum by (instance) (increase({master('ha_state_transitions_total')}"
             f"[$__rate_interval]))", "HA state changes {{instance}}"),
            (f"sum by (pod) (increase({series('master_failovers')}[$__rate_interval]))",
             "ridden through {{pod}}"),
            (f"sum by (pod) (increase({series('master_probe_errors')}[$__rate_interval]))",
             "probe errors {{pod}}"),
        ), "State changes of each master's HA state machine (a promotion is several), "
           "failovers each engine's store client rode through (its breaker closed on a new "
           "leader), and rounds of the breaker's probe that failed with an error (etcd "
           "answering garbage, the client raising; logged, the probe goes on).", width=6),
        P("Time without a master (engines)", "percentunit", (
            (rate(series("master_down_seconds"), _BY_RANK), _RANK),
        ), "Share of time each engine rank's store client had no master answering (breaker "
           "open: loads and saves fail fast, vLLM recomputes). A leader kill costs ~10 s: "
           "etcd lease ~5 s, leader warm-up ~5 s.", width=24, min=0),
    ))

def disk_tier_row() -> Row:
    """What the disk tier serves (tier_metrics: each load job classified by the tier that held
    its blocks) and what the master holds on disk."""
    tokens = rate(series("load_tier_tokens", tp_rank="0"), "tier")
    disk = rate(series("load_tier_tokens", tp_rank="0", tier="disk"))
    served = rate(series("load_tier_tokens", tp_rank="0", tier="=~memory|disk"))
    return Row("Disk tier", (
        P("Prompt tokens served per tier", "short", ((tokens, "{{tier}}"),),
          "Prompt tokens per second loaded from the store, by the tier that held their blocks: "
          "memory, disk (evicted from memory, still on a store node's disk), unknown (the "
          "master named no replica just before the get). Rank 0 (every rank loads its share of "
          "the same tokens). Needs enable_offload or tier_metrics.", min=0),
        P("Disk share of tokens served from the store", "percentunit", (
            (f"{disk} / {served}", "disk"),
        ), "Share of the store-served prompt tokens that came from disk: what the disk tier "
           "adds over memory alone.", min=0, max=1),
        P("Load bandwidth per tier", "Bps", ((rate(series("load_tier_bytes"), "tier"),
                                             "{{tier}}"),),
          "Bytes per second loaded from each tier, all ranks."),
        P("Disk tier on the masters", "bytes", (
            (f"sum by (instance) ({master('master_allocated_file_size_bytes')})",
             "on disk {{instance}}"),
            (f"sum by (instance) ({master('master_total_file_capacity_bytes')})",
             "capacity {{instance}}"),
        ), "Bytes of evicted-or-offloaded objects the store nodes hold on disk, and the disk "
           "capacity they reported (MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES each).", width=12,
          min=0),
        P("Gets served from disk (master)", "Bps", (
            (f"sum by (instance) (rate({master('file_cache_hit_bytes_total')}"
             f"[$__rate_interval]))", "{{instance}}"),
        ), "Bytes per second of replica lookups the master answered with a disk replica (all "
           "clients, not only this connector).", width=12, min=0),
    ))


LOAD_PIPELINE = Dash(
    uid="mooncake-pool-load",
    file="load-pipeline.json",
    title="Mooncake pool / Load pipeline",
    description="Receive-thread pool of the pooled Mooncake store connector: queue, per-phase "
    "latency, bandwidth and utilisation per thread.",
    rows=(
        Row("Receive pool", (
            P("Shared load queue depth vs receive threads", "short", (
                (f"max by ({_BY_RANK}) ({series('load_queue_depth')})", f"queued {_RANK}"),
                (f"max by ({_BY_RANK}) ({series('recv_threads')})", f"recv_threads {_RANK}"),
                (f"max by ({_BY_RANK}) ({series('recv_threads_active')})", f"active {_RANK}"),
            ), "Jobs waiting in the shared receive queue, sampled each engine step. Staying above "
               "recv_threads means the pool is saturated (alert MooncakePoolLoadQueueSaturated). "
               "active: threads taking jobs (with load_threads auto, the tuner's choice; "
               "recv_threads is then the maximum)."),
            P("In-flight load jobs per thread", "short", (
                (f"sum by (thread) ({series('load_inflight')})", "thread {{thread}}"),
            ), "Jobs each receive thread is working on (0 or 1 per rank), summed over ranks."),
            P("Receive thread utilisation", "percentunit", (
                (rate(series("load_busy_seconds"), "thread", agg="avg"), "thread {{thread}}"),
            ), "Share of wall time each thread spent on jobs (rate of busy seconds), averaged over "
               "ranks. Near 100% on every thread: add threads.", min=0),
            P("Receive threads per deployment", "short", (
                (f"max by (model_name, pod, tp_rank) ({series('recv_threads')})", ""),
            ), "The configured load_threads (VLLM_MOONCAKE_LOAD_RECV_THREADS; with auto, the "
               "maximum) of each pod and rank.", kind="table", width=24, height=6,
              table_value="recv_threads"),
        )),
        Row("Latency by phase, per thread (p99 solid, p50 dashed)", (
            P("Queue wait", "s", p50_p99("load_queue_wait_seconds"),
              "Time a job waited in the shared queue before a thread took it."),
            P("Preparation (Python)", "s", p50_p99("load_prepare_seconds"),
              "Key and address preparation before any store call (GIL-bound work)."),
            P("Master lookup", "s", p50_p99("load_master_lookup_seconds"),
              "Replica lookup on the Mooncake master for a job's keys (sampled jobs)."),
            P("Transfer", "s", p50_p99("load_transfer_seconds"),
              "Data phase: the batch get minus the master lookup. " + EXEMPLAR_HINT,
              exemplars=True),
            P("Whole load job", "s", p50_p99("load_job_seconds"),
              "From enqueue to completion: what a request waits for its KV from the store. "
              + EXEMPLAR_HINT, exemplars=True),
            P("Time to first token (vLLM)", "s",
              vllm_p50_p99("vllm:time_to_first_token_seconds_bucket", "TTFT"),
              "vLLM's TTFT, for context: store loads should lower it."),
            store_ttft_panel(),
            store_ttft_phases_panel(),
            P("Request timelines dropped (TTFT breakdown)", "ops", (
                (rate(series("ttft_store_dropped")), "dropped"),
            ), "Request timelines the scheduler dropped unpublished: more than 4096 requests "
               "looked up and not finished at once (the oldest arrival's goes first). Above 0, "
               "the two TTFT panels left miss the longest-waiting store hits."),
        )),
        Row("Throughput", (
            P("Load bandwidth per thread and total", "Bps", per_thread_and_total("load_bytes"),
              "Bytes loaded from the store per second (Grafana scales to MB/s, GB/s)."),
            P("Load jobs per second", "ops", (
                (rate(series("load_jobs"), "thread, status"), "thread {{thread}} {{status}}"),
            ), "Finished load jobs per thread and status (ok / error)."),
            P("Blocks loaded per second", "ops", per_thread_and_total("load_keys"),
              "Store keys (one per block and TP rank) loaded per second."),
        )),
        disk_tier_row(),
    ),
)

def kv_events_row() -> Row:
    """The store's KV events for routers (kv_events on; docs/kv-events.md): what the engine
    announced, why blocks were withdrawn, and what the bounded queues dropped. Collapsed: the
    events are off by default."""
    return Row("KV events for routers", (
        P("Store KV events published", "ops", (
            (rate(series("kv_events"), "kind, medium, locality"),
             "{{kind}} ({{medium}}, locality {{locality}})"),
        ), "Blocks announced per second in BlockStored (every TP rank's shards of a block are "
           "in the store, or this engine found it there; one event carries a run of a "
           "request's blocks) and BlockRemoved (an announced block left the store) events, "
           "into vLLM's KV event stream, with the medium and locality they carry: a "
           "router drops what it does not take (Dynamo: any locality but unset or LOCAL). "
           "Removed far below stored while the store is full: removals are missed (is the "
           "sweep on?).", min=0),
        P("Removal sweeps", "ops", (
            (rate(series("kv_events_sweeps"), "result"), "{{result}}"),
        ), "Rounds of the sweep that asks the master which announced blocks are still stored: "
           "ok, error (the master's HTTP admin port did not answer; removals then come from "
           "lookups only), off (counted once at startup: the sweep cannot work with this "
           "tenant or HA setup). Runbook: MooncakePoolKvEventSweepFailing.", min=0),
        P("Sweep round length (mean)", "s", (
            (f'{rate(series("kv_events_sweep_seconds"), "pod")} / '
             f'{rate(series("kv_events_sweeps"), "pod")}', "{{pod}}"),
        ), "Wall time of a removal sweep round: a block the store loses reaches the router "
           "within kv_events_sweep_s plus one round (or at the first lookup that misses it).",
           min=0),
        P("Keys the sweeps ask of the master", "ops", (
            (rate(series("kv_events_sweep_keys"), "pod"), "{{pod}}"),
            (rate(series("kv_events_sweep_keys")), "all engines shown"),
        ), "Store keys per second the removal sweeps ask of the master's HTTP admin port "
           "(every shard of every live block, each round). The master answers every engine's: "
           "its CPU per 1,000 keys is in docs/performance.md. A longer kv_events_sweep_s or a "
           "smaller kv_events_max_live asks less.", min=0),
        P("BlockRemoved by source", "ops", (
            (rate(series("kv_events_removals"), "source"), "{{source}}"),
        ), "What found each block gone: sweep (the periodic master query), lookup (a scheduler "
           "lookup missed it), live_limit (kv_events_max_live reached), reset (the connector "
           "cache was reset: the engine stopped using the store).", min=0),
        P("KV events dropped", "ops", (
            (rate(series("kv_events_dropped"), "kind"), "{{kind}}"),
        ), "Blocks dropped from the events because a bounded queue was full (never waited "
           "for): a router's "
           "view of the store is then incomplete; raise kv_events_queue.", min=0),
    ), collapsed=True)


def tenants_row() -> Row:
    """Each tenant's hit rate, bytes and refused puts (the connector's series carry the engine's
    tenant_id as `tenant`), and the master's per-tenant quota figures (--enable_multi_tenants)."""
    hit, miss = rate(series("lookup_hit_tokens"), "tenant"), rate(series("lookup_miss_tokens"),
                                                                  "tenant")

    def by_tenant(family: str, legend: str, reduce: str = "rate") -> tuple[str, str]:
        sel = master(family)
        expr = f"sum by (tenant_id) ({sel})" if reduce == "sum" else \
            f"sum by (tenant_id) (rate({sel}[$__rate_interval]))"
        return expr, legend

    return Row("Tenants", (
        P("Token hit rate per tenant", "percentunit", ((f"{hit} / ({hit} + {miss})",
                                                        "{{tenant}}"),),
          "Prompt tokens found in the store / tokens looked up, per Mooncake tenant "
          "(tenant_id). A tenant over its quota keeps fewer blocks and hits less; the other "
          "tenants' hit rates should not move.", min=0, max=1),
        P("Store bytes per tenant", "Bps", (
            (rate(series("load_bytes"), "tenant"), "loaded {{tenant}}"),
            (rate(series("save_bytes"), "tenant"), "stored {{tenant}}"),
        ), "Bytes per second loaded from and written to the store, per tenant."),
        P("Puts refused by the master, per tenant", "ops", (
            (rate(series("failures", op="save", code="=~-1700|-1701"), "tenant, code"),
             "{{tenant}} {{code}}"),
        ), "Save jobs the master refused: -1700 the tenant is over its quota (its new blocks "
           "are not stored), -1701 the tenant is not in the quota policy (nothing of it is "
           "stored; alert MooncakePoolTenantPutsRefused).", min=0),
        P("Tenant quota use (master)", "bytes", (
            by_tenant("mooncake_tenant_quota_charged_bytes", "used {{tenant_id}}", "sum"),
            by_tenant("mooncake_tenant_quota_effective_bytes", "quota {{tenant_id}}", "sum"),
        ), "Memory each tenant holds (charged) against its effective quota (the policy's "
           "quota, scaled down when the quotas add up to more than the pool).", min=0),
        P("Quota rejects per tenant (master)", "ops", (
            (f"sum by (tenant_id, reason) (rate({master('mooncake_tenant_quota_reject_total')}"
             f"[$__rate_interval]))", "{{tenant_id}} {{reason}}"),
        ), "Writes the master refused per tenant and reason (quota_exceeded: evicting the "
           "tenant's own older, unleased blocks could not make room).", min=0),
        P("Evicted to make room, per tenant (master)", "Bps", (
            by_tenant("mooncake_tenant_evict_bytes_total", "{{tenant_id}}"),
        ), "Bytes per second of a tenant's own blocks the master evicted to admit its new "
           "writes within its quota (other tenants' blocks are never evicted for it).", min=0),
    ))


ERRORS_AND_STORE = Dash(
    uid="mooncake-pool-errors",
    file="errors-and-store.json",
    title="Mooncake pool / Errors and store",
    description="Failures, save path, scheduler lookups and hit rate of the pooled Mooncake "
    "store connector, and the Mooncake master's own metrics.",
    rows=(
        Row("Errors", (
            failures_panel(),
            P("Load job error ratio", "percentunit", (
                (f"({rate(series('load_jobs', status='error'))} or vector(0)) / "
                 f"{rate(series('load_jobs'))}", "error share"),
            ), "Share of load jobs that failed (alert MooncakePoolLoadErrorRateHigh).", min=0),
            P("Blocks failed to load (recomputed)", "ops", (
                (rate(series("load_error_blocks"), _BY_RANK), _RANK),
            ), "KV blocks reported to vLLM as failed loads; vLLM recomputes their prefill."),
        )),
        Row("Deadlines and stuck calls", (
            P("Job threads stuck in a store call", "short", (
                (f"max by ({_BY_RANK}, op) ({series('threads_stuck')})", f"{_RANK} {{{{op}}}}"),
                (f"max by ({_BY_RANK}) ({series('staging_buffers')})",
                 f"{_RANK} staging buffers"),
            ), "Threads retired while a store call outlived load_timeout_s / save_timeout_s, "
               "still waiting for Mooncake to return (at most one per pool thread), and the "
               "staging buffers registered now (one per live thread, plus the stuck ones'). "
               "Non-zero for minutes: a frozen store node or master (alert "
               "MooncakePoolStoreCallsStuck)."),
            P("Jobs past their deadline", "ops", (
                (rate(series("failures", code="timeout"), "op"), "{{op}} timed out"),
                (rate(series("threads_replaced"), "op"), "{{op}} threads replaced"),
            ), "Load jobs recomputed and saves abandoned at their deadline, and the threads "
               "replaced because their call hung."),
            P("Auto tuner errors", "ops", ((rate(series("autotune_errors"), _BY_RANK), _RANK),),
              "Windows the load_threads: auto tuner could not judge (logged; tuning goes on)."),
        )),
        Row("Save path", (
            P("Keys saved, skipped (already stored) and failed", "ops", (
                (rate(series("save_keys")), "written"),
                (rate(series("save_skipped_keys")), "skipped (dedup)"),
                (rate(series("save_error_keys")), "failed"),
            ), "Keys written to the store per second, keys not written because the store "
               "already holds them, and keys a failed or dropped save never wrote (they miss "
               "later; alert MooncakePoolSavesFailing past a fifth of the keys)."),
            P("Save put latency", "s", p50_p99("save_put_seconds", "tp_rank", "rank {{tp_rank}}"),
              "Store put of a save job's new blocks."),
            P("Save wait for KV ready", "s",
              p50_p99("save_ready_wait_seconds", "tp_rank", "rank {{tp_rank}}"),
              "Wait for the step's KV (CUDA event) before the put."),
            P("Save bandwidth", "Bps", ((rate(series("save_bytes"), _BY_RANK), _RANK),),
              "Bytes written to the store per second.", width=12),
            P("Save queue depth", "short", (
                (f"max by ({_BY_RANK}) ({series('save_queue_depth')})", _RANK),
            ), "Save jobs waiting for the save thread (sampled each step).", width=12),
        )),
        Row("Scheduler lookup and hit rate", (
            P("Token hit rate", "percentunit", (
                (token_hit_ratio(), "store (connector lookups)"),
                (hit_ratio(vllm("vllm:external_prefix_cache_hits_total"),
                           vllm("vllm:external_prefix_cache_queries_total")),
                 "vLLM external prefix cache"),
                (hit_ratio(vllm("vllm:prefix_cache_hits_total"),
                           vllm("vllm:prefix_cache_queries_total")), "vLLM local prefix cache"),
            ), "Store: lookup_hit_tokens / (hit + miss). Zero while lookups happen usually means "
               "mismatched block hashes across engines (PYTHONHASHSEED; alert "
               "MooncakePoolStoreHitRateZero).", min=0, max=1, width=6),
            P("Scheduler lookup latency", "s", p50_p99("lookup_seconds", "", ""),
              "Scheduler-side prefix lookup in the store (all TP namespaces).", width=6),
            P("Scheduler lookups by result", "ops", (
                (rate(series("lookups"), "result"), "{{result}}"),
                (rate(series("lookups_deferred")), "deferred (waited for a look-ahead turn)"),
            ), "Lookups per second by result (hit, miss, error, timeout; abandoned: its "
               "request finished or was aborted before vLLM used the answer), and arrivals whose "
               "lookup waited for a turn (lookup_ahead lookups of requests vLLM had not reached "
               "were out already).", width=6),
            P("Keys probed by scheduler lookups", "ops", (
                (rate(series("lookup_keys")), "keys probed"),
            ), "Store keys (blocks x TP namespaces) the scheduler asks the master about per "
               "second: the lookup load on the master.", width=6),
            P("Preloads of queued requests", "ops", (
                (rate(series("preload_keys"), "outcome"), "{{outcome}}"),
            ), "Store objects of queued requests' prefixes read into host memory before vLLM "
               "scheduled them, by outcome: used (the load copied them instead of reading the "
               "store), unused (freed first), failed, no_room (the preload buffer was full: "
               "raise preload_buffer_size).", width=12),
            P("Preload buffer held", "bytes", (
                (f"max by ({_BY_RANK}) ({series('preload_bytes')})", _RANK),
            ), "Bytes of preload_buffer_size held by preloads read or being read, not yet "
               "used or freed.", width=12, min=0),
            tenant_hit_rate(),
            P("Key namespace per pod and rank", "short", (
                (f"max by (model_name, pod, tp_rank, fingerprint, hash_algo, transfer) "
                 f"({series('layout_info')})", ""),
            ), "The layout fingerprint (model, dtype, block size, KV heads, layers, TP size, "
               "hash algorithm) in every store key. Engines of one model can share blocks only "
               "when their fingerprints match (and PYTHONHASHSEED, for non-sha256 hashes). "
               "transfer: staged (contiguous buffer + copies) or multibuffer.",
              kind="table", width=24, height=6, table_value=None),
            P("Store objects by layout and TP size", "ops", (
                (rate(series("layout_keys"), "op, layout, group, store_tp_size, tp_size"),
                 "{{op}} {{layout}} {{group}} store_tp={{store_tp_size}} on tp={{tp_size}}"),
            ), "Objects loaded and saved per second by stored layout: kv_heads (KV heads in "
               "store_tp_size shards, read whole), kv_heads_slice (part of a shard, read by a "
               "larger TP size), latent (MLA, one object per block); by KV cache group and this "
               "engine's TP size. Loads with tp differing from store_tp are blocks shared across "
               "fleets of different TP sizes (docs/layouts.md).", width=24),
        )),
        Row("Mooncake master", (
            P("Keys in the store", "short", (
                (f"sum by (instance) ({master('master_key_count')})", "keys {{instance}}"),
            ), "Objects the master manages."),
            P("Capacity and allocated bytes", "bytes", (
                (f"sum by (instance) ({master('master_total_capacity_bytes')})",
                 "capacity {{instance}}"),
                (f"sum by (instance) ({master('master_allocated_bytes')})",
                 "allocated {{instance}}"),
            ), "Mounted segment capacity and bytes allocated across segments.", min=0),
            P("Active clients", "short", (
                (f"sum by (instance) ({master('master_active_clients')})", "clients {{instance}}"),
            ), "Clients (store nodes and engines) with a live lease on the master."),
            P("Master requests per second by RPC", "reqps", tuple(
                (f"sum({rate_m(f'master_{rpc}_requests_total')})", rpc) for rpc in MASTER_RPCS
            ), "RPCs the master received.", width=12),
            P("Master failures per second by RPC", "reqps", tuple(
                (f"sum({rate_m(f'master_{rpc}_failures_total')})", rpc) for rpc in MASTER_RPCS
            ) + ((f"sum({rate_m('master_put_start_alloc_failures_total')})",
                  "put_start allocation"),), "Failed master RPCs (allocation failures: the "
               "pool is full and eviction cannot keep up).", width=12),
        )),
        master_ha_row(),
        tenants_row(),
        kv_events_row(),
    ),
)

DASHBOARDS = (LOAD_PIPELINE, ERRORS_AND_STORE)


# --- building ---------------------------------------------------------------------------------

def _variables(with_master: bool) -> list:
    def query_var(name: str, query: str, title: str):
        return (
            gd.QueryVariable(name).label(title).datasource(DS)
            .query({"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery",
                    "qryType": 1})
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dm.VariableSort.NATURAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(dm.VariableOption(selected=True, text="All", value="$__all"))
        )

    recv = "vllm:mooncake_pool_recv_threads"
    return [
        gd.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        query_var("model", f"label_values({recv}, model_name)", "Model"),
        query_var("pod", f'label_values({recv}{{model_name=~"$model"}}, pod)', "Pod"),
        query_var("tp_rank",
                  f'label_values({recv}{{model_name=~"$model", pod=~"$pod"}}, tp_rank)', "TP rank"),
        query_var("thread",
                  'label_values(vllm:mooncake_pool_load_inflight{model_name=~"$model", '
                  'pod=~"$pod", tp_rank=~"$tp_rank"}, thread)', "Thread"),
    ] + ([query_var("master", "label_values(master_key_count, instance)",
                    "Mooncake master")] if with_master else [])


def _panel(spec: P, panel_id: int):
    if spec.kind == "timeseries":
        b = (timeseries.Panel().line_width(1).fill_opacity(8)
             .show_points(common.VisibilityMode.NEVER)
             .legend(cb.VizLegendOptions().show_legend(True)
                     .display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM))
             .tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING))
             .override_by_regexp("^p50", [dm.DynamicConfigValue(
                 id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]})]))
        if spec.stack:
            b = b.stacking(cb.StackingConfig().mode(common.StackingMode.NORMAL))
    elif spec.kind == "stat":
        b = stat.Panel().text_mode(common.BigValueTextMode.VALUE_AND_NAME)
    elif spec.kind == "table":
        hide = {"Time": True} | ({"Value": True} if spec.table_value is None else {})
        rename = {"Value": spec.table_value} if spec.table_value else {}
        b = table.Panel().with_transformation(dm.DataTransformerConfig(
            id_val="organize", options={"excludeByName": hide, "renameByName": rename}))
    else:
        raise ValueError(spec.kind)
    b = (b.id(panel_id).title(spec.title).description(spec.description).unit(spec.unit)
         .datasource(DS).span(spec.width).height(spec.height))
    if spec.min is not None:
        b = b.min(spec.min)
    if spec.max is not None:
        b = b.max(spec.max)
    for i, (expr, legend) in enumerate(spec.targets):
        q = prometheus.Dataquery().expr(expr).ref_id(chr(ord("A") + i)).datasource(DS)
        if spec.kind == "table":
            q = q.instant().format(pm.PromQueryFormat.TABLE)
        else:
            q = q.range().legend_format(legend or "__auto")
            if spec.exemplars:
                q = q.exemplar(True)
        b = b.with_target(q)
    return b


def build(d: Dash) -> dict:
    b = (gd.Dashboard(d.title).uid(d.uid).description(d.description).tags(list(d.tags))
         .editable().time("now-1h", "now").refresh("30s").timezone("browser")
         .tooltip(dm.DashboardCursorSync.CROSSHAIR)
         .timepicker(gd.TimePicker().refresh_intervals(["10s", "30s", "1m", "5m", "15m"])))
    uses_master = any(re.search(r"(?<![\w:])(master|ha)_", expr) for row in d.rows
                      for p in row.panels for expr, _ in p.targets)
    for v in _variables(uses_master):
        b = b.with_variable(v)
    panel_id = 1
    for row in d.rows:
        r = gd.Row(row.title).id(panel_id).collapsed(row.collapsed)
        panel_id += 1
        b = b.with_row(r)
        for spec in row.panels:
            b = b.with_panel(_panel(spec, panel_id))
            panel_id += 1
    return json.loads(json.dumps(b.build(), cls=JSONEncoder))


def render_json(d: Dash) -> str:
    return json.dumps(build(d), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 if a committed dashboard differs from the code")
    ap.add_argument("--out", type=Path, default=HERE,
                    help="output directory (default: dashboards/)")
    args = ap.parse_args(argv)
    stale = []
    for d in DASHBOARDS:
        path = args.out / d.file
        text = render_json(d)
        old = path.read_text() if path.exists() else ""
        if old == text:
            continue
        if args.check:
            stale.append(path)
            diff = difflib.unified_diff(old.splitlines(), text.splitlines(), str(path),
                                        f"{path} (generated)", lineterm="", n=1)
            print("\n".join(list(diff)[:40]), file=sys.stderr)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date: {', '.join(map(str, stale))}; run python -m dashboards.generate",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
