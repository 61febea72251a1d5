"""What changed in vLLM's connector API from 0.32 (the CPU build in .venv) to 0.33 (the image's
version, scripts/unit_033.sh), checked under both: the sleep-mode hook 0.33 is the first to ask;
the MTP tail (`extra_retained_tokens`) that 0.33's in-tree coordinator adds to a sliding window
(`_coverage_spec`), which `GroupSpec` applies for every version; the in-tree capacity-only
consumer (`_capacity_only`); and the lookahead block hashes 0.33 keeps off with a connector.
Where the versions differ, a test says which behaviour it checks for which version."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import vllm
from packaging.version import Version
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

from connector import PooledMooncakeStoreConnector
from connector.store.groups import SLIDING, GroupSpec, groups_from_kv_cache_config
from tests.unit.test_groups import BS, _Pool, first_absent_in

VLLM_033 = Version(vllm.__version__).release >= (0, 33)


# ---- sleep mode ---------------------------------------------------------------------------
def _ktc():
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="PooledMooncakeStoreConnector",
                            kv_connector_module_path="connector", kv_role="kv_both")


def _engine_config(model: str, sleep: bool, monkeypatch):
    """vLLM's own config validation of `vllm serve MODEL --kv-transfer-config ...
    [--enable-sleep-mode]`, on a platform that has sleep mode (CUDA/ROCm/XPU; the CPU platform
    refuses it before any connector is asked, so it is stood in for here)."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_sleep_mode_available", lambda self: True)
    return VllmConfig(model_config=ModelConfig(model=model, dtype="float32",
                                               enable_sleep_mode=sleep),
                      kv_transfer_config=_ktc())


def test_the_connector_declares_sleep_mode_unsupported():
    # Its KV caches are registered with the store once; sleep would free or remap them under
    # transfers still addressing them.
    assert PooledMooncakeStoreConnector.supports_sleep_mode(_ktc()) is False


def test_a_sleep_mode_engine_with_the_connector(tiny_model, monkeypatch):
    from vllm.config import ModelConfig

    # Where the tests run (vLLM's CPU platform, 0.32 or 0.33) sleep mode is refused first.
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        ModelConfig(model=tiny_model, dtype="float32", enable_sleep_mode=True)
    assert _engine_config(tiny_model, False, monkeypatch).kv_transfer_config is not None
    if VLLM_033:
        # 0.33 asks the connector at config time: the engine refuses to start, naming it.
        with pytest.raises(ValueError,
                           match="PooledMooncakeStoreConnector does not support sleep mode"):
            _engine_config(tiny_model, True, monkeypatch)
    else:
        # 0.32 never asks (it has no supports_sleep_mode): the config is accepted. Only its
        # CPU build is supported, whose platform refuses sleep mode on its own (above).
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

        assert not hasattr(KVConnectorBase_V1, "supports_sleep_mode")
        assert _engine_config(tiny_model, True, monkeypatch).model_config.enable_sleep_mode


# ---- the MTP tail below a sliding window (extra_retained_tokens) ---------------------------
def _spec(window: int, retained: int = 0) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                             sliding_window=window, extra_retained_tokens=retained)


def _coverage(window: int, retained: int) -> SlidingWindowSpec:
    """The spec an external hit must cover: 0.33's in-tree `_coverage_spec` itself; 0.32's
    in-tree coordinator has none (it ignores the tail), so there the window is widened as
    0.33 does it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import coordinator

    if VLLM_033:
        return coordinator._coverage_spec(_spec(window, retained))
    assert not hasattr(coordinator, "_coverage_spec")
    return dataclasses.replace(_spec(window, retained), sliding_window=window + retained,
                               extra_retained_tokens=0)


# Tails that reach below the window's first block (in whole blocks the tail changes a hit only
# where it crosses a block boundary; the checks below fail a case that would test nothing).
WINDOW_TAILS = [(64, 2), (64, 3), (100, 30), (33, 1), (33, 31), (128, 32), (1000, 40)]


@pytest.mark.parametrize("window, retained", WINDOW_TAILS)
def test_needed_blocks_include_the_mtp_tail_as_vllm_allocates_it(window, retained):
    g = GroupSpec(SLIDING, window, retained=retained)
    mgr = dataclasses.make_dataclass("Mgr", ["sliding_window", "extra_retained_tokens"])(
        window, retained)
    cov = _coverage(window, retained)
    cov_mgr = dataclasses.make_dataclass("Mgr", ["sliding_window", "extra_retained_tokens"])(
        cov.sliding_window, cov.extra_retained_tokens)
    widened = 0
    for n in range(0, 80):
        want = SlidingWindowManager.get_num_skipped_tokens(mgr, n * BS) // BS
        assert g.first_needed(n, BS) == want, n
        assert SlidingWindowManager.get_num_skipped_tokens(cov_mgr, n * BS) // BS == want, n
        widened += want < GroupSpec(SLIDING, window).first_needed(n, BS)
    assert widened, "the tail never reached below the window: the case tests nothing"


@pytest.mark.parametrize("window, retained", WINDOW_TAILS)
def test_sliding_hits_with_the_mtp_tail_match_the_in_tree_coverage(window, retained):
    rng = random.Random(window * 100 + retained)
    g = GroupSpec(SLIDING, window, retained=retained)
    cov = _coverage(window, retained)
    shorter = 0
    for _ in range(300):
        n, p = rng.randrange(1, 48), rng.choice([0.6, 0.9, 0.98])  # 0.98: long windows too
        present = {i for i in range(n) if rng.random() < p}
        _, want = SlidingWindowManager.find_longest_cache_hit(
            list(range(n)), n * BS, [0], _Pool(present), cov, False, BS)
        got = g.hit(first_absent_in(present), n, BS)
        assert got * BS == want, (n, sorted(present))
        shorter += got < GroupSpec(SLIDING, window).hit(first_absent_in(present), n, BS)
    assert shorter, "the tail never changed a hit: the case tests nothing"


@pytest.mark.parametrize("window, retained", WINDOW_TAILS)
def test_a_sliding_group_saves_the_mtp_tail_a_replay_hit_needs(window, retained):
    g = GroupSpec(SLIDING, window, retained=retained)
    for prompt in range(33, 900, 13):
        n = (prompt - 1) // BS
        saved = {i for i, k in zip(range(n + 1), g.save_mask(0, n + 1, prompt, BS, 0),
                                   strict=True) if k}
        cov = _coverage(window, retained)
        first = max(0, n * BS - cov.sliding_window + 1) // BS
        assert set(range(first, n)) <= saved, (prompt, sorted(saved))


def test_the_mtp_tail_is_read_from_vllms_kv_cache_config():
    cfg = KVCacheConfig(1, [], [KVCacheGroupSpec(["a"], _spec(64, 3))])
    assert groups_from_kv_cache_config(cfg, BS) == (GroupSpec(SLIDING, 64, ("a",), retained=3),)


# ---- capacity-only consumers -----------------------------------------------------------------
def _in_tree_capacity_only(file: str, cls: str):
    """The in-tree store connector's own `_capacity_only` rule (a consumer that contributes its
    segment and transfers no KV), as `cls.__init__` in `file` computes it: its assignments up to
    `self._capacity_only`, read from the installed vLLM's source and run on a stand-in config
    (statements that call anything but `.get`, or read what the stand-in lacks, are left out:
    clients, block sizes, KV events). None where the class has no such rule."""
    import ast
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    path = (Path(importlib.util.find_spec("vllm").origin).parent / "distributed" /
            "kv_transfer" / "kv_connector" / "v1" / "mooncake" / "store" / file)
    tree = ast.parse(path.read_text())
    init = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    names = [ast.unparse(s.targets[0]) if isinstance(s, ast.Assign) else None
             for s in init.body]
    if "self._capacity_only" not in names:
        return None
    stmts = [s for s in init.body[:names.index("self._capacity_only") + 1]
             if isinstance(s, ast.Assign) and all(
                 isinstance(c.func, ast.Attribute) and c.func.attr == "get"
                 for c in ast.walk(s.value) if isinstance(c, ast.Call))]
    codes = [compile(ast.Module([s], []), str(path), "exec") for s in stmts]

    def rule(kv_role: str, extra: dict) -> bool:
        ktc = SimpleNamespace(kv_role=kv_role, kv_connector_extra_config=extra)
        ns = {"vllm_config": SimpleNamespace(kv_transfer_config=ktc), "kv_role": kv_role,
              "self": SimpleNamespace()}
        for code in codes[:-1]:
            try:
                exec(code, ns)  # vLLM's own statements, from its installed source
            except (AttributeError, NameError):  # reads what the stand-in lacks: not the rule
                pass
        exec(codes[-1], ns)
        return ns["self"]._capacity_only

    return rule


def test_capacity_only_consumers_neither_load_nor_save_as_in_tree():
    from connector.config import load_config

    rules = {f: _in_tree_capacity_only(f, c) for f, c in [
        ("connector.py", "MooncakeStoreConnector"), ("scheduler.py", "MooncakeStoreScheduler"),
        ("worker.py", "MooncakeStoreWorker")]}
    assert rules["connector.py"] and rules["worker.py"], "the in-tree rule was not found"
    # 0.33 is the first whose scheduler mirrors the rule (it then builds no coordinator).
    assert (rules["scheduler.py"] is not None) == VLLM_033
    base = {"master_server_address": "127.0.0.1:50051", "metadata_server": "P2PHANDSHAKE"}
    seen = set()
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        for lookup in ({}, {"enable_lookup": True}, {"enable_lookup": False}):
            for decode in ({}, {"save_decode_cache": True}, {"save_decode_cache": False}):
                extra = {**lookup, **decode}
                want = {f: r(role, extra) for f, r in rules.items() if r}
                assert len(set(want.values())) == 1, (role, extra, want)  # mirrors agree
                cfg = load_config({**base, **extra}, {}, kv_role=role)
                ours = not cfg.enable_load and not cfg.enable_save
                assert ours == want["connector.py"], (role, extra, cfg)
                seen.add(ours)
    assert seen == {True, False}


# ---- lookahead block hashes (BlockStored.lookahead_token_ids) -------------------------------
def test_block_hashes_stay_the_legacy_ones_with_a_kv_connector():
    """The store keys are vLLM's block hashes, each over its block's tokens and its parent. 0.33
    can hash tokens beyond a block too (EAGLE block drop; `BlockStored.lookahead_token_ids`
    publishes them) but keeps the legacy hashes whenever a KV connector is configured; 0.32
    has no lookahead hashes."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import BlockStored

    if not VLLM_033:
        assert not hasattr(VllmConfig, "num_hash_lookahead_tokens")
        assert "lookahead_token_ids" not in BlockStored.__struct_fields__
        return
    assert BlockStored.__struct_defaults__[-1] is None
    assert BlockStored.__struct_fields__[-1] == "lookahead_token_ids"

    def lookahead(ktc) -> int:  # a target with an EAGLE drafter reading 3 tokens ahead
        spec = SimpleNamespace(use_eagle_block_drop=lambda: True,
                               disable_lookahead_block_hashes=False)
        cfg = SimpleNamespace(speculative_config=spec, kv_transfer_config=ktc,
                              cache_config=SimpleNamespace(enable_prefix_caching=True),
                              num_prefill_lookahead_tokens=3)
        return VllmConfig.num_hash_lookahead_tokens.fget(cfg)

    assert lookahead(None) == 3  # without a connector, this engine hashes lookahead tokens
    assert lookahead(_ktc()) == 0


def test_loads_wait_for_the_gpu_where_vllm_does_not_hold_freed_blocks_back():
    """vLLM defers the reuse of freed blocks while batches overlap for a KV consumer only; a
    producer's load could land in a block that the step still on the GPU writes, so its loads
    wait for the work queued before them (tests/store/test_deadlines.py checks the wait)."""
    import inspect
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.scheduler import Scheduler

    from connector.connector import loads_need_a_fence

    rule = inspect.getsource(Scheduler.__init__)
    assert "max_concurrent_batches > 1" in rule and "is_kv_consumer" in rule, \
        "vLLM's rule for deferred frees changed: check loads_need_a_fence"

    def cfg(role: str, batches: int) -> SimpleNamespace:
        return SimpleNamespace(max_concurrent_batches=batches, kv_transfer_config=KVTransferConfig(
            kv_connector="PooledMooncakeStoreConnector", kv_role=role))

    assert loads_need_a_fence(cfg("kv_producer", 2))
    assert not any(loads_need_a_fence(c) for c in (
        cfg("kv_both", 2), cfg("kv_consumer", 2), cfg("kv_producer", 1)))
