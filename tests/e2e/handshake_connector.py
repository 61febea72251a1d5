"""A test member for vLLM's MultiConnector: the in-tree ExampleConnector (runs on CPU) with the
handshake metadata that NixlConnector has (which needs a GPU). MultiConnector forwards only its
first member's handshake metadata to every member's scheduler side, so this member decides what
a connector placed after it receives. Loaded by module path:
`{"kv_connector": "HandshakeExampleConnector",
  "kv_connector_module_path": "tests.e2e.handshake_connector"}`."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


@dataclass
class ExampleHandshake(KVConnectorHandshakeMetadata):
    storage_path: str


class HandshakeExampleConnector(ExampleConnector):
    def get_handshake_metadata(self) -> ExampleHandshake:
        return ExampleHandshake(str(self._storage_path))
