"""Connector configuration: one validated, frozen object built once at startup.

Sources, highest priority first:
  1. ``kv_connector_extra_config`` keys (see ``EXTRA_KEYS``);
  2. the JSON file named by ``MOONCAKE_CONFIG_PATH`` (the same fields as vLLM's in-tree
     Mooncake store connector), for the Mooncake fields only;
  3. ``VLLM_MOONCAKE_LOAD_RECV_THREADS`` for the receive-pool size (default 1, as in vLLM).

Every problem raises ``ConfigError`` with a message that names the field and says how to fix it,
so a bad deployment fails at startup with one readable line instead of a hang or a bare trace.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

RECV_THREADS_ENV = "VLLM_MOONCAKE_LOAD_RECV_THREADS"
CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
MAX_RECV_THREADS = 64
DEFAULT_AUTO_MAX = 8
PROTOCOLS = ("tcp", "rdma")
ON_MASTER_UNREACHABLE = ("fail", "degrade")
STAGING_MODES = ("auto", "on", "off")
ETCD_SCHEME = "etcd://"
# The Mooncake client reads the HA cluster id from this variable (default "mooncake_cluster",
# as the masters' --cluster_id); the connector exports cluster_id there when it is unset.
CLUSTER_ID_ENV = "MC_STORE_CLUSTER_ID"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

# The Mooncake fields: accepted in extra_config and in the MOONCAKE_CONFIG_PATH file.
MOONCAKE_KEYS = (
    "metadata_server",
    "master_server_address",
    "protocol",
    "device_name",
    "local_hostname",
    "global_segment_size",
    "local_buffer_size",
    "cluster_id",
)
# Connector-only keys, accepted in extra_config.
CONNECTOR_KEYS = (
    "load_threads",
    "load_threads_max",
    "load_split_blocks",
    "staging",
    "staging_buffer_size",
    "cache_prefix",
    "model_id",
    "lookup_timeout_s",
    "lookup_wait_ms",
    "enable_save",
    "enable_load",
    "save_decode_tokens",
    "master_lookup_sample_ratio",
    "trace_sample_ratio",
    "on_master_unreachable",
    "store_timeout_s",
)
EXTRA_KEYS = MOONCAKE_KEYS + CONNECTOR_KEYS


class ConfigError(ValueError):
    """A connector setting is missing or invalid; the message names the field and the fix."""


def parse_size(value: Any, field_name: str) -> int:
    """Parse ``4GB``, ``512MiB``, ``1.5G`` or a plain byte count into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}: expected a size such as 4GB or 536870912, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field_name}: size must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            unit = (m.group(2) or "").upper().replace("I", "").replace("B", "") or ""
            return int(float(m.group(1)) * _SIZE_UNITS[unit])
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
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field_name}: expected a number in [{lo}, {hi}], got {value!r}")
    if not lo <= float(value) <= hi:
        raise ConfigError(f"{field_name}: must be in [{lo}, {hi}], got {value}")
    return float(value)


def _bool(value: Any, field_name: str) -> bool:
    if isinstance(value, bool):
        return value
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
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    # Bytes this process adds to the distributed pool. 0 = a pure client whose blocks live
    # on store nodes; then stored blocks outlive engine restarts.
    global_segment_size: int = 4 * 2**30
    local_buffer_size: int = 512 * 2**20
    # HA master group (master_server_address etcd://...): the masters' --cluster_id, or ""
    # for Mooncake's default. Exported as MC_STORE_CLUSTER_ID before the client is set up.
    cluster_id: str = ""

    @property
    def ha(self) -> bool:
        return self.master_server_address.startswith(ETCD_SCHEME)


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector needs, validated."""

    store: StoreConfig
    load_threads: int = 1  # receive threads in the pool (with auto: the maximum)
    load_threads_auto: bool = False  # adapt the active count online (connector/autotune.py)
    load_split_blocks: int = 0
    # Move blocks through a contiguous per-thread buffer (see connector/staging.py):
    # auto = for KV caches in host memory over TCP.
    staging: str = "auto"
    staging_buffer_size: int = 16 * 2**20
    cache_prefix: str = "mcpool"
    model_id: str = ""
    lookup_timeout_s: float = 2.0
    lookup_wait_ms: float = 5.0
    enable_save: bool = True
    enable_load: bool = True
    save_decode_tokens: bool = False
    master_lookup_sample_ratio: float = 0.1
    trace_sample_ratio: float | None = None
    on_master_unreachable: str = "fail"
    store_timeout_s: float = 5.0
    source: dict[str, str] = field(default_factory=dict, compare=False)


def _load_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"{CONFIG_PATH_ENV}: file {path!r} does not exist; point it at a Mooncake JSON "
            "config or set the fields in kv_connector_extra_config"
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
    unknown = sorted(set(data) - set(MOONCAKE_KEYS) - {"transfer_timeout", "replica_num"})
    if unknown:
        raise ConfigError(
            f"{CONFIG_PATH_ENV}: unknown field(s) {unknown} in {path!r}; "
            f"allowed: {list(MOONCAKE_KEYS)}"
        )
    return data


_HOST_PORT = re.compile(r"^[^:\s,;/]+:\d{1,5}$")


def etcd_endpoints(url: str, field_name: str) -> list[str]:
    """The host:port list of an ``etcd://h1:p1[,h2:p2]`` address (`;` separates too, as in
    the masters' --etcd_endpoints)."""
    eps = [e.strip() for e in re.split(r"[,;]", url[len(ETCD_SCHEME):])]
    if not eps or not all(_HOST_PORT.match(e) for e in eps):
        raise ConfigError(f"{field_name}: expected etcd://host:port[,host:port] (the etcd "
                          f"endpoints of the HA masters), got {url!r}")
    return eps


def _master_address(value: Any, field_name: str) -> str:
    master = _text(value, field_name)
    if master.startswith(ETCD_SCHEME):
        etcd_endpoints(master, field_name)
    elif not _HOST_PORT.match(master):
        raise ConfigError(f"{field_name}: expected host:port (one master) or "
                          f"etcd://host:port[,host:port] (an HA master group), got {master!r}")
    return master


def _cluster_id(value: Any, field_name: str, master: str, environ: Mapping[str, str]) -> str:
    """The HA cluster id; it must agree with MC_STORE_CLUSTER_ID, which the client reads."""
    env = environ.get(CLUSTER_ID_ENV, "")
    if value is None:
        return env if master.startswith(ETCD_SCHEME) else ""
    cid = _text(value, field_name)
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


def load_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> ConnectorConfig:
    """Build the connector config from vLLM's extra_config and the environment."""
    environ = os.environ if environ is None else environ
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {unknown}; allowed keys: "
            f"{list(EXTRA_KEYS)}"
        )
    source: dict[str, str] = {}
    merged: dict[str, Any] = {}
    path = environ.get(CONFIG_PATH_ENV)
    if path:
        for k, v in _load_config_file(path).items():
            merged[k], source[k] = v, CONFIG_PATH_ENV
    for k, v in extra.items():
        merged[k], source[k] = v, "kv_connector_extra_config"

    def where(k: str) -> str:
        return f"{source.get(k, 'kv_connector_extra_config')}.{k}"

    for required in ("master_server_address", "metadata_server"):
        if required not in merged:
            raise ConfigError(
                f"{required}: not set; add it to kv_connector_extra_config or to the JSON "
                f"file named by {CONFIG_PATH_ENV} (e.g. \"master_server_address\": "
                '"127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata")'
            )
    protocol = _text(merged.get("protocol", "tcp"), where("protocol")).lower()
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"{where('protocol')}: unknown protocol {merged['protocol']!r}; use one of {PROTOCOLS}"
        )
    master = _master_address(merged["master_server_address"], where("master_server_address"))
    metadata = _text(merged["metadata_server"], where("metadata_server"))
    if metadata.startswith(ETCD_SCHEME):
        etcd_endpoints(metadata, where("metadata_server"))
    store = StoreConfig(
        metadata_server=metadata,
        master_server_address=master,
        cluster_id=_cluster_id(merged.get("cluster_id"), where("cluster_id"), master, environ),
        protocol=protocol,
        device_name=_text(merged.get("device_name", ""), where("device_name"), allow_empty=True),
        local_hostname=_text(
            merged.get("local_hostname", environ.get("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")),
            where("local_hostname"),
        ),
        global_segment_size=parse_size(
            merged.get("global_segment_size", StoreConfig.global_segment_size),
            where("global_segment_size"),
        ),
        local_buffer_size=parse_size(
            merged.get("local_buffer_size", StoreConfig.local_buffer_size),
            where("local_buffer_size"),
        ),
    )
    if store.protocol == "rdma" and not store.device_name:
        raise ConfigError(
            f"{where('device_name')}: protocol rdma needs an RDMA device (e.g. \"mlx5_0\"); "
            "set device_name or use protocol tcp"
        )

    fix_threads = (f"set {RECV_THREADS_ENV} or extra_config load_threads to 1..{MAX_RECV_THREADS}"
                   " or auto")
    name, value = (("kv_connector_extra_config.load_threads", extra["load_threads"])
                   if "load_threads" in extra else (RECV_THREADS_ENV,
                                                    environ.get(RECV_THREADS_ENV, "1")))
    auto = isinstance(value, str) and value.strip().lower() == "auto"
    if auto:
        threads = _int_in_range(extra.get("load_threads_max", DEFAULT_AUTO_MAX),
                                "kv_connector_extra_config.load_threads_max", 1,
                                MAX_RECV_THREADS, "the most threads load_threads: auto may use")
    else:
        if "load_threads_max" in extra:
            raise ConfigError("kv_connector_extra_config.load_threads_max: only used with "
                              "load_threads: auto; remove it or set load_threads to auto")
        threads = _int_in_range(value, name, 1, MAX_RECV_THREADS, fix_threads)

    def opt(key: str, parse, *args):
        return parse(extra[key], f"kv_connector_extra_config.{key}", *args) if key in extra \
            else getattr(ConnectorConfig, key)

    on_unreachable = opt("on_master_unreachable", _text)
    if on_unreachable not in ON_MASTER_UNREACHABLE:
        raise ConfigError(
            f"kv_connector_extra_config.on_master_unreachable: {on_unreachable!r}; use "
            f"{ON_MASTER_UNREACHABLE[0]!r} (refuse to start) or {ON_MASTER_UNREACHABLE[1]!r} "
            "(serve without the cache and reconnect in the background)"
        )
    staging = opt("staging", _text).lower()
    if staging not in STAGING_MODES:
        raise ConfigError(
            f"kv_connector_extra_config.staging: {staging!r}; use 'auto' (staged copies for "
            "host-memory KV caches over tcp), 'on' or 'off' (multi-buffer transfers)"
        )
    trace_ratio = (
        _number(extra["trace_sample_ratio"], "kv_connector_extra_config.trace_sample_ratio", 0, 1)
        if "trace_sample_ratio" in extra else None
    )
    return ConnectorConfig(
        store=store,
        load_threads=threads,
        load_threads_auto=auto,
        load_split_blocks=opt("load_split_blocks", _int_in_range, 0, 1 << 20,
                              "0 keeps each request in one job"),
        staging=staging,
        staging_buffer_size=opt("staging_buffer_size", parse_size),
        cache_prefix=opt("cache_prefix", _text),
        model_id=opt("model_id", _text),
        lookup_timeout_s=opt("lookup_timeout_s", _number, 0.001, 600),
        lookup_wait_ms=opt("lookup_wait_ms", _number, 0, 10_000),
        enable_save=opt("enable_save", _bool),
        enable_load=opt("enable_load", _bool),
        save_decode_tokens=opt("save_decode_tokens", _bool),
        master_lookup_sample_ratio=opt("master_lookup_sample_ratio", _number, 0, 1),
        trace_sample_ratio=trace_ratio,
        on_master_unreachable=on_unreachable,
        store_timeout_s=opt("store_timeout_s", _number, 0.1, 600),
        source=source,
    )
