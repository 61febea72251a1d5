"""`master.ha.enabled` rendered by the real helm: two masters electing a leader through etcd
(an existing one, or the bundled single-member StatefulSet), with the flags measured to work on
Mooncake 0.3.13.post1 (oplog on, the pod IP as --rpc_address), anti-affinity, a
PodDisruptionBudget, clients pointed at etcd with the cluster id, and both masters scraped.
"""

from __future__ import annotations

import json

import pytest

from tests.helm_kit import (
    HA_VALUES,
    PREFIX,
    RELEASE,
    by_kind,
    env_of,
    vllm_containers,
)

MASTER = f"{PREFIX}-master"
ETCD = f"{PREFIX}-etcd"
BUNDLED = f"{ETCD}.llm.svc:2379"
MASTER_LABELS = {"app.kubernetes.io/name": "mooncake-pooled-connector",
                 "app.kubernetes.io/instance": RELEASE, "app.kubernetes.io/component": "master"}


@pytest.fixture(scope="module")
def ha(helm) -> list[dict]:
    return helm.render("-f", str(HA_VALUES))


def master_pod(docs: list[dict]) -> dict:
    return by_kind(docs, "Deployment")[MASTER]["spec"]["template"]


def test_two_masters_with_the_ha_flags(ha):
    dep = by_kind(ha, "Deployment")[MASTER]
    assert dep["spec"]["replicas"] == 2
    assert "strategy" not in dep["spec"]  # RollingUpdate: a standby takes over during a rollout
    c = master_pod(ha)["spec"]["containers"][0]
    assert c["args"] == [
        "--rpc_port=50051", "--rpc_address=$(POD_IP)", "--enable_ha=true",
        "--ha_backend_type=etcd", f"--etcd_endpoints={BUNDLED}", "--cluster_id=pool-a",
        "--enable_oplog=true", "--metrics_host=0.0.0.0", "--metrics_port=9003",
        "--rpc_enable_tcp_no_delay=true", "--client_ttl=10",
    ]
    assert env_of(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert {p["name"] for p in c["ports"]} == {"rpc", "metrics"}
    # a standby listens only on its metrics port, which serves /health for every role
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics"}, probe


@pytest.mark.parametrize("mode", ["required", "preferred"])
def test_masters_repel_each_other(helm, mode):
    key = f"{mode}DuringSchedulingIgnoredDuringExecution"
    docs = helm.render("-f", str(HA_VALUES), "--set", f"master.ha.antiAffinity={mode}")
    tpl = master_pod(docs)
    anti = tpl["spec"]["affinity"]["podAntiAffinity"]
    assert list(anti) == [key]
    (term,) = anti[key]
    term = term.get("podAffinityTerm", term)
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == MASTER_LABELS
    assert MASTER_LABELS.items() <= tpl["metadata"]["labels"].items()


def test_pod_disruption_budget(helm, ha):
    (pdb,) = by_kind(ha, "PodDisruptionBudget").values()
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == MASTER_LABELS
    assert not by_kind(helm.render(), "PodDisruptionBudget")  # single master: no PDB
    err = helm.error("-f", str(HA_VALUES), "--set", "master.ha.podDisruptionBudget.minAvailable=2")
    assert "master.ha.podDisruptionBudget.minAvailable 2 must be below master.ha.replicas 2" in err


def test_bundled_etcd(ha):
    (sts,) = by_kind(ha, "StatefulSet").values()
    assert sts["metadata"]["name"] == ETCD and sts["spec"]["replicas"] == 1
    svc = by_kind(ha, "Service")[ETCD]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert [p["port"] for p in svc["spec"]["ports"]] == [2379]
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "quay.io/coreos/etcd:v3.5.21" and c["command"] == ["etcd"]
    assert "--listen-client-urls=http://0.0.0.0:2379" in c["args"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "client"}
    vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in vols["data"]


def test_bundled_etcd_persistence(helm):
    persistence = "master.ha.etcd.bundled.persistence"
    docs = helm.render("-f", str(HA_VALUES), "--set", f"{persistence}.enabled=true",
                       "--set", f"{persistence}.storageClassName=fast")
    (sts,) = by_kind(docs, "StatefulSet").values()
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    assert "volumes" not in sts["spec"]["template"]["spec"]


def test_existing_etcd_replaces_the_bundled_one(helm):
    docs = helm.render("-f", str(HA_VALUES),
                       "--set", "master.ha.etcd.endpoints[0]=etcd-0.infra:2379",
                       "--set", "master.ha.etcd.endpoints[1]=etcd-1.infra:2379")
    assert not by_kind(docs, "StatefulSet") and ETCD not in by_kind(docs, "Service")
    args = master_pod(docs)["spec"]["containers"][0]["args"]
    assert "--etcd_endpoints=etcd-0.infra:2379;etcd-1.infra:2379" in args
    cm = next(iter(by_kind(docs, "ConfigMap").values()))
    cfg = json.loads(cm["data"]["mooncake.json"])
    assert cfg["master_server_address"] == "etcd://etcd-0.infra:2379;etcd-1.infra:2379"


def test_clients_find_the_leader_through_etcd(ha):
    cms = by_kind(ha, "ConfigMap")
    engines = vllm_containers(ha)
    assert set(engines) == {"engine-a", "engine-b"}
    for name, c in engines.items():
        cfg = json.loads(cms[f"{PREFIX}-{name}-mooncake"]["data"]["mooncake.json"])
        assert cfg["master_server_address"] == f"etcd://{BUNDLED}"
        assert cfg["metadata_server"] == f"etcd://{BUNDLED}"
        assert env_of(c)["MC_STORE_CLUSTER_ID"]["value"] == "pool-a"
    store = by_kind(ha, "Deployment")[f"{PREFIX}-store"]["spec"]["template"]["spec"]
    c = store["containers"][0]
    assert f"--master_server_address=etcd://{BUNDLED}" in c["args"]
    assert f"--metadata_server=etcd://{BUNDLED}" in c["args"]
    assert env_of(c)["MC_STORE_CLUSTER_ID"]["value"] == "pool-a"
    # Store nodes leave a partitioned leader within seconds, not Mooncake's 30 s RPC timeout.
    assert env_of(c)["MC_RPC_TIMEOUT_MS"]["value"] == "5000"
    assert env_of(c)["MC_RPC_CONNECT_TIMEOUT_MS"]["value"] == "1000"


def test_no_cluster_id_without_ha(helm):
    docs = helm.render("--set", "storeNodes.enabled=true")
    for d in by_kind(docs, "Deployment").values():
        for c in d["spec"]["template"]["spec"]["containers"]:
            for var in ("MC_STORE_CLUSTER_ID", "MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS"):
                assert var not in env_of(c), (d["metadata"]["name"], var)


@pytest.mark.parametrize("kind, endpoints", [("PodMonitor", "podMetricsEndpoints"),
                                             ("ServiceMonitor", "endpoints")])
def test_both_masters_are_scraped(helm, kind, endpoints):
    """The monitor selects every master (leader and standby) on the metrics port, which
    serves /metrics, /role and /ha_status; HA masters' Service carries only that port."""
    docs = helm.render("-f", str(HA_VALUES), "--set", f"monitoring.kind={kind}")
    mon = by_kind(docs, kind)[f"{PREFIX}-master"]
    assert mon["spec"]["selector"]["matchLabels"] == MASTER_LABELS
    (ep,) = mon["spec"][endpoints]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    tpl = master_pod(docs)
    assert MASTER_LABELS.items() <= tpl["metadata"]["labels"].items()
    assert by_kind(docs, "Deployment")[MASTER]["spec"]["replicas"] == 2
    svc = by_kind(docs, "Service")[MASTER]
    assert [p["name"] for p in svc["spec"]["ports"]] == ["metrics"]
    assert svc["spec"]["selector"] == MASTER_LABELS


@pytest.mark.parametrize("setting, message", [
    ("master.ha.replicas=1", "at '/master/ha/replicas': minimum: got 1, want 2"),
    ("master.ha.clusterId=a b", "at '/master/ha/clusterId'"),
    ("master.ha.antiAffinity=soft", "at '/master/ha/antiAffinity': value must be one of"),
    ("master.ha.etcd.endpoints[0]=http://etcd:2379", "at '/master/ha/etcd/endpoints/0'"),
    ("master.ha.etcd.bundled.persistence.size=lots",
     "at '/master/ha/etcd/bundled/persistence/size'"),
    ("master.ha.enable=true", "at '/master/ha': additional properties 'enable' not allowed"),
])
def test_schema_rejects_bad_ha_values(helm, setting, message):
    err = helm.error("-f", str(HA_VALUES), "--set", setting)
    assert message in err, err


def test_a_master_that_exits_is_started_again(helm, ha):
    """A promoted standby that cannot bind its RPC port exits with status 255 and no master
    serves (tests/store/test_ha_promotion.py). What recovers it here is restartPolicy: the
    master is the container's own process (no shell to outlive it), so the kubelet starts it
    again and it takes over. The /health probes cannot: /health answers 200 in every HA
    state. From Kubernetes 1.27 the pod also reserves the RPC port, so the case cannot arise
    from the pod's own outgoing connections."""
    pod = master_pod(ha)["spec"]
    assert pod["restartPolicy"] == "Always"
    (c,) = pod["containers"]
    assert c["command"] == ["mooncake_master"] and "--rpc_port=50051" in c["args"]
    assert all("exec" not in c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert pod["securityContext"]["sysctls"] == [
        {"name": "net.ipv4.ip_local_reserved_ports", "value": "50051"}]
    for args in (("--kube-version", "1.26.0"), ("--set", "master.ha.reserveRpcPort=false")):
        pod = master_pod(helm.render("-f", str(HA_VALUES), *args))["spec"]
        assert "sysctls" not in pod["securityContext"] and pod["restartPolicy"] == "Always"
    single = by_kind(helm.render(), "Deployment")[MASTER]["spec"]["template"]["spec"]
    assert single["restartPolicy"] == "Always" and "sysctls" not in single["securityContext"]
