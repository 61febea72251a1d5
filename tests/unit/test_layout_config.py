"""The in-tree store TP settings: store_tp_size, or enable_store_tp_lcm with prefill_tp_sizes,
accepted with the in-tree meaning and checked against the model's KV heads; bad values refused
with the field named."""

from __future__ import annotations

import ast
import importlib.util
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from connector.config import ConfigError, helm_extra_config, load_config
from connector.store.keys import check_store_tp_size

STORE = {"master_server_address": "127.0.0.1:50051",
         "metadata_server": "http://127.0.0.1:8080/metadata"}


def cfg(**extra):
    return load_config({**STORE, **extra}, environ={})


def in_tree_function(path: str, name: str) -> Callable[..., Any]:
    """A top-level function of the installed vLLM's source (`path` under vllm/), defined on
    its own from that source (without importing its module), to check a behaviour against."""
    file = Path(importlib.util.find_spec("vllm").origin).parent / path
    fn = next(f for f in ast.parse(file.read_text()).body
              if isinstance(f, ast.FunctionDef) and f.name == name)
    ns: dict[str, Any] = {"math": math, "re": re, "Any": Any}
    exec(compile(ast.Module([fn], []), str(file), "exec"), ns)  # vLLM's own function
    return ns[name]


def test_store_tp_size_and_lcm_resolve_as_in_tree():
    assert cfg().store_tp is None
    assert cfg(store_tp_size=4).store_tp == 4
    assert cfg(enable_store_tp_lcm=True, prefill_tp_sizes=[2, 3, 4]).store_tp == 12
    assert cfg(enable_store_tp_lcm="true", prefill_tp_sizes="2, 4").store_tp == 4


@pytest.mark.parametrize("extra, message", [
    ({"store_tp_size": 0}, "store_tp_size: must be 1..1024"),
    ({"store_tp_size": "two"}, "store_tp_size: expected an integer"),
    ({"enable_store_tp_lcm": True}, "enable_store_tp_lcm: needs prefill_tp_sizes"),
    ({"enable_store_tp_lcm": True, "prefill_tp_sizes": []}, "prefill_tp_sizes: expected a list"),
    ({"enable_store_tp_lcm": True, "prefill_tp_sizes": [2, 0]}, "prefill_tp_sizes: must be"),
])
def test_bad_store_tp_settings_name_the_field(extra, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**extra)


@pytest.mark.parametrize("extra, store_tp, warning", [
    ({"enable_store_tp_lcm": False, "prefill_tp_sizes": [2, 4]}, None,
     "prefill_tp_sizes: [2, 4] ignored (as by the in-tree connector) with enable_store_tp_lcm "
     "false; the store TP size is this engine's TP size (store_tp_size unset); remove "
     "prefill_tp_sizes, or set enable_store_tp_lcm: true to use it"),
    ({"prefill_tp_sizes": [2, 4], "store_tp_size": 8}, 8,
     "prefill_tp_sizes: [2, 4] ignored (as by the in-tree connector) with enable_store_tp_lcm "
     "false; the store TP size is store_tp_size 8;"),
    ({"enable_store_tp_lcm": True, "prefill_tp_sizes": [2, 3], "store_tp_size": 2}, 6,
     "store_tp_size: 2 ignored (as by the in-tree connector) with enable_store_tp_lcm true; the "
     "store TP size is 6, the least common multiple of prefill_tp_sizes [2, 3]; remove "
     "store_tp_size, or set enable_store_tp_lcm: false to use it"),
])
def test_the_value_in_tree_ignores_is_ignored_with_a_warning(extra, store_tp, warning):
    """vLLM's in-tree worker (store/worker.py: resolve_store_tp_size, _select_store_layout)
    reads prefill_tp_sizes only with enable_store_tp_lcm: true, and store_tp_size only without
    it. Such a deployment starts there, so it starts here, with the same store TP size, and a
    warning names the value left unused (the in-tree connector says nothing)."""
    c = cfg(**extra)
    assert c.store_tp == store_tp
    assert len(c.warnings) == 1 and c.warnings[0].startswith(f"kv_connector_extra_config.{warning}")
    ignored = warning.split(":", 1)[0]
    assert getattr(c, ignored) is None  # dropped: nothing downstream can read it
    assert cfg(store_tp_size=4).warnings == () == cfg(
        enable_store_tp_lcm=True, prefill_tp_sizes=[2]).warnings


def test_the_store_tp_size_is_the_in_tree_one():
    """Every form the in-tree resolve_store_tp_size takes, with the value it resolves to."""
    resolve = in_tree_function("distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py",
                               "resolve_store_tp_size")
    for extra in ({}, {"store_tp_size": 4}, {"enable_store_tp_lcm": False, "store_tp_size": 2},
                  {"enable_store_tp_lcm": True, "prefill_tp_sizes": [2, 3, 4]},
                  {"enable_store_tp_lcm": False, "prefill_tp_sizes": [2, 4]},
                  {"prefill_tp_sizes": [2, 4], "store_tp_size": 8},
                  {"enable_store_tp_lcm": True, "prefill_tp_sizes": [2, 3], "store_tp_size": 2}):
        assert cfg(**extra).store_tp == resolve(extra), extra


def test_enable_store_tp_lcm_1_is_off_as_in_tree():
    """The in-tree worker turns the least common multiple on only for `enable_store_tp_lcm`
    that `is True` (store/worker.py: resolve_store_tp_size, _select_store_layout): a JSON 1
    there is off, and the store TP size is store_tp_size's (or the engine's). Here too, with
    a warning that names the value and the fix: other booleans take 1 as true (the in-tree
    readers take bool(value)), and this one would have stored blocks under another store TP
    size than an in-tree engine with the same settings. (Text such as "true" is this
    connector's own form, on as before.)"""
    on = 1
    resolve = in_tree_function("distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py",
                               "resolve_store_tp_size")
    for extra in ({"enable_store_tp_lcm": on, "prefill_tp_sizes": [2, 3], "store_tp_size": 2},
                  {"enable_store_tp_lcm": on, "prefill_tp_sizes": [2, 4]},
                  {"enable_store_tp_lcm": on, "store_tp_size": 4}):
        c = cfg(**extra)
        assert c.store_tp == resolve(extra), extra
        assert c.enable_store_tp_lcm is False
        assert c.warnings[0].startswith(
            f"kv_connector_extra_config.enable_store_tp_lcm: {on!r} is off, as the in-tree "
            "connector reads it"), c.warnings
        assert "write true" in c.warnings[0]
    assert cfg(enable_store_tp_lcm=0, store_tp_size=2).store_tp == 2
    assert cfg(enable_store_tp_lcm=0, store_tp_size=2).warnings == ()


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
