"""Pooled-receiver Mooncake store KV connector for vLLM.

Load it with `"kv_connector": "PooledMooncakeStoreConnector", "kv_connector_module_path":
"connector"`. Data flow: scheduler lookup (`scheduler`) -> step metadata (`metadata`) ->
worker load/save (`worker`, `recv_pool`) -> events (`events`) -> stats (`stats`) ->
exporters (`prom`, `tracing`).
"""

from connector.connector import PooledMooncakeStoreConnector

__all__ = ["PooledMooncakeStoreConnector"]
