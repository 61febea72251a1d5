"""The Prometheus alert rules in dashboards/alerts.yaml: they parse, their promtool unit tests
pass (each alert fires on a bad series and stays quiet on a healthy one), and every metric they
name is one the connector exports; every alert has a runbook page (docs/runbooks/<AlertName>.md)
and a runbook_url to it, and every page an alert."""

from __future__ import annotations

import json
import re
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
    "MooncakePoolSavesFailing",
    "MooncakePoolKvEventSweepFailing",
    "MooncakePoolTenantPutsRefused",
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


# ---------------------------------------------------------------- runbooks

RUNBOOKS = ROOT / "docs" / "runbooks"
SECTIONS = ["What it means", "Confirm it on the dashboards", "Likely causes, most likely first",
            "Fix"]
# A panel reference in a runbook: **<dashboard> › <panel title>**.
PANEL_REF = re.compile(r"\*\*([^*›]+?) › ([^*]+?)\*\*")


def _panels() -> dict[str, set[str]]:
    """Panel and row titles of each dashboard, keyed by its title after 'Mooncake pool / '."""
    out = {}
    for path in (ROOT / "dashboards").glob("*.json"):
        dash = json.loads(path.read_text())
        titles, stack = set(), list(dash["panels"])
        while stack:
            p = stack.pop()
            titles.add(" ".join(p.get("title", "").split()))
            stack += p.get("panels", [])
        out[dash["title"].removeprefix("Mooncake pool / ")] = titles
    return out


def test_every_alert_has_a_runbook_page_and_every_page_an_alert():
    alerts = {r["alert"] for r in _rules()}
    pages = {p.stem for p in RUNBOOKS.glob("*.md")}
    assert not alerts - pages, f"alerts without a page docs/runbooks/<AlertName>.md: " \
                               f"{sorted(alerts - pages)}"
    assert not pages - alerts, f"runbook pages of no alert in dashboards/alerts.yaml: " \
                               f"{sorted(pages - alerts)}"


def test_every_alert_links_its_runbook():
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["site_url"]
    for r in _rules():
        assert r["annotations"].get("runbook_url") == f"{site}runbooks/{r['alert']}/", \
            f"{r['alert']}: runbook_url must be <mkdocs.yml site_url>runbooks/{r['alert']}/"


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_runbook_page_says_what_where_why_and_how(rule):
    """Each page: its alert and severity, the four sections in order, and panel references
    that exist on the dashboards."""
    name = rule["alert"]
    path = RUNBOOKS / f"{name}.md"
    if not path.exists():
        pytest.fail(f"no runbook page {path.relative_to(ROOT)}")
    text = path.read_text()
    assert text.startswith(f"# {name}\n"), f"{path.name}: first line must be '# {name}'"
    assert f"**Severity** {rule['labels']['severity']}." in text, path.name
    heads = re.findall(r"^## (.+)$", text, re.M)
    assert heads == SECTIONS, f"{path.name}: sections {heads}, want {SECTIONS}"
    confirm = text.split("## Confirm it on the dashboards")[1].split("\n## ")[0]
    refs = PANEL_REF.findall(" ".join(confirm.split()))
    assert refs, f"{path.name}: name the panels that confirm it, as **Dashboard › Panel**"
    panels = _panels()
    for dash, panel in PANEL_REF.findall(" ".join(text.split())):
        assert dash in panels, f"{path.name}: no dashboard {dash!r}; have {sorted(panels)}"
        assert panel in panels[dash], f"{path.name}: no panel {panel!r} on {dash!r}"


def test_alerts_page_links_every_runbook():
    page = (ROOT / "docs" / "alerts.md").read_text()
    for r in _rules():
        assert f"[{r['alert']}](runbooks/{r['alert']}.md)" in page, \
            f"docs/alerts.md: add a row for {r['alert']} linking its runbook"


def test_no_leader_runbook_names_the_failed_promotion():
    """The case behind most of this alert's firings on Mooncake 0.3.13, by its log line and
    exit status, with the prevention and the recovery (tests/store/test_ha_promotion.py)."""
    text = (RUNBOOKS / "MooncakeMasterNoServingLeader.md").read_text()
    assert "Failed to start master service: 1" in text and "status 255" in text
    assert "net.ipv4.ip_local_reserved_ports" in text and "restartPolicy" in text
