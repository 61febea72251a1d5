"""checkov (Kubernetes framework) on what users deploy: the chart rendered with the default
values, with RDMA on (ci/three-deployments-values.yaml) and with HA masters (ci/ha-values.yaml).
Every finding must be accepted, with a reason, in helm/checkov-skips.yaml; a new finding fails,
and so does an accepted one that no longer occurs.

checkov lives in its own virtualenv (bin/checkov-env, scripts/setup_checks.sh).
"""

from __future__ import annotations

import fnmatch
import json
import subprocess

import pytest
import yaml

from tests.helm_kit import CI_VALUES, HA_VALUES, ROOT, Helm, ensure_helm

CHECKOV = ROOT / "bin" / "checkov"
SKIPS = ROOT / "helm" / "checkov-skips.yaml"


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> set[tuple[str, str]]:
    """(check id, resource) of every failed check over the three renders."""
    if not CHECKOV.exists():
        r = subprocess.run(["bash", str(ROOT / "scripts" / "setup_checks.sh")], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0 and CHECKOV.exists(), r.stdout + r.stderr
    tmp = tmp_path_factory.mktemp("checkov")
    helm = Helm(ensure_helm(), tmp)
    files = []
    for name, args in (("defaults", []), ("rdma", ["-f", str(CI_VALUES)]),
                       ("ha", ["-f", str(HA_VALUES)])):
        f = tmp / f"{name}.yaml"
        f.write_text(helm.template(*args).stdout)
        files += ["-f", str(f)]
    r = subprocess.run([str(CHECKOV), *files, "--framework", "kubernetes", "--skip-download",
                        "--compact", "--quiet", "-o", "json"],
                       capture_output=True, text=True, timeout=600)
    reports = json.loads(r.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    out = set()
    for rep in reports:
        assert rep["check_type"] == "kubernetes"
        assert rep["summary"]["passed"] > 50, rep["summary"]  # it did check the manifests
        out |= {(f["check_id"], f["resource"]) for f in rep["results"]["failed_checks"]}
    return out


def skips() -> dict[str, dict]:
    return yaml.safe_load(SKIPS.read_text())


def accepted(check: str, resource: str, table: dict[str, dict]) -> bool:
    entry = table.get(check)
    return entry is not None and any(fnmatch.fnmatch(resource, g)
                                     for g in entry.get("resources", ["*"]))


def test_every_skip_has_a_reason():
    for check, entry in skips().items():
        assert check.startswith("CKV_K8S_"), check
        assert len(entry["reason"]) > 40 or entry["reason"].startswith("Same as "), check
        assert set(entry) <= {"title", "reason", "resources"}, check


def test_no_new_findings(findings):
    table = skips()
    new = sorted(f for f in findings if not accepted(*f, table))
    assert not new, "checkov findings: fix them or add them to helm/checkov-skips.yaml " \
                    f"with a reason: {new}"


def test_no_stale_skips(findings):
    table = skips()
    stale = []
    for check, entry in table.items():
        for glob in entry.get("resources", ["*"]):
            if not any(c == check and fnmatch.fnmatch(r, glob) for c, r in findings):
                stale.append((check, glob))
    assert not stale, f"helm/checkov-skips.yaml accepts findings that no longer occur: {stale}"


def test_capability_finding_is_only_the_rdma_deployment(findings):
    """IPC_LOCK is the expected RDMA capability: nothing else adds one (the helm test pod has
    it for the RDMA deployment's preflight container alone)."""
    assert {r for c, r in findings if c == "CKV_K8S_25"} == \
        {"Deployment.llm.pool-mooncake-pooled-connector-threads-16",
         "Pod.llm.pool-mooncake-pooled-connector-preflight"}
