"""Static checks of the generated Grafana dashboards (no Grafana server needed).

- the committed JSON is what `python -m dashboards.generate` produces;
- every PromQL expression parses (`promtool check rules` on a throw-away rules file);
- every metric an expression names is exported by the connector (metric_catalog), by vLLM core
  (a short allow-list) or by a real Mooncake master (scraped from its /metrics here);
- every query filters by the dashboard variables its family's labels allow;
- the JSON type-checks with `tsc --strict` against @grafana/schema 11.6.

Tools: promtool (Debian `prometheus`), grafana-foundation-sdk and dashboards/tscheck/node_modules;
scripts/setup_dashboard_tools.sh installs them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dashboards import promql  # noqa: E402

DASH_DIR = ROOT / "dashboards"
TSC = DASH_DIR / "tscheck" / "node_modules" / ".bin" / "tsc"
SETUP_HINT = "run scripts/setup_dashboard_tools.sh"


def _dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASH_DIR.glob("*.json"))}


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels inside collapsed rows
    return [p for p in out if p.get("type") != "row"]


def _exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every target."""
    return [(name, p["title"], t["expr"]) for name, d in _dashboards().items()
            for p in _panels(d) for t in p.get("targets", [])]


def _variable_selectors() -> list[tuple[str, str, str]]:
    """The series selector inside every `label_values(selector, label)` variable query."""
    out = []
    for name, d in _dashboards().items():
        for v in d["templating"]["list"]:
            q = v.get("query")
            if isinstance(q, dict):
                q = q.get("query", "")
            m = re.fullmatch(r"label_values\((.*),\s*\w+\)", q or "")
            if v.get("type") == "query":
                assert m, f"{name}: variable {v['name']} query {q!r} is not label_values(...)"
                out.append((name, f"variable ${v['name']}", m.group(1)))
    return out


def _promtool() -> str:
    exe = shutil.which("promtool")
    if not exe:
        pytest.fail(f"promtool not found; {SETUP_HINT}")
    return exe


def _check_exprs(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    rules = {"groups": [{"name": "dashboard_exprs", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": promql.substitute(e, rate_interval="5m")}
        for i, e in enumerate(exprs)]}]}
    path = tmp_path / "exprs.rules.json"  # JSON is YAML; no quoting surprises
    path.write_text(json.dumps(rules, indent=1))
    return subprocess.run([_promtool(), "check", "rules", str(path)],
                          capture_output=True, text=True, timeout=60)


# --- generation -------------------------------------------------------------------------------

def test_committed_json_is_up_to_date():
    r = subprocess.run([sys.executable, "-m", "dashboards.generate", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"dashboards are stale; run python -m dashboards.generate\n{r.stderr}"
    assert set(_dashboards()) == {"load-pipeline.json", "errors-and-store.json"}


def test_check_flags_a_stale_file(tmp_path):
    from dashboards import generate

    for d in generate.DASHBOARDS:
        shutil.copy(DASH_DIR / d.file, tmp_path / d.file)
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0
    stale = tmp_path / generate.DASHBOARDS[0].file
    stale.write_text(stale.read_text().replace("Shared load queue depth", "Queue"))
    assert generate.main(["--check", "--out", str(tmp_path)]) == 1
    assert generate.main(["--out", str(tmp_path)]) == 0  # regenerating repairs it
    assert generate.main(["--check", "--out", str(tmp_path)]) == 0


def test_layout_ids_and_metadata():
    for name, d in _dashboards().items():
        assert d["uid"] and d["title"] and d["schemaVersion"] >= 39, name
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        cells: dict[tuple[int, int], str] = {}
        for p in d["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24, (name, p["title"], g)
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{name}: {p['title']} overlaps {cells[(x, y)]}"
                    cells[(x, y)] = p["title"]
        for p in _panels(d):
            assert p.get("description"), f"{name}: panel {p['title']} has no description"
            assert p["fieldConfig"]["defaults"].get("unit"), f"{name}: {p['title']} has no unit"
            assert p["targets"], f"{name}: {p['title']} has no query"
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        names = [v["name"] for v in d["templating"]["list"]]
        uses_master = bool(re.search(r'(?<![\w:])master_', json.dumps(d["panels"])))
        assert names == ["datasource", "model", "pod", "tp_rank", "thread"] + (
            ["master"] if uses_master else []), names
        for v in d["templating"]["list"][1:]:
            assert v["includeAll"] and v["allValue"] == ".*" and v["multi"], v["name"]


# --- PromQL -----------------------------------------------------------------------------------

def test_every_expression_parses(tmp_path):
    exprs = [e for _, _, e in _exprs()] + [e for _, _, e in _variable_selectors()]
    assert len(exprs) > 40
    r = _check_exprs(exprs, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in r.stdout


def test_promtool_rejects_a_broken_expression(tmp_path):
    r = _check_exprs(["sum by (thread) (rate(vllm:mooncake_pool_load_bytes_total[5m])"], tmp_path)
    assert r.returncode != 0


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, thread) (rate(vllm:a_bucket{thread=~"$t", '
            'x="rate(y)"}[$__rate_interval]))) / on (pod) group_left sum(master_b) or vector(0)')
    assert promql.metric_names(expr) == {"vllm:a_bucket", "master_b"}


@pytest.fixture(scope="module")
def master_metric_names() -> set[str]:
    """Every family name a real mooncake_master exports."""
    from devkit.local_cluster import MooncakeMaster

    master = MooncakeMaster().start()
    try:
        text = master.metrics_text()
    finally:
        master.stop()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    names |= {re.split(r"[{\s]", line, maxsplit=1)[0] for line in text.splitlines()
              if line and not line.startswith("#")}
    assert "master_key_count" in names
    return names


def test_every_metric_exists(master_metric_names):
    connector = promql.exported_names()
    allowed = connector | set(promql.VLLM_CORE) | master_metric_names | set(promql.MASTER_HA) \
        | set(promql.MASTER_TENANT)
    unknown = []
    for name, title, expr in _exprs() + _variable_selectors():
        names = promql.metric_names(expr)
        assert names, f"{name}: {title}: no metric in {expr}"
        unknown += [f"{name}: {title}: {m}" for m in sorted(names - allowed)]
        for m in names:
            if not m.startswith(("vllm:", *promql.MASTER_PREFIXES)):
                unknown.append(f"{name}: {title}: {m} is neither vllm: nor a master family "
                               f"{promql.MASTER_PREFIXES}")
    assert not unknown, "\n".join(unknown)


def test_every_connector_family_is_on_a_dashboard():
    used = set().union(*(promql.metric_names(e) for _, _, e in _exprs()))
    missing = []
    for f in promql.CATALOG.FAMILIES:
        series = {f.name + s for s in ("_bucket", "_sum", "_count")} if f.kind == "histogram" \
            else {f.exported}
        if not series & used:
            missing.append(f.exported)
    assert not missing, f"families without a panel: {missing}"


_SELECTOR = re.compile(r"((?:vllm:|" + "|".join(promql.MASTER_PREFIXES)
                       + r")[A-Za-z0-9_:]*)(\{[^}]*\})?")


def _wanted_filters(metric: str, by_exported: dict) -> dict[str, str]:
    """label -> variable every selector of `metric` must carry."""
    if metric.startswith(promql.MASTER_PREFIXES):
        return {"instance": "master"}
    labels = ("model_name", "pod") + tuple(by_exported[metric].labels if metric in by_exported
                                           else ())
    return {lb: promql.VARIABLES[lb] for lb in labels if lb in promql.VARIABLES}


def test_every_query_filters_by_the_dashboard_variables():
    """Each selector carries `label=~"$var"` for every variable label its family has. A variable
    query filters by the variables before it: model > pod > tp_rank > thread cascade."""
    by_exported = {}
    for f in promql.CATALOG.FAMILIES:
        for s in (("_bucket", "_sum", "_count") if f.kind == "histogram" else ("",)):
            by_exported[f.name + s if s else f.exported] = f
    order = list(promql.VARIABLES.values())
    problems = []
    for name, title, expr in _exprs() + _variable_selectors():
        for m in _SELECTOR.finditer(expr):
            metric, matchers = m.group(1), m.group(2) or ""
            want = _wanted_filters(metric, by_exported)
            if title.startswith("variable $"):
                own = title.removeprefix("variable $")
                before = order[:order.index(own)] if own in order else []
                want = {k: v for k, v in want.items() if v in before}
            for label, var in want.items():
                if f'{label}=~"${var}"' not in matchers:
                    problems.append(f"{name}: {title}: {metric} lacks {label}=~\"${var}\"")
    assert not problems, "\n".join(problems)


# --- Grafana schema ---------------------------------------------------------------------------

def _tsc(tmp_path: Path, dashboards: dict[str, dict]) -> subprocess.CompletedProcess:
    if not TSC.exists():
        pytest.fail(f"{TSC} missing; {SETUP_HINT}")
    if not shutil.which("node"):
        pytest.fail("node not found; install Node.js >= 18")
    (tmp_path / "node_modules").symlink_to(TSC.parents[1])
    files = []
    for name, d in dashboards.items():
        ts = tmp_path / (Path(name).stem + ".ts")
        ts.write_text(
            "import type { Dashboard } from '@grafana/schema';\n"
            "function check<const T extends Dashboard>(x: T): T { return x; }\n"
            f"check({json.dumps(d, indent=1)});\n")
        files.append(str(ts))
    return subprocess.run(
        [str(TSC), "--strict", "--noEmit", "--target", "es2022", "--module", "esnext",
         "--moduleResolution", "bundler", *files],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "NODE_OPTIONS": "--max-old-space-size=1024"})


def test_json_typechecks_against_grafana_schema(tmp_path):
    r = _tsc(tmp_path, _dashboards())
    assert r.returncode == 0, r.stdout + r.stderr


def test_tsc_catches_a_schema_error(tmp_path):
    d = json.loads((DASH_DIR / "load-pipeline.json").read_text())
    d["panels"][1]["gridPos"]["h"] = "8"  # a string where the schema wants a number
    d["refresh"] = 30
    r = _tsc(tmp_path, {"broken.json": d})
    assert r.returncode != 0
    assert "not assignable" in r.stdout


def test_vllm_allow_list_matches_vllm():
    """Every vLLM core family the dashboards use is defined in the installed vLLM's metrics code
    (read as text; vLLM is not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        pytest.fail("vllm is not installed; run scripts/setup.sh")
    source = "\n".join(p.read_text(errors="replace")
                       for p in (Path(spec.origin).parent / "v1" / "metrics").glob("*.py"))
    for name in promql.VLLM_CORE:
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}"' in source, f"{base} not defined by vLLM {spec.origin}"


def test_exemplar_panels_link_to_traces():
    """Every panel over an exemplar family asks Grafana for exemplars, and the provisioned
    Prometheus data source links the exemplar label holding the trace id to a traces source."""
    import yaml

    cat = promql.CATALOG
    for fam in cat.EXEMPLAR_FAMILIES:
        bucket = cat.BY_KEY[fam].name + "_bucket"
        panels = [p for d in _dashboards().values() for p in _panels(d)
                  if any(bucket in t["expr"] for t in p.get("targets", []))]
        assert panels, f"no panel shows {bucket}"
        for p in panels:
            assert all(t.get("exemplar") for t in p["targets"]), p["title"]
    ds = yaml.safe_load((DASH_DIR / "grafana-datasources.yaml").read_text())["datasources"]
    by_uid = {d["uid"]: d for d in ds}
    dests = [dest for d in ds if d["type"] == "prometheus"
             for dest in d["jsonData"]["exemplarTraceIdDestinations"]]
    assert dests
    for dest in dests:
        assert dest["name"] == cat.EXEMPLAR_LABELS[0]  # "trace_id", as observability/prom.py writes
        assert by_uid[dest["datasourceUid"]]["type"] in ("tempo", "jaeger", "zipkin")
