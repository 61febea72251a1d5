"""How a failed store load reaches vLLM, per model layout, and what it costs the request.

A store fault must cost at most a recompute. Two things in vLLM decide whether it does:

- The channel. vLLM takes block ids (`get_block_ids_with_load_errors`) only from models with
  one KV cache group: on a hybrid model (several groups, whose block ids overlap) its scheduler
  raises RuntimeError and EngineCore dies. There a failure must be reported per request, in
  `KVConnectorTransferResults.failed_recving` (vLLM then recomputes the whole prefix). Where
  block ids are allowed they are kept: they let vLLM keep the blocks before the first bad one.
- vLLM acts on `failed_recving` only for requests waiting for remote KVs (asynchronous loads),
  so an in-step load cannot be failed per request: multi-group models get no in-step loads.
- The policy. vLLM's `kv_load_failure_policy` defaults to `fail`, which fails the request. The
  connector's `on_load_failure` (default `recompute`) sets it on the config vLLM's Scheduler
  reads right after it creates its connector. Inside vLLM's MultiConnector a member gets a copy
  of the config, so the Scheduler's own one is found on the call stack.
"""

from __future__ import annotations

import sys
from typing import Any

from connector.store.groups import GroupSpec


def per_request(groups: tuple[GroupSpec, ...]) -> bool:
    """Failures go in failed_recving (not as block ids): the model has several KV cache groups."""
    return len(groups) > 1


def in_step_allowed(groups: tuple[GroupSpec, ...]) -> bool:
    """Whether loads may run inside a step: only where a failed one can be reported (block ids)."""
    return not per_request(groups)


def _scheduler_configs() -> list[Any]:
    """The kv-transfer configs of the vLLM Schedulers creating this connector (on the stack)."""
    try:
        from vllm.v1.core.sched.interface import SchedulerInterface
    except ImportError:  # an older tree: no scheduler to find
        return []
    found = []
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, SchedulerInterface):
            ktc = getattr(getattr(owner, "vllm_config", None), "kv_transfer_config", None)
            if ktc is not None and all(ktc is not f for f in found):
                found.append(ktc)
        frame = frame.f_back
    return found


def apply_policy(vllm_config: Any, on_load_failure: str) -> list[str]:
    """Set vLLM's kv_load_failure_policy to `on_load_failure` on this config and the
    Scheduler's; returns one log line per config it changed."""
    changed = []
    configs = [vllm_config.kv_transfer_config]
    configs += [c for c in _scheduler_configs() if c is not configs[0]]
    for ktc in configs:
        was = getattr(ktc, "kv_load_failure_policy", None)
        if was is not None and was != on_load_failure:
            ktc.kv_load_failure_policy = on_load_failure
            changed.append(f"kv_load_failure_policy {was} -> {on_load_failure} "
                           f"(kv_connector_extra_config.on_load_failure={on_load_failure})")
    return changed
