"""Preflight for a deployment: `python -m connector.doctor` (console script `mcpool-doctor`).

It reads the configuration an engine would read (`MOONCAKE_CONFIG_PATH`, the environment, and
the engine's `--kv-transfer-config`, given here as `--config FILE` or `--kv-transfer-config
JSON`), then walks the path a store hit takes: the master (or the HA group's leader, found
through etcd), the store segments mounted on it, and a put/get/remove of a test object through
a real Mooncake client. It prints one line per check, with the fix on a failure, and exits 1
if any check failed, so it serves as a `helm test` hook and as the first command of an on-call
engineer's first hour.

Each check is one `Check` in `CHECKS`, run in order; a check runs only when the checks it
`needs` passed and `applies` says it concerns this config (a tenant or disk-tier check, for
one, applies only when the config names them), so adding a check is adding one entry.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.error
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from connector.config import (
    CONFIG_PATH_ENV,
    DEFAULT_TENANT,
    EXTRA,
    ConfigError,
    ConnectorConfig,
    load_config,
)
from connector.store.client import (
    DIRECT_HTTP,
    ERROR_NAMES,
    StoreUnavailable,
    check_reachable,
    cluster_id,
    open_store,
    replicate_config,
)

# Mooncake's default --metrics_port: the master's admin HTTP server (/metrics, /health,
# /get_segments_detail).
MASTER_METRICS_PORT = 9003
TEST_OBJECT_BYTES = 64 * 1024
PROBE_BUFFER = 16 * 2**20  # the doctor's own client: a small transfer buffer, no segment
SHOWN_SEGMENTS = 4  # segments named on the segments line; the rest are counted
FULL = 0.99  # a share of allocated bytes above which a failed put reads as "store full"


class CheckFailed(Exception):
    """A check found a problem; `fix` says what to do about it."""

    def __init__(self, problem: str, fix: str = "") -> None:
        super().__init__(f"{problem}; fix: {fix}" if fix else problem)


@dataclass
class Context:
    """What the checks share: the inputs, and what earlier checks found."""

    extra: Mapping[str, Any]
    environ: Mapping[str, str]
    metrics_port: int
    min_segments: int
    timeout: float | None
    cfg: ConnectorConfig | None = None
    master: str = ""  # the serving master (HA: the leader) as host:port
    segments: list[dict[str, Any]] = field(default_factory=list)
    # A client left open for the process's exit: closing an HA client waits out Mooncake's
    # 30 s leader watch (0.3.13, Client::LeaderMonitorThreadMain), a wait the doctor, with no
    # segment mounted, has no reason to make (`cli` exits without it).
    unclosed: Any = None

    @property
    def wait(self) -> float:
        return self.timeout if self.timeout is not None else self.cfg.store_timeout_s


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Context], str]  # the PASS line's detail; raises CheckFailed
    needs: tuple[str, ...] = ()
    applies: Callable[[Context], bool] = lambda ctx: True


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ---- the checks, in the order a store hit needs them ---------------------------------------


def check_config(ctx: Context) -> str:
    try:
        ctx.cfg = load_config(ctx.extra, ctx.environ)
    except ConfigError as e:
        raise CheckFailed(str(e)) from None
    s = ctx.cfg.store
    sources = sorted(set(ctx.cfg.source.values())) or ["defaults"]
    # The connector sets vLLM's kv_load_failure_policy from on_load_failure at startup.
    cost = "a recompute" if ctx.cfg.on_load_failure == "recompute" else "the request"
    return (f"master_server_address {s.master_server_address}, metadata_server "
            f"{s.metadata_server}, protocol {s.protocol}, cache_prefix {ctx.cfg.cache_prefix} "
            f"(from {', '.join(sources)}); a failed load costs {cost}")


def check_master(ctx: Context) -> str:
    s = ctx.cfg.store
    try:
        ctx.master = check_reachable(s, ctx.wait)
    except StoreUnavailable as e:
        raise CheckFailed(str(e)) from None
    if s.ha:
        return (f"leader {ctx.master} of cluster id {cluster_id(s)!r}, named by etcd "
                f"{s.master_server_address}; metadata server answers")
    return f"Mooncake master {ctx.master} and metadata server {s.metadata_server} answer"


def check_segments(ctx: Context) -> str:
    host = ctx.master.rsplit(":", 1)[0]
    url = f"http://{host}:{ctx.metrics_port}/get_segments_detail"
    try:
        with DIRECT_HTTP.open(url, timeout=ctx.wait) as r:
            ctx.segments = json.loads(r.read()).get("segments") or []
    except (OSError, ValueError) as e:
        raise CheckFailed(f"cannot read the mounted segments from {url} ({e})",
                          "pass --master-metrics-port with the master's --metrics_port, and "
                          "let this host reach it") from None
    if len(ctx.segments) < ctx.min_segments:
        raise CheckFailed(
            f"no store segment mounted: {len(ctx.segments)} on master {ctx.master}, "
            f"expected at least {ctx.min_segments}",
            "start the store nodes (mooncake_client --global_segment_size=...) against this "
            "master, or give the engines global_segment_size > 0")
    cap = sum(s["allocator_capacity_bytes"] for s in ctx.segments)
    used = sum(s["allocator_used_bytes"] for s in ctx.segments)
    shown = ", ".join(f"{s['segment_name']} ({s.get('protocol', '?')}, "
                      f"{_size(s['allocator_capacity_bytes'])}, "
                      f"{s['allocator_used_bytes'] / max(1, s['allocator_capacity_bytes']):.0%}"
                      " used)" for s in ctx.segments[:SHOWN_SEGMENTS])
    more = len(ctx.segments) - SHOWN_SEGMENTS
    return (f"{len(ctx.segments)} mounted, {_size(cap - used)} free of {_size(cap)}: {shown}"
            + (f", and {more} more" if more > 0 else ""))


def check_protocol(ctx: Context) -> str:
    want = ctx.cfg.store.protocol
    other = [s for s in ctx.segments if s.get("protocol", want) != want]
    if other:
        names = ", ".join(f"{s['segment_name']} uses {s['protocol']}"
                          for s in other[:SHOWN_SEGMENTS])
        raise CheckFailed(f"wrong protocol: {want} in the config, but segment {names}",
                          "set protocol (and device_name for rdma) to what the store nodes "
                          "use, or restart them with --protocol=" + want)
    return f"{want}, as every mounted segment"


def _admin(ctx: Context, path: str) -> tuple[int, bytes]:
    """(HTTP status, body) of a GET on the master's admin port (an HTTP error is an answer)."""
    host = ctx.master.rsplit(":", 1)[0]
    url = f"http://{host}:{ctx.metrics_port}{path}"
    try:
        with DIRECT_HTTP.open(url, timeout=ctx.wait) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        raise CheckFailed(f"cannot read {url} ({e})", "pass --master-metrics-port with the "
                          "master's --metrics_port, and let this host reach it") from None


def check_tenant(ctx: Context) -> str:
    """The config's tenant on the master: in its quota policy, with room to write."""
    tenant = ctx.cfg.store.tenant_id
    status, raw = _admin(ctx, f"/api/v1/tenant_quotas?tenant_id={tenant}")
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        body = {}
    if status == 409:  # UNAVAILABLE_IN_CURRENT_MODE
        return (f"tenant {tenant!r}: a key namespace only (master {ctx.master} is not in "
                "multi-tenant mode, so no quota applies)")
    if status == 404:
        raise CheckFailed(f"tenant {tenant!r} is not in the quota policy of master "
                          f"{ctx.master}: every put of it is refused (-1701)",
                          "add it to the master's policy (the --tenant_quota_connector_uri "
                          f"file, or PUT /api/v1/tenant_quotas?tenant_id={tenant}), or set "
                          "tenant_id to a tenant the policy lists")
    q = body.get("data") or {}
    if status != 200 or not q:
        raise CheckFailed(f"the master answered {status} {body} for tenant {tenant!r}",
                          "check the master log")
    if q.get("admission_closed"):
        raise CheckFailed(f"tenant {tenant!r}: admission closed on master {ctx.master} (its "
                          "puts are refused)", "restore the tenant's policy on the master")
    return (f"tenant {tenant!r}: {_size(q['charged_bytes'])} used of a "
            f"{_size(q['effective_quota_bytes'])} quota ({_size(q['requested_quota_bytes'])} "
            "in the policy, scaled to the pool)")


def check_disk_tier(ctx: Context) -> str:
    """enable_offload needs a store node with a disk tier mounted on the master."""
    text = _admin(ctx, "/metrics")[1].decode()
    cap = _sample(text, "master_total_file_capacity_bytes")
    used = _sample(text, "master_allocated_file_size_bytes")
    if not cap:
        raise CheckFailed(f"enable_offload is set, but no store node has a disk tier mounted "
                          f"on master {ctx.master} (master_total_file_capacity_bytes 0)",
                          "run the master and the store nodes with --enable_offload=true (the "
                          "store nodes with MOONCAKE_OFFLOAD_FILE_STORAGE_PATH on a local "
                          "disk), or remove enable_offload")
    return f"disk tier mounted: {_size(used)} on disk of {_size(cap)}"


def _sample(text: str, family: str) -> float:
    """Sum of a family's samples in a Prometheus exposition (0 when absent)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((family + " ", family + "{")))


def _put_problem(rc: int, ctx: Context) -> CheckFailed:
    cap = sum(s["allocator_capacity_bytes"] for s in ctx.segments)
    used = sum(s["allocator_used_bytes"] for s in ctx.segments)
    what = f"put of a {_size(TEST_OBJECT_BYTES)} test object failed: {rc} " \
           f"{ERROR_NAMES.get(rc, '')}".rstrip()
    if rc == -200 and cap and used >= FULL * cap:
        return CheckFailed(f"{what}: store full ({_size(used)} of {_size(cap)} allocated, "
                           "nothing evictable)",
                           "add store nodes or raise their global_segment_size; check the "
                           "master's eviction (--eviction_high_watermark_ratio, "
                           "--default_kv_lease_ttl)")
    tenant = ctx.cfg.store.tenant_id
    if rc == -1701:
        return CheckFailed(f"{what}: tenant {tenant!r} is not in the master's quota policy",
                           f"add {tenant!r} to the policy, or set tenant_id to a listed tenant")
    if rc == -1700:
        return CheckFailed(f"{what}: tenant {tenant!r} is at its quota and nothing of it is "
                           "evictable", "raise the tenant's quota, or add pool memory")
    if rc == -200:
        return CheckFailed(f"{what}: no segment can take it (replica_num "
                           f"{ctx.cfg.store.replica_num}, {len(ctx.segments)} segment(s))",
                           "mount store segments, or lower replica_num to the segments there")
    return CheckFailed(what, "check the master and store node logs")


def check_round_trip(ctx: Context) -> str:
    s = ctx.cfg.store
    t0 = time.monotonic()
    try:  # a client of our own with no segment: the test object lands where engines' blocks do
        client, _ = open_store(s, 0, min(PROBE_BUFFER, s.local_buffer_size), ctx.wait)
    except StoreUnavailable as e:
        raise CheckFailed(str(e)) from None
    key = f"{ctx.cfg.cache_prefix}/__doctor__/{socket.gethostname()}/{os.getpid()}"
    data = os.urandom(TEST_OBJECT_BYTES)
    try:  # timed to the remove: the close is not part of the round trip
        rc = client.put(key, data, replicate_config(s.replica_num))
        if rc != 0:
            raise _put_problem(rc, ctx)
        back = client.get(key)
        if back != data:
            raise CheckFailed(f"get of the test object returned {len(back)} bytes, not the "
                              f"{len(data)} put", "check the store node logs and the network "
                              "between this host and the store nodes")
        rc = client.remove(key, force=True)
        if rc != 0:
            raise CheckFailed(f"remove of the test object failed: {rc} "
                              f"{ERROR_NAMES.get(rc, '')}", "check the master log")
        took = time.monotonic() - t0
    finally:
        if s.ha:
            ctx.unclosed = client
        else:
            client.close()
    return (f"put, get and remove of a {_size(TEST_OBJECT_BYTES)} test object in "
            f"{took * 1000:.0f} ms (client setup included)")


# Dynamo's KV indexer (ai-dynamo-runtime 1.6.1, lib/kv-router zmq_wire/convert.rs): the tier
# it files an event's medium under (case-sensitive; any other medium is dropped).
DYNAMO_TIERS = {"GPU": "device", "CPU": "host", "CPU_TIER2": "disk", "DISK": "disk",
                "NVME": "disk", "STORAGE": "disk", "EXTERNAL": "external",
                "NETWORK": "external", "REMOTE": "external", "SHARED": "external"}


def router_fit(medium: str, locality: str | None) -> str:
    """What the routers of docs/kv-events.md do with events of this medium and locality."""
    tier = DYNAMO_TIERS.get(medium)
    if locality not in (None, "LOCAL"):
        dynamo = (f"Dynamo's indexer drops every one (locality {locality}); set "
                  "kv_events_locality: none")
    elif tier is None:
        dynamo = (f"Dynamo's indexer drops every one (unknown medium {medium!r}); set "
                  "kv_events_medium: STORAGE")
    else:
        dynamo = f"Dynamo's indexer files them under its {tier} tier"
    return (f"{dynamo}; llm-d's scorer keeps them as tier {medium.lower()!r} (its weight: "
            "1.0 unless configured)")


def check_kv_events(ctx: Context) -> str:
    """The store's KV events: what routers make of them, and whether the sweep's address
    answers (a sweep that never does leaves removals to lookups alone)."""
    from types import SimpleNamespace

    from connector.observability.kv_event_settings import event_settings, sweep_address
    from connector.store.master_http import query_keys

    vllm_on = SimpleNamespace(enable_kv_cache_events=True, publisher="zmq", endpoint=None,
                              replay_endpoint=None)
    try:
        st = event_settings(ctx.cfg, vllm_on)
    except ConfigError as e:
        raise CheckFailed(str(e)) from None
    locality = st.locality or "unset"
    fit = f"medium {st.medium}, locality {locality}: {router_fit(st.medium, st.locality)}"
    if st.sweep_off:
        return f"{fit}; no sweep: {st.sweep_off}"
    if not st.sweep_s:
        return f"{fit}; no sweep (kv_events_sweep_s 0): removals come from lookups only"
    where = st.sweep_target
    try:
        where = sweep_address(st, ctx.cfg.store, ctx.wait)()
        query_keys(where, ["__mcpool_doctor__"], timeout=ctx.wait)
    except Exception as e:  # noqa: BLE001 - any failure is the sweep's failure
        raise CheckFailed(f"{fit}; the sweep's address {where} does not answer "
                          f"/batch_query_keys ({e})",
                          "set kv_events_master_http to the master's host:port of "
                          "--metrics_port that engines reach (:port for the HA leader's), or "
                          "kv_events_sweep_s to 0") from None
    return f"{fit}; the sweep's address {where} answers"


CHECKS: list[Check] = [
    Check("config", check_config),
    Check("master", check_master, needs=("config",)),
    Check("segments", check_segments, needs=("master",)),
    Check("protocol", check_protocol, needs=("segments",)),
    Check("tenant", check_tenant, needs=("master",),
          applies=lambda ctx: ctx.cfg.store.tenant_id != DEFAULT_TENANT),
    Check("disk tier", check_disk_tier, needs=("master",),
          applies=lambda ctx: ctx.cfg.enable_offload),
    Check("round trip", check_round_trip, needs=("master",)),
    Check("kv events", check_kv_events, needs=("master",),
          applies=lambda ctx: ctx.cfg.kv_events == "on"),
]


def run(ctx: Context, checks: list[Check] = CHECKS, out: TextIO | None = None) -> bool:
    """Run the checks in order, one line each; True when none failed."""
    out = out or sys.stdout
    passed: set[str] = set()
    ok = True
    width = max(len(c.name) for c in checks)
    for c in checks:
        missing = [n for n in c.needs if n not in passed]
        if missing:
            print(f"SKIP {c.name:<{width}}  needs {', '.join(missing)}", file=out, flush=True)
            continue
        if not c.applies(ctx):
            continue
        try:
            detail = c.run(ctx)
        except CheckFailed as e:
            ok = False
            print(f"FAIL {c.name:<{width}}  {e}", file=out, flush=True)
            continue
        passed.add(c.name)
        print(f"PASS {c.name:<{width}}  {detail}", file=out, flush=True)
    return ok


def _kv_transfer_config(text: str, where: str) -> dict[str, Any]:
    """The extra_config of a kv-transfer-config, or a bare extra_config."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column "
                          f"{e.colno}); fix it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must hold a JSON object")
    if "kv_connector" in data or EXTRA in data:  # vllm serve's --kv-transfer-config
        return data.get(EXTRA) or {}
    return data


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None,
         exit_now: Callable[[int], None] | None = None) -> int:
    """Run the checks; the exit status. `exit_now` ends the process when a client was left
    open (`cli`), so no destructor waits on it."""
    p = argparse.ArgumentParser(
        prog="mcpool-doctor", description=__doc__.split("\n\n")[0],
        epilog=f"{CONFIG_PATH_ENV} and the connector's environment variables are read as an "
               "engine reads them.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE",
                     help="JSON file: vllm serve's --kv-transfer-config, or its "
                          f"{EXTRA} alone")
    src.add_argument("--kv-transfer-config", metavar="JSON",
                     help="the engine's --kv-transfer-config, as given to vllm serve")
    p.add_argument("--master-metrics-port", type=int, default=MASTER_METRICS_PORT,
                   help="the master's --metrics_port (its HTTP admin server; default "
                        f"{MASTER_METRICS_PORT})")
    p.add_argument("--min-segments", type=int, default=1,
                   help="fail when fewer store segments are mounted (default 1)")
    p.add_argument("--timeout", type=float,
                   help="seconds per network probe (default: the config's store_timeout_s)")
    a = p.parse_args(argv)
    environ = os.environ if environ is None else environ
    extra: dict[str, Any] = {}
    try:
        if a.config:
            try:
                with open(a.config, encoding="utf-8") as f:
                    extra = _kv_transfer_config(f.read(), f"--config {a.config}")
            except OSError as e:
                raise ConfigError(f"--config: cannot read {a.config!r} ({e.strerror})") from None
        elif a.kv_transfer_config:
            extra = _kv_transfer_config(a.kv_transfer_config, "--kv-transfer-config")
    except ConfigError as e:
        print(f"FAIL config  {e}", flush=True)
        return 1
    ctx = Context(extra=extra, environ=environ, metrics_port=a.master_metrics_port,
                  min_segments=a.min_segments, timeout=a.timeout)
    ok = run(ctx)
    if ctx.unclosed is not None and exit_now is not None:
        exit_now(0 if ok else 1)
    return 0 if ok else 1


def _exit_unclosed(rc: int) -> None:
    """End the process with a client still open (Context.unclosed), its output flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def cli() -> int:
    """The command (`mcpool-doctor`, `python -m connector.doctor`)."""
    return main(exit_now=_exit_unclosed)


if __name__ == "__main__":
    sys.exit(cli())
