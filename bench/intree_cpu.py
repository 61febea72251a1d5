"""vLLM's in-tree `MooncakeStoreConnector`, loadable by a CPU engine for the serving benchmark.

The in-tree save path records a `torch.cuda.Event` per step (`worker.wait_for_save`), and on
the CPU wheel `torch.cuda.Event()` raises, so the unmodified connector cannot save there. This
module gives it a host event whose `record`/`synchronize` do nothing, which is exact on CPU:
the forward pass runs on the calling thread and has written the KV cache by the time
`wait_for_save` runs. Nothing else of the in-tree connector is changed; on a machine with CUDA
the real event stays.

    --kv-transfer-config '{"kv_connector": "CpuMooncakeStoreConnector",
                           "kv_connector_module_path": "bench.intree_cpu", ...}'
"""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)


class HostEvent:
    """Stands in for `torch.cuda.Event` where work is synchronous (CPU)."""

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


if not torch.cuda.is_available():
    # The CPU wheel has no CUDA: the in-tree save path records an event only to wait for the
    # forward pass, which on the CPU is already done; a host event keeps its code unchanged.
    torch.cuda.Event = HostEvent  # type: ignore[misc,assignment]


class CpuMooncakeStoreConnector(MooncakeStoreConnector):
    """The in-tree connector, unchanged; importing this module installs the host event."""
