"""KV cache groups as the store sees them: which layers, what kind, and which blocks a prefix
hit needs from each.

vLLM's hybrid KV cache manager gives a model with sliding-window layers beside full attention
one group per kind, each with its own block table (`kv_cache_config.kv_cache_groups`). A
full-attention group (MLA included) needs every block of a prefix; a sliding-window group of
window W needs only the blocks the next token still attends to, the same ones vLLM allocates
for a hit (`SlidingWindowManager.get_num_skipped_tokens`), and vLLM frees the rest as the
request moves on. So a sliding-window group stores just the window before the prompt's replay
boundary (and one per `prefix_cache_retention_interval`, as vLLM's own prefix cache keeps them),
loads just the window before the hit, and a prefix is a hit only where every group has what it
needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

FULL = "full"
SLIDING = "sliding_window"


class GroupError(ValueError):
    """A KV cache group this connector cannot store (not attention KV)."""


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: its kind, window (sliding only), layers in order, and whether its
    KV is an MLA latent (one copy per token, the same on every TP rank)."""

    kind: str = FULL
    window: int = 0
    layers: tuple[str, ...] = ()  # (): every registered layer, in registration order
    latent: bool = False
    retained: int = 0  # sliding only: tokens vLLM keeps below the window (MTP re-prefill)

    def first_needed(self, n_blocks: int, block_size: int) -> int:
        """First block a hit of `n_blocks` blocks needs (vLLM's skipped tokens, in blocks)."""
        if self.kind == FULL:
            return 0
        return max(0, n_blocks * block_size - self.window + 1 - self.retained) // block_size

    def hit(self, first_absent: Callable[[int, int], int], n_max: int, block_size: int) -> int:
        """Longest hit of at most `n_max` blocks this group can restore, given the first
        block of a range that is not stored (`first_absent(lo, hi)`, `hi` if all are): full
        attention asks once for the whole prefix, so a lookup can answer window by window.
        Sliding window: the longest n whose needed blocks are all present, searched from the
        right block by block, as vLLM's SlidingWindowManager does."""
        if self.kind == FULL:
            return first_absent(0, n_max)
        run = 0
        for i in range(n_max - 1, -1, -1):
            if first_absent(i, i + 1) == i:
                run = 0
                continue
            run += 1
            if i <= self.first_needed(i + run, block_size):
                return i + run  # blocks [i, i + run) are all a hit of i + run blocks needs
        return 0

    def save_mask(self, first: int, end: int, num_prompt_tokens: int, block_size: int,
                  retention: int | None) -> list[bool]:
        """Which of blocks [first, end) to store. Full attention: all. Sliding window: the
        window before the replay boundary (num_prompt_tokens - 1, in whole blocks), and
        before every `retention`-token boundary (0: none; None: every block)."""
        if self.kind == FULL or retention is None:
            return [True] * (end - first)
        ends = {(num_prompt_tokens - 1) // block_size}
        if retention:
            step = retention // block_size
            ends |= set(range(step, end + 1, step))
        keep = set()
        for n in ends:
            keep.update(range(self.first_needed(n, block_size), n))
        return [i in keep for i in range(first, end)]


ONE_FULL = (GroupSpec(),)  # a model without KV cache groups (tests, benchmarks)


def groups_from_kv_cache_config(kv_cache_config: Any, block_size: int
                                ) -> tuple[GroupSpec, ...]:
    """The groups of vLLM's KVCacheConfig (one full group when there is none, as in tests)."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return ONE_FULL
    # Block i is keyed by request.block_hashes[i], which names tokens [0, (i+1)*block_size)
    # only if vLLM hashes per block. A hybrid model's --prefix-match-unit hashes finer: hash i
    # then names a shorter prefix, and prompts that differ later in block i share its key.
    hash_bs = getattr(kv_cache_config, "hash_block_size", None)
    if hash_bs not in (None, block_size):
        raise GroupError(
            f"vLLM hashes prompts every {hash_bs} tokens (prefix_match_unit), not per "
            f"{block_size}-token block; this connector keys each block by its block hash. "
            "Unset --prefix-match-unit, or serve this model without the connector")
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            # vLLM groups the subclasses of one base spec as "uniform": full attention beside
            # MLA, sink or R-SWA layers (which evict blocks) would pass as plain full attention
            # if only the first layer's spec were read.
            kinds = sorted({type(s).__name__ for s in spec.kv_cache_specs.values()})
            if len(kinds) > 1:
                raise GroupError(
                    f"KV cache group {i} mixes {', '.join(kinds)} layers (layers "
                    f"{list(g.layer_names)[:3]}...); this connector stores a group of one kind. "
                    "Serve this model without the connector, or report the model")
            spec = next(iter(spec.kv_cache_specs.values()))
        if getattr(spec, "block_size", block_size) != block_size:
            raise GroupError(
                f"KV cache group {i} has blocks of {spec.block_size} tokens, not the engine's "
                f"{block_size}; this connector keys every group by the engine's block hashes. "
                "Serve this model without the connector, or report the model")
        # A sliding-window layer in a FullAttentionSpec (hybrid manager off) keeps every
        # block, so it is stored as full attention.
        if type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
            out.append(GroupSpec(SLIDING, spec.sliding_window, tuple(g.layer_names),
                                 latent=isinstance(spec, SlidingWindowMLASpec),
                                 retained=spec.extra_retained_tokens))
        elif isinstance(spec, FullAttentionSpec) and type(spec) in (FullAttentionSpec,
                                                                    MLAAttentionSpec):
            out.append(GroupSpec(FULL, 0, tuple(g.layer_names),
                                 latent=isinstance(spec, MLAAttentionSpec)))
        else:
            raise GroupError(
                f"KV cache group {i} ({type(spec).__name__}, layers {list(g.layer_names)[:3]}"
                "...) is not full or sliding-window attention; this connector stores only "
                "those. Serve this model without the connector, or report the model")
    if len({g.latent for g in out}) > 1:
        raise GroupError("this model mixes MLA and other attention KV caches; this connector "
                         "stores one kind per model. Serve it without the connector")
    return tuple(out)


def window_hit(groups: Sequence[GroupSpec], first_absent: Callable[[int, int, int], int],
               n_max: int, block_size: int) -> int:
    """Longest prefix, in blocks, that every group can restore (`first_absent(group, lo,
    hi)`, as `GroupSpec.hit` takes it): each group's hit bounds the others', until no group
    lowers it (vLLM's hybrid rule)."""
    n = n_max
    while True:
        lowest = min(g.hit(partial(first_absent, gi), n, block_size)
                     for gi, g in enumerate(groups))
        if lowest >= n:
            return n
        n = lowest
