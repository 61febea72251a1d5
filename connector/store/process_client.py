"""One Mooncake client per process for an engine's scheduler and worker.

Where vLLM runs the worker inside the engine-core process (its "uni" executor: world size 1
without data parallelism, the commonest deployment; and external_launcher), the scheduler's
lookups and the worker's loads and saves each opened a client. Mooncake keeps one watch of an
HA group's master view per process (0.3.13, `EtcdLeaderCoordinator::WaitForViewChange`: "only a
SINGLE waiter per process per prefix is supported"): the second client's watch cancelled the
first's. After a leader failover the first client, the worker's, stayed on the dead leader
until Mooncake's next re-read of etcd (every 30 s), and every load failed with -900 meanwhile.

So the scheduler uses the worker's handle when one is open in its process for the same store:
one client, one leader watch, one breaker and one probe for the engine. vLLM makes the worker
first (with the KV caches) and the scheduler after it. Workers each open their own (the TP
ranks of a test in one process register their own buffers), and a scheduler with no worker
beside it (vLLM's "mp" and "ray" executors) opens its own as before.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from connector.config import StoreConfig
from connector.store.client import StoreHandle

logger = logging.getLogger("vllm.connector.store.process_client")
_lock = threading.Lock()
# The newest worker handle per store config; weak, so that it never keeps a shut-down worker
# (and its KV caches) alive in a process that goes on, such as one that runs engines in turn.
_workers: weakref.WeakValueDictionary[StoreConfig, StoreHandle] = weakref.WeakValueDictionary()


def worker_store(key: StoreConfig, cfg: StoreConfig, *args: Any, **kwargs: Any) -> StoreHandle:
    """A worker's own handle (`StoreHandle(cfg, *args, **kwargs)`), offered to a scheduler of
    this process whose store config is `key` (the worker may open with an adjusted `cfg`)."""
    handle = StoreHandle(cfg, *args, **kwargs)
    with _lock:
        _workers[key] = handle
    return handle


def scheduler_store(cfg: StoreConfig, *args: Any, **kwargs: Any) -> StoreHandle:
    """The open worker handle of this process for `cfg`, shared (close it as usual, once: the
    client closes at its last user's close), else a handle of the scheduler's own."""
    with _lock:
        held = _workers.get(cfg)
        shared = held is not None and held.share()
    if shared:
        logger.info("scheduler: using the worker's Mooncake client of this process")
        return held
    return StoreHandle(cfg, *args, **kwargs)
