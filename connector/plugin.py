"""vLLM plugin: registers `PooledMooncakeStoreConnector` by name in every vLLM process.

vLLM runs the `vllm.general_plugins` entry points (pyproject.toml) in the API server (while
parsing arguments), the engine core and every worker, so an installed connector needs no
`kv_connector_module_path`, and vLLM's `MultiConnector`, which looks its members up by class
name in the API server (`build_kv_connector_stats`), finds it. Registration is lazy: the
connector module is imported only where vLLM uses it.
"""

from __future__ import annotations

NAME = "PooledMooncakeStoreConnector"
MODULE = "connector.connector"


def register() -> None:
    """Register the connector with vLLM's connector factory (once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except ValueError:  # already registered in this process (plugin and module path both)
        pass
