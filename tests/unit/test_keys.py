"""Key namespaces: what defines the stored bytes changes every key, the writer's TP size does not,
and the namespace is unambiguous by construction."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from connector.config import ConfigError, load_config
from connector.store.groups import GroupSpec
from connector.store.keys import KeyBuilder, Layout, kv_signature, layout_signature
from connector.worker.kv_regions import plan_group

BASE = Layout("org/llama-8b", "bfloat16", 32, 8, 128, 32, 2)
H = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
STORE = {"master_server_address": "127.0.0.1:50051",
         "metadata_server": "http://127.0.0.1:8080/metadata"}


@pytest.mark.parametrize("change", [
    {"model": "org/llama-70b"}, {"revision": "v2"}, {"dtype": "float16"}, {"block_size": 64},
    {"num_kv_heads": 4}, {"head_size": 64}, {"num_layers": 16}, {"store_tp_size": 4},
    {"tenant": "team-b"}, {"hash_algo": "xxhash"}, {"cache_layout": "cuda"},
    {"quantization": '["fp8_per_tensor", null]'}, {"hf_overrides": '[["rope_theta", 1e6]]'},
])
def test_any_layout_change_changes_every_key(change):
    a, b = KeyBuilder("p", BASE), KeyBuilder("p", dataclasses.replace(BASE, **change))
    assert a.fingerprint != b.fingerprint
    assert not set(a.all_shard_keys(H)) & set(b.all_shard_keys(H))


def test_keys_of_the_default_tenant_are_those_stored_before_tenants_were_in_keys():
    """Tenants namespace keys (a master without --enable_multi_tenants ignores the client's
    tenant), but the default tenant's keys stay as they were: stores keep their hits."""
    assert KeyBuilder("p", BASE).fingerprint == "f480b5c02f3cbe83"  # as before this change


def test_the_writers_tp_size_is_not_part_of_the_key():
    """Engines of TP 1, 2 and 4 that store 2 shards per block use the same keys."""
    keys = {tp: KeyBuilder("p", dataclasses.replace(BASE, tp_size=tp, store_tp_size=2))
            .all_shard_keys(H) for tp in (1, 2, 4)}
    assert keys[1] == keys[2] == keys[4]
    assert len(keys[1]) == 2 * len(H)


def test_key_format_and_shard_namespaces():
    kb = KeyBuilder("prod-a", BASE, groups=2)
    fp = kb.fingerprint
    assert kb.keys(H[:1], 1) == [f"prod-a/llama-8b/{fp}/g0s1of2/{H[0].hex()}"]
    assert kb.keys(H[:1], 0, group=1) == [f"prod-a/llama-8b/{fp}/g1s0of2/{H[0].hex()}"]
    assert kb.all_shard_keys(H[:2]) == [kb.keys(H[:1], 0)[0], kb.keys(H[:1], 1)[0],
                                        kb.keys(H[1:2], 0)[0], kb.keys(H[1:2], 1)[0]]
    assert KeyBuilder("prod-b", BASE).keys(H[:1], 1) != kb.keys(H[:1], 1)


def _caches(order: str, dtype=None, names=("l0", "l1")):
    """vLLM's per-layer views [64 blocks, 4 heads, 32 tokens, 16] with head-major (HND) or
    token-major (NHD) memory inside a block."""
    dtype = dtype or torch.bfloat16
    if order == "HND":
        return {n: torch.zeros(64, 4, 32, 16, dtype=dtype) for n in names}
    return {n: torch.zeros(64, 32, 4, 16, dtype=dtype).transpose(1, 2) for n in names}


def test_layout_signature_tells_memory_orders_and_dtypes_apart():
    nhd, hnd = _caches("NHD"), _caches("HND")
    assert next(iter(nhd.values())).shape == next(iter(hnd.values())).shape
    sigs = {kv_signature(nhd, 64, "CPU_ATTN"), kv_signature(hnd, 64, "CPU_ATTN"),
            kv_signature(_caches("NHD", torch.float16), 64, "CPU_ATTN"),
            kv_signature(nhd, 64, "FLASH_ATTN")}
    assert len(sigs) == 4
    keys = [set(KeyBuilder("p", BASE).with_signature(s).all_shard_keys(H)) for s in sigs]
    assert all(not a & b for i, a in enumerate(keys) for b in keys[i + 1:])


def test_signature_covers_layer_order_and_count():
    """Issue 25.7: the stored object is the layers concatenated in order, so engines whose layers
    are ordered differently, or that have more layers of the same shape, must not share keys
    (a sorted set of per-layer shapes was the same for all three)."""
    caches = _caches("HND", names=("l0", "l1", "l2"))
    swapped = {"l1": caches["l1"], "l0": caches["l0"], "l2": caches["l2"]}
    fewer = {"l0": caches["l0"], "l1": caches["l1"]}
    sigs = [kv_signature(c, 64, "CPU_ATTN") for c in (caches, swapped, fewer)]
    assert len(set(sigs)) == 3
    assert kv_signature(dict(caches), 64, "CPU_ATTN") == sigs[0]  # and equal when equal


def test_signature_is_the_same_for_every_tp_size():
    """A TP=2 rank's tensors hold half the heads; its shard description equals the TP=1
    engine's, so their keys (with the same store_tp_size) are equal."""
    full = _caches("HND")
    half = {n: t[:, :2].contiguous() for n, t in full.items()}
    one = plan_group(full, 64, 4, 2, tp_size=1, tp_rank=0).description
    two = [plan_group(half, 64, 4, 2, tp_size=2, tp_rank=r).description for r in (0, 1)]
    assert one == two[0] == two[1]
    g = (GroupSpec(),)
    assert layout_signature("CPU_ATTN", g, [one]) == layout_signature("CPU_ATTN", g, [two[0]])


def test_fingerprint_fields_are_encoded_one_by_one():
    """Issue 25.8: joined with "|", model "a|b" at revision "" and model "a" at revision "b|"
    gave one fingerprint text."""
    a = dataclasses.replace(BASE, model="a|b", revision="")
    b = dataclasses.replace(BASE, model="a", revision="b|")
    assert a.fingerprint() != b.fingerprint()


@pytest.mark.parametrize("extra, field", [
    ({"cache_prefix": "a/b"}, "cache_prefix"),
    ({"cache_prefix": "a b/c"}, "cache_prefix"),
    ({"cache_prefix": "x" * 5000}, "cache_prefix"),
    ({"model_id": ""}, "model_id"),
    ({"local_buffer_size": "0"}, "local_buffer_size"),
])
def test_namespace_parts_are_refused_with_the_field_named(extra, field):
    """Issue 25.8: `/` inside a prefix made prefix `a/b` with model `m` and prefix `a` with model
    `b/m` build keys that start the same way; an empty model id or a 0-byte buffer were taken."""
    with pytest.raises(ConfigError, match=field):
        load_config({**STORE, **extra}, environ={})


def test_key_parts_cannot_run_into_each_other():
    """Every part before the hash is free of `/` (prefix checked, model reduced), so splitting a
    key on `/` gives back exactly the prefix, model, fingerprint, shard and hash."""
    kb = KeyBuilder("tenant.a_1-x", dataclasses.replace(BASE, model="b/m/../x y"))
    parts = kb.keys(H[:1])[0].split("/")
    assert parts[0] == "tenant.a_1-x" and len(parts) == 5 and parts[4] == H[0].hex()
    with pytest.raises(ValueError, match="cache_prefix"):
        KeyBuilder("a/b", BASE)


def test_same_layout_same_keys_across_processes():
    import subprocess
    import sys

    code = ("from tests.unit.test_keys import BASE, H, _caches; from connector.store.keys import "
            "KeyBuilder, kv_signature; print(KeyBuilder('p', BASE).with_signature("
            "kv_signature(_caches('NHD'), 64, 'CPU_ATTN')).keys(H, 1)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "random", "PATH": ""}).stdout
    here = KeyBuilder("p", BASE).with_signature(kv_signature(_caches("NHD"), 64, "CPU_ATTN"))
    assert out.strip() == here.keys(H, 1)[0]


def _vllm_config(pp: int = 1, tp: int = 1):
    """The fields layout_from_vllm reads, as vLLM's config holds them."""
    from types import SimpleNamespace as NS

    mc = NS(dtype="torch.float32", model="org/m", revision=None, use_mla=False,
            get_total_num_kv_heads=lambda: 4, get_head_size=lambda: 64,
            get_num_layers=lambda _pc: 2)
    pc = NS(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=0,
            decode_context_parallel_size=1, prefill_context_parallel_size=1)
    return NS(model_config=mc, cache_config=NS(cache_dtype="auto", block_size=32),
              parallel_config=pc)


def test_pipeline_parallelism_is_refused_with_the_field_named():
    """Each stage holds other layers, while lookups and the stored layout describe one stage's."""
    from connector.store.keys import layout_from_vllm

    assert layout_from_vllm(_vllm_config(pp=1)).num_layers == 2
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size=2: .*serve without pipeline"):
        layout_from_vllm(_vllm_config(pp=2))


def test_a_tenant_other_than_the_default_has_keys_of_its_own():
    from connector.store.keys import layout_from_vllm

    plain, team = (KeyBuilder("p", layout_from_vllm(_vllm_config(), tenant=t)) for t in
                   ("", "team-b"))
    assert plain.fingerprint != team.fingerprint
    assert not set(plain.all_shard_keys(H)) & set(team.all_shard_keys(H))



def test_a_disk_tier_is_refused_where_ranks_read_slices():
    """Mooncake fails ranged gets of objects on disk (tests/store/test_disk_tier_worker.py)."""
    from connector.store.keys import check_disk_tier

    slices = dataclasses.replace(BASE, tp_size=2, store_tp_size=1)
    with pytest.raises(ValueError, match=r"^enable_offload: with store_tp_size 1 below the TP "
                                         r"size 2 .*set store_tp_size to a multiple of 2"):
        check_disk_tier(slices, True)
    check_disk_tier(slices, False)
    with pytest.raises(ValueError, match=r"^enable_offload: with prefill_tp_sizes \(least .*"
                                         r"choose prefill_tp_sizes whose least common multiple "
                                         r"is a multiple of 2"):
        check_disk_tier(slices, True, "prefill_tp_sizes (least common multiple of [1])")
    for whole in (dataclasses.replace(BASE, tp_size=2, store_tp_size=2),
                  dataclasses.replace(BASE, tp_size=1, store_tp_size=2),
                  dataclasses.replace(BASE, num_kv_heads=1, tp_size=2)):  # MLA: one latent
        check_disk_tier(whole, True)


def test_a_quantized_engine_of_the_same_model_has_keys_of_its_own(tiny_model):
    """The same checkpoint served with its weights quantized (`--quantization`, or a
    `quantization_config`) computes other K and V for the same tokens: it must never read the
    unquantized engines' blocks, nor they its, nor engines quantized another way. Engines
    quantized alike share, and unquantized engines keep the keys they had."""
    from vllm.config import ModelConfig, VllmConfig

    from connector.store.keys import layout_from_vllm

    def layout(**quant) -> Layout:
        return layout_from_vllm(VllmConfig(model_config=ModelConfig(
            model=tiny_model, dtype="bfloat16", **quant)))

    # (test_keys_of_the_default_tenant_... pins the keys of an unquantized layout)
    engines = [layout(), layout(quantization="fp8_per_tensor"),
               layout(quantization="fp8_per_block"),
               layout(quantization_config={"linear": "fp8_per_channel"}),
               layout(quantization_config={"linear": "mxfp8"})]
    keys = [set(KeyBuilder("p", x).all_shard_keys(H)) for x in engines]
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not a & b
    assert KeyBuilder("p", layout(quantization="fp8_per_tensor")).fingerprint == \
        KeyBuilder("p", engines[1]).fingerprint
    # A checkpoint quantized already: the model names its weights, and the method vLLM
    # resolves for it is the GPU's kernel choice (awq or awq_marlin): one fleet, one namespace.
    ckpt = Path(tiny_model).parent / "tiny-fp8"
    if not ckpt.exists():
        shutil.copytree(tiny_model, ckpt)
        config = json.loads((ckpt / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        (ckpt / "config.json").write_text(json.dumps(config))
    engine = VllmConfig(model_config=ModelConfig(model=str(ckpt), dtype="bfloat16"))
    assert engine.model_config.quantization == "fp8"
    resolved = layout_from_vllm(engine)
    engine.model_config.quantization = "fp8_marlin"  # as another GPU's vLLM would resolve it
    assert layout_from_vllm(engine) == resolved
    # A quantization and a tenant never hash alike, whatever their text.
    q = dataclasses.replace(BASE, quantization="team-b")
    assert KeyBuilder("p", q).fingerprint != KeyBuilder("p", dataclasses.replace(
        BASE, tenant="team-b")).fingerprint


def test_an_engine_with_other_hf_overrides_has_keys_of_its_own(tiny_model):
    """`--hf-overrides` can change what the model computes for the same tokens: a YaRN RoPE
    scaling (how long-context engines serve a model) rotates every key otherwise, so such an
    engine must not read the plain engines' blocks, nor they its. Engines started with the
    same overrides share."""
    from vllm.config import ModelConfig, VllmConfig

    from connector.store.keys import layout_from_vllm

    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 2048}}

    def layout(overrides: dict) -> Layout:
        mc = ModelConfig(model=tiny_model, dtype="bfloat16", hf_overrides=overrides)
        return layout_from_vllm(VllmConfig(model_config=mc))

    plain, long, factor2 = (layout(o) for o in (
        {}, yarn, {"rope_scaling": {**yarn["rope_scaling"], "factor": 2.0}}))
    keys = [set(KeyBuilder("p", x).all_shard_keys(H)) for x in (plain, long, factor2)]
    assert not keys[0] & keys[1] and not keys[0] & keys[2] and not keys[1] & keys[2]
    assert KeyBuilder("p", layout(yarn)).fingerprint == KeyBuilder("p", long).fingerprint
