"""Prometheus export: turns stats payloads into the families of `metric_catalog`.

Runs in vLLM's API-server process, on stats already aggregated across TP ranks. The metric
classes are the ones vLLM injects (Ray swaps in wrappers), and every family has the `vllm:`
prefix so vLLM's collector cleanup covers it when the logger is rebuilt.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from connector.metric_catalog import BY_KEY, FAMILIES, LATENCY_BUCKETS, Family

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level


def _registered(name: str) -> Any:
    """The collector already registered under `name` (a second connector of this class)."""
    from prometheus_client import REGISTRY

    return REGISTRY._names_to_collectors.get(name)  # noqa: SLF001 - no public lookup exists


class PooledStorePromMetrics(KVConnectorPromMetrics):
    """Creates every family once; `observe` only looks up cached label children."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = {f.key: self._create(f, list(labelnames)) for f in FAMILIES}
        self._children: dict[tuple[str, int], Any] = {}

    def _create(self, fam: Family, base_labels: list[str]) -> Any:
        labels = base_labels + list(fam.labels)
        kwargs: dict[str, Any] = {"name": fam.name, "documentation": fam.help,
                                  "labelnames": labels}
        if fam.kind == "histogram":
            cls = self._histogram_cls
            kwargs["buckets"] = list(LATENCY_BUCKETS)
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
            fam_key, *values = key.split("|")
            fam = BY_KEY.get(fam_key)
            if fam is None or len(values) != len(fam.labels):
                logger.debug("ignoring unknown stats key %r", key)
                return None
            base = self.per_engine_labelvalues[engine_idx]
            child = self._metrics[fam_key].labels(*base, *values)
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
        for key, value in transfer_stats_data.get("g", {}).items():
            child = self._child(key, engine_idx)
            if child is not None:
                child.set(value)
