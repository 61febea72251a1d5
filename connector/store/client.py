"""Opening a Mooncake store client, naming its error codes, and riding out master outages.

`MooncakeDistributedStore.setup()` retries for ~90 s while holding the GIL when the master is
down, so we probe the master's RPC port and metadata server first and fail (or degrade) with a
message that names the field, instead of freezing the engine.

With an HA master group (`master_server_address: etcd://...`) the leader is the address that
etcd holds under `mooncake-store/<cluster id>/master_view`; the client follows it by itself.
While no leader serves (the old leader's etcd lease, then the new leader's warm-up), each store
call blocks for seconds and returns -900 (docs/failover.json, `blocked_call_s`), so the breaker
below fails jobs at once instead, and one probe thread watches etcd for the new leader before
it spends a call on it.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from connector.config import (
    CLUSTER_ID_ENV,
    DEFAULT_TENANT,
    ETCD_SCHEME,
    StoreConfig,
    etcd_endpoints,
)

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level

# ErrorCode values from Mooncake's types.h.
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",  # a get from the disk tier larger than the owner's staging buffer
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1700: "TENANT_QUOTA_EXCEEDED",  # a put over the tenant's quota (master --enable_multi_tenants)
    -1701: "TENANT_NOT_REGISTERED",  # the tenant is not in the master's quota policy
}
# Label value for failures that are Python exceptions rather than store return codes.
EXCEPTION_CODE = "exception"
# Label value for a save dropped before it read its blocks: its request was preempted, or
# finished while saves fail or hang.
ABANDONED_CODE = "abandoned"
# Label value for a get that returned fewer bytes than a block (a stored object of another
# size under the key).
SHORT_READ_CODE = "short_read"
# Label values for jobs the pool's watchdog reported: past their deadline, or queued at close.
TIMEOUT_CODE = "timeout"
SHUTDOWN_CODE = "shutdown"
# Codes that mean the master itself is gone: stop calling it until a probe says it is back.
MASTER_DOWN_CODES = frozenset({-900, -901})
PROBE_KEY = "__mcpool_probe__"
# A new HA leader publishes its address in etcd when its warm-up starts and opens its RPC port
# only when it serves (~5 s later): the probe then connects to that port every FAST_PROBE_S
# (a TCP connect, no etcd read) for up to LEADER_WARMUP_WAIT_S, so the breaker closes within
# FAST_PROBE_S of the new leader serving instead of within probe_s.
FAST_PROBE_S = 0.1
LEADER_WARMUP_WAIT_S = 10.0
RPC_TIMEOUT_ENV, RPC_CONNECT_TIMEOUT_ENV = "MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS"
# Both the masters and the client use this id when none is given.
DEFAULT_CLUSTER_ID = "mooncake_cluster"


class StoreError(Exception):
    """A store operation was not made or failed. `code` is its bounded label: a Mooncake error
    code, or one of the label values above ("unavailable" while there is no client or the
    breaker is open)."""

    def __init__(self, code: str, message: str = "") -> None:
        super().__init__(message or code)
        self.code = code


class StoreUnavailable(StoreError):
    """The Mooncake master or metadata server cannot be reached (an outage, not a bad config:
    the message still names the field to check)."""

    def __init__(self, message: str) -> None:
        super().__init__("unavailable", message)


class EtcdGarbage(StoreUnavailable):
    """etcd answered the master-view read with something that is not a master view (a broken
    gateway or proxy, a key written by something else): at startup an outage naming the
    field, in the breaker's probe an error that is logged and counted."""


def _probe_tcp(host: str, port: int, timeout: float) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e)


# Not a request header of the master's RPC protocol: a live master closes the connection.
_NOT_A_REQUEST = b"\xff" * 64


def _probe_answers(host: str, port: int, timeout: float) -> str | None:
    """None if the master at host:port reacts: it closes a connection at once when its first
    bytes are not a request (Mooncake 0.3.13, checked). A frozen or wedged master, whose kernel
    still completes TCP connects, stays silent, and Mooncake's setup() against it retries its
    RPC 20 times holding the GIL (minutes in which the whole engine process stands still):
    found here in `timeout` instead."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(_NOT_A_REQUEST)
            sock.recv(64)  # b"" (closed) or an answer: a live process either way
    except TimeoutError:
        return f"accepts connections but does not answer within {timeout:g}s (frozen?)"
    except ConnectionResetError:
        return None  # closed with our bytes unread: it reacted
    except OSError as e:
        return e.strerror or str(e)
    return None


def _probe_any(endpoints: list[str], timeout: float) -> tuple[str | None, str | None]:
    """(the first endpoint that accepts a connection, else None; the last error)."""
    err = None
    for ep in endpoints:
        host, port = ep.rsplit(":", 1)
        err = _probe_tcp(host, int(port), timeout)
        if err is None:
            return ep, None
    return None, err


def cluster_id(cfg: StoreConfig) -> str:
    """The HA cluster id the client will use (load_config made the config and env agree)."""
    return os.environ.get(CLUSTER_ID_ENV, "").strip() or cfg.cluster_id or DEFAULT_CLUSTER_ID


def etcd_leader(cfg: StoreConfig, timeout: float) -> tuple[str, str | None]:
    """(the leader an HA group publishes in etcd, "" while none; why it cannot be read). Each
    endpoint in turn until one answers the read: a member that accepts connections but does
    not answer (frozen, or cut off from the others, often in the very failure that moves the
    master) must not hide the members that do."""
    errors = []
    for ep in etcd_endpoints(cfg.master_server_address, "master_server_address"):
        try:  # a refused connection is an OSError of the read too
            return _read_master_view(cfg, ep, timeout), None
        except OSError as e:
            errors.append(f"{ep} did not answer a read of the master view ({e})")
    return "", f"no etcd endpoint of {cfg.master_server_address} answers: {'; '.join(errors)}"


# HTTP to etcd and to the master goes to them directly, as Mooncake's own etcd client and this
# connector's reads of the master (store/master_http.py) do: an `http_proxy` in a pod's
# environment (for its downloads) must not route them elsewhere, or nowhere.
DIRECT_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _read_master_view(cfg: StoreConfig, ep: str, timeout: float) -> str:
    """The leader etcd endpoint `ep` names ("" while none); OSError when it does not answer,
    EtcdGarbage when it answers with something else."""
    key = base64.b64encode(f"mooncake-store/{cluster_id(cfg)}/master_view".encode()).decode()
    req = urllib.request.Request(f"http://{ep}/v3/kv/range", data=json.dumps({"key": key}).encode())
    try:  # etcd's JSON gateway: no etcd client library needed
        with DIRECT_HTTP.open(req, timeout=timeout) as r:
            body = r.read()
    except http.client.HTTPException as e:  # BadStatusLine, IncompleteRead, ...
        raise EtcdGarbage(f"master_server_address: etcd {ep} answered a read of the master "
                          f"view with a broken HTTP response ({e!r})") from e
    try:
        kvs = json.loads(body).get("kvs", [])
        leader = base64.b64decode(kvs[0]["value"], validate=True).decode() if kvs else ""
    except (ValueError, AttributeError, LookupError, TypeError, binascii.Error) as e:
        raise EtcdGarbage(f"master_server_address: etcd {ep} answered a read of the master "
                          f"view with {body[:80]!r}, not a master view ({e!r})") from e
    if leader and not _is_host_port(leader):
        raise EtcdGarbage(f"master_server_address: etcd {ep} names {leader[:80]!r} as the "
                          f"leader of cluster id {cluster_id(cfg)!r}, not host:port")
    return leader


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def find_master(cfg: StoreConfig, timeout: float) -> tuple[str, str | None]:
    """(the master that should serve this client: the configured one or the HA leader; why it
    cannot, or None). Cheap: TCP connects, one etcd read and the master's reaction to a
    connection (`_probe_answers`), never a store call."""
    if cfg.ha:
        leader, problem = etcd_leader(cfg, timeout)
        if problem:
            return "", problem
        if not leader:
            return "", (f"no Mooncake master leads cluster id {cluster_id(cfg)!r} in "
                        f"{cfg.master_server_address}; start the HA masters or set cluster_id "
                        "to their --cluster_id")
        what = f"the HA leader {leader} that etcd names"
    else:
        leader, what = cfg.master_server_address, f"Mooncake master {cfg.master_server_address}"
    host, port = leader.rsplit(":", 1)
    err = _probe_answers(host, int(port), timeout)
    return leader, (f"{what} is unreachable ({err})" if err else None)


def _not_etcd(ep: str, timeout: float) -> str | None:
    """What answers HTTP at host:port `ep` when that is not etcd (etcd's GET /version names its
    server); None for etcd, and for no HTTP answer at all (nothing there, or a gRPC-only
    etcd), which this check leaves to Mooncake."""
    try:
        with DIRECT_HTTP.open(f"http://{ep}/version", timeout=timeout) as r:
            body = r.read(256)
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, http.client.HTTPException):
        return None
    try:
        etcd = "etcdserver" in json.loads(body)
    except (ValueError, TypeError):
        etcd = False
    return None if etcd else repr(body[:60])


def check_reachable(cfg: StoreConfig, timeout: float) -> str:
    """The serving master's address; raise StoreUnavailable naming the field that is wrong."""
    master, problem = find_master(cfg, timeout)
    if problem:
        raise StoreUnavailable(
            f"master_server_address: {problem}; start mooncake_master there, fix the address, "
            "or set kv_connector_extra_config.on_master_unreachable=\"degrade\" to serve "
            "without the cache")
    md = cfg.metadata_server
    url = urllib.parse.urlparse(md)
    bare = [] if "://" in md else [e.strip() for e in re.split(r"[,;]", md)]
    if md.startswith(ETCD_SCHEME):
        ep, err = _probe_any(etcd_endpoints(md, "metadata_server"), timeout)
        if ep is None:
            raise StoreUnavailable(f"metadata_server: no etcd endpoint of {md} "
                                   f"answers ({err}); start etcd there or fix the address")
    elif bare and all(map(_is_host_port, bare)):
        # No scheme: etcd endpoints to Mooncake. Pointed at the master's HTTP metadata
        # server instead, setup() talks etcd to it for minutes holding the GIL, then fails
        # naming master_server_address. Refused only when every endpoint answers HTTP as
        # something other than etcd (asked in turn until one may be etcd).
        other = []
        for ep in bare:
            if (what := _not_etcd(ep, timeout)) is None:
                break
            other.append((ep, what))
        else:
            ep, what = other[0]
            raise StoreUnavailable(
                f"metadata_server: {md} has no scheme, which Mooncake reads as etcd "
                f"endpoints, but {ep} answers GET /version with {what}, as etcd does not; "
                f"write http://{ep}/metadata for the master's HTTP metadata server, or "
                f"etcd://{md} with etcd's endpoints")
    if url.scheme in ("http", "https"):
        err = _probe_tcp(url.hostname or "", url.port or (443 if url.scheme == "https" else 80),
                         timeout)
        if err:
            raise StoreUnavailable(
                f"metadata_server: {cfg.metadata_server} is unreachable ({err}); start the "
                "master with --enable_http_metadata_server or fix the URL"
            )
    return master


def open_store(cfg: StoreConfig, global_segment_size: int, local_buffer_size: int,
               timeout: float) -> tuple[Any, str]:
    """Probe, then set up a `MooncakeDistributedStore` client; returns it and the master that
    serves it (the HA leader for an etcd:// address)."""
    master = check_reachable(cfg, timeout)
    if cfg.cluster_id:  # the client reads it from the environment (load_config checked both)
        _export(CLUSTER_ID_ENV, cfg.cluster_id)
    apply_transfer_timeout(cfg.transfer_timeout)
    if cfg.ha:
        # Unless transfer_timeout or the environment set them: bound one master RPC by
        # store_timeout_s (with Mooncake's 30 s a call in flight to a partitioned leader held
        # its job that long) and a reconnect by 1 s (with 30 s, the call after a timeout
        # blocked ~90 s reconnecting to the unreachable old leader).
        _export(RPC_TIMEOUT_ENV, str(int(timeout * 1000)))
        _export(RPC_CONNECT_TIMEOUT_ENV, str(int(min(timeout, 1.0) * 1000)))
    from mooncake.store import MooncakeDistributedStore  # heavy; worker/scheduler only

    store = MooncakeDistributedStore()
    # The default tenant is left to Mooncake, as the in-tree connector does (a client without a
    # tenant argument is in the default tenant).
    tenant = {"tenant_id": cfg.tenant_id} if cfg.tenant_id != DEFAULT_TENANT else {}
    rc = store.setup(
        cfg.local_hostname, cfg.metadata_server, global_segment_size, local_buffer_size,
        cfg.protocol, cfg.device_name, cfg.master_server_address, **tenant,
    )
    if rc != 0:
        raise StoreUnavailable(
            f"master_server_address: Mooncake client setup against {cfg.master_server_address} "
            f"failed with code {rc} ({ERROR_NAMES.get(rc, 'unknown')}); check the master log, "
            "protocol/device_name and that global_segment_size fits in memory"
            + (f", and that the masters run with --cluster_id={cluster_id(cfg)}" if cfg.ha
               else "")
        )
    return store, master


# Mooncake's own deadlines, read from the environment when its transports start: a TCP
# transfer (MC_TCP_STATUS_TIMEOUT_SEC), other transports (MC_TRANSFER_TIMEOUT) and master
# RPCs (MC_RPC_TIMEOUT_MS). Each defaults to 30 s; what a get from a frozen store node and one
# through a frozen master return, and when: `python -m devkit.frozen_peer` (docs/frozen-peer.json).
TIMEOUT_ENV = {"MC_TCP_STATUS_TIMEOUT_SEC": 1, "MC_TRANSFER_TIMEOUT": 1, "MC_RPC_TIMEOUT_MS": 1000}


def apply_transfer_timeout(seconds: float | None) -> None:
    """Set Mooncake's call timeouts (unless the environment already sets them), so a call
    stuck on a frozen peer returns: the only bound for zero-copy transfers."""
    if seconds is None:
        return
    for var, per_second in TIMEOUT_ENV.items():
        _export(var, str(max(1, round(seconds * per_second))))


def _export(var: str, value: str) -> None:
    """Give Mooncake `var` unless the environment sets it. Blank is unset, as `load_config`
    reads every variable: Mooncake reads a blank MC_STORE_CLUSTER_ID as its default cluster
    id, not the configured one."""
    if not os.environ.get(var, "").strip():
        os.environ[var] = value


def replicate_config(replica_num: int, preferred_segment: str = "") -> Any:
    """The ReplicateConfig passed to every put (replica_num copies of each block, on the
    preferred segment when one is set)."""
    from mooncake.store import ReplicateConfig

    cfg = ReplicateConfig()
    cfg.replica_num = replica_num
    if preferred_segment:
        cfg.preferred_segment = preferred_segment
    return cfg


def error_code_label(code: int) -> str:
    """Bounded label value for a negative store return code."""
    return str(code) if code in ERROR_NAMES else "other"


class StoreHandle:
    """The process's store client, with a circuit breaker for a dead master.

    on_master_unreachable="fail": open now, raise StoreUnavailable on failure.
    "degrade": if the first attempt fails, serve without the cache (every lookup a miss, no
    saves) and retry in a background thread every `retry_s` seconds; `on_connect` callbacks
    run once the client exists (the worker registers its KV buffers there), before any job
    can see the client.

    Once running, a call that returns an RPC failure trips the breaker (`trip`): `ready()`
    returns None, so every job fails at once and vLLM recomputes, instead of each one waiting
    seconds for its own RPC to fail. One probe thread closes the breaker when the master
    answers: it makes a store call only once the master (for an HA group, the leader etcd
    names) accepts connections, so a failover costs one blocked call, not one per job. The
    client re-attaches to a new leader by itself; the breaker closes on the first call that
    succeeds there. Codes other than -900/-901 never trip it: the -703 (gets) and -200 (puts)
    that follow a promotion for about a second, until the store nodes have remounted their
    segments on the new leader, fail only their own jobs (recomputed, counted by code).

    A trip counts only for a call started since the breaker last closed: `require()` notes
    the breaker's generation on the calling thread and `check()` passes it on, so a -900/-901
    from a call that was in flight through the outage and returns after the probe closed the
    breaker is stale and changes nothing. The probe is supervised: an exception in a round
    (etcd answering garbage, the store client raising) is logged, counted (`on_probe_error`)
    and the next round goes on, so the cache cannot stay off for the life of the process.
    `close()` stops both background threads: the client is closed only once a probe call on it
    has returned, and a reconnect that completes after `close()` closes its own client. A
    handle `share()`d by several users (connector.store.process_client) closes at its last
    user's `close()`, after every user's `wait_first`.
    """

    def __init__(self, cfg: StoreConfig, global_segment_size: int, local_buffer_size: int,
                 mode: str, timeout: float, retry_s: float = 5.0, probe_s: float = 0.5,
                 on_probe_error: Callable[[], object] | None = None) -> None:
        self._args = (cfg, global_segment_size, local_buffer_size, timeout)
        self._retry_s = retry_s
        self._probe_s = probe_s
        self._on_probe_error = on_probe_error
        self._last_probe_error = ""
        self._callbacks: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the breaker's state
        self._connect_lock = threading.Lock()  # installing a client vs on_connect and close
        self._threads: list[threading.Thread] = []  # probe and reconnect threads started
        self._users = 1  # share() adds one, close() takes one: the last closes the client
        self._waits: list[Callable[[], object]] = []  # wait_first of the users closed so far
        self._awaited, self._awaited_until = "", 0.0  # a new leader warming up, watched until
        self._generation = 0  # +1 whenever the breaker closes or a client is installed
        self._calls = threading.local()  # .generation: when this thread's call started
        self.client: Any = None
        self.master = ""  # the master (HA: leader) that served the last successful probe
        self.down_code: str = ""  # the code that tripped the breaker; "" while healthy
        self._down_since = 0.0  # monotonic time the breaker opened (0 while closed)
        self._outage = [0, 0.0]  # failovers ridden through, seconds without a master: unreported
        self.replicate = replicate_config(cfg.replica_num, cfg.preferred_segment)  # every put
        try:
            self.client, self.master = open_store(*self._args)
        except StoreUnavailable as e:
            if mode == "fail":
                raise
            logger.warning("serving without the KV store until it is reachable: %s", e)
            self._start(self._reconnect, "mcpool-reconnect")

    def _start(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def on_connect(self, callback) -> None:
        """Run callback(client) now if connected, else when the background retry succeeds
        (exactly once either way: a reconnect completing meanwhile waits for this)."""
        with self._connect_lock:
            self._callbacks.append(callback)
            if self.client is not None:
                callback(self.client)

    def share(self) -> bool:
        """One more user of this handle (its client, breaker and probe), if it is not closed
        yet: that user closes it too, and the client stays open until the last one has."""
        with self._connect_lock:
            if self._stop.is_set():
                return False
            self._users += 1
            return True

    def ready(self) -> Any:
        """The client if connected and the breaker is closed, else None."""
        return None if self.down_code else self.client

    def require(self) -> Any:
        """The client, or StoreError when there is none or the breaker is open (no call made).
        Notes the breaker's generation on this thread, for `check()`."""
        generation = self._generation
        client = self.ready()
        if client is None:
            raise StoreError(self.down_code or "unavailable")
        self._calls.generation = generation
        return client

    def check(self, results: list[int]) -> None:
        """The one result check: a master-down code among the results of a call this thread
        started (after `require()`) trips the breaker, unless the breaker closed since."""
        down = next((r for r in results if r in MASTER_DOWN_CODES), None)
        if down is not None:
            self.trip(down, getattr(self._calls, "generation", None))

    def trip(self, code: int, generation: int | None = None) -> None:
        """Open the breaker after an RPC failure of a call started in `generation` (None: a
        call made just now); a probe thread closes it again."""
        with self._lock:
            if self.down_code or self.client is None or self._stop.is_set():
                return
            if generation is not None and generation != self._generation:
                logger.debug("ignoring %d from a store call started before the master "
                             "answered again", code)
                return
            self.down_code, self._down_since = str(code), time.monotonic()
            self._start(self._probe, "mcpool-probe")
        logger.error("Mooncake master %s RPC failed (%d %s): failing store calls fast until a "
                     "master answers again", self.master, code, ERROR_NAMES.get(code, ""))

    def take_outage(self) -> tuple[int, float]:
        """(failovers ridden through, seconds without a master) since the last call; the
        seconds include an outage still in progress."""
        with self._lock:
            now = time.monotonic()
            if self._down_since:
                self._outage[1] += now - self._down_since
                self._down_since = now
            failovers, seconds = self._outage
            self._outage = [0, 0.0]
        return failovers, seconds

    def _probe(self) -> None:
        """One round after another until the breaker closes (or the handle is closed). No
        exception ends the thread: it is logged and counted, and the next round goes on."""
        wait: float | None = self._probe_s
        while not self._stop.wait(wait):
            try:
                wait = self._probe_round()
                if wait is None:
                    return
            except Exception as e:  # noqa: BLE001 - supervised, see above
                wait = self._probe_s
                text = f"{type(e).__name__}: {e}"
                log = logger.warning if text != self._last_probe_error else logger.debug
                log("Mooncake breaker probe failed (%s); probing again", text)
                self._last_probe_error = text
                if self._on_probe_error is not None:
                    self._on_probe_error()

    def _probe_round(self) -> float | None:
        """None once the breaker is closed (or the handle closed), else the seconds to wait
        before the next round."""
        cfg, timeout = self._args[0], self._args[3]
        client = self.client
        if client is None:  # closed
            return None
        if self._awaited and time.monotonic() < self._awaited_until:
            master = self._awaited
            host, port = master.rsplit(":", 1)
            if _probe_tcp(host, int(port), FAST_PROBE_S) is not None:
                return FAST_PROBE_S
        else:
            master, problem = find_master(cfg, min(timeout, 1.0))
            if problem:
                if cfg.ha and master and master != self.master:  # a new leader, warming up
                    self._awaited, self._awaited_until = (
                        master, time.monotonic() + LEADER_WARMUP_WAIT_S)
                    return FAST_PROBE_S
                return self._probe_s
        self._awaited = ""
        res = client.batch_is_exist([PROBE_KEY])
        if len(res) != 1:
            raise RuntimeError(f"batch_is_exist of one key answered {res!r}")
        if res[0] < 0:
            return self._probe_s
        with self._lock:
            if self._stop.is_set():
                return None
            failover = cfg.ha and master != self.master
            self._outage[0] += failover
            self._outage[1] += time.monotonic() - self._down_since
            self._generation += 1
            self._down_since, self.down_code, old, self.master = 0.0, "", self.master, master
        logger.info("Mooncake master %s answers%s; store calls resumed", master,
                    f" (failover from {old})" if failover else " again")
        return None

    def _reconnect(self) -> None:
        while not self._stop.wait(self._retry_s):
            try:
                client, master = open_store(*self._args)
            except StoreUnavailable as e:
                logger.debug("store still unreachable: %s", e)
                continue
            except Exception as e:  # noqa: BLE001 - supervised like the probe
                logger.warning("connecting to the Mooncake store failed (%r); retrying", e)
                continue
            with self._connect_lock:
                if self._stop.is_set():  # closed meanwhile: nobody else would close it
                    client.close()
                    return
                try:
                    for cb in self._callbacks:
                        cb(client)
                except Exception:  # noqa: BLE001 - e.g. a buffer registration failed
                    logger.exception("setting up the new store client failed; retrying")
                    client.close()
                    continue
                with self._lock:
                    self._generation += 1
                    self.client, self.master = client, master
            logger.info("connected to the Mooncake store; cache enabled")
            return

    def close(self, wait_first: Sequence[Callable[[], object]] = ()) -> None:
        """Close the client and stop the probe and reconnect threads. With `wait_first`
        (calls that block until a thread still inside a store call has returned), or a probe
        call still running, close it from a background thread once they return: so shutdown
        never waits on a frozen peer, and the client is never freed under a call. A shared
        handle only notes `wait_first` until its last user closes it."""
        with self._connect_lock:
            if self._users == 0:  # closed already
                return
            self._users -= 1
            self._waits += wait_first
            if self._users > 0:
                return
            self._stop.set()
            client, self.client = self.client, None
            # Nothing of its users is kept alive by a closed handle (their KV caches above all).
            self._callbacks, self._on_probe_error = [], None
        if client is None:
            return
        waits = [*self._waits, *(t.join for t in self._threads if t.is_alive())]
        if not waits:
            client.close()
            return

        def close_later() -> None:
            for wait in waits:
                wait()
            client.close()

        threading.Thread(target=close_later, name="mcpool-close", daemon=True).start()
