"""Key namespaces: two models or layouts never share a key; every TP rank has its own."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from connector.keys import KeyBuilder, Layout

BASE = Layout("org/llama-8b", "bfloat16", 32, 8, 128, 32, 2)
H = [hashlib.sha256(bytes([i])).digest() for i in range(3)]


@pytest.mark.parametrize("change", [
    {"model": "org/llama-70b"}, {"revision": "v2"}, {"dtype": "float16"}, {"block_size": 64},
    {"num_kv_heads_per_rank": 4}, {"head_size": 64}, {"num_layers": 16}, {"tp_size": 4},
    {"pp_rank": 1}, {"hash_algo": "xxhash"}, {"cache_layout": "cuda"},
])
def test_any_layout_change_changes_every_key(change):
    a, b = KeyBuilder("p", BASE), KeyBuilder("p", dataclasses.replace(BASE, **change))
    assert a.fingerprint != b.fingerprint
    assert not set(a.all_rank_keys(H)) & set(b.all_rank_keys(H))


def test_key_format_and_rank_namespaces():
    kb = KeyBuilder("prod-a", BASE)
    assert kb.keys(H[:1], 1) == [f"prod-a/llama-8b/{kb.fingerprint}/tp2r1/{H[0].hex()}"]
    assert kb.all_rank_keys(H[:2]) == [kb.keys(H[:1], 0)[0], kb.keys(H[:1], 1)[0],
                                       kb.keys(H[1:2], 0)[0], kb.keys(H[1:2], 1)[0]]
    assert KeyBuilder("prod-b", BASE).keys(H[:1], 1) != kb.keys(H[:1], 1)
