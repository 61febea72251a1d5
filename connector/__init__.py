"""Pooled-receiver Mooncake store KV connector for vLLM.

Load it with `"kv_connector": "PooledMooncakeStoreConnector", "kv_connector_module_path":
"connector"`. Data flow: scheduler lookup (`scheduler`) -> step metadata (`metadata`) ->
worker load/save (`worker`, `ledger`, `recv_pool`) -> events (`events`) -> stats (`stats`) ->
exporters (`prom`, `tracing`).

The connector class is imported on first use, so the catalogues (`metric_catalog`,
`config`) import without vLLM: the dashboards, the Helm tests and the docs read them.
"""

from typing import Any

__all__ = ["PooledMooncakeStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "PooledMooncakeStoreConnector":
        from connector.connector import PooledMooncakeStoreConnector

        return PooledMooncakeStoreConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
