"""Whether any rank of the TP group saw something in this step, agreed by every rank.

Each TP rank loads its own shards of a step's in-step loads. A load that fails on one rank
leaves that rank's KV heads of those blocks unfilled, and the step's forward mixes its
attention output into every rank's hidden states (TP all-reduces it): every rank's KV computed
in that step is suspect, not only the failing rank's. So the save guard must taint the step's
requests on every rank, and the ranks agree first: a MAX all-reduce of one flag over vLLM's
TP group (its gloo CPU group), once per step with in-step loads. Every rank gets the same step
metadata, so every rank makes the call for the same steps; the worker makes it whatever its
own loads did.
"""

from __future__ import annotations

from collections.abc import Callable

AnyRank = Callable[[bool], bool]  # this rank's flag -> whether any rank's flag is set


def lone_rank(flag: bool) -> bool:
    """TP=1: this rank is the group."""
    return flag


def tp_any_rank() -> AnyRank:
    """The OR of a flag over vLLM's TP group (`lone_rank` at TP=1)."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return lone_rank
    import torch
    import torch.distributed as dist

    cpu_group = group.cpu_group

    def any_rank(flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group)
        return bool(t.item())

    return any_rank
