"""Every setting of vLLM's in-tree MooncakeStoreConnector has an answer here (connector/config.py
IN_TREE): the same meaning, accepted as an equivalent (with a log line), or refused with the
reason. The in-tree settings are read from the installed vLLM's own source, so a setting a new
vLLM adds fails this test until it has an answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from connector.config import (
    BY_NAME,
    ENV,
    EQUIVALENT,
    EXTRA,
    FILE,
    IN_TREE,
    REFUSED,
    SAME,
    ConfigError,
    load_config,
)

BASE = {"master_server_address": "127.0.0.1:50051", "metadata_server": "P2PHANDSHAKE"}


def _vllm() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("vllm").origin).parent


def in_tree_surface() -> dict[str, set[str]]:
    """The settings vLLM's in-tree store connector reads, from its installed source."""
    import dataclasses

    from vllm.distributed.mooncake_store import MooncakeStoreConfig

    root = _vllm() / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "mooncake"
    sources = [*sorted((root / "store").glob("*.py")), root / "rdma_utils.py"]
    text = "\n".join(p.read_text() for p in sources)
    extra = set(re.findall(r'extra_config(?:\.get\(|\[)\s*"(\w+)"', text))
    extra |= set(re.findall(r'"(\w+)" in extra_config', text))
    env = set(re.findall(r"envs\.([A-Z][A-Z0-9_]+)", text))
    env |= set(re.findall(r'os\.getenv\(\s*"(\w+)"', (root.parents[3] / "mooncake_store.py")
                          .read_text()))
    return {FILE: {f.name for f in dataclasses.fields(MooncakeStoreConfig)}, EXTRA: extra,
            ENV: env}


def test_every_in_tree_setting_has_an_answer():
    surface = in_tree_surface()
    assert {"mode", "tenant_id", "enable_offload"} <= surface[FILE]  # the reader works
    assert {"load_async", "save_decode_cache", "store_tp_size"} <= surface[EXTRA]
    assert {"VLLM_MOONCAKE_STORE_TIER_LOG", "MOONCAKE_PREFERRED_SEGMENT"} <= surface[ENV]
    answered = {(t.where, t.name) for t in IN_TREE}
    missing = sorted((where, name) for where, names in surface.items() for name in names
                     if (where, name) not in answered)
    assert not missing, f"in-tree settings without an answer in IN_TREE: {missing}"
    for t in IN_TREE:
        assert t.answer in (SAME, EQUIVALENT, REFUSED), t
        assert t.answer == SAME or t.how, f"{t.name}: say what it becomes or why it is refused"
        assert not t.key or t.key in BY_NAME, t


@pytest.mark.parametrize("t", [t for t in IN_TREE if t.answer == REFUSED], ids=lambda t: t.name)
def test_refused_settings_name_the_setting_and_the_way_out(t):
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, t.name: True}, {})
    msg = str(e.value)
    assert msg.startswith(f"kv_connector_extra_config.{t.name}: not supported") and \
        t.how in msg and "\n" not in msg
    # Off, as the in-tree connector reads false or null, it asks for nothing: accepted.
    for off in (False, "False", None, 0, "no"):
        assert load_config({**BASE, t.name: off}, {}).store == load_config(BASE, {}).store


def test_a_null_value_is_not_set():
    """JSON null reads as unset, as the in-tree connector reads it (store_tp_size: null)."""
    assert load_config({**BASE, "store_tp_size": None, "tenant_id": None}, {}) == \
        load_config(BASE, {})


# One typical value of each accepted in-tree setting, as the usage doc writes it.
TYPICAL = {"mode": "embedded", "load_async": True, "lookup_async": False,
           "enable_lookup": True, "save_decode_cache": False,
           "enable_cross_layers_blocks": "False"}


@pytest.mark.parametrize("t", [t for t in IN_TREE if t.answer == EQUIVALENT
                               and t.where in (FILE, EXTRA)], ids=lambda t: t.name)
def test_accepted_settings_are_logged_not_silently_ignored(t):
    cfg = load_config({**BASE, t.name: TYPICAL[t.name]}, {})
    assert any(n.startswith(f"kv_connector_extra_config.{t.name}=") for n in cfg.notes), \
        cfg.notes


def test_mode_is_the_segment_size(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**BASE, "mode": "standalone-store"}))
    cfg = load_config({}, {"MOONCAKE_CONFIG_PATH": str(path)})
    assert cfg.store.global_segment_size == 0
    assert load_config({**BASE, "mode": "embedded"}, {}).store.global_segment_size == 4 * 2**30
    with pytest.raises(ConfigError, match="standalone-store needs global_segment_size 0"):
        load_config({**BASE, "mode": "standalone-store", "global_segment_size": "1GB"}, {})
    with pytest.raises(ConfigError, match="embedded needs global_segment_size above 0"):
        load_config({**BASE, "mode": "embedded", "global_segment_size": 0}, {})


def test_aliases_and_their_conflicts():
    cfg = load_config({**BASE, "enable_lookup": False, "save_decode_cache": True}, {})
    assert not cfg.enable_load and cfg.save_decode_tokens
    with pytest.raises(ConfigError, match="enable_lookup: contradicts"):
        load_config({**BASE, "enable_lookup": False, "enable_load": True}, {})
    assert load_config({**BASE, "lookup_async": True}, {}).lookup_wait_ms == 0
    assert load_config({**BASE, "lookup_async": True, "lookup_wait_ms": 3}, {}).lookup_wait_ms \
        == 3  # an explicit budget wins
    with pytest.raises(ConfigError, match="load_async: false is not supported"):
        load_config({**BASE, "load_async": False}, {})


def test_kv_role_decides_what_is_stored():
    assert load_config(BASE, {}, kv_role="kv_producer").enable_save
    consumer = load_config(BASE, {}, kv_role="kv_consumer")
    assert consumer.enable_load and not consumer.enable_save
    assert load_config({**BASE, "save_decode_cache": True}, {}, kv_role="kv_consumer").enable_save
    # Capacity only (in-tree: kv_consumer, no lookup, no decode saves): no loads, no saves.
    cap = load_config({**BASE, "enable_lookup": False}, {}, kv_role="kv_consumer")
    assert not cap.enable_load and not cap.enable_save


def test_in_tree_environment_variables():
    cfg = load_config(BASE, {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "10.0.0.7",
                             "VLLM_MOONCAKE_STORE_TIER_LOG": "1",
                             "VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO": "0.5",
                             "MOONCAKE_PREFERRED_SEGMENT": "10.0.0.8:15001"})
    assert cfg.store.local_hostname == "10.0.0.7" and cfg.tier_metrics
    assert cfg.disk_staging_usable_ratio == 0.5  # a variable is text: parsed as a number
    assert cfg.store.preferred_segment == "10.0.0.8:15001"
    assert load_config(BASE, {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "10.0.0.7",
                              "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.9"}).store.local_hostname == \
        "10.0.0.9"
    with pytest.raises(ConfigError, match="VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO: must be"):
        load_config(BASE, {"VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO": "3"})


def test_tenant_and_disk_tier():
    cfg = load_config(BASE, {})
    assert cfg.store.tenant_id == "default" and not cfg.enable_offload and not cfg.tier_metrics
    cfg = load_config({**BASE, "tenant_id": " team-a ", "enable_offload": True}, {})
    assert cfg.store.tenant_id == "team-a" and cfg.enable_offload and cfg.tier_metrics
    assert load_config({**BASE, "tenant_id": None}, {}).store.tenant_id == "default"  # in-tree
    for bad in ("_system", "a\tb"):
        with pytest.raises(ConfigError, match="tenant_id: .* is not a Mooncake tenant name"):
            load_config({**BASE, "tenant_id": bad}, {})
    assert not load_config({**BASE, "enable_offload": True, "tier_metrics": False},
                           {}).tier_metrics


def test_local_hostname_by_default_is_this_nodes_address_toward_the_master():
    """Unset, the segment's address is VLLM_HOST_IP (as the in-tree connector's get_ip), else
    this node's address on the route to the master: a loopback default with a master on
    another node sent other nodes' transfers to their own loopback."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # this host's routed address
        s.connect(("192.0.2.77", 9))
        routed = s.getsockname()[0]
    remote = {**BASE, "master_server_address": "192.0.2.77:50051"}
    assert load_config(remote, {}).store.local_hostname == routed
    assert load_config({**remote, "master_server_address": "etcd://192.0.2.77:2379,h:2379"},
                       {}).store.local_hostname == routed
    for master in ("127.0.0.1:50051", "localhost:50051", "etcd://127.0.0.1:2379"):
        assert load_config({**BASE, "master_server_address": master},
                           {}).store.local_hostname == "127.0.0.1", master
    assert load_config(remote, {"VLLM_HOST_IP": "10.0.0.5"}).store.local_hostname == "10.0.0.5"
    assert load_config({**remote, "local_hostname": "10.0.0.6"},
                       {"VLLM_HOST_IP": "10.0.0.5"}).store.local_hostname == "10.0.0.6"


def test_an_empty_variable_is_unset_and_a_ratio_may_start_with_its_point():
    """As vLLM and the in-tree connector read them: an empty variable is unset (an empty
    MOONCAKE_REQUESTER_LOCAL_HOSTNAME falls back to the default), and .5 is a number."""
    plain = load_config(BASE, {})
    assert load_config(BASE, {"MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "",
                              "VLLM_MOONCAKE_STORE_TIER_LOG": " "}) == plain
    assert load_config(BASE, {"VLLM_MOONCAKE_DISK_STAGING_USABLE_RATIO": ".5"}
                       ).disk_staging_usable_ratio == 0.5
