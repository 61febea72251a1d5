"""A lookup's store calls: the longest prefix of a prompt that every KV cache group can
restore, in few master round trips.

Blocks are asked in windows of batch existence checks. A full-attention group's are probed
from the left: a first window of `FIRST_WINDOW` blocks (one round trip covers most prompts),
which also asks for the prompt's last block. If that is stored, the whole prefix most likely
is (a hit of a long prompt, which windows alone take five round trips for at 8,192 blocks),
and the rest is asked in one call; a hole in it still ends the hit, and the blocks past the
hole were asked for nothing (the master leases each it finds, as it does every block a lookup
asks). If the last block is not stored (a stored prefix and a new suffix, or a miss), later
windows grow fourfold, so a partial hit asks little past its end. A sliding-window group is
probed from the right in growing windows: only the window before the hit is needed
(`connector.store.groups`). A block is there only if every store shard of it is.

What is known of each block lives in one byte per block and group, so that the scans over a
128K-token prompt's 8,192 blocks run in C (`bytearray.find`). Past its deadline a probe makes
no further store call (`Late`); what it already asked still proves a prefix (`proven`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from connector.store.groups import FULL, GroupSpec, window_hit

# Blocks probed by the first batch_is_exist: one master round trip covers a prefix of up to
# 2048 tokens at 32 per block.
FIRST_WINDOW = 64

# What a probe knows of each block, and batch_is_exist's answers (0: absent, 1: there) as
# those states.
UNKNOWN, THERE, GONE = 0, 1, 2
_STATES = bytes([GONE, THERE] + [GONE] * 254)


class Late(Exception):
    """The probe reached its deadline before its next store call."""


class Deadline(Protocol):
    at: float  # perf_counter after which no store call starts


def _first_not_there(known: bytearray, lo: int, hi: int) -> int:
    """First block of [lo, hi) not known to be stored (unknown or gone); `hi` if none."""
    end = known.find(UNKNOWN, lo, hi)
    end = hi if end < 0 else end
    gone = known.find(GONE, lo, end)
    return end if gone < 0 else gone


class PrefixProbe:
    """One lookup's probing of `hashes` (a prompt's full blocks) in every group.

    `keys(hashes, group)` gives every shard's key of each block, block-major; `exist(keys)`
    is the store's batch existence check, 1 or 0 per key (it raises on a store error)."""

    def __init__(self, hashes: Sequence[bytes], groups: Sequence[GroupSpec], shards: int,
                 block_size: int, keys: Callable[[Sequence[bytes], int], list[str]],
                 exist: Callable[[list[str]], list[int]]) -> None:
        self._hashes, self._groups, self._shards = tuple(hashes), groups, shards
        self._block_size, self._keys, self._exist = block_size, keys, exist
        self._known = [bytearray(len(hashes)) for _ in groups]
        self._spans = [FIRST_WINDOW] * len(groups)
        self.keys_asked = 0

    def run(self, deadline: Deadline) -> int:
        """The hit, in blocks: the longest prefix every group can restore."""

        def first_absent(g: int, lo: int, hi: int) -> int:
            known = self._known[g]
            while (i := _first_not_there(known, lo, hi)) < hi and not known[i]:
                self._probe(g, i, deadline)
                lo = i
            return i

        return window_hit(self._groups, first_absent, len(self._hashes), self._block_size)

    def proven(self) -> int:
        """The hit that what was asked so far proves (after `Late`)."""
        return window_hit(self._groups,
                          lambda g, lo, hi: _first_not_there(self._known[g], lo, hi),
                          len(self._hashes), self._block_size)

    def gone(self) -> Iterator[tuple[int, bytes]]:
        """(group, hash) of each block a store call found absent."""
        for g, known in enumerate(self._known):
            i = known.find(GONE)
            while i >= 0:
                yield g, self._hashes[i]
                i = known.find(GONE, i + 1)

    def _probe(self, g: int, i: int, deadline: Deadline) -> None:
        """One store call: the window of group `g` that holds block `i`."""
        if time.perf_counter() >= deadline.at:
            raise Late
        known, hashes, spans = self._known[g], self._hashes, self._spans
        last, tail = len(hashes) - 1, ()
        if self._groups[g].kind != FULL:
            lo, hi = max(0, i + 1 - spans[g]), i + 1
        elif known[last] == THERE:  # the prompt's last block is stored: the rest at once
            lo, hi = i, last
        else:
            lo, hi = i, min(last + 1, i + spans[g])
            tail = (hashes[last],) if hi <= last and not known[last] else ()
        spans[g] *= 4
        keys = self._keys(hashes[lo:hi] + tail, g)
        self.keys_asked += len(keys)
        res = self._exist(keys)
        # A block is there if every shard is (1; 0: absent). A short answer raises: a miss,
        # never a hit of blocks nobody asked about.
        n = self._shards
        there = bytes(res) if n == 1 else bytes(map(min, zip(*[iter(res)] * n, strict=True)))
        if len(there) != hi - lo + len(tail):
            raise ValueError(f"batch_is_exist answered {len(res)} of {len(keys)} keys")
        states = there.translate(_STATES)
        known[lo:hi] = states[:hi - lo]
        if tail:
            known[last] = states[-1]
