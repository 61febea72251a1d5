"""Opening a Mooncake store client, and naming its error codes.

`MooncakeDistributedStore.setup()` retries for ~90 s while holding the GIL when the master is
down, so we probe the master's RPC port and metadata server first and fail (or degrade) with a
message that names the field, instead of freezing the engine.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from connector.config import ConfigError, StoreConfig

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level

# ErrorCode values from Mooncake's types.h.
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
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
}
# Label value for failures that are Python exceptions rather than store return codes.
EXCEPTION_CODE = "exception"
# Label value for a save given up on at a preemption (its blocks were reused under it).
ABANDONED_CODE = "abandoned"
# Label values for jobs the pool's watchdog reported: past their deadline, or queued at close.
TIMEOUT_CODE = "timeout"
SHUTDOWN_CODE = "shutdown"
# Codes that mean the master itself is gone: stop calling it until a probe says it is back.
MASTER_DOWN_CODES = frozenset({-900, -901})
PROBE_KEY = "__mcpool_probe__"


class StoreUnavailable(ConfigError):
    """The Mooncake master or metadata server cannot be reached."""


def _probe_tcp(host: str, port: int, timeout: float) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or str(e)


def check_reachable(cfg: StoreConfig, timeout: float) -> None:
    """Raise StoreUnavailable naming the field whose endpoint does not answer."""
    host, port = cfg.master_server_address.rsplit(":", 1)
    err = _probe_tcp(host, int(port), timeout)
    if err:
        raise StoreUnavailable(
            f"master_server_address: Mooncake master {cfg.master_server_address} is unreachable "
            f"({err}); start mooncake_master there, fix the address, or set "
            "kv_connector_extra_config.on_master_unreachable=\"degrade\" to serve without the cache"
        )
    url = urllib.parse.urlparse(cfg.metadata_server)
    if url.scheme in ("http", "https"):
        err = _probe_tcp(url.hostname or "", url.port or 80, timeout)
        if err:
            raise StoreUnavailable(
                f"metadata_server: {cfg.metadata_server} is unreachable ({err}); start the "
                "master with --enable_http_metadata_server or fix the URL"
            )


def open_store(cfg: StoreConfig, global_segment_size: int, local_buffer_size: int,
               timeout: float) -> Any:
    """Probe, then set up a `MooncakeDistributedStore` client."""
    check_reachable(cfg, timeout)
    from mooncake.store import MooncakeDistributedStore  # heavy; worker/scheduler only

    apply_transfer_timeout(cfg.transfer_timeout)
    store = MooncakeDistributedStore()
    rc = store.setup(
        cfg.local_hostname, cfg.metadata_server, global_segment_size, local_buffer_size,
        cfg.protocol, cfg.device_name, cfg.master_server_address,
    )
    if rc != 0:
        raise StoreUnavailable(
            f"master_server_address: Mooncake client setup against {cfg.master_server_address} "
            f"failed with code {rc} ({ERROR_NAMES.get(rc, 'unknown')}); check the master log, "
            "protocol/device_name and that global_segment_size fits in memory"
        )
    return store


# Mooncake's own deadlines, read from the environment when its transports start: a TCP
# transfer (MC_TCP_STATUS_TIMEOUT_SEC), other transports (MC_TRANSFER_TIMEOUT) and master
# RPCs (MC_RPC_TIMEOUT_MS). Each defaults to 30 s; measured here: a get from a frozen store
# node returns -800 and one through a frozen master -901, 30 s after the call.
TIMEOUT_ENV = {"MC_TCP_STATUS_TIMEOUT_SEC": 1, "MC_TRANSFER_TIMEOUT": 1, "MC_RPC_TIMEOUT_MS": 1000}


def apply_transfer_timeout(seconds: float | None) -> None:
    """Set Mooncake's call timeouts (unless the environment already sets them), so a call
    stuck on a frozen peer returns: the only bound for zero-copy transfers."""
    if seconds is None:
        return
    for var, per_second in TIMEOUT_ENV.items():
        os.environ.setdefault(var, str(max(1, round(seconds * per_second))))


def replicate_config(replica_num: int) -> Any:
    """The ReplicateConfig passed to every put (replica_num copies of each block)."""
    from mooncake.store import ReplicateConfig

    cfg = ReplicateConfig()
    cfg.replica_num = replica_num
    return cfg


def error_code_label(code: int) -> str:
    """Bounded label value for a negative store return code."""
    return str(code) if code in ERROR_NAMES else "other"


class StoreHandle:
    """The process's store client, with a circuit breaker for a dead master.

    on_master_unreachable="fail": open now, raise StoreUnavailable on failure.
    "degrade": if the first attempt fails, serve without the cache (every lookup a miss, no
    saves) and retry in a background thread every `retry_s` seconds; `on_connect` callbacks
    run once the client exists (the worker registers its KV buffers there).

    Once running, a call that returns an RPC failure trips the breaker (`trip`): `ready()`
    returns None, so every job fails at once and vLLM recomputes, instead of each one waiting
    seconds for its own RPC to fail. A probe thread closes the breaker when the master answers.
    """

    def __init__(self, cfg: StoreConfig, global_segment_size: int, local_buffer_size: int,
                 mode: str, timeout: float, retry_s: float = 5.0, probe_s: float = 0.5) -> None:
        self._args = (cfg, global_segment_size, local_buffer_size, timeout)
        self._retry_s = retry_s
        self._probe_s = probe_s
        self._callbacks: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.client: Any = None
        self.down_code: str = ""  # the code that tripped the breaker; "" while healthy
        self.replicate = replicate_config(cfg.replica_num)  # passed to every put
        try:
            self.client = open_store(*self._args)
        except StoreUnavailable as e:
            if mode == "fail":
                raise
            logger.warning("serving without the KV store until it is reachable: %s", e)
            threading.Thread(target=self._reconnect, name="mcpool-reconnect",
                             daemon=True).start()

    def on_connect(self, callback) -> None:
        """Run callback(client) now if connected, else when the background retry succeeds."""
        self._callbacks.append(callback)
        if self.client is not None:
            callback(self.client)

    def ready(self) -> Any:
        """The client if connected and the breaker is closed, else None."""
        return None if self.down_code else self.client

    def trip(self, code: int) -> None:
        """Open the breaker after an RPC failure; a probe thread closes it again."""
        with self._lock:
            if self.down_code or self.client is None:
                return
            self.down_code = str(code)
        logger.error("Mooncake master RPC failed (%d %s): failing store calls fast until it "
                     "answers again", code, ERROR_NAMES.get(code, ""))
        threading.Thread(target=self._probe, name="mcpool-probe", daemon=True).start()

    def _probe(self) -> None:
        cfg, timeout = self._args[0], self._args[3]
        while not self._stop.wait(self._probe_s):
            client = self.client
            if client is None:  # closed
                return
            try:
                check_reachable(cfg, min(timeout, 1.0))
                if min(client.batch_is_exist([PROBE_KEY])) < 0:
                    continue
            except StoreUnavailable:
                continue
            logger.info("Mooncake master answers again; store calls resumed")
            self.down_code = ""
            return

    def _reconnect(self) -> None:
        while not self._stop.wait(self._retry_s):
            try:
                client = open_store(*self._args)
            except StoreUnavailable as e:
                logger.debug("store still unreachable: %s", e)
                continue
            for cb in self._callbacks:
                cb(client)
            self.client = client
            logger.info("connected to the Mooncake store; cache enabled")
            return

    def close(self, wait_first: Sequence[Callable[[], object]] = ()) -> None:
        """Close the client. With `wait_first` (calls that block until a thread still inside
        a store call has returned), close it from a background thread once they return: so
        shutdown never waits on a frozen peer, and the client is never freed under a call."""
        self._stop.set()
        client, self.client = self.client, None
        if client is None:
            return
        if not wait_first:
            client.close()
            return

        def close_later() -> None:
            for wait in wait_first:
                wait()
            client.close()

        threading.Thread(target=close_later, name="mcpool-close", daemon=True).start()
