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


def _caches(order: str, dtype=None):
    """Two layers of [2, 64 blocks, 4 heads, 32 tokens, 16] with NHD or HND memory order."""
    import torch

    dtype = dtype or torch.bfloat16
    if order == "NHD":
        return {f"l{i}": torch.zeros(2, 64, 4, 32, 16, dtype=dtype) for i in range(2)}
    # same logical shape, heads and tokens swapped in memory
    return {f"l{i}": torch.zeros(2, 64, 32, 4, 16, dtype=dtype).transpose(2, 3)
            for i in range(2)}


def test_layout_signature_tells_memory_orders_and_dtypes_apart():
    import torch

    from connector.keys import kv_signature

    nhd, hnd = _caches("NHD"), _caches("HND")
    assert next(iter(nhd.values())).shape == next(iter(hnd.values())).shape
    sigs = {kv_signature(nhd, 64, "CPU_ATTN"), kv_signature(hnd, 64, "CPU_ATTN"),
            kv_signature(_caches("NHD", torch.float16), 64, "CPU_ATTN"),
            kv_signature(nhd, 64, "FLASH_ATTN")}
    assert len(sigs) == 4
    keys = [set(KeyBuilder("p", BASE).with_signature(s).all_rank_keys(H)) for s in sigs]
    assert all(not a & b for i, a in enumerate(keys) for b in keys[i + 1:])


def test_same_layout_same_keys_across_processes():
    import subprocess
    import sys

    from connector.keys import kv_signature

    code = ("from tests.unit.test_keys import BASE, H, _caches; from connector.keys import "
            "KeyBuilder, kv_signature; print(KeyBuilder('p', BASE).with_signature("
            "kv_signature(_caches('HND'), 64, 'CPU_ATTN')).keys(H, 1)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "random", "PATH": ""}).stdout
    here = KeyBuilder("p", BASE).with_signature(kv_signature(_caches("HND"), 64, "CPU_ATTN"))
    assert out.strip() == here.keys(H, 1)[0]
