"""The chart's network policies, rendered by the real helm: on by default, one per component,
every rendered pod selected by one, no rule that admits everybody, and the transfer engine's
port range in the policies equal to the range the processes are told to pick from.

The ports themselves were observed on a running master + store node + client (ss -ltnp):
the traffic matrix in docs/helm.md, "Network policies", lists them.
"""

from __future__ import annotations

import pytest

from tests.helm_kit import (
    CI_VALUES,
    HA_VALUES,
    PREFIX,
    RELEASE,
    by_kind,
    env_of,
)

RELEASE_PEER = {"podSelector": {"matchLabels": {
    "app.kubernetes.io/name": "mooncake-pooled-connector",
    "app.kubernetes.io/instance": RELEASE}}}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def pod_templates(docs: list[dict]) -> dict[str, dict]:
    """Every pod the release runs: workload templates, and bare pods (the helm test hook)."""
    out = {d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] in WORKLOADS}
    out |= {d["metadata"]["name"]: d for d in docs if d["kind"] == "Pod"}
    return out


def selects(policy: dict, labels: dict) -> bool:
    sel = policy["spec"]["podSelector"]
    assert set(sel) <= {"matchLabels"}, sel  # matchExpressions would need evaluating here
    return sel.get("matchLabels", {}).items() <= labels.items()


def rules_of(policy: dict) -> list[dict]:
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    return policy["spec"].get("ingress", [])


def open_ports(policy: dict, peer: dict) -> list[tuple[int, int]]:
    """(first, last) port ranges the policy opens to `peer` (exact peer match)."""
    out = []
    for rule in rules_of(policy):
        if peer in rule["from"]:
            out += [(p["port"], p.get("endPort", p["port"])) for p in rule["ports"]]
    return sorted(out)


@pytest.mark.parametrize("values", [None, CI_VALUES, HA_VALUES],
                         ids=["defaults", "three-deployments", "ha"])
def test_every_pod_is_selected_and_no_rule_admits_everybody(helm, values):
    docs = helm.render(*(["-f", str(values)] if values else []))
    policies = list(by_kind(docs, "NetworkPolicy").values())
    pods = pod_templates(docs)
    assert policies and pods
    for name, tpl in pods.items():
        assert any(selects(p, tpl["metadata"]["labels"]) for p in policies), \
            f"{name}: no NetworkPolicy selects its pods"
    for p in policies:
        assert p["spec"]["podSelector"].get("matchLabels"), p["metadata"]["name"]  # not {}
        assert rules_of(p), p["metadata"]["name"]
        for rule in rules_of(p):
            # no `from` (or an empty one) admits every source, no `ports` every port
            assert rule.get("from") and rule.get("ports"), (p["metadata"]["name"], rule)
            for peer in rule["from"]:
                assert peer and all(peer.values()), (p["metadata"]["name"], peer)
                assert "ipBlock" not in peer, (p["metadata"]["name"], peer)


def test_default_traffic_matrix(helm):
    """Defaults: master and engines; the release talks to itself on exactly these ports."""
    docs = helm.render()
    pols = by_kind(docs, "NetworkPolicy")
    assert set(pols) == {f"{PREFIX}-master", f"{PREFIX}-vllm", f"{PREFIX}-preflight"}
    master, vllm = pols[f"{PREFIX}-master"], pols[f"{PREFIX}-vllm"]
    assert open_ports(master, RELEASE_PEER) == [(8080, 8080), (9003, 9003), (50051, 50051)]
    assert len(rules_of(master)) == 1  # nobody else: metricsFrom is empty by default
    assert open_ports(vllm, RELEASE_PEER) == [(15000, 17000)]
    assert len(rules_of(vllm)) == 1  # the API port stays closed until apiFrom is set
    # the helm test pod: a release pod (so the master admits it), its own client's range only
    preflight = pols[f"{PREFIX}-preflight"]
    assert open_ports(preflight, RELEASE_PEER) == [(15000, 17000)]
    assert len(rules_of(preflight)) == 1
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    assert selects(preflight, pod["metadata"]["labels"])
    assert RELEASE_PEER["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_configured_peers_get_only_their_ports(helm):
    docs = helm.render("-f", str(CI_VALUES))
    pols = by_kind(docs, "NetworkPolicy")
    assert set(pols) == {f"{PREFIX}-{c}" for c in ("master", "vllm", "store", "preflight")}
    prom = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    assert open_ports(pols[f"{PREFIX}-master"], prom) == [(9003, 9003)]
    assert open_ports(pols[f"{PREFIX}-master"], gateway) == []
    assert open_ports(pols[f"{PREFIX}-vllm"], prom) == [(8000, 8000)]
    assert open_ports(pols[f"{PREFIX}-vllm"], gateway) == [(8000, 8000)]
    store = pols[f"{PREFIX}-store"]
    assert open_ports(store, RELEASE_PEER) == [(15000, 17000)]
    assert len(rules_of(store)) == 1
    # every pod of the release matches the release peer, so the pods can reach each other
    for name, tpl in pod_templates(docs).items():
        assert RELEASE_PEER["podSelector"]["matchLabels"].items() <= \
            tpl["metadata"]["labels"].items(), name


def test_ha_policies_cover_etcd_and_drop_the_metadata_port(helm):
    docs = helm.render("-f", str(HA_VALUES))
    pols = by_kind(docs, "NetworkPolicy")
    assert set(pols) == {f"{PREFIX}-{c}"
                         for c in ("master", "vllm", "store", "etcd", "preflight")}
    # HA masters serve no HTTP metadata (it lives in etcd)
    assert open_ports(pols[f"{PREFIX}-master"], RELEASE_PEER) == [(9003, 9003), (50051, 50051)]
    assert open_ports(pols[f"{PREFIX}-etcd"], RELEASE_PEER) == [(2379, 2379)]
    ext = helm.render("-f", str(HA_VALUES), "--set", "master.ha.etcd.endpoints[0]=etcd.infra:2379")
    assert f"{PREFIX}-etcd" not in by_kind(ext, "NetworkPolicy")


def test_transfer_ports_in_policy_match_the_processes_range(helm):
    """The range opened between pods is the range Mooncake is told to pick its ports from."""
    docs = helm.render("-f", str(CI_VALUES), "--set", "transferEngine.minPort=20000",
                       "--set", "transferEngine.maxPort=20063")
    for name in ("vllm", "store"):
        pol = by_kind(docs, "NetworkPolicy")[f"{PREFIX}-{name}"]
        assert open_ports(pol, RELEASE_PEER) == [(20000, 20063)]
    containers = [c for tpl in pod_templates(docs).values() for c in tpl["spec"]["containers"]
                  if c["name"] in ("vllm", "store")]
    assert len(containers) == 4  # three engine Deployments and the store node Deployment
    for c in containers:
        env = env_of(c)
        assert env["MC_MIN_RPC_PORT"]["value"] == "20000"
        assert env["MC_MAX_RPC_PORT"]["value"] == "20063"


@pytest.mark.parametrize("setting, message", [
    # Mooncake silently falls back to 15000-17000 inside the ephemeral range (observed).
    ("transferEngine.minPort=40000", "at '/transferEngine/minPort'"),
    ("transferEngine.maxPort=80000", "at '/transferEngine/maxPort'"),
    ("networkPolicy.apiFrom[0].podSelector=null", "at '/networkPolicy/apiFrom/0"),
])
def test_schema_rejects_bad_network_values(helm, setting, message):
    assert message in helm.error("--set", setting)


def test_min_port_above_max_port_is_refused(helm):
    err = helm.error("--set", "transferEngine.minPort=17000",
                     "--set", "transferEngine.maxPort=16000")
    assert "transferEngine: minPort 17000 is above maxPort 16000" in err


def test_policies_can_be_turned_off(helm):
    assert not by_kind(helm.render("--set", "networkPolicy.enabled=false"), "NetworkPolicy")
