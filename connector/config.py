"""Connector configuration: one validated, frozen object built once at startup.

Every key is declared once, in `KEYS` (name, type, bounds, default, doc, environment
variable), as `metric_catalog` declares the metrics: the parser, the docs' key table
(`python -m connector.config`, docs/configuration.md) and the Helm schema test all read it, so
a key cannot drift between them. Importable without vLLM.

Sources, highest priority first:
  1. ``kv_connector_extra_config`` keys;
  2. the JSON file named by ``MOONCAKE_CONFIG_PATH`` (the same fields as vLLM's in-tree
     Mooncake store connector), for the Mooncake fields only;
  3. a key's environment variable, where it has one.

Every problem raises ``ConfigError`` with a message that names the field and says how to fix it,
so a bad deployment fails at startup with one readable line instead of a hang or a bare trace.
"""

from __future__ import annotations

import decimal
import json
import math
import os
import re
import socket
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from connector.docsync import sync_block

RECV_THREADS_ENV = "VLLM_MOONCAKE_LOAD_RECV_THREADS"
CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
EXTRA = "kv_connector_extra_config"
MAX_RECV_THREADS = 64
ETCD_SCHEME = "etcd://"
PORT_RE = r"(6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
# The Mooncake client reads the HA cluster id from this variable (default "mooncake_cluster",
# as the masters' --cluster_id); the connector exports cluster_id there when it is unset.
CLUSTER_ID_ENV = "MC_STORE_CLUSTER_ID"
DEFAULT_TENANT = "default"  # Mooncake's tenant when none is given


class ConfigError(ValueError):
    """A connector setting is missing or invalid; the message names the field and the fix."""


@dataclass(frozen=True)
class Key:
    """One configuration key. `kind`: size, int, ints (a list), float, bool, text or choice."""

    name: str
    kind: str
    default: Any  # None: required, or derived when unset (see `shown`)
    doc: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    env: str = ""  # read when the key is set nowhere else
    mooncake: bool = False  # also accepted in the MOONCAKE_CONFIG_PATH file (in-tree field)
    fix: str = ""  # how to fix an out-of-range value
    shown: str = ""  # the default as the docs show it, when it is not a plain value
    pattern: str = ""  # text: a regular expression the whole value must match

    def parse(self, value: Any, name: str) -> Any:
        """The validated value; errors name the field as `name` (where it was set)."""
        if self.kind == "size":
            size = parse_size(value, name)
            if self.hi is not None and not self.lo <= size <= self.hi:
                raise ConfigError(f"{name}: must be {self.lo:.0f} bytes..{self.hi / 2**20:.0f}MB,"
                                  f" got {value!r} ({size} bytes)")
            if self.lo is not None and size < self.lo:
                raise ConfigError(f"{name}: must be at least {self.lo / 2**20:.0f}MB, got "
                                  f"{value!r} ({size} bytes); {self.fix}")
            return size
        if self.kind == "int":
            return _int_in_range(value, name, int(self.lo), int(self.hi), self.fix)
        if self.kind == "ints":
            if isinstance(value, str):
                value = [v for v in re.split(r"[,\s]+", value.strip()) if v]
            if not isinstance(value, (list, tuple)) or not value:
                raise ConfigError(f"{name}: expected a list of integers such as [1, 2, 4], "
                                  f"got {value!r}; {self.fix}")
            return tuple(_int_in_range(v, name, int(self.lo), int(self.hi), self.fix)
                         for v in value)
        if self.kind == "float":
            return _number(value, name, self.lo, self.hi)
        if self.kind == "bool":
            return _bool(value, name)
        text = _text(value, name, allow_empty=self.default == "")
        if self.kind == "choice":
            text = text.lower()
            if text not in self.choices:
                raise ConfigError(f"{name}: {value!r}; use one of {self.choices}: {self.fix}")
        if self.pattern and not re.fullmatch(self.pattern, text):
            raise ConfigError(f"{name}: {value!r}; {self.fix}")
        return text


_PAY = "a thread is added only if it pays 5 %; see connector/worker/autotune.py"
KEYS: tuple[Key, ...] = (
    # Mooncake fields: extra_config or the MOONCAKE_CONFIG_PATH file.
    Key("master_server_address", "text", None, "Mooncake master RPC `host:port`, or "
        "`etcd://h1:2379[,h2:2379]` for an HA master group (see Reliability)", mooncake=True),
    Key("metadata_server", "text", None,
        "e.g. `http://master:8080/metadata` (the master's HTTP metadata server), or "
        "`etcd://h1:2379[,h2:2379]`", mooncake=True),
    Key("cluster_id", "text", "", "HA only: the masters' `--cluster_id`; exported as "
        f"`{CLUSTER_ID_ENV}` (which the Mooncake client reads) when that is unset, an error "
        "when it is set to another value", env=CLUSTER_ID_ENV, mooncake=True,
        shown=f"env `{CLUSTER_ID_ENV}`, else Mooncake's `mooncake_cluster`"),
    Key("protocol", "choice", "tcp", "`tcp` or `rdma`", choices=("tcp", "rdma"),
        mooncake=True),
    Key("device_name", "text", "", "RDMA device(s) for `rdma` (e.g. `mlx5_0`); empty: Mooncake "
        "finds them itself, as with the in-tree connector", mooncake=True),
    Key("local_hostname", "text", None, "address other nodes reach this one at",
        env="MOONCAKE_LOCAL_HOSTNAME", mooncake=True,
        shown="`VLLM_HOST_IP`, else this node's address on the route to the master "
              "(`127.0.0.1` for a master on this host's loopback)"),
    Key("global_segment_size", "size", 4 * 2**30,
        "bytes this engine adds to the pool; `0` when store nodes hold the data (blocks then "
        "survive engine restarts)", mooncake=True, shown="`4GB`"),
    Key("local_buffer_size", "size", 512 * 2**20, "client transfer buffer", lo=2**20,
        mooncake=True, fix="the Mooncake client's transfer buffer; e.g. 512MB", shown="`512MB`"),
    Key("replica_num", "int", 1,
        "in-tree field: replicas of each stored block (Mooncake `ReplicateConfig` on every put)",
        lo=1, hi=16, mooncake=True, fix="replicas per stored block; 1 keeps one copy"),
    Key("transfer_timeout", "float", None,
        "in-tree field, seconds: Mooncake's own call timeouts (`MC_TCP_STATUS_TIMEOUT_SEC`, "
        "`MC_TRANSFER_TIMEOUT`, `MC_RPC_TIMEOUT_MS`) unless the environment sets them; the only "
        "bound on zero-copy transfers, which hold their request's blocks until they return, "
        "and on a staged call's hold on its thread (a staged save's put, a shutdown)",
        lo=0.1, hi=3600, mooncake=True, shown="`load_timeout_s`"),
    # Connector keys: extra_config only.
    Key("load_threads", "int", 1,
        "receive threads, 1..64, or `auto`: the connector adapts the number of active threads "
        "online, starting from 1 (hill climbing on load throughput while jobs queue up: "
        f"{_PAY}), shown as `vllm:mooncake_pool_recv_threads_active`", lo=1,
        hi=MAX_RECV_THREADS, env=RECV_THREADS_ENV,
        fix=f"set {RECV_THREADS_ENV} or extra_config load_threads to 1..{MAX_RECV_THREADS} "
            "or auto", shown=f"env `{RECV_THREADS_ENV}`, else 1"),
    Key("load_threads_max", "int", 8, "with `auto`: the most threads it may use (the pool's "
        "size)", lo=1, hi=MAX_RECV_THREADS, fix="the most threads load_threads: auto may use"),
    Key("load_split_blocks", "int", 0,
        "split a request's load into jobs of at most this many blocks, so one long prompt "
        "spreads over the receive threads (0: one job per request)", lo=0, hi=1 << 20,
        fix="0 keeps each request in one job"),
    Key("staging", "choice", "auto",
        "`on`: each block moves as one contiguous buffer through a per-thread staging buffer "
        "and torch copies place its regions; `off`: multi-buffer transfers straight into the "
        "KV regions; `auto`: `on` for KV caches in host memory over `tcp` with several "
        "regions per block (see `docs/benchmark.md`), `off` on GPUs and RDMA",
        choices=("auto", "on", "off"),
        fix="'auto' (staged copies for host-memory KV caches over tcp), 'on' or 'off' "
            "(multi-buffer transfers)"),
    Key("staging_buffer_size", "size", 16 * 2**20,
        "staging buffer per receive thread (and one for saves), 4 KiB..1 GiB; a job larger than "
        "it is moved in several calls. Those of the receive threads taking jobs and of the "
        "in-step thread are registered at startup, so no first store hit waits for it",
        lo=4096, hi=2**30, shown="`16MB`"),
    Key("address_cache_size", "size", 64 * 2**20,
        "host memory per KV cache group and TP rank for the buffer address lists that "
        "transfers of its blocks take (a Python integer per layer and block), made on a "
        "block's first use and kept while the KV cache is "
        "registered; a block past it has its list made on every use, CPU on the receive and "
        "save threads in proportion to layers times blocks. The startup log says how many "
        "of the KV cache's blocks it covers; 0 keeps none",
        lo=0, hi=64 * 2**30, shown="`64MB`", fix="a size such as 256MB, or 0"),
    Key("preload_buffer_size", "size", 256 * 2**20,
        "host memory per TP rank, registered with the store, into which the store prefixes "
        "of queued requests (found by `lookup_ahead` lookups) are read before vLLM schedules "
        "them, so that their loads are memory copies when it does; a prefix that does not fit "
        "whole is loaded when scheduled, as without it. Used where staged transfers are (see "
        "`staging`) and the model has one KV cache group; 0 turns preloads off",
        lo=0, hi=64 * 2**30, shown="`256MB`", fix="0 turns preloads off"),
    Key("sync_load_ms", "float", 50.0,
        "loads expected to take at most this long (all of one engine step's together, from "
        "recent transfer times) run inside the step, which waits for them: the request's "
        "prefill runs in that step instead of one or two steps later. Staged transfers only "
        "(see `staging`); a load still running at 10x this (1 s at least) is stopped and "
        "recomputed. 0: every load is asynchronous (see `docs/ttft.md`)", lo=0, hi=1000),
    Key("load_early_start", "bool", True,
        "KV caches in host memory: queue a step's asynchronous loads before its forward pass "
        "rather than after it (on CPU the forward runs on the thread that queues them); off "
        "where vLLM zeroes newly allocated blocks"),
    Key("cache_prefix", "text", "mcpool",
        "key namespace; engines share blocks only within one prefix (1-64 of `A-Z a-z 0-9 . _ "
        "-`: it is the first part of every store key)", pattern=r"[A-Za-z0-9._-]{1,64}",
        fix="use 1-64 characters of A-Z a-z 0-9 . _ - (no '/': it separates the parts of a "
            "store key, so one tenant's prefix could otherwise begin another's keys)"),
    Key("model_id", "text", None, "model identity in the key fingerprint",
        shown="model path + revision"),
    Key("store_tp_size", "int", None,
        "in-tree field: store each block as this many objects, each a 1/store_tp_size share "
        "of the KV heads, so engines of any TP size share blocks stored with the same value "
        "(a rank holding part of an object reads just its bytes; see `docs/layouts.md`)",
        lo=1, hi=1024, fix="engines that share blocks must use the same value",
        shown="this engine's TP size"),
    Key("enable_store_tp_lcm", "bool", False,
        "in-tree field: use the least common multiple of `prefill_tp_sizes` as "
        "`store_tp_size` (a `store_tp_size` set too is ignored, as in-tree, with a warning)"),
    Key("prefill_tp_sizes", "ints", None,
        "in-tree field: the TP sizes of the engines that write the store, for "
        "`enable_store_tp_lcm` (without it ignored, as in-tree, with a warning)", lo=1,
        hi=1024, fix="list the writers' TP sizes, e.g. [2, 4]",
        shown="unset"),
    Key("lookup_timeout_s", "float", 2.0,
        "a scheduler lookup slower than this is a miss, counted from when vLLM first asks "
        "about the request (the lookup starts when the request arrives)",
        lo=0.001, hi=600),
    Key("lookup_ahead", "int", 16,
        "lookups started for arriving requests vLLM has not asked about yet, at most; later "
        "arrivals start theirs in arrival order as those are asked about or finish, or when "
        "vLLM asks about them first (a request it asks about waits behind at most this many "
        "lookups; 0: every lookup starts when vLLM asks)",
        lo=0, hi=100_000),
    Key("lookup_answer_ttl_s", "float", 5.0,
        "how long a lookup's answer stands: one older when vLLM asks (or asks again) about its "
        "request is looked up again, as the master leases what a lookup found only for its "
        "`--default_kv_lease_ttl` (5 s by default) and may evict it after, and a miss may have "
        "been stored since; a prefix already read into host memory (a preload) does not age; "
        "0: answers never age", lo=0, hi=3600),
    Key("lookup_wait_ms", "float", 5.0,
        "budget per engine step for waiting on lookups, shared by every waiting request "
        "(lookups start when a request arrives; one not done is asked again next step)",
        lo=0, hi=10_000),
    Key("enable_save", "bool", True, "store new full blocks"),
    Key("enable_load", "bool", True, "load prefixes from the store"),
    Key("save_decode_tokens", "bool", False, "also store blocks filled by generated tokens"),
    Key("master_lookup_sample_ratio", "float", 0.1,
        "share of load jobs whose master lookup is timed separately, besides each thread's "
        "first job and one every 5 s (see Observability)",
        lo=0, hi=1),
    Key("trace_sample_ratio", "float", None, "share of jobs traced "
        "(`parentbased_traceidratio`); overrides the OTel sampler variables", lo=0, hi=1,
        shown="from `OTEL_TRACES_SAMPLER[_ARG]`, else 0.05"),
    Key("on_master_unreachable", "choice", "fail",
        "`fail`: refuse to start; `degrade`: serve without the cache and reconnect in the "
        "background", choices=("fail", "degrade"),
        fix="'fail' (refuse to start) or 'degrade' (serve without the cache and reconnect in "
            "the background)"),
    Key("on_load_failure", "choice", "recompute",
        "what a store load that fails costs its request: `recompute` (vLLM recomputes the "
        "blocks; the connector sets vLLM's `kv_load_failure_policy` to `recompute`, whose "
        "default `fail` would fail the request) or `fail` (vLLM fails the request)",
        choices=("recompute", "fail"),
        fix="'recompute' (a failed load costs a recompute) or 'fail' (it fails the request)"),
    Key("store_timeout_s", "float", 5.0, "connect timeout when probing the master at startup",
        lo=0.1, hi=600),
    Key("load_timeout_s", "float", 5.0,
        "deadline of a load job, from its enqueue: a job still queued then never starts, a "
        "staged one still running is reported, and vLLM recomputes its blocks; a zero-copy get "
        "writes into the blocks until its call returns, bounded by `transfer_timeout` (this "
        "value by default); a thread whose own call outlives it is replaced", lo=0.1, hi=3600),
    Key("save_timeout_s", "float", 30.0,
        "deadline of a save job, from its enqueue: one that has not read its blocks yet is "
        "dropped and its request's blocks released; one reading them (a zero-copy put, a staged "
        "gather) keeps them until that call returns (`transfer_timeout`; a gather: memory "
        "speed) and never reads them again; a thread whose own call outlives it is replaced",
        lo=0.1, hi=3600),
    # Tenants and the disk tier (docs/tenants.md, docs/disk-tier.md).
    Key("tenant_id", "text", DEFAULT_TENANT, "in-tree field: the Mooncake tenant of this "
        "engine's store client (its key namespace and, on a master with "
        "`--enable_multi_tenants`, its quota: the tenant must be in the quota policy); also the "
        "`tenant` label of the hit-rate, byte and failure series", mooncake=True),
    Key("enable_offload", "bool", False, "in-tree field: the store has a disk tier (master "
        "and store nodes run with `--enable_offload`): a load's gets are made one after "
        "another, each fitting the owner's staging buffer, and `tier_metrics` is on",
        mooncake=True),
    Key("tier_metrics", "bool", None, "classify every load by the tier that holds its blocks "
        "(memory or disk; one master replica query per load job), exported as "
        "`vllm:mooncake_pool_load_tier_tokens_total` and `..._bytes_total`",
        env="VLLM_MOONCAKE_STORE_TIER_LOG",
        shown="env `VLLM_MOONCAKE_STORE_TIER_LOG`, else `enable_offload`"),
    Key("disk_staging_buffer_size", "size", 1280 * 2**20, "with `enable_offload`: the staging "
        "buffer of the store node that owns the disk tier (its "
        "`MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES`); a get from disk larger than it fails "
        "with -10", lo=4096, hi=64 * 2**30, shown="`1280MB` (Mooncake's)"),
    Key("disk_staging_usable_ratio", "float", 0.9, "share of `disk_staging_buffer_size` this "
        "engine's gets in flight may fill together (split among its receive and in-step "
        "threads on every TP rank; staging adds DirectIO alignment)", lo=0.01, hi=1.0,
        env="VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO"),
    Key("preferred_segment", "text", "", "put every block on this segment (`host:port` of a "
        "store node), as Mooncake's `ReplicateConfig.preferred_segment`",
        env="MOONCAKE_PREFERRED_SEGMENT", mooncake=True),
    # KV events for routers (docs/kv-events.md, connector/observability/kv_events.py).
    Key("kv_events", "choice", "auto", "publish `BlockStored`/`BlockRemoved` for the blocks "
        "this engine writes to the store, in vLLM's KV event stream: `auto` when "
        "`--kv-events-config` has `enable_kv_cache_events`, `on` (an error without it), `off`",
        choices=("auto", "on", "off"),
        fix="'auto' (with vLLM's --kv-events-config), 'on' or 'off'"),
    Key("kv_events_medium", "text", "STORAGE", "the `medium` of the store's events (vLLM's "
        "`MEDIUM_STORAGE`; the in-tree store connector says `cpu`)",
        pattern=r"[A-Za-z][A-Za-z0-9_]{0,31}", fix="a tier name such as STORAGE or CPU"),
    Key("kv_events_locality", "choice", "none", "the `locality` of the store's events: "
        "`none` (unset: what Dynamo's KV indexer takes; it drops any event whose locality is "
        "neither unset nor LOCAL), `local`, or `remote` (the shared store, not this engine's "
        "KV cache: for a router that reads it)",
        choices=("none", "local", "remote"), fix="'none', 'local' or 'remote'"),
    Key("kv_events_sweep_s", "float", 5.0, "seconds between sweeps that ask the master's "
        "HTTP admin port which announced blocks are still stored (a `BlockRemoved` for each "
        "one gone); 0: removals only from lookups that miss an announced block", lo=0,
        hi=3600),
    Key("kv_events_master_http", "text", "", "`host:port` of the master's metrics/admin HTTP "
        "port (`--metrics_port`) for the sweeps; `:port`: the serving master's host (with HA "
        "masters the leader etcd names, found again each round: a standby does not answer)",
        pattern=r"[^\s:/]*:" + PORT_RE,
        fix="the master's host:port of --metrics_port, e.g. 10.0.0.5:9003, or :9003 for the "
            "serving master's (the HA leader's)",
        shown="the host of `master_server_address` (the HA leader's with an `etcd://` one), "
              "port 9003 (Mooncake's default)"),
    # A 128K-token prompt at block size 16 is 8,192 blocks: the default takes several such
    # prompts' blocks in one step (it was 10,000, which dropped most of a second one's).
    Key("kv_events_queue", "int", 65_536, "blocks the events held until vLLM takes them "
        "(each step) may carry, the saves planned but not yet landed (and as many blocks of "
        "settled saves still landing), and per worker the saved blocks not yet reported; "
        "beyond it blocks are dropped from the events and counted "
        "(`vllm:mooncake_pool_kv_events_dropped_total`)", lo=16, hi=10_000_000,
        fix="a count of blocks, e.g. 65536"),
    Key("kv_events_max_live", "int", 65_536, "announced blocks tracked for removal; past it "
        "the oldest is announced removed (a router forgets it rather than trust a block "
        "nothing watches)", lo=16, hi=10_000_000, fix="a count of blocks, e.g. 65536"),
)
BY_NAME = {k.name: k for k in KEYS}
MOONCAKE_KEYS = tuple(k.name for k in KEYS if k.mooncake)
CONNECTOR_KEYS = tuple(k.name for k in KEYS if not k.mooncake)
EXTRA_KEYS = MOONCAKE_KEYS + CONNECTOR_KEYS


# ---- vLLM's in-tree MooncakeStoreConnector: every setting it reads, and its answer here -------
FILE, ENV, KV = CONFIG_PATH_ENV + " file", "environment", "kv-transfer-config"
SAME, EQUIVALENT, REFUSED = "same", "equivalent", "refused"
@dataclass(frozen=True)
class InTree:
    """One setting of vLLM's in-tree `MooncakeStoreConnector` and what this connector does
    with it: `same` (implemented with the same meaning: `key`), `equivalent` (accepted; `how`
    says what it becomes here) or `refused` (startup error with `how`: why and what instead).
    docs/migration.md's table and the startup log lines come from these entries."""

    name: str
    where: str  # FILE, EXTRA, ENV or KV
    answer: str
    how: str
    key: str = ""  # this connector's key: a same-meaning setting, or the target of an alias
    alias: bool = False  # the value passes to `key` unchanged


IN_TREE: tuple[InTree, ...] = (
    # The MOONCAKE_CONFIG_PATH file (vllm/distributed/mooncake_store.py: MooncakeStoreConfig).
    *(InTree(n, FILE, SAME, "", n) for n in (
        "metadata_server", "master_server_address", "protocol", "device_name",
        "global_segment_size", "local_buffer_size", "tenant_id", "enable_offload")),
    InTree("mode", FILE, EQUIVALENT, "`embedded` is a `global_segment_size` above 0, "
           "`standalone-store` is `global_segment_size: 0` (then its default); a size that "
           "contradicts the mode is an error", "global_segment_size"),
    # kv_connector_extra_config (kv_connector/v1/mooncake/store/{connector,scheduler,worker}.py).
    InTree("load_async", EXTRA, EQUIVALENT, "`true` is what this connector always does: loads "
           "run on receive threads while the step computes; `false` is refused (the in-tree "
           "worker asserts `true` too)"),
    InTree("lookup_async", EXTRA, EQUIVALENT, "lookups always run off the scheduler loop; "
           "`true` never waits for one (`lookup_wait_ms: 0`), `false` waits up to "
           "`lookup_wait_ms` per step", "lookup_wait_ms"),
    InTree("enable_lookup", EXTRA, EQUIVALENT, "`enable_load` (false: never load from the "
           "store)", "enable_load", alias=True),
    InTree("save_decode_cache", EXTRA, EQUIVALENT, "`save_decode_tokens`; a `kv_consumer` "
           "with it also stores its prompt blocks (the in-tree consumer fills the prompt "
           "prefix)", "save_decode_tokens", alias=True),
    InTree("cache_prefix", EXTRA, SAME, "", "cache_prefix"),
    InTree("preferred_segment", EXTRA, SAME, "", "preferred_segment"),
    InTree("enable_cross_layers_blocks", EXTRA, EQUIVALENT, "nothing to set: the block "
           "layout (one region per layer, or one per block when layers are contiguous) is "
           "read from the registered KV tensors"),
    InTree("lookup_rpc_port", EXTRA, REFUSED, "this connector has no lookup socket: the "
           "scheduler asks the store directly; remove it"),
    *(InTree(n, EXTRA, SAME, "", n) for n in (
        "store_tp_size", "enable_store_tp_lcm", "prefill_tp_sizes")),
    InTree("custom_mem_pool", EXTRA, REFUSED, "the KV cache stays vLLM's own allocation, "
           "registered with the store as it is (the NVLINK/BAREX pools serve GPU transports "
           "this connector does not use); remove it"),
    InTree("enable_group_semantics", EXTRA, REFUSED, "not implemented: a block's store shards "
           "are separate objects and a lookup hits only when every shard is there; remove it"),
    # Environment (vllm/envs.py).
    InTree(CONFIG_PATH_ENV, ENV, SAME, "", ""),
    InTree(RECV_THREADS_ENV, ENV, SAME, "receive threads, 1..64 (0 or below: 1, as the in-tree "
           "worker reads it), or `auto` (see the key)", "load_threads"),
    InTree("VLLM_MOONCAKE_STORE_TIER_LOG", ENV, SAME, "per-tier series on /metrics instead of "
           "a log line per batch", "tier_metrics"),
    InTree("VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO", ENV, SAME, "", "disk_staging_usable_ratio"),
    InTree("MOONCAKE_PREFERRED_SEGMENT", ENV, SAME, "", "preferred_segment"),
    InTree("MOONCAKE_REQUESTER_LOCAL_HOSTNAME", ENV, EQUIVALENT, "`local_hostname` (when "
           "neither it nor `MOONCAKE_LOCAL_HOSTNAME` is set)", "local_hostname", alias=True),
    InTree("VLLM_RPC_BASE_PATH", ENV, EQUIVALENT, "nothing to set: the in-tree lookup socket "
           "lives there, this connector has none (vLLM still uses it for its own sockets)"),
    # The kv-transfer-config itself.
    InTree("kv_role", KV, SAME, "`kv_both` and `kv_producer` load and store; `kv_consumer` "
           "loads and stores nothing unless `save_decode_tokens` (`save_decode_cache`) is on"),
)
IN_TREE_BY_NAME = {(t.where, t.name): t for t in IN_TREE}
_IN_TREE_FIELDS = {t.name: t for t in IN_TREE if t.where in (FILE, EXTRA) and t.name not in BY_NAME}
MODES = ("embedded", "standalone-store")


def _d(name: str) -> Any:
    """A key's declared default, for the dataclass fields below."""
    return BY_NAME[name].default


# A number and an optional unit: B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (all powers of
# 1024, as Mooncake reads them). "4IB" or "4KI" are errors, not 4 bytes.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(B|[KMGT](?:B|IB)?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(value: Any, field_name: str) -> int:
    """Parse ``4GB``, ``512MiB``, ``1.5G``, ``.5gb`` or a plain byte count into bytes. A JSON
    number with a fraction (``4294967296.0``, which some config generators write) is truncated to
    whole bytes, as the in-tree connector's ``_parse_size`` does (``int(value)``)."""
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}: expected a size such as 4GB or 536870912, got {value!r}")
    if isinstance(value, float) and math.isfinite(value):
        value = int(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = (m.group(2) or "").upper()[:1].replace("B", "")
            value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field_name}: size must be >= 0 bytes, got {value}")
        if value >= 2**64:  # Mooncake's setup takes a 64-bit size (pybind11 names no field)
            raise ConfigError(f"{field_name}: size must be below 16 EiB (2**64 bytes), got "
                              f"{value}; use a size such as 4GB")
        return value
    raise ConfigError(
        f"{field_name}: cannot parse size {value!r}; use bytes (536870912) or a unit "
        "suffix such as 512MB, 4GB, 1GiB"
    )


def _int_in_range(value: Any, field_name: str, lo: int, hi: int, fix: str) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field_name}: expected an integer {lo}..{hi}, got {value!r}; {fix}")
    if not lo <= value <= hi:
        raise ConfigError(f"{field_name}: must be {lo}..{hi}, got {value}; {fix}")
    return value


def _number(value: Any, field_name: str, lo: float, hi: float) -> float:
    if isinstance(value, str) and re.match(r"^\s*(\d+(\.\d*)?|\.\d+)\s*$", value):  # env
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field_name}: expected a number in [{lo}, {hi}], got {value!r}")
    if not lo <= float(value) <= hi:
        raise ConfigError(f"{field_name}: must be in [{lo}, {hi}], got {value}")
    return float(value)


def _bool(value: Any, field_name: str) -> bool:
    """true/false, also as text (environment) or the JSON numbers 1/0 (the in-tree file reader
    takes ``bool(value)``, so ``"enable_offload": 1`` is on there)."""
    if isinstance(value, bool):
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"{field_name}: expected true or false, got {value!r}")


def _text(value: Any, field_name: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        raise ConfigError(f"{field_name}: expected a non-empty string, got {value!r}")
    return value.strip()


@dataclass(frozen=True)
class StoreConfig:
    """How to reach the Mooncake master and what this client contributes to the pool."""

    metadata_server: str
    master_server_address: str
    protocol: str = _d("protocol")
    device_name: str = _d("device_name")
    local_hostname: str = _d("local_hostname")  # None: load_config works it out
    global_segment_size: int = _d("global_segment_size")
    local_buffer_size: int = _d("local_buffer_size")
    replica_num: int = _d("replica_num")
    transfer_timeout: float | None = _d("transfer_timeout")
    # HA master group (master_server_address etcd://...): the masters' --cluster_id, or ""
    # for Mooncake's default. Exported as MC_STORE_CLUSTER_ID before the client is set up.
    cluster_id: str = _d("cluster_id")
    tenant_id: str = _d("tenant_id")
    preferred_segment: str = _d("preferred_segment")  # "" lets Mooncake place each block

    @property
    def ha(self) -> bool:
        return self.master_server_address.startswith(ETCD_SCHEME)


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector needs, validated."""

    store: StoreConfig
    load_threads: int = _d("load_threads")  # receive threads (with auto: the maximum)
    load_threads_auto: bool = False  # adapt the active count online (connector/worker/autotune.py)
    load_split_blocks: int = _d("load_split_blocks")
    staging: str = _d("staging")
    address_cache_size: int = _d("address_cache_size")
    preload_buffer_size: int = _d("preload_buffer_size")
    staging_buffer_size: int = _d("staging_buffer_size")
    sync_load_ms: float = _d("sync_load_ms")
    load_early_start: bool = _d("load_early_start")
    cache_prefix: str = _d("cache_prefix")
    model_id: str | None = _d("model_id")
    store_tp_size: int | None = _d("store_tp_size")
    enable_store_tp_lcm: bool = _d("enable_store_tp_lcm")
    prefill_tp_sizes: tuple[int, ...] | None = _d("prefill_tp_sizes")
    lookup_timeout_s: float = _d("lookup_timeout_s")
    lookup_ahead: int = _d("lookup_ahead")
    lookup_answer_ttl_s: float = _d("lookup_answer_ttl_s")
    lookup_wait_ms: float = _d("lookup_wait_ms")
    enable_save: bool = _d("enable_save")
    enable_load: bool = _d("enable_load")
    save_decode_tokens: bool = _d("save_decode_tokens")
    master_lookup_sample_ratio: float = _d("master_lookup_sample_ratio")
    trace_sample_ratio: float | None = _d("trace_sample_ratio")
    on_master_unreachable: str = _d("on_master_unreachable")
    on_load_failure: str = _d("on_load_failure")
    store_timeout_s: float = _d("store_timeout_s")
    load_timeout_s: float = _d("load_timeout_s")
    save_timeout_s: float = _d("save_timeout_s")
    enable_offload: bool = _d("enable_offload")
    tier_metrics: bool | None = _d("tier_metrics")  # None: as enable_offload
    disk_staging_buffer_size: int = _d("disk_staging_buffer_size")
    disk_staging_usable_ratio: float = _d("disk_staging_usable_ratio")
    kv_events: str = _d("kv_events")
    kv_events_medium: str = _d("kv_events_medium")
    kv_events_locality: str = _d("kv_events_locality")
    kv_events_sweep_s: float = _d("kv_events_sweep_s")
    kv_events_master_http: str = _d("kv_events_master_http")
    kv_events_queue: int = _d("kv_events_queue")
    kv_events_max_live: int = _d("kv_events_max_live")
    source: dict[str, str] = field(default_factory=dict, compare=False)
    # One line per in-tree setting that was accepted as an equivalent, for the startup log.
    notes: tuple[str, ...] = field(default=(), compare=False)
    # One line per setting given but ignored (as the in-tree connector ignores it), logged as a
    # warning: the operator meant it to count.
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def store_tp(self) -> int | None:
        """The store TP size (store objects per block), as the in-tree connector resolves it:
        the lcm of prefill_tp_sizes with enable_store_tp_lcm, else store_tp_size."""
        if self.enable_store_tp_lcm:
            return math.lcm(*self.prefill_tp_sizes)
        return self.store_tp_size

    @property
    def store_tp_field(self) -> str:
        """The setting `store_tp` comes from, as an error about its value names it."""
        if self.enable_store_tp_lcm:
            return f"prefill_tp_sizes (least common multiple of {list(self.prefill_tp_sizes)})"
        return "store_tp_size"


def _load_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"{CONFIG_PATH_ENV}: file {path!r} does not exist; point it at a Mooncake JSON "
            f"config or set the fields in {EXTRA}"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{CONFIG_PATH_ENV}: {path!r} is not valid JSON ({e.msg} at line {e.lineno} "
            f"column {e.colno}); fix the file"
        ) from None
    except OSError as e:
        raise ConfigError(f"{CONFIG_PATH_ENV}: cannot read {path!r}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_PATH_ENV}: {path!r} must hold a JSON object")
    allowed = MOONCAKE_KEYS + tuple(t.name for t in IN_TREE if t.where == FILE)
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(
            f"{CONFIG_PATH_ENV}: unknown field(s) {unknown} in {path!r}; "
            f"allowed: {list(allowed)}"
        )
    return data


def _host_port(value: str, field_name: str) -> str:
    m = re.match(r"^[^:\s]+:(\d{1,5})$", value)
    if not m or not 1 <= int(m.group(1)) <= 65535:
        raise ConfigError(f"{field_name}: expected host:port with a port 1..65535, "
                          f"got {value!r}")
    return value


def etcd_endpoints(url: str, field_name: str) -> list[str]:
    """The host:port list of an ``etcd://h1:p1[,h2:p2]`` address, or of one without the scheme
    (Mooncake reads a metadata_server without one as etcd endpoints); `;` separates too, as in
    the masters' --etcd_endpoints."""
    eps = [e.strip() for e in re.split(r"[,;]", url.removeprefix(ETCD_SCHEME))]
    if not all(re.match(rf"^[^:\s,;/]+:{PORT_RE}$", e) for e in eps):
        raise ConfigError(f"{field_name}: expected etcd://host:port[,host:port] (the etcd "
                          f"endpoints of the HA masters, ports 1..65535), got {url!r}")
    return eps


def _master_address(value: str, field_name: str) -> str:
    if value.startswith(ETCD_SCHEME):
        etcd_endpoints(value, field_name)
        return value
    try:
        return _host_port(value, field_name)
    except ConfigError:
        raise ConfigError(f"{field_name}: expected host:port (one master, port 1..65535) or "
                          f"etcd://host:port[,host:port] (an HA master group), got {value!r}"
                          ) from None


def _local_hostname(master: str, environ: Mapping[str, str]) -> str:
    """The address this engine registers its segment at when none is set, which other nodes
    use to reach it: VLLM_HOST_IP, as vLLM's get_ip and the in-tree connector read it; else
    this node's address on the route to the master (its first etcd endpoint in HA), so a
    master on another node gets this node's IP, one on this host's loopback 127.0.0.1; else
    vLLM's get_ip. A loopback default registered with a remote master sent other nodes'
    transfers to their own loopback."""
    if environ.get("VLLM_HOST_IP"):
        return environ["VLLM_HOST_IP"]
    ep = master.removeprefix(ETCD_SCHEME)
    host, _, port = re.split(r"[,;]", ep)[0].strip().rpartition(":")
    try:  # a UDP connect sends nothing: it only picks the route
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)
        # IPv4 first, as vLLM's get_ip: /etc/hosts often lists localhost as ::1 first
        family, _, _, _, addr = min(infos, key=lambda i: i[0] != socket.AF_INET)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except (OSError, ValueError):
        from vllm.utils.network_utils import get_ip

        return get_ip()


def _cluster_id(cid: str, field_name: str, master: str, environ: Mapping[str, str]) -> str:
    """The HA cluster id; it must agree with MC_STORE_CLUSTER_ID, which the client reads."""
    env = environ.get(CLUSTER_ID_ENV, "")
    if not cid or field_name == CLUSTER_ID_ENV:  # unset, or taken from the variable itself
        return cid if master.startswith(ETCD_SCHEME) else ""
    if not master.startswith(ETCD_SCHEME):
        raise ConfigError(f"{field_name}: only used with an HA master group; set "
                          "master_server_address to etcd://host:port or remove cluster_id")
    if not re.match(r"^[A-Za-z0-9._-]+$", cid):
        raise ConfigError(f"{field_name}: {cid!r} is not a cluster id; use the masters' "
                          "--cluster_id (letters, digits, '.', '_', '-')")
    if env and env != cid:
        raise ConfigError(f"{field_name}: {cid!r} differs from {CLUSTER_ID_ENV}={env!r} in the "
                          "environment, which the Mooncake client uses; make them equal or "
                          "unset one")
    return cid


def _metadata_url(value: str, field_name: str) -> str:
    """etcd endpoints (with the scheme or without: Mooncake reads both as etcd), or a URL. An
    HTTP one is asked at its path (`<url>?key=...`): without one Mooncake's puts of the
    segment descriptors got 404, and setup failed naming master_server_address."""
    if value.startswith(ETCD_SCHEME) or ("://" not in value and ":" in value):
        etcd_endpoints(value, field_name)
        return value
    url = urllib.parse.urlparse(value)
    try:
        port = url.port  # raises on a port outside 0..65535
    except ValueError:
        port = 0
    if port == 0:
        raise ConfigError(f"{field_name}: port out of range 1..65535 in {value!r}")
    if url.scheme in ("http", "https") and not url.path:
        raise ConfigError(f"{field_name}: {value!r} has no path, where an HTTP metadata server "
                          f"answers; write {value}/metadata for the master's "
                          "(--enable_http_metadata_server)")
    return value


def load_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None,
    kv_role: str | None = None,
) -> ConnectorConfig:
    """Build the connector config from vLLM's extra_config, the MOONCAKE_CONFIG_PATH file and
    the environment; in-tree settings are translated or refused as `IN_TREE` says. `kv_role`
    is the kv-transfer-config's (None: kv_both)."""
    # An empty variable is unset, as vLLM and the in-tree connector read most of theirs.
    environ = {k: v for k, v in (os.environ if environ is None else environ).items()
               if v.strip()}
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS) - set(_IN_TREE_FIELDS))
    if unknown:
        raise ConfigError(f"{EXTRA}: unknown key(s) {unknown}; allowed keys: {list(EXTRA_KEYS)} "
                          "(and the in-tree connector's, see docs/migration.md)")
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}  # where each key was set: EXTRA, CONFIG_PATH_ENV or a variable
    label: dict[str, str] = {}  # how errors name it: "<source>.<field>", or the variable
    in_tree: dict[str, tuple[Any, str]] = {}
    path = environ.get(CONFIG_PATH_ENV)
    for src, data in ((CONFIG_PATH_ENV, _load_config_file(path) if path else {}),
                      (EXTRA, extra)):
        for k, v in data.items():
            if v is None:  # JSON null: not set (the in-tree connector reads it so too)
                continue
            if k in _IN_TREE_FIELDS:
                in_tree[k] = (v, f"{src}.{k}")
            else:
                merged[k], source[k], label[k] = v, src, f"{src}.{k}"
    notes = _translate_in_tree(in_tree, merged, source, label)
    for key in KEYS:
        if key.name not in merged and key.env and key.env in environ:
            merged[key.name], source[key.name] = environ[key.env], key.env
            label[key.name] = key.env
    for t in IN_TREE:
        if t.where == ENV and t.alias and t.key not in merged and t.name in environ:
            merged[t.key], source[t.key], label[t.key] = environ[t.name], t.name, t.name
            notes.append(f"{t.name} (in-tree setting): {t.how}")
    for required in ("master_server_address", "metadata_server"):
        if required not in merged:
            raise ConfigError(
                f"{required}: not set; add it to {EXTRA} or to the JSON "
                f"file named by {CONFIG_PATH_ENV} (e.g. \"master_server_address\": "
                '"127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata")'
            )

    def where(name: str) -> str:
        return label.get(name, f"{EXTRA}.{name}")

    def value(name: str) -> Any:
        """The parsed value of a key, or its default."""
        key = BY_NAME[name]
        return key.parse(merged[name], where(name)) if name in merged else key.default

    store = StoreConfig(
        metadata_server=_metadata_url(value("metadata_server"), where("metadata_server")),
        master_server_address=_master_address(value("master_server_address"),
                                              where("master_server_address")),
        cluster_id=_cluster_id(value("cluster_id"), where("cluster_id"),
                               value("master_server_address"), environ),
        protocol=value("protocol"),
        device_name=value("device_name"),
        local_hostname=value("local_hostname") if "local_hostname" in merged
        else _local_hostname(value("master_server_address"), environ),
        global_segment_size=value("global_segment_size"),
        local_buffer_size=value("local_buffer_size"),
        replica_num=value("replica_num"),
        transfer_timeout=value("transfer_timeout"),
        tenant_id=_tenant_id(merged.get("tenant_id"), where("tenant_id")),
        preferred_segment=value("preferred_segment"),
    )
    threads, auto = _threads(merged, source, notes)
    parsed = {k.name: value(k.name) for k in KEYS
              if not k.mooncake and k.name not in ("load_threads", "load_threads_max")}
    offload = value("enable_offload")
    if parsed["tier_metrics"] is None:
        parsed["tier_metrics"] = offload
    if kv_role == "kv_consumer" and "enable_save" not in merged:
        parsed["enable_save"] = parsed["save_decode_tokens"]
        notes.append("kv_role kv_consumer: stores " + (
            "prompt and generated blocks (save_decode_tokens)" if parsed["enable_save"]
            else "nothing (set save_decode_tokens or save_decode_cache to store)"))
    warnings = _resolve_store_tp(parsed, merged.get("enable_store_tp_lcm"),
                                 where("enable_store_tp_lcm"))
    return ConnectorConfig(store=store, load_threads=threads, load_threads_auto=auto,
                           enable_offload=offload, source=source, notes=tuple(notes),
                           warnings=tuple(warnings), **parsed)


def _translate_in_tree(in_tree: dict[str, tuple[Any, str]], merged: dict[str, Any],
                       source: dict[str, str], label: dict[str, str]) -> list[str]:
    """Apply the in-tree settings found in the file or extra_config to `merged` (refused ones
    raise); returns one log line per setting accepted."""
    notes = []
    for name, (raw, at) in in_tree.items():
        t = _IN_TREE_FIELDS[name]
        if t.answer == REFUSED:
            if str(raw).strip().lower() in ("false", "", "0", "no", "off"):
                notes.append(f"{at}={raw!r} (in-tree setting, off): nothing to do here")
                continue
            raise ConfigError(f"{at}: not supported by this connector: {t.how}")
        if t.alias:
            val = _bool(raw, at)
            if t.key in merged and BY_NAME[t.key].parse(merged[t.key], label[t.key]) != val:
                raise ConfigError(f"{at}: contradicts {label[t.key]}; keep one of them")
            merged[t.key], source[t.key], label[t.key] = val, at.rsplit(".", 1)[0], at
        elif name == "lookup_async":  # an explicit lookup_wait_ms wins
            if _bool(raw, at) and "lookup_wait_ms" not in merged:
                merged["lookup_wait_ms"], source["lookup_wait_ms"] = 0.0, at.rsplit(".", 1)[0]
                label["lookup_wait_ms"] = at
        elif name == "mode":
            _mode(raw, at, merged, source, label)
        elif not _bool(raw, at) and name == "load_async":
            raise ConfigError(f"{at}: false is not supported: loads are always asynchronous "
                              "here (the in-tree worker requires true as well); remove it")
        else:
            _bool(raw, at)  # load_async: true, enable_cross_layers_blocks: validated only
        notes.append(f"{at}={raw!r} (in-tree setting): {t.how}")
    return notes


def _mode(raw: Any, at: str, merged: dict[str, Any], source: dict[str, str],
          label: dict[str, str]) -> None:
    """The in-tree `mode`: the engine's segment size says the same thing here."""
    mode = raw.strip().lower() if isinstance(raw, str) else raw
    if mode not in MODES:
        raise ConfigError(f"{at}: {raw!r}; use one of {MODES} (or set global_segment_size)")
    key = BY_NAME["global_segment_size"]
    size = key.parse(merged["global_segment_size"], label["global_segment_size"]) \
        if "global_segment_size" in merged else None
    if mode == "standalone-store" and size is None:
        merged["global_segment_size"], label["global_segment_size"] = 0, at
        source["global_segment_size"] = at.rsplit(".", 1)[0]
    elif (mode == "standalone-store") != (size == 0) and size is not None:
        raise ConfigError(f"{at}: {mode} needs global_segment_size "
                          f"{'0' if mode == 'standalone-store' else 'above 0'}, "
                          f"{label['global_segment_size']} is {size}; fix one of them")


def _tenant_id(raw: Any, at: str) -> str:
    """The Mooncake tenant: blank or null is the default tenant (as in-tree); Mooncake's
    policy rules apply (no leading '_', no control characters)."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return DEFAULT_TENANT
    tenant = _text(raw, at)
    if tenant.startswith("_") or any(ord(c) < 32 or ord(c) == 127 for c in tenant):
        raise ConfigError(f"{at}: {raw!r} is not a Mooncake tenant name (no leading '_', no "
                          "control characters); use the name in the master's quota policy")
    return tenant


def _resolve_store_tp(parsed: dict[str, Any], raw_lcm: Any, lcm_at: str) -> list[str]:
    """The in-tree store TP keys: store_tp_size, or enable_store_tp_lcm with prefill_tp_sizes.
    The in-tree worker (store/worker.py: resolve_store_tp_size, _select_store_layout) reads
    prefill_tp_sizes only with enable_store_tp_lcm, and store_tp_size only without it; a
    deployment that sets the other one too starts there, so it starts here, with the same store
    TP size. It turns the lcm on only for `is True`: `raw_lcm` (as given, at `lcm_at`) the
    JSON number 1 is off. What is ignored is dropped from `parsed`; returns a warning naming
    each, as the operator who set it expected it to count."""
    warnings = []
    if type(raw_lcm) is int and raw_lcm:
        parsed["enable_store_tp_lcm"] = False
        warnings.append(f"{lcm_at}: {raw_lcm!r} is off, as the in-tree connector reads it "
                        "(only the JSON boolean true turns it on there), so the store TP size "
                        "is the one it would use; write true to use the least common multiple "
                        "of prefill_tp_sizes, or false")
    lcm, sizes = parsed["enable_store_tp_lcm"], parsed["prefill_tp_sizes"]
    if lcm and sizes is None:
        raise ConfigError(f"{EXTRA}.enable_store_tp_lcm: needs prefill_tp_sizes (the writers' "
                          "TP sizes, e.g. [2, 4]); set it or remove enable_store_tp_lcm")
    ignored = "store_tp_size" if lcm else "prefill_tp_sizes"
    value = parsed[ignored]
    if value is None:
        return warnings
    parsed[ignored] = None
    if lcm:
        used = f"{math.lcm(*sizes)}, the least common multiple of prefill_tp_sizes {list(sizes)}"
        fix = "remove store_tp_size, or set enable_store_tp_lcm: false to use it"
    else:
        tp = parsed["store_tp_size"]
        used = f"store_tp_size {tp}" if tp else "this engine's TP size (store_tp_size unset)"
        fix = "remove prefill_tp_sizes, or set enable_store_tp_lcm: true to use it"
    shown = list(value) if isinstance(value, tuple) else value
    return [*warnings, f"{EXTRA}.{ignored}: {shown} ignored (as by the in-tree connector) with "
            f"enable_store_tp_lcm {str(lcm).lower()}; the store TP size is {used}; {fix}"]


def _threads(merged: dict[str, Any], source: dict[str, str],
             notes: list[str]) -> tuple[int, bool]:
    """load_threads (from extra_config or the environment): a count, or auto with a maximum.
    The in-tree variable at 0 or below is 1 thread, as the in-tree worker reads it (max(1, n));
    noted in `notes`."""
    key, raw = BY_NAME["load_threads"], merged.get("load_threads", "1")
    name = RECV_THREADS_ENV if source.get("load_threads") == RECV_THREADS_ENV \
        else f"{EXTRA}.load_threads"
    auto = isinstance(raw, str) and raw.strip().lower() == "auto"
    if auto:
        return BY_NAME["load_threads_max"].parse(merged.get("load_threads_max", 8),
                                                 f"{EXTRA}.load_threads_max"), True
    if "load_threads_max" in merged:
        raise ConfigError(f"{EXTRA}.load_threads_max: only used with load_threads: auto; "
                          "remove it or set load_threads to auto")
    if name == RECV_THREADS_ENV and re.fullmatch(r"\s*-?\d+\s*", raw) and int(raw) < 1:
        notes.append(f"{RECV_THREADS_ENV}={raw!r} (in-tree setting): 1 receive thread, as the "
                     "in-tree worker reads it (max(1, n))")
        return 1, False
    return _int_in_range(raw, name, int(key.lo), int(key.hi), key.fix), False


# ---- the docs' key table ----------------------------------------------------------------
def _shown(key: Key) -> str:
    if key.shown:
        return key.shown
    if key.default is None:
        return "required"
    if isinstance(key.default, bool):
        return str(key.default).lower()
    if isinstance(key.default, str):
        return f"`{key.default}`" if key.default else '`""`'
    return str(key.default)


def _range(key: Key) -> str:
    if key.choices:
        return " / ".join(f"`{c}`" for c in key.choices)
    if key.kind == "size":
        if key.hi is None:
            return f">= {key.lo / 2**20:.0f} MB" if key.lo is not None else "bytes"
        return f"{key.lo:.0f} B..{key.hi / 2**20:.0f} MB"
    if key.lo is None:
        return ""
    lo, hi = (int(key.lo), int(key.hi)) if key.kind in ("int", "ints") else (key.lo, key.hi)
    return ("list of " if key.kind == "ints" else "") + f"{lo}..{hi}" + (
        " or `auto`" if key.name == "load_threads" else "")


def markdown_table() -> str:
    rows = ["| key | default | range | meaning |", "|---|---|---|---|"]
    for k in KEYS:
        doc = k.doc + (f" (env `{k.env}`)" if k.env and not k.shown else "")
        where = " (also in the `MOONCAKE_CONFIG_PATH` file)" if k.mooncake else ""
        rows.append(f"| `{k.name}` | {_shown(k)} | {_range(k)} | {doc}{where} |")
    return "\n".join(rows)


# ---- the Helm chart's schema for extraConfig ----------------------------------------------
HELM_SCHEMA = "helm/mooncake-pooled-connector/values.schema.json"
HELM_LOCAL_BUFFER = "engineLocalBufferSize"  # the schema's definition of it


def json_schema(key: Key) -> dict[str, Any]:
    """The JSON-schema fragment that admits what `key.parse` admits (sizes: any size text)."""
    kinds = {"size": {"type": ["string", "integer"]}, "int": {"type": "integer"},
             "ints": {"type": "array", "minItems": 1,
                      "items": {"type": "integer", "minimum": int(key.lo or 0),
                                "maximum": int(key.hi or 0)}},
             "float": {"type": "number"}, "bool": {"type": "boolean"}, "text": {"type": "string"}}
    out: dict[str, Any] = {"description": key.doc}
    if key.kind == "choice":
        out |= {"type": "string", "enum": list(key.choices)}
    else:
        out |= kinds[key.kind]
    if key.kind in ("int", "float") and key.lo is not None:
        cast = int if key.kind == "int" else float
        out |= {"minimum": cast(key.lo), "maximum": cast(key.hi)}
    if key.kind == "text" and key.default != "":
        out["minLength"] = 1
    if key.pattern:
        out["pattern"] = f"^{key.pattern}$"
    return out


# Mooncake fields the chart has no typed value for (it writes the others into the Mooncake
# file from its values): its extraConfig takes them.
HELM_EXTRA_MOONCAKE = ("replica_num", "transfer_timeout", "preferred_segment")


def _integers_above(n: str) -> list[str]:
    """Regexes of the integers above `n` (digits, no leading zero; "" is 0), written without
    leading zeros."""
    alts = [f"[1-9][0-9]{{{len(n)},}}"]
    for i, d in enumerate(n):
        if d != "9":
            rest = len(n) - i - 1
            alts.append(f"{n[:i]}[{int(d) + 1}-9]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return alts


def _decimals_at_least(t: str) -> str:
    """A regex of the decimal numbers (`12`, `0.5`, leading zeros allowed) at least `t`, a
    plain decimal without exponent: the schema has no arithmetic, so sizes are compared by
    their digits."""
    ip, _, fp = t.partition(".")
    ip, fp = ip.lstrip("0"), fp.rstrip("0")
    alts = [f"0*({'|'.join(_integers_above(ip))})(\\.[0-9]+)?"]
    if fp:
        frac = [f"{fp[:i]}[{int(d) + 1}-9]" for i, d in enumerate(fp) if d != "9"] + [fp]
        alts.append(f"{'0*' if ip else '0+'}{ip}\\.({'|'.join(frac)})[0-9]*")
    else:
        alts.append(f"0*{ip}(\\.[0-9]+)?")
    return "|".join(alts)


def size_at_least(lo: int) -> dict[str, Any]:
    """The JSON-schema fragment of the sizes (as the chart's `size` definition writes them:
    a byte count or a number with a unit) that `parse_size` reads as `lo` bytes or more, so
    that helm refuses what the connector would refuse at startup. Exact but for numbers of
    17 or more significant digits, which float rounding may read as `lo` from just below."""
    units = {"": "[Bb]?", "K": "[Kk]", "M": "[Mm]", "G": "[Gg]", "T": "[Tt]"}
    forms = []
    with decimal.localcontext(prec=60):
        for unit, letter in units.items():
            t = format(decimal.Decimal(lo) / _SIZE_UNITS[unit], "f")
            suffix = letter + ("([Ii][Bb]|[Bb])?" if unit else "")
            forms.append(f"({_decimals_at_least(t)}) ?{suffix}")
    return {"anyOf": [{"type": "integer", "minimum": lo},
                      {"type": "string", "pattern": f"^({'|'.join(forms)})$"}]}


def helm_local_buffer_size() -> dict[str, Any]:
    """The chart's engine `localBufferSize` (local_buffer_size in the Mooncake file): a size
    of at least the connector's minimum. A smaller one fails with a `const` that says so, as
    the chart's image.repository does: helm's own message for a failed anyOf is the pattern."""
    key = BY_NAME["local_buffer_size"]
    least = f"at least {key.lo / 2**20:.0f}MB"
    return {"description": f"The engines' Mooncake transfer buffer: a size as in `size`, "
                           f"{least}, as the connector requires (python -m connector.config "
                           "writes this definition)",
            "allOf": [{"$ref": "#/definitions/size"}],
            "if": {"not": size_at_least(int(key.lo))},
            "then": {"const": f"{least} (the connector refuses a smaller local_buffer_size "
                              f"at startup), e.g. {key.default // 2**20}MB"}}


def helm_extra_config() -> dict[str, Any]:
    """The chart's extraConfig properties: every connector key but load_threads (recvThreads),
    and the Mooncake fields of HELM_EXTRA_MOONCAKE."""
    return {k.name: json_schema(k) for k in KEYS
            if (not k.mooncake or k.name in HELM_EXTRA_MOONCAKE) and k.name != "load_threads"}


def sync_helm_schema(path: str = HELM_SCHEMA, check: bool = False) -> bool:
    with open(path, encoding="utf-8") as f:
        schema = json.load(f)
    defs = schema["definitions"]
    if (defs["extraConfig"]["properties"] == helm_extra_config()
            and defs.get(HELM_LOCAL_BUFFER) == helm_local_buffer_size()):
        return True
    if not check:
        defs["extraConfig"]["properties"] = helm_extra_config()
        defs[HELM_LOCAL_BUFFER] = helm_local_buffer_size()
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(schema, indent=2) + "\n")
    return False


CONFIG_PAGE = "docs/configuration.md"


def sync_docs(path: str = CONFIG_PAGE, check: bool = False) -> bool:
    """Write the key table between the configuration page's markers; with check, only compare."""
    return sync_block(path, "config-table", markdown_table(), check)


# ---- docs/migration.md: every in-tree setting and its answer ------------------------------
MIGRATION_DOC = "docs/migration.md"


def in_tree_table() -> str:
    rows = ["| in-tree setting | where | here | what it does here |", "|---|---|---|---|"]
    for t in IN_TREE:
        here = {SAME: "same meaning", EQUIVALENT: "accepted",
                REFUSED: "**refused** (accepted when off: false, 0 or null)"}[t.answer]
        key = BY_NAME.get(t.key)
        what = t.how or (key.doc if key else "")
        if t.answer == SAME and t.key and t.key != t.name:
            what = f"key `{t.key}`" + (f": {what}" if what else "")
        rows.append(f"| `{t.name}` | {t.where} | {here} | {what} |")
    return "\n".join(rows)


def sync_migration(path: str = MIGRATION_DOC, check: bool = False) -> bool:
    return sync_block(path, "in-tree-table", in_tree_table(), check)


if __name__ == "__main__":
    import sys

    check = "--check" in sys.argv
    ok = sync_docs(check=check) & sync_helm_schema(check=check) & sync_migration(check=check)
    sys.exit(0 if ok or not check else 1)
