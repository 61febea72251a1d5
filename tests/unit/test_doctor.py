"""The preflight's runner and input parsing, without a store: a check runs only when the checks
it needs passed, a check that does not apply prints nothing, every failure sets the exit status,
and a kv-transfer-config is read as vllm serve reads it. (The checks themselves run against a
real master, store node and etcd in tests/store/test_doctor.py.)"""

from __future__ import annotations

import io
import json

import pytest

from connector.config import ConfigError
from connector.doctor import Check, CheckFailed, Context, _kv_transfer_config, main, run


def ctx() -> Context:
    return Context(extra={}, environ={}, metrics_port=9003, min_segments=1, timeout=1.0)


def fail(_: Context) -> str:
    raise CheckFailed("it broke", "mend it")


def test_needs_skip_and_applies():
    out = io.StringIO()
    checks = [Check("a", lambda c: "fine"), Check("b", fail, needs=("a",)),
              Check("c", lambda c: "never", needs=("b",)),
              Check("tenant", lambda c: "x", applies=lambda c: False),
              Check("d", lambda c: "also fine", needs=("a",))]
    assert run(ctx(), checks, out) is False
    assert out.getvalue().splitlines() == [
        "PASS a       fine",
        "FAIL b       it broke; fix: mend it",
        "SKIP c       needs b",
        "PASS d       also fine",
    ]


def test_all_passing_is_true():
    assert run(ctx(), [Check("a", lambda c: "fine")], io.StringIO()) is True


def test_kv_transfer_config_or_bare_extra_config():
    full = {"kv_connector": "PooledMooncakeStoreConnector", "kv_connector_extra_config":
            {"cache_prefix": "p"}}
    assert _kv_transfer_config(json.dumps(full), "x") == {"cache_prefix": "p"}
    assert _kv_transfer_config('{"cache_prefix": "p"}', "x") == {"cache_prefix": "p"}
    with pytest.raises(ConfigError, match="--config f: not valid JSON"):
        _kv_transfer_config("{", "--config f")


def test_unreadable_config_file_is_one_failed_line(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "nope.json")], environ={}) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("FAIL config  --config: cannot read")


def test_missing_master_is_the_config_line(capsys):
    assert main([], environ={}) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FAIL config") and "master_server_address: not set" in lines[0]
    assert all(line.startswith("SKIP") for line in lines[1:])
