"""The Prometheus alert rules in dashboards/alerts.yaml: they parse, their promtool unit tests
pass (each alert fires on a bad series and stays quiet on a healthy one), and every metric they
name is one the connector exports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dashboards import promql  # noqa: E402

RULES = ROOT / "dashboards" / "alerts.yaml"
RULE_TESTS = ROOT / "dashboards" / "alerts_test.yaml"
EXPECTED_ALERTS = {
    "MooncakePoolLoadErrorRateHigh",
    "MooncakePoolLoadQueueSaturated",
    "MooncakePoolMasterLookupSlow",
    "MooncakePoolStoreHitRateZero",
    "MooncakePoolStoreHitRateCollapsed",
    "MooncakePoolNoSuccessfulStoreOps",
    "MooncakePoolMasterUnreachable",
    "MooncakePoolStoreCallsStuck",
    "MooncakeMasterNoServingLeader",
    "MooncakeMasterStandbyNotFollowing",
}


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if not exe:
        pytest.fail("promtool not found; run scripts/setup_dashboard_tools.sh "
                    "(apt-get install prometheus)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_rules_parse():
    r = _promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in r.stdout


def test_rule_unit_tests_pass():
    r = _promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_rule_unit_tests_can_fail(tmp_path):
    """Sanity: a rules file whose threshold no longer matches makes the unit tests fail."""
    broken = RULES.read_text().replace("> 0.05", "> 0.5")
    assert broken != RULES.read_text()
    (tmp_path / "alerts.yaml").write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    r = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert r.returncode != 0
    assert "MooncakePoolLoadErrorRateHigh" in r.stdout + r.stderr


def test_every_alert_is_documented_and_tested():
    rules = _rules()
    assert {r["alert"] for r in rules} == EXPECTED_ALERTS
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fires, quiet = set(), set()
    for t in tests:
        for a in t.get("alert_rule_test", []):
            (fires if a.get("exp_alerts") else quiet).add(a["alertname"])
    for r in rules:
        name = r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        assert "Runbook:" in r["annotations"]["description"], f"{name}: no runbook hint"
        assert name in fires, f"{name}: no promtool test where it fires"
        assert name in quiet, f"{name}: no promtool test where it stays quiet"


def test_alert_metrics_are_exported_by_the_connector():
    allowed = promql.exported_names() | set(promql.VLLM_CORE) | set(promql.MASTER_HA)
    for r in _rules():
        names = promql.metric_names(r["expr"])
        assert names, r["alert"]
        assert names <= allowed, f"{r['alert']}: unknown metrics {sorted(names - allowed)}"


def test_alert_test_series_are_exported_by_the_connector():
    """The unit tests feed only real series names, with each family's real label names."""
    families = {}
    for f in promql.CATALOG.FAMILIES:
        for s in (("_bucket", "_sum", "_count") if f.kind == "histogram" else ("",)):
            families[f.name + s if s else f.exported] = f
    target_labels = {"job", "instance", "pod", "vllm_deployment"}
    for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for s in t["input_series"]:
            name, _, rest = s["series"].partition("{")
            labels = {kv.split("=")[0].strip() for kv in rest.rstrip("}").split(",")}
            if name in promql.MASTER_HA:  # a master's own series: target labels only
                assert labels == {"job", "instance"}, s["series"]
                continue
            assert name in families, name
            f = families[name]
            want = {"model_name", "engine", *f.labels} | ({"le"} if name.endswith("_bucket")
                                                          else set())
            assert labels - target_labels == want, f"{s['series']}: labels != {sorted(want)}"


RUNBOOKS = ROOT / "docs" / "runbooks"


def _dashboard_titles() -> set[str]:
    import json

    titles: set[str] = set()

    def walk(panels: list[dict]) -> None:
        for p in panels:
            titles.add(p.get("title", ""))
            walk(p.get("panels", []))

    for f in (ROOT / "dashboards").glob("*.json"):
        d = json.loads(f.read_text())
        titles.add(d["title"])
        walk(d["panels"])
    return titles


def test_runbook_pages_match_their_alerts_and_dashboards():
    """docs/runbooks/<AlertName>.md: an alert of that name points to it, the page has the
    four sections an on-call engineer looks for, and every dashboard, row and panel it names
    exists in the committed dashboards."""
    import re

    rules = {r["alert"]: r for r in _rules()}
    titles = _dashboard_titles()
    pages = sorted(RUNBOOKS.glob("*.md"))
    assert pages
    for page in pages:
        name, text = page.stem, page.read_text()
        assert name in rules, f"{page.name}: no alert {name}"
        assert f"docs/runbooks/{page.name}" in rules[name]["annotations"]["description"], name
        for section in ("## What it means", "## Confirm on the dashboards", "## Likely causes",
                        "## Fix"):
            assert section in text, f"{page.name}: no {section!r}"
        named = re.findall(r'(?:panel|row|On) "([^"]+)"', text)
        assert named, f"{page.name}: names no dashboard panel"
        assert set(named) <= titles, f"{page.name}: unknown {sorted(set(named) - titles)}"


def test_no_leader_runbook_names_the_failed_promotion():
    text = (RUNBOOKS / "MooncakeMasterNoServingLeader.md").read_text()
    assert "Failed to start master service: 1" in text and "status 255" in text
    assert "net.ipv4.ip_local_reserved_ports" in text and "restartPolicy" in text
