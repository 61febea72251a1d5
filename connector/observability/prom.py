"""Prometheus export: turns stats payloads into the families of `metric_catalog`.

Runs in vLLM's API-server process, on stats already aggregated across TP ranks. The metric
classes are the ones vLLM injects (Ray swaps in wrappers), and every family has the `vllm:`
prefix so vLLM's collector cleanup covers it when the logger is rebuilt.

Exemplars: samples of traced jobs (the payload's "x") are observed with their trace and span ids
as exemplars, which prometheus_client serves when the scraper negotiates OpenMetrics. That is
vLLM's ASGI mount at `/metrics/` (the trailing slash): plain `/metrics` is answered by
prometheus-fastapi-instrumentator, which always writes the text format. Not with Ray's metric
wrappers (no exemplar argument) nor with several API servers (the multiprocess collector does
not carry exemplars).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from connector.config import DEFAULT_TENANT, ConfigError, ConnectorConfig, load_config
from connector.observability.metric_catalog import (
    EXEMPLAR_LABELS,
    FAMILIES,
    Family,
    known_series,
)
from connector.observability.stats import parse_key

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level


def _registered(name: str) -> Any:
    """The collector already registered under `name` (a second connector of this class)."""
    from prometheus_client import REGISTRY

    return REGISTRY._names_to_collectors.get(name)  # noqa: SLF001 - no public lookup exists


def _config(vllm_config: Any) -> ConnectorConfig | None:
    """The connector's config, for the labels it fills in (None when the config is odd: the
    worker and scheduler report a bad config themselves)."""
    try:
        return load_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
    except (AttributeError, ConfigError):
        return None


class PooledStorePromMetrics(KVConnectorPromMetrics):
    """Creates every family once, and the known series at 0; `observe` only looks up cached
    label children."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        from prometheus_client import Histogram

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = {f.key: self._create(f, list(labelnames)) for f in FAMILIES}
        self._children: dict[tuple[str, int], Any] = {}
        self._unknown: set[str] = set()
        cfg = _config(vllm_config)
        self._config_labels = {
            "cache_prefix": cfg.cache_prefix if cfg else ConnectorConfig.cache_prefix,
            "tenant": cfg.store.tenant_id if cfg else DEFAULT_TENANT,
            "medium": cfg.kv_events_medium if cfg else ConnectorConfig.kv_events_medium,
            "locality": cfg.kv_events_locality if cfg else ConnectorConfig.kv_events_locality}
        self._exemplars = isinstance(self._histogram_cls, type) and \
            issubclass(self._histogram_cls, Histogram)  # Ray's wrappers take no exemplar
        tp_size = getattr(getattr(vllm_config, "parallel_config", None),
                          "tensor_parallel_size", 1)
        for engine_idx in self.per_engine_labelvalues:
            for key in known_series(tp_size, tiers=bool(cfg and cfg.tier_metrics)):
                self._child(key, engine_idx)

    def _create(self, fam: Family, base_labels: list[str]) -> Any:
        labels = base_labels + list(fam.labels)
        kwargs: dict[str, Any] = {"name": fam.name, "documentation": fam.help,
                                  "labelnames": labels}
        if fam.kind == "histogram":
            cls = self._histogram_cls
            kwargs["buckets"] = list(fam.buckets)
        elif fam.kind == "counter":
            cls = self._counter_cls
        else:
            cls = self._gauge_cls
            kwargs["multiprocess_mode"] = "mostrecent"
        try:
            return cls(**kwargs)
        except ValueError:
            # Two connectors of this class in one MultiConnector share the families instead of
            # failing with "Duplicated timeseries".
            existing = _registered(fam.name) or _registered(fam.name + "_total")
            if existing is None:
                raise
            return existing

    def _child(self, key: str, engine_idx: int) -> Any:
        child = self._children.get((key, engine_idx))
        if child is None:
            parsed = parse_key(key)
            if parsed is None:  # a worker of another connector version: say so, once
                if key not in self._unknown:
                    self._unknown.add(key)
                    logger.warning("ignoring stats key %r: not in this connector's metric "
                                   "catalogue (mixed versions?)", key)
                return None
            fam, values = parsed
            base = self.per_engine_labelvalues[engine_idx]
            child = self._metrics[fam.key].labels(
                *base, *(self._config_labels.get(label) or values[label]
                         for label in fam.labels))
            self._children[(key, engine_idx)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.get("c", {}).items():
            child = self._child(key, engine_idx)
            if child is not None and value:
                child.inc(value)
        for key, values in transfer_stats_data.get("h", {}).items():
            child = self._child(key, engine_idx)
            if child is not None:
                for v in values:
                    child.observe(v)
        for key, exemplars in transfer_stats_data.get("x", {}).items():
            child = self._child(key, engine_idx)
            if child is not None:
                for v, trace_id, span_id in exemplars:
                    if self._exemplars:
                        child.observe(v, dict(zip(EXEMPLAR_LABELS, (trace_id, span_id),
                                                  strict=True)))
                    else:
                        child.observe(v)
        for key, value in transfer_stats_data.get("g", {}).items():
            child = self._child(key, engine_idx)
            if child is not None:
                child.set(value)
