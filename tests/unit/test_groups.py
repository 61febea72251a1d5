"""KV cache groups on their own: a sliding-window group's hits and needed blocks follow vLLM's
own SlidingWindowManager exactly; what it saves always covers what a hit at the prompt's replay
boundary needs; the groups vLLM builds are read, and the ones the store cannot hold refused."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from connector.store.groups import FULL, SLIDING, GroupError, GroupSpec, groups_from_kv_cache_config

BS = 32


def first_absent_in(present: set[int]) -> Callable[[int, int], int]:
    """`GroupSpec.hit`'s question, answered from a set of stored blocks."""
    return lambda lo, hi: next((i for i in range(lo, hi) if i not in present), hi)



def _spec(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                             sliding_window=window)


class _Pool:
    """The block pool interface vLLM's hit search reads: which hashes are cached."""

    def __init__(self, present: set[int]) -> None:
        self.present, self.hash_block_size = present, BS
        self.null_block = KVCacheBlock(0)

    def get_cached_block(self, block_hash, group_ids):
        return [KVCacheBlock(1)] * len(group_ids) if block_hash in self.present else None


@pytest.mark.parametrize("window", [33, 64, 100, 128, 1000])
def test_sliding_hits_match_vllms_own_rule(window):
    rng = random.Random(window)
    g = GroupSpec(SLIDING, window)
    for _ in range(300):
        n = rng.randrange(1, 40)
        present = {i for i in range(n) if rng.random() < 0.7}
        _, want = SlidingWindowManager.find_longest_cache_hit(
            list(range(n)), n * BS, [0], _Pool(present), _spec(window), False, BS)
        assert g.hit(first_absent_in(present), n, BS) * BS == want, (n, sorted(present))


@pytest.mark.parametrize("window", [33, 64, 128, 1000])
def test_needed_blocks_are_the_ones_vllm_allocates(window):
    g = GroupSpec(SLIDING, window)
    mgr = SimpleNamespace(sliding_window=window, extra_retained_tokens=0)
    for n in range(0, 60):
        skipped = SlidingWindowManager.get_num_skipped_tokens(mgr, n * BS)
        assert g.first_needed(n, BS) == skipped // BS


@pytest.mark.parametrize("retention", [0, 128, None])
def test_a_sliding_group_saves_what_a_replay_hit_needs(retention):
    g, full = GroupSpec(SLIDING, 64), GroupSpec(FULL)
    for prompt in range(33, 700, 17):
        n = (prompt - 1) // BS
        saved = {i for i, k in zip(range(n + 1), g.save_mask(0, n + 1, prompt, BS, retention),
                                   strict=True) if k}
        assert set(range(g.first_needed(n, BS), n)) <= saved
        assert full.save_mask(0, n, prompt, BS, retention) == [True] * n
        if retention is None:
            assert saved == set(range(n + 1))
        elif retention == 0:
            assert len(saved) <= 2  # the 64-token window: two blocks


def _config(*groups) -> KVCacheConfig:
    return KVCacheConfig(1, [], [KVCacheGroupSpec(list(names), spec) for names, spec in groups])


def test_groups_from_vllms_kv_cache_config():
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    got = groups_from_kv_cache_config(_config((["a"], _spec(64)), (["b", "c"], full)), BS)
    assert got == (GroupSpec(SLIDING, 64, ("a",)), GroupSpec(FULL, 0, ("b", "c")))
    assert groups_from_kv_cache_config(_config((["m"], mla)), BS) == (
        GroupSpec(FULL, 0, ("m",), latent=True),)
    assert groups_from_kv_cache_config(None, BS) == (GroupSpec(),)
    same = UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={"d": full, "e": full})
    assert groups_from_kv_cache_config(_config((["d", "e"], same)), BS) == (
        GroupSpec(FULL, 0, ("d", "e")),)


FULL_SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


def _uniform(other) -> list:
    """One group vLLM calls uniform (every layer a FullAttentionSpec, subclasses included):
    a full attention layer, then `other`."""
    return [(["a", "b"], UniformTypeKVCacheSpecs(block_size=BS, kv_cache_specs={
        "a": FULL_SPEC, "b": other}))]


@pytest.mark.parametrize("groups, why", [
    ([(["s"], MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float32,)))],
     "not full or sliding-window"),
    ([(["a"], FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32,
                                dtype=torch.bfloat16))], "blocks of 64 tokens"),
    ([(["a"], FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32,
                                dtype=torch.bfloat16)),
      (["m"], MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576,
                               dtype=torch.bfloat16))], "mixes MLA"),
    (_uniform(RSWASpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                       rswa_window=64)), "group 0 mixes FullAttentionSpec, RSWASpec"),
    (_uniform(SinkFullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32,
                                    dtype=torch.bfloat16, sink_len=4)), "mixes FullAttention"),
    (_uniform(MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=576,
                               dtype=torch.bfloat16)), "mixes FullAttentionSpec, MLA"),
])
def test_groups_the_store_cannot_hold_are_refused(groups, why):
    with pytest.raises(GroupError, match=why):
        groups_from_kv_cache_config(_config(*groups), BS)


def test_hashes_finer_than_a_block_are_refused():
    """A hybrid model served with --prefix-match-unit 16 at 32-token blocks: vLLM hashes every
    16 tokens (resolve_kv_cache_block_sizes), so block_hashes[0] names tokens [0, 16) only, and
    two prompts that differ in tokens 16-31 share block 0's store key: one would load the
    other's KV. Before, the connector took those hashes as one per block."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.request import Request

    config = _config((["a"], _spec(64)), (["b"], FULL_SPEC))
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=True, prefix_match_unit=16),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        kv_transfer_config=object())
    assert resolve_kv_cache_block_sizes(config, vllm_config) == (BS, 16)
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    hasher = get_request_block_hasher(16, fn)
    one, other = (Request(r, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
                  for r, tokens in (("1", list(range(65))), ("2", [*range(16), *[9] * 49])))
    assert one.block_hashes[0] == other.block_hashes[0]  # block 0's key, were it taken as is
    config.hash_block_size = 16  # as EngineCore sets it on the connector's config
    with pytest.raises(GroupError, match="every 16 tokens"):
        groups_from_kv_cache_config(config, BS)
    config.hash_block_size = BS
    assert [g.kind for g in groups_from_kv_cache_config(config, BS)] == [SLIDING, FULL]
