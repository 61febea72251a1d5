"""How failed loads reach vLLM per layout, and the failure policy the connector sets on the
config vLLM's Scheduler reads (also from inside MultiConnector, which hands its members a copy)."""

from __future__ import annotations

import copy

from vllm.config import KVTransferConfig
from vllm.v1.core.sched.interface import SchedulerInterface

from connector.scheduler.load_failures import apply_policy, in_step_allowed, per_request
from connector.store.groups import ONE_FULL, SLIDING, GroupSpec

HYBRID = (GroupSpec(), GroupSpec(kind=SLIDING, window=64))


class _Config:
    def __init__(self) -> None:
        self.kv_transfer_config = KVTransferConfig(kv_connector="X", kv_role="kv_both")


class _Scheduler:
    """Stands in for vLLM's Scheduler: it creates its connector in __init__ and reads the
    policy from its own config afterwards."""

    def __init__(self, member_gets_a_copy: bool, wanted: str) -> None:
        self.vllm_config = _Config()
        given = self.vllm_config
        if member_gets_a_copy:  # as MultiConnector does for each member
            given = copy.copy(self.vllm_config)
            given.kv_transfer_config = KVTransferConfig(kv_connector="X", kv_role="kv_both")
        self.lines = apply_policy(given, wanted)
        self.policy = self.vllm_config.kv_transfer_config.kv_load_failure_policy


SchedulerInterface.register(_Scheduler)


def test_failures_go_per_request_and_in_step_loads_stop_on_several_groups():
    assert not per_request(ONE_FULL) and in_step_allowed(ONE_FULL)
    assert per_request(HYBRID) and not in_step_allowed(HYBRID)


def test_vllm_default_policy_becomes_recompute_on_the_schedulers_config():
    assert KVTransferConfig(kv_connector="X", kv_role="kv_both").kv_load_failure_policy \
        == "fail"  # vLLM's default
    for copied in (False, True):
        s = _Scheduler(copied, "recompute")
        assert s.policy == "recompute", copied
        assert s.lines and "on_load_failure=recompute" in s.lines[0]


def test_an_operator_who_wants_fail_says_so():
    s = _Scheduler(True, "fail")
    assert s.policy == "fail" and s.lines == []
