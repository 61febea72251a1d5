"""Which store KV events an engine publishes, from the connector's keys and vLLM's
`--kv-events-config` (observability.kv_events makes them): validated here, without importing
vLLM, so the preflight (connector.doctor) checks them without paying for vLLM's import, which
was most of its run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from connector.config import EXTRA, ConfigError, ConnectorConfig, StoreConfig

MASTER_HTTP_PORT = 9003  # Mooncake's default --metrics_port (its HTTP admin server)
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class EventSettings:
    """What the store's events say and how they are gathered (validated)."""

    medium: str
    locality: str | None
    sweep_s: float  # 0: no sweep
    # host:port of the master's HTTP admin port; ":port" with HA masters: the leader's, found
    # each round (`sweep_address`); "" without a sweep
    master_http: str
    queue: int
    max_live: int
    sweep_off: str = ""  # why the sweep is off though kv_events_sweep_s asked for one

    @property
    def sweep_target(self) -> str:
        """Where the sweep asks, as the logs say it."""
        if self.master_http.startswith(":"):
            return f"the HA leader's port {self.master_http[1:]}"
        return self.master_http

    def sweep_note(self, shards: int) -> str:
        """The sweep as the startup log states it: where, how often, and the most it can ask
        of the master (every shard of up to `max_live` blocks a round), which the master
        answers for every engine of the fleet."""
        if not self.sweep_s:
            return "no sweep: removals from lookups"
        keys = self.max_live * shards
        return (f"sweep of {self.sweep_target} every {self.sweep_s:g}s: at most {keys:,} store "
                f"keys a round ({self.max_live:,} live blocks x {shards} "
                f"shard{'s' if shards != 1 else ''}), "
                f"{keys / self.sweep_s:,.0f} a second, asked of the master")


def event_settings(config: ConnectorConfig, kv_events_config: Any) -> EventSettings | None:
    """The events this engine publishes (None: none), from the connector's keys and vLLM's
    `--kv-events-config`. A combination that cannot work is a ConfigError naming the field."""
    mode = config.kv_events
    vllm_on = bool(kv_events_config and kv_events_config.enable_kv_cache_events)
    publisher = getattr(kv_events_config, "publisher", None) if vllm_on else None
    if mode == "off" or (mode == "auto" and (not vllm_on or publisher == "null")):
        return None
    if not vllm_on:
        raise ConfigError(
            f"{EXTRA}.kv_events: 'on', but --kv-events-config does not enable vLLM's KV "
            "events; add --kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": "
            "\"zmq\", \"endpoint\": \"tcp://*:5557\"}' or set kv_events to auto or off")
    if publisher == "null":
        raise ConfigError(
            "--kv-events-config.publisher: 'null' discards every event, so kv_events: 'on' "
            "reaches no router; set \"publisher\": \"zmq\" or kv_events to auto or off")
    for name in ("endpoint", "replay_endpoint"):
        ep = getattr(kv_events_config, name, None)
        if publisher == "zmq" and ep is not None and not str(ep).startswith(_ENDPOINT_SCHEMES):
            raise ConfigError(
                f"--kv-events-config.{name}: {ep!r} is not a ZMQ endpoint; use "
                "tcp://*:5557 (or ipc://...)")
    sweep_s, http, off = config.kv_events_sweep_s, config.kv_events_master_http, ""
    # A sweep that cannot work is turned off, not the engine: removals then come from lookups
    # alone (an upgrade must not stop a deployment that served before the sweep existed).
    if sweep_s > 0 and config.store.tenant_id != "default":
        off = (f"{EXTRA}.kv_events_sweep_s: the master's HTTP key query sees only the default "
               f"tenant, not tenant_id {config.store.tenant_id!r}: no sweep, removals come "
               "from lookups only; set kv_events_sweep_s to 0 to say so")
    elif sweep_s > 0:
        http = http or f":{MASTER_HTTP_PORT}"
        if http.startswith(":") and not config.store.ha:  # the one master's host
            http = config.store.master_server_address.rsplit(":", 1)[0] + http
    if off:
        sweep_s = 0.0
    locality = None if config.kv_events_locality == "none" else config.kv_events_locality.upper()
    return EventSettings(config.kv_events_medium, locality, sweep_s, http if sweep_s else "",
                         config.kv_events_queue, config.kv_events_max_live, off)


def sweep_address(settings: EventSettings, store: StoreConfig, timeout: float
                  ) -> Callable[[], str]:
    """Where a sweep round asks (host:port): the configured address, or with HA masters
    (`:port`) the leader etcd names now, on that port. A standby answers the query with 503,
    and a failover moves the leader, so it is read each round: an OSError when etcd names
    none (the round fails, and is counted)."""
    if not settings.master_http.startswith(":"):
        return lambda: settings.master_http
    from connector.store.client import cluster_id, etcd_leader

    def leader() -> str:
        address, problem = etcd_leader(store, timeout)
        if not address:
            raise OSError(problem or f"no master leads cluster id {cluster_id(store)!r}")
        return address.rsplit(":", 1)[0] + settings.master_http

    return leader
