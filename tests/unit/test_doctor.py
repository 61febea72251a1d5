"""The preflight's runner and input parsing, without a store: a check runs only when the checks
it needs passed, a check that does not apply prints nothing, every failure sets the exit status,
and a kv-transfer-config is read as vllm serve reads it. (The checks themselves run against a
real master, store node and etcd in tests/store/test_doctor.py.)"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from connector.config import ConfigError
from connector.doctor import Check, CheckFailed, Context, _kv_transfer_config, main, run

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_kv_events_check_imports_no_vllm():
    """The kv events check (its settings and the sweep's answer) runs without importing vLLM
    or torch: their import was most of a doctor run with kv events on."""
    code = (
        "import sys\n"
        "from connector.config import load_config\n"
        "from connector.doctor import Context, check_kv_events\n"
        "ctx = Context(extra={}, environ={}, metrics_port=9003, min_segments=1, timeout=1.0)\n"
        "ctx.cfg = load_config({'master_server_address': '127.0.0.1:50051', "
        "'metadata_server': 'P2PHANDSHAKE', 'kv_events': 'on', 'kv_events_sweep_s': 0}, {})\n"
        "print(check_kv_events(ctx))\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("medium STORAGE") and lines[-1] == "[]", out.stdout
