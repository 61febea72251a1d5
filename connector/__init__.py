"""Pooled-receiver Mooncake store KV connector for vLLM.

Load it with `"kv_connector": "PooledMooncakeStoreConnector", "kv_connector_module_path":
"connector"`. Grouped by side, in the order data flows: scheduler lookup (`scheduler/`) ->
step metadata (`metadata`) -> worker load/save (`worker/`, over the store client and keys of
`store/`) -> events, stats and exporters (`observability/`). Beside them: the class vLLM loads
(`connector`), its registration (`plugin`), the key catalogue (`config`), the preflight
(`doctor`) and the docs generator (`docsync`).

The connector class is imported on first use, so the catalogues (`observability.metric_catalog`,
`config`) import without vLLM: the dashboards, the Helm tests and the docs read them.
"""

from typing import Any

__all__ = ["PooledMooncakeStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "PooledMooncakeStoreConnector":
        from connector.connector import PooledMooncakeStoreConnector

        return PooledMooncakeStoreConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
