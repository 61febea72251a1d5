"""Bad configuration fails at startup with one message naming the field and the fix."""

from __future__ import annotations

import json

import pytest

from connector.config import RECV_THREADS_ENV, ConfigError, load_config, parse_size

BASE = {"master_server_address": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata"}


def error_for(extra: dict | None = None, environ: dict | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, **(extra or {})}, environ or {})
    return str(e.value)


def test_defaults_and_env_thread_count():
    cfg = load_config(BASE, {})
    assert cfg.load_threads == 1 and cfg.store.protocol == "tcp"
    assert load_config(BASE, {RECV_THREADS_ENV: "8"}).load_threads == 8
    # extra_config overrides the environment.
    assert load_config({**BASE, "load_threads": 2}, {RECV_THREADS_ENV: "8"}).load_threads == 2


@pytest.mark.parametrize("value", ["four", "2.5", "65"])
def test_bad_thread_count_from_env(value):
    msg = error_for(environ={RECV_THREADS_ENV: value})
    assert RECV_THREADS_ENV in msg and "1..64" in msg


@pytest.mark.parametrize("value", ["0", "00", "-3"])
def test_env_thread_count_below_one_is_one_as_in_tree(value):
    """The in-tree worker runs max(1, VLLM_MOONCAKE_LOAD_RECV_THREADS) receive threads, so a
    deployment with 0 starts there with 1 thread: here too, with a startup note. The
    connector's own key keeps refusing 0 (test below)."""
    cfg = load_config(BASE, {RECV_THREADS_ENV: value})
    assert cfg.load_threads == 1 and not cfg.load_threads_auto
    assert any(n.startswith(f"{RECV_THREADS_ENV}={value!r} (in-tree setting): 1 receive")
               for n in cfg.notes), cfg.notes


@pytest.mark.parametrize("value", [0, -1, "four", 2.5, True])
def test_bad_thread_count_from_extra_config(value):
    msg = error_for({"load_threads": value})
    assert "load_threads" in msg and "1..64" in msg


def test_unknown_protocol():
    msg = error_for({"protocol": "udp"})
    assert "protocol" in msg and "'tcp'" in msg


def test_rdma_without_a_device_lets_mooncake_find_them():
    """vLLM's usage docs give `protocol: rdma` with `device_name: ""`: Mooncake 0.3.13 then
    discovers the RDMA devices itself ("Set auto discovery ON by default ... since no device
    names provided"), and the in-tree connector passes the empty name on."""
    cfg = load_config({**BASE, "protocol": "rdma", "device_name": ""}, environ={})
    assert (cfg.store.protocol, cfg.store.device_name) == ("rdma", "")


def test_staging_mode():
    assert load_config(BASE, {}).staging == "auto"
    assert load_config({**BASE, "staging": "OFF"}, {}).staging == "off"
    msg = error_for({"staging": "sometimes"})
    assert "staging" in msg and "'auto'" in msg


@pytest.mark.parametrize("field", ["global_segment_size", "local_buffer_size",
                                   "staging_buffer_size"])
@pytest.mark.parametrize("value", ["4 gigs", "-5", -5, "GB", [4]])
def test_malformed_sizes(field, value):
    msg = error_for({field: value})
    assert field in msg


def test_sizes_the_in_tree_reader_takes():
    """vLLM's in-tree _parse_size (distributed/mooncake_store.py) takes a JSON number with a
    fraction as int(value) and a number without a leading digit ("[\\d.]+"), so files with
    4294967296.0 or ".5gb" start there: the same bytes here."""
    from tests.unit.test_layout_config import in_tree_function

    in_tree = in_tree_function("distributed/mooncake_store.py", "_parse_size")
    for size in (4294967296.0, 1.9, ".5gb", "4.", "1.5GB", " 512 mb ", 1024):
        assert parse_size(size, "x") == in_tree(size), size
    assert parse_size(4294967296.0, "x") == 4 * 2**30
    assert parse_size(1.9, "x") == 1  # truncated, as int(1.9)
    assert parse_size(".5gb", "x") == 2**29
    assert parse_size("4.", "x") == 4
    cfg = load_config({**BASE, "global_segment_size": 4294967296.0,
                       "local_buffer_size": ".5gb"}, {})
    assert (cfg.store.global_segment_size, cfg.store.local_buffer_size) == (2**32, 2**29)
    for bad in (float("nan"), float("inf"), -1.0, ".", "..5", "1.2.3"):
        with pytest.raises(ConfigError, match="^x: "):
            parse_size(bad, "x")


@pytest.mark.parametrize("size", [1e30, float(2**64), "17000000T", "20000000000000000000"])
def test_a_size_past_what_mooncake_takes_names_the_field(size):
    """Mooncake's setup takes sizes as 64-bit unsigned integers: a larger one (a JSON 1e30,
    truncated to an integer since floats are read as in-tree) failed at startup with
    pybind11's 'incompatible function arguments', naming no field."""
    msg = error_for({"global_segment_size": size})
    assert "global_segment_size" in msg and "below 16 EiB" in msg, msg


def test_json_one_and_zero_are_booleans_as_in_tree():
    """The in-tree file reader takes bool(enable_offload), so "enable_offload": 1 turns the disk
    tier on there; 1 and 0 are true and false for every boolean here. Other numbers stay
    errors rather than guesses."""
    assert load_config({**BASE, "enable_offload": 1}, {}).enable_offload is True
    assert load_config({**BASE, "enable_save": 0}, {}).enable_save is False
    assert "enable_offload: expected true or false, got 2" in error_for({"enable_offload": 2})


def test_size_units():
    assert parse_size("4GB", "x") == 4 * 2**30
    assert parse_size("512MiB", "x") == 512 * 2**20
    assert parse_size("1.5G", "x") == int(1.5 * 2**30)
    assert parse_size(1024, "x") == 1024


@pytest.mark.parametrize("value", ["4IB", "4KI", "2 BB", "1.5Q"])
def test_size_units_are_never_misread(value):
    with pytest.raises(ConfigError, match="cannot parse size"):
        parse_size(value, "x")  # "4IB" was read as 4 bytes


def test_staging_buffer_is_bounded():
    assert "staging_buffer_size: must be" in error_for({"staging_buffer_size": "1T"})
    assert load_config({**BASE, "staging_buffer_size": "64MB"}, {}).staging_buffer_size == \
        64 * 2**20


@pytest.mark.parametrize("extra,field", [
    ({"master_server_address": "127.0.0.1:65536"}, "master_server_address"),
    ({"master_server_address": "127.0.0.1:0"}, "master_server_address"),
    ({"metadata_server": "http://127.0.0.1:99999/metadata"}, "metadata_server"),
    # Before, these passed and startup called the unreachable address an outage (served
    # without the cache for good under on_master_unreachable=degrade), or probed port 80.
    ({"metadata_server": "http://127.0.0.1:0/metadata"}, "metadata_server"),
    ({"metadata_server": "etcd://127.0.0.1:99999"}, "metadata_server"),
    ({"metadata_server": "127.0.0.1:2379,127.0.0.1:0"}, "metadata_server"),
    ({"master_server_address": "etcd://127.0.0.1:2379,127.0.0.1:65536"},
     "master_server_address"),
])
def test_ports_out_of_range(extra, field):
    assert f"{field}: " in error_for(extra) and "65535" in error_for(extra)


def test_an_http_metadata_server_needs_its_path():
    """Mooncake asks an HTTP metadata server at `<url>?key=...`: without the path (the master's
    is /metadata) its puts got 404 and setup failed naming master_server_address."""
    assert error_for({"metadata_server": "http://10.0.0.1:8080"}) == (
        "kv_connector_extra_config.metadata_server: 'http://10.0.0.1:8080' has no path, where "
        "an HTTP metadata server answers; write http://10.0.0.1:8080/metadata for the "
        "master's (--enable_http_metadata_server)")
    for fine in ("http://m/metadata", "https://m:8443/md", "m:2379,n:2379", "P2PHANDSHAKE"):
        assert load_config({**BASE, "metadata_server": fine}, {}).store.metadata_server == fine


@pytest.mark.parametrize("key", ["lookup_rpc_port", "enable_group_semantics", "custom_mem_pool"])
def test_in_tree_fields_without_meaning_are_rejected_with_why(key, tmp_path):
    msg = error_for({key: "x"})
    assert f"{key}: not supported by this connector" in msg and "remove it" in msg


def test_in_tree_replica_num_and_transfer_timeout_apply(tmp_path):
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({**BASE, "replica_num": 2, "transfer_timeout": 7}))
    cfg = load_config({}, {"MOONCAKE_CONFIG_PATH": str(path)})
    assert cfg.store.replica_num == 2 and cfg.store.transfer_timeout == 7.0
    assert "replica_num" in error_for({"replica_num": 0})
    assert "transfer_timeout" in error_for({"transfer_timeout": "soon"})


def test_transfer_timeout_sets_mooncake_timeouts(monkeypatch):
    from connector.store.client import apply_transfer_timeout

    for var in ("MC_TCP_STATUS_TIMEOUT_SEC", "MC_TRANSFER_TIMEOUT", "MC_RPC_TIMEOUT_MS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "9")  # an operator's own setting wins
    apply_transfer_timeout(3.0)
    import os

    assert os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] == "3"
    assert os.environ["MC_RPC_TIMEOUT_MS"] == "3000" and os.environ["MC_TRANSFER_TIMEOUT"] == "9"


def test_deadlines_validated():
    cfg = load_config(BASE, {})
    assert cfg.load_timeout_s == 5.0 and cfg.save_timeout_s == 30.0
    assert "load_timeout_s" in error_for({"load_timeout_s": 0})
    assert "save_timeout_s" in error_for({"save_timeout_s": "never"})


def test_unknown_extra_config_key():
    msg = error_for({"load_thread": 4})
    assert "load_thread" in msg and "allowed keys" in msg


def test_wrong_types():
    assert "lookup_timeout_s" in error_for({"lookup_timeout_s": "soon"})
    assert "enable_save" in error_for({"enable_save": "maybe"})
    assert "master_server_address" in error_for({"master_server_address": "nohostport"})


def test_missing_master_address():
    with pytest.raises(ConfigError, match="master_server_address: not set"):
        load_config({"metadata_server": BASE["metadata_server"]}, {})


def test_config_file_fallback(tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**BASE, "protocol": "tcp", "global_segment_size": "1GB"}))
    cfg = load_config({}, {"MOONCAKE_CONFIG_PATH": str(path)})
    assert cfg.store.global_segment_size == 2**30
    assert cfg.source["global_segment_size"] == "MOONCAKE_CONFIG_PATH"


def test_missing_config_file(tmp_path):
    msg = error_for(environ={"MOONCAKE_CONFIG_PATH": str(tmp_path / "nope.json")})
    assert "MOONCAKE_CONFIG_PATH" in msg and "does not exist" in msg


def test_invalid_json_config_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"protocol": "tcp",')
    msg = error_for(environ={"MOONCAKE_CONFIG_PATH": str(path)})
    assert "MOONCAKE_CONFIG_PATH" in msg and "not valid JSON" in msg and "line 1" in msg


def test_bad_value_in_config_file_names_the_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**BASE, "global_segment_size": "lots"}))
    with pytest.raises(ConfigError, match="MOONCAKE_CONFIG_PATH.global_segment_size"):
        load_config({}, {"MOONCAKE_CONFIG_PATH": str(path)})


def test_unknown_key_in_config_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**BASE, "protocl": "tcp"}))
    assert "protocl" in error_for(environ={"MOONCAKE_CONFIG_PATH": str(path)})


def test_docs_key_table_and_quoted_error_match_the_catalogue():
    """The configuration page's table is generated from KEYS, and the error it quotes is the
    real one; so is the observability page's metric table from the metric catalogue."""
    import re
    from pathlib import Path

    from connector.config import (
        CONFIG_PAGE,
        HELM_SCHEMA,
        helm_extra_config,
        sync_docs,
        sync_helm_schema,
    )
    from connector.observability import metric_catalog

    root = Path(__file__).resolve().parents[2]
    page = root / CONFIG_PAGE
    assert sync_docs(str(page), check=True), "run: python -m connector.config"
    assert metric_catalog.sync_docs(str(root / metric_catalog.METRICS_PAGE), check=True), \
        "run: python -m connector.observability.metric_catalog"
    assert sync_helm_schema(str(root / HELM_SCHEMA), check=True), \
        "the chart's extraConfig schema drifted from KEYS: run python -m connector.config"
    helm_row = next(line for line in (root / "docs" / "helm.md").read_text()
                    .splitlines() if line.startswith("| `extraConfig` |"))
    assert set(re.findall(r"`([a-z_]+)`", helm_row.split("|")[3])) == \
        set(helm_extra_config()) | {"kv_connector_extra_config", "auto", "on", "off", "fail",
                                    "degrade", "recompute"}
    values = (root / "helm" / "mooncake-pooled-connector" / "values.yaml").read_text()
    assert "(VLLM_MOONCAKE_LOAD_RECV_THREADS), 1..64,\n  # or auto" in values
    quoted = re.search(r"`(kv_connector_extra_config\.load_threads: must be[^`]*)`",
                       page.read_text()).group(1)
    assert error_for({"load_threads": 0}) == quoted


def test_dataclass_defaults_come_from_the_catalogue():
    from dataclasses import fields

    from connector.config import BY_NAME, KEYS, ConnectorConfig, StoreConfig

    declared = {f.name: f.default for cls in (StoreConfig, ConnectorConfig)
                for f in fields(cls) if f.name in BY_NAME}
    assert set(declared) == {k.name for k in KEYS} - {"load_threads_max"}
    for required in ("master_server_address", "metadata_server"):
        assert BY_NAME[required].default is None
        del declared[required]
    assert all(BY_NAME[n].default == d for n, d in declared.items())


def test_docs_module_table_lists_every_module():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "development.md").read_text()
    table = page.split("| module | job |")[1].split("\n\n")[0]
    listed = set(re.findall(r"`([a-z_]+\.py)`", table))
    modules = {p.name for p in (root / "connector").glob("*.py")} - {"__init__.py"}
    assert listed == modules


def test_catalogues_import_without_vllm_and_docs_are_in_sync():
    """The dashboards, the chart tests and the docs read the catalogues without vLLM."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, connector.observability.metric_catalog, connector.config, "
            "dashboards.promql; "
            "assert 'vllm' not in sys.modules, 'the catalogues pulled in vLLM'")
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
    for module in ("connector.observability.metric_catalog", "connector.config"):
        r = subprocess.run([sys.executable, "-m", module, "--check"], cwd=root)
        assert r.returncode == 0, f"README or chart schema out of sync: run python -m {module}"


@pytest.mark.parametrize(("url", "port"), [("https://meta.example.com/metadata", 443),
                                           ("http://meta.example.com/metadata", 80),
                                           ("https://meta.example.com:8443/metadata", 8443)])
def test_the_metadata_server_is_probed_on_its_schemes_port(monkeypatch, url, port):
    """An https:// metadata server without a port is reached on 443: probing 80 refused to
    start (fail) or never connected (degrade) where nothing listens on 80."""
    import connector.store.client as client

    probed = []
    monkeypatch.setattr(client, "_probe_tcp", lambda host, p, timeout: probed.append((host, p)))
    monkeypatch.setattr(client, "_probe_answers", lambda host, p, timeout: None)  # the master
    cfg = load_config({**BASE, "metadata_server": url}, {}).store
    client.check_reachable(cfg, 1.0)
    assert probed[-1] == ("meta.example.com", port)
