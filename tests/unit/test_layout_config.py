"""The in-tree store TP settings: store_tp_size, or enable_store_tp_lcm with prefill_tp_sizes,
accepted with the in-tree meaning and checked against the model's KV heads; bad values refused
with the field named."""

from __future__ import annotations

import pytest

from connector.config import ConfigError, helm_extra_config, load_config
from connector.store.keys import check_store_tp_size

STORE = {"master_server_address": "127.0.0.1:50051",
         "metadata_server": "http://127.0.0.1:8080/metadata"}


def cfg(**extra):
    return load_config({**STORE, **extra}, environ={})


def test_store_tp_size_and_lcm_resolve_as_in_tree():
    assert cfg().store_tp is None
    assert cfg(store_tp_size=4).store_tp == 4
    assert cfg(enable_store_tp_lcm=True, prefill_tp_sizes=[2, 3, 4]).store_tp == 12
    assert cfg(enable_store_tp_lcm="true", prefill_tp_sizes="2, 4").store_tp == 4


@pytest.mark.parametrize("extra, message", [
    ({"store_tp_size": 0}, "store_tp_size: must be 1..1024"),
    ({"store_tp_size": "two"}, "store_tp_size: expected an integer"),
    ({"enable_store_tp_lcm": True}, "enable_store_tp_lcm: needs prefill_tp_sizes"),
    ({"prefill_tp_sizes": [2, 4]}, "prefill_tp_sizes: only used with enable_store_tp_lcm"),
    ({"enable_store_tp_lcm": True, "prefill_tp_sizes": []}, "prefill_tp_sizes: expected a list"),
    ({"enable_store_tp_lcm": True, "prefill_tp_sizes": [2, 0]}, "prefill_tp_sizes: must be"),
    ({"enable_store_tp_lcm": True, "prefill_tp_sizes": [2], "store_tp_size": 2},
     "store_tp_size: set either"),
])
def test_bad_store_tp_settings_name_the_field(extra, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**extra)


def test_store_tp_size_must_split_the_kv_heads():
    assert [check_store_tp_size(s, 8) for s in (None, 1, 2, 8, 16)] == [0, 1, 2, 8, 16]
    assert check_store_tp_size(4, 1) == 4  # MLA: one latent; any TP size stores it once
    with pytest.raises(ValueError, match=r"store_tp_size: 3 .* 8 KV heads.*\[1, 2, 4, 8\]"):
        check_store_tp_size(3, 8)
    assert check_store_tp_size(2, 6, tp_size=6) == 2  # each shard spans 3 ranks (read-only)
    with pytest.raises(ValueError, match="store_tp_size: 3 and this engine's TP size 2"):
        check_store_tp_size(3, 6, tp_size=2)  # rank 0 would hold shard 0 and half of shard 1


def test_a_least_common_multiple_that_does_not_fit_names_prefill_tp_sizes():
    """With enable_store_tp_lcm the store TP size is worked out from prefill_tp_sizes: an
    error about it names that list, not store_tp_size, which is not set."""
    from connector.store.keys import layout_from_vllm
    from tests.unit.test_keys import _vllm_config

    c = cfg(enable_store_tp_lcm=True, prefill_tp_sizes=[3])
    with pytest.raises(ValueError, match=r"^prefill_tp_sizes \(least common multiple of "
                                         r"\[3\]\): 3 does not split the model's 4 KV heads"):
        layout_from_vllm(_vllm_config(), store_tp_size=c.store_tp,
                         store_tp_field=c.store_tp_field)
    c = cfg(enable_store_tp_lcm=True, prefill_tp_sizes=[2, 4])
    assert layout_from_vllm(_vllm_config(tp=2), store_tp_size=c.store_tp,
                            store_tp_field=c.store_tp_field).store_tp_size == 4
    assert cfg(store_tp_size=3).store_tp_field == "store_tp_size"


def test_the_chart_schema_admits_the_lists():
    schema = helm_extra_config()["prefill_tp_sizes"]
    assert schema["type"] == "array" and schema["items"]["minimum"] == 1
    assert helm_extra_config()["cache_prefix"]["pattern"] == "^[A-Za-z0-9._-]{1,64}$"
