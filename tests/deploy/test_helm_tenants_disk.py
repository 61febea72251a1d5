"""The chart's tenants (a tenant per deployment, the master's multi-tenant quota policy) and disk
tier (store nodes with --enable_offload, a volume for the offload path, engines told, the
network policy opened for disk reads), rendered with real `helm template` and checked with
`helm lint` and `kubernetes-validate` (ci/tenants-disk-tier-values.yaml)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helm_kit import (
    CHART,
    WITH_IMAGE,
    arg_after,
    by_kind,
    env_of,
    kubernetes_validate,
    vllm_containers,
)

VALUES = CHART / "ci" / "tenants-disk-tier-values.yaml"


@pytest.fixture(scope="module")
def docs(helm) -> list[dict]:
    return helm.render("-f", str(VALUES))


def test_lint_and_kubernetes_validate(helm, tmp_path):
    r = helm.run("lint", "--strict", str(CHART), *WITH_IMAGE, "-f", str(VALUES))
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(helm.template("-f", str(VALUES)).stdout)
    r = kubernetes_validate(rendered)
    assert r.returncode == 0, r.stdout + r.stderr


def deployment(docs: list[dict], suffix: str) -> dict:
    return next(d for name, d in by_kind(docs, "Deployment").items() if name.endswith(suffix))


def test_master_runs_multi_tenant_with_the_policy(docs):
    master = deployment(docs, "-master")["spec"]["template"]["spec"]
    args = master["containers"][0]["args"]
    assert "--enable_multi_tenants=true" in args and "--tenant_quota_connector_type=file" in args
    uri = next(a for a in args if a.startswith("--tenant_quota_connector_uri="))
    mount = next(m for m in master["containers"][0]["volumeMounts"]
                 if m["name"] == "tenant-quotas")
    assert uri.split("=", 1)[1].startswith(mount["mountPath"] + "/")
    cm_name = next(v for v in master["volumes"] if v["name"] == "tenant-quotas")["configMap"]
    policy = yaml.safe_load(by_kind(docs, "ConfigMap")[cm_name["name"]]["data"][
        "tenant_quotas.yaml"])
    assert policy == {"version": 1, "tenants": [{"name": "search", "quota": "200GB"},
                                                {"name": "batch", "quota": "40GB"}]}
    assert "--enable_offload=true" in args  # the store nodes keep a disk tier


def test_each_deployment_is_its_tenant(docs):
    cms = by_kind(docs, "ConfigMap")
    for name in ("search", "batch"):
        cfg = json.loads(next(cm for n, cm in cms.items() if n.endswith(f"-{name}-mooncake"))
                         ["data"]["mooncake.json"])
        assert cfg["tenant_id"] == name and cfg["enable_offload"] is True


def test_rendered_tenant_and_disk_tier_reach_the_connector(docs, tmp_path):
    """The connector's own loader reads each deployment's rendered Mooncake file."""
    from connector.config import load_config

    cms = by_kind(docs, "ConfigMap")
    for name, c in vllm_containers(docs).items():
        path = tmp_path / f"{name}.json"
        path.write_text(next(cm for n, cm in cms.items() if n.endswith(f"-{name}-mooncake"))
                        ["data"]["mooncake.json"])
        kv = json.loads(arg_after(c["args"], "--kv-transfer-config"))
        cfg = load_config(kv.get("kv_connector_extra_config"),
                          {"MOONCAKE_CONFIG_PATH": str(path)}, kv_role=kv["kv_role"])
        assert cfg.store.tenant_id == name and cfg.enable_offload and cfg.tier_metrics


def test_store_nodes_keep_the_disk_tier_on_its_volume(docs):
    spec = deployment(docs, "-store")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert "--enable_offload=true" in c["args"]
    env = env_of(c)
    path = env["MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"]["value"]
    assert env["MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES"]["value"] == "1800000000000"
    assert env["MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY"]["value"] == "lru"
    assert {"name": "offload", "mountPath": path} in c["volumeMounts"]
    assert {"name": "offload", "persistentVolumeClaim": {"claimName": "mooncake-nvme"}} in \
        spec["volumes"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True  # the tier is a volume


def test_network_policy_lets_engines_read_the_disk_tier(docs):
    store = next(p for n, p in by_kind(docs, "NetworkPolicy").items() if n.endswith("-store"))
    ports = store["spec"]["ingress"][0]["ports"]
    assert {"port": 32768, "endPort": 60999, "protocol": "TCP"} in ports


def test_without_offload_nothing_of_the_disk_tier_renders(helm):
    docs = helm.render(values={"storeNodes": {"enabled": True}})
    store = deployment(docs, "-store")["spec"]["template"]["spec"]
    assert "--enable_offload=true" not in store["containers"][0]["args"]
    assert all(v["name"] != "offload" for v in store["volumes"])
    assert "--enable_offload=true" not in deployment(docs, "-master")["spec"]["template"][
        "spec"]["containers"][0]["args"]
    cm = next(cm for n, cm in by_kind(docs, "ConfigMap").items() if n.endswith("-mooncake"))
    assert json.loads(cm["data"]["mooncake.json"])["enable_offload"] is False


@pytest.mark.parametrize("values,message", [
    ({"master": {"multiTenants": {"enabled": True, "tenants": [{"name": "a", "quota": "1GB"}]}},
      "deployments": [{"name": "b", "model": "m", "tenantId": "b"}]},
     'deployments[b]: tenantId "b" is not in master.multiTenants.tenants'),
    ({"master": {"multiTenants": {"enabled": True}}},
     "master.multiTenants.enabled: list the tenants and their quotas"),
])
def test_inconsistent_tenants_are_refused(helm, values, message):
    assert message in helm.error(values=values)


@pytest.mark.parametrize("values,path", [
    ({"deploymentDefaults": {"tenantId": "_internal"}}, "/deploymentDefaults/tenantId"),
    ({"master": {"multiTenants": {"tenants": [{"name": "a", "quota": "lots"}]}}},
     "/master/multiTenants/tenants/0/quota"),
    ({"storeNodes": {"offload": {"evictionPolicy": "random"}}},
     "/storeNodes/offload/evictionPolicy"),
])
def test_schema_rejects_bad_tenant_and_disk_values(helm, values, path):
    assert path in helm.error(values=values)
