"""Offline checks of the Helm chart with the real helm binary (./bin/helm, v4).

What runs: `helm lint --strict`, `helm template` (defaults, ci/three-deployments-values.yaml and
ci/ha-values.yaml), `helm install --dry-run=client`, `kubernetes-validate --strict -k 1.30.0` and
yamllint on the rendered output, the values schema's error messages, the secure defaults, the
per-deployment thread count, and the structure of the CRD objects (ServiceMonitor/PodMonitor/
PrometheusRule), which kubernetes-validate has no schema for. Network policies:
tests/deploy/test_helm_netpol.py; HA masters: tests/deploy/test_helm_ha.py; checkov:
tests/deploy/test_helm_checkov.py.

helm is installed by scripts/setup_helm.sh when ./bin/helm is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from connector.config import (
    BY_NAME,
    CONNECTOR_KEYS,
    HELM_EXTRA_MOONCAKE,
    HELM_LOCAL_BUFFER,
    ConfigError,
    load_config,
    parse_size,
)
from connector.observability.kv_event_settings import event_settings
from tests.helm_kit import (
    CHART,
    CI_VALUES,
    CRD_KINDS,
    HA_VALUES,
    IMAGE,
    RELEASE,
    ROOT,
    WITH_IMAGE,
    arg_after,
    by_kind,
    env_of,
    kubernetes_validate,
    pod_specs,
    vllm_containers,
)

# ---------------------------------------------------------------- lint and validation


VALUE_SETS = pytest.mark.parametrize("values", [None, CI_VALUES, HA_VALUES],
                                     ids=["defaults", "three-deployments", "ha"])


@VALUE_SETS
def test_lint_strict(helm, values):
    args = ["lint", "--strict", str(CHART), *WITH_IMAGE] + (["-f", str(values)] if values else [])
    r = helm.run(*args)
    assert "1 chart(s) linted, 0 chart(s) failed" in r.stdout


IMAGE_ERROR = ("at '/image/repository': value must be 'the image you built from "
               "docker/Dockerfile: set image.repository (docs/helm.md, Build the image)'")


@pytest.mark.parametrize("command", ["template", "install", "lint"])
def test_no_image_is_refused_with_one_line(helm, command):
    """No image set: every entry point fails at render time with one line naming
    image.repository and where the image comes from."""
    args = {"template": ["template", RELEASE, str(CHART)],
            "install": ["install", RELEASE, str(CHART), "--dry-run=client"],
            "lint": ["lint", "--strict", str(CHART)]}[command]
    r = helm.run(*args, check=False)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    lines = [ln for ln in out.splitlines() if "image" in ln]
    # lint reports it once for values.yaml and once for the templates
    assert len(lines) == (2 if command == "lint" else 1), out
    assert all(ln.endswith(IMAGE_ERROR) for ln in lines), out
    # The values file says the same, so nobody wonders where the old placeholder went.
    assert yaml.safe_load((CHART / "values.yaml").read_text())["image"]["repository"] == ""


@VALUE_SETS
def test_rendered_output_passes_kubernetes_validate(helm, values, tmp_path):
    out = helm.template(*(["-f", str(values)] if values else [])).stdout
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(out)
    r = kubernetes_validate(rendered)
    report = r.stdout + r.stderr
    assert r.returncode == 0, report
    docs = [d for d in yaml.safe_load_all(out) if d]
    core = [d for d in docs if d["kind"] not in CRD_KINDS]
    # Every core object was validated against a real schema (a missing schema is only a WARN).
    assert report.count("passed for resource") == len(core), report
    for line in report.splitlines():
        if "Couldn't find schema" in line:
            assert any(f"kind {k} " in line for k in CRD_KINDS), line


def test_rendered_output_passes_yamllint(helm, tmp_path):
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(helm.template("-f", str(CI_VALUES)).stdout)
    config = ("{extends: default, rules: {line-length: disable, document-start: disable, "
              "comments: disable, indentation: {spaces: consistent, indent-sequences: whatever}}}")
    r = subprocess.run([sys.executable, "-m", "yamllint", "-f", "parsable", "-d", config,
                        str(rendered)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_install_dry_run_client(helm):
    r = helm.run("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", "llm",
                 "-f", str(CI_VALUES))
    assert "Network policies are on" not in r.stdout  # apiFrom is set
    assert "STATUS: pending-install" in r.stdout
    assert "VLLM_MOONCAKE_LOAD_RECV_THREADS=16" in r.stdout  # NOTES lists the thread counts


def test_notes_forward_to_the_first_deployments_service_port(helm):
    """The NOTES' port-forward names the port the first deployment's Service has: 8000:8000
    whatever `service.port` was made a command that fails (the Service has no port 8000)."""
    r = helm.run("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", "llm",
                 "-f", str(CI_VALUES), "--set", "deploymentDefaults.service.port=80")
    notes = r.stdout.split("NOTES:", 1)[1]
    assert re.search(r"port-forward svc/\S+ 8000:80\n", notes), notes


# ---------------------------------------------------------------- per-deployment rendering


def test_three_deployments_carry_their_own_thread_count(helm):
    docs = helm.render("-f", str(CI_VALUES))
    containers = vllm_containers(docs)
    assert set(containers) == {"threads-1", "threads-4", "threads-16"}
    for name, c in containers.items():
        env = env_of(c)
        assert env["VLLM_MOONCAKE_LOAD_RECV_THREADS"]["value"] == name.split("-")[1]
        assert env["MOONCAKE_CONFIG_PATH"]["value"] == "/etc/mooncake/mooncake.json"
        assert env["MOONCAKE_LOCAL_HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "status.podIP"


def test_recv_threads_auto_with_a_maximum(helm):
    docs = helm.render("-f", str(CI_VALUES), "--set", "deployments[0].name=auto",
                       "--set", "deployments[0].recvThreads=auto",
                       "--set", "deployments[0].extraConfig.load_threads_max=6")
    c = vllm_containers(docs)["auto"]
    assert env_of(c)["VLLM_MOONCAKE_LOAD_RECV_THREADS"]["value"] == "auto"
    cfg = json.loads(arg_after(c["args"], "--kv-transfer-config"))
    assert cfg["kv_connector_extra_config"]["load_threads_max"] == 6
    # The connector accepts exactly what the chart rendered.
    extra = {**cfg["kv_connector_extra_config"], "master_server_address": "m:1",
             "metadata_server": "http://m:2/metadata"}
    parsed = load_config(extra, {"VLLM_MOONCAKE_LOAD_RECV_THREADS": "auto"})
    assert parsed.load_threads_auto and parsed.load_threads == 6


def test_a_thread_maximum_without_auto_is_refused_at_render(helm):
    """load_threads_max in the defaults' extraConfig and a deployment with a fixed recvThreads:
    the connector refuses that pair at startup (the engine would crash-loop), so helm does."""
    values = {"deploymentDefaults": {"model": "m", "recvThreads": "auto",
                                     "extraConfig": {"load_threads_max": 16}},
              "deployments": [{"name": "adaptive"}, {"name": "fixed", "recvThreads": 4}]}
    with pytest.raises(ConfigError, match="load_threads_max: only used with load_threads: auto"):
        load_config({"master_server_address": "m:1", "metadata_server": "http://m:2/metadata",
                     "load_threads_max": 16}, {"VLLM_MOONCAKE_LOAD_RECV_THREADS": "4"})
    assert ("deployments[fixed]: extraConfig.load_threads_max is used only with recvThreads: "
            "auto, not 4; set recvThreads to auto or remove load_threads_max"
            in helm.error(values=values))
    values["deployments"].pop()
    assert set(vllm_containers(helm.render(values=values))) == {"adaptive"}


def test_each_deployment_has_its_own_mooncake_configmap(helm):
    docs = helm.render("-f", str(CI_VALUES))
    cms = by_kind(docs, "ConfigMap")
    master = f"{RELEASE}-mooncake-pooled-connector-master.llm.svc"
    for d in by_kind(docs, "Deployment").values():
        spec = d["spec"]["template"]["spec"]
        if spec["containers"][0]["name"] != "vllm":
            continue
        vol = next(v for v in spec["volumes"] if v["name"] == "mooncake-config")
        cfg = json.loads(cms[vol["configMap"]["name"]]["data"]["mooncake.json"])
        assert cfg["master_server_address"] == f"{master}:50051"
        assert cfg["metadata_server"] == f"http://{master}:8080/metadata"
        assert "local_hostname" not in cfg  # comes from MOONCAKE_LOCAL_HOSTNAME (pod IP)
        entry = d["metadata"]["labels"]["mooncake-pooled-connector/deployment"]
        if entry == "threads-16":
            assert cfg["protocol"] == "rdma" and cfg["device_name"] == "mlx5_0"
            assert cfg["global_segment_size"] == "16GB"
        else:
            # store nodes hold the pool, so engines contribute nothing by default
            assert cfg["protocol"] == "tcp" and "device_name" not in cfg
            assert cfg["global_segment_size"] == 0
        sha = d["spec"]["template"]["metadata"]["annotations"]["checksum/mooncake-config"]
        assert len(sha) == 64


def test_vllm_command_and_kv_transfer_config(helm):
    containers = vllm_containers(helm.render("-f", str(CI_VALUES)))
    c = containers["threads-4"]
    assert c["command"] == ["vllm"]
    args = c["args"]
    assert args[:2] == ["serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert arg_after(args, "--port") == "8000"
    assert arg_after(args, "--block-size") == "16"
    assert arg_after(containers["threads-16"]["args"], "--tensor-parallel-size") == "2"
    kv = json.loads(arg_after(args, "--kv-transfer-config"))
    assert kv == {
        "kv_connector": "PooledMooncakeStoreConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        # defaults merged key by key with the entry's own extraConfig
        "kv_connector_extra_config": {"on_master_unreachable": "degrade",
                                      "lookup_timeout_s": 2, "trace_sample_ratio": 0.05},
    }
    kv1 = json.loads(arg_after(containers["threads-1"]["args"], "--kv-transfer-config"))
    assert kv1["kv_connector_extra_config"] == {"on_master_unreachable": "degrade",
                                                "lookup_timeout_s": 2}
    assert args[-4:] == ["--max-model-len", "8192", "--gpu-memory-utilization", "0.9"]


def test_engines_get_a_shutdown_timeout_and_a_grace_period_above_it(helm):
    """vLLM kills EngineCore at once on SIGTERM when --shutdown-timeout is 0 (its default), so
    the connector's queued saves would be lost: the chart passes 30 s by default (or the value
    given), and the pod's grace period leaves room after it."""
    docs = helm.render("-f", str(CI_VALUES), "--set", "deployments[1].shutdownTimeout=90")
    seen = {}
    for d in by_kind(docs, "Deployment").values():
        pod = d["spec"]["template"]
        if pod["metadata"]["labels"].get("app.kubernetes.io/component") != "vllm":
            continue
        c = next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")
        seen[d["metadata"]["name"]] = (int(arg_after(c["args"], "--shutdown-timeout")),
                                       pod["spec"]["terminationGracePeriodSeconds"])
    print(seen)
    assert sorted(t for t, _ in seen.values()) == [30, 30, 90], seen
    assert all(grace == t + 15 for t, grace in seen.values()), seen
    r = helm.run("template", RELEASE, str(CHART), *WITH_IMAGE,
                 "--set", "deploymentDefaults.shutdownTimeout=-1", check=False)
    assert r.returncode != 0 and "shutdownTimeout" in r.stderr, r.stderr


def test_default_render_omits_empty_extra_config(helm):
    c = vllm_containers(helm.render())["engine"]
    kv = json.loads(arg_after(c["args"], "--kv-transfer-config"))
    assert "kv_connector_extra_config" not in kv


def test_tracing_env_only_when_endpoint_set(helm):
    containers = vllm_containers(helm.render("-f", str(CI_VALUES)))
    env = env_of(containers["threads-4"])
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]["value"] == \
        "http://otel-collector.observability.svc:4318/v1/traces"
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]["value"] == "http/protobuf"
    assert env["OTEL_SERVICE_NAME"]["value"] == f"{RELEASE}-mooncake-pooled-connector-threads-4"
    assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
    assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.05"
    for name in ("threads-1", "threads-16"):
        assert not any(k.startswith("OTEL_") for k in env_of(containers[name]))


def test_extra_config_schema_matches_connector_keys():
    """The chart's extraConfig keys are exactly the connector's, minus load_threads, plus the
    Mooncake fields it has no typed value for."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    keys = set(schema["definitions"]["extraConfig"]["properties"])
    assert keys == set(CONNECTOR_KEYS) - {"load_threads"} | set(HELM_EXTRA_MOONCAKE)


def test_mooncake_fields_without_a_typed_value_reach_the_connector(helm):
    """replica_num, transfer_timeout (the only bound on zero-copy transfers) and
    preferred_segment: the schema refused them in extraConfig, and no value set them."""
    extra = {"replica_num": 2, "transfer_timeout": 7.5, "preferred_segment": "10.0.0.9:50052"}
    c = vllm_containers(helm.render(values={"deploymentDefaults": {"extraConfig": extra}}))[
        "engine"]
    got = json.loads(arg_after(c["args"], "--kv-transfer-config"))["kv_connector_extra_config"]
    cfg = load_config({**got, "master_server_address": "m:50051",
                       "metadata_server": "http://m:8080/metadata"}, {})
    assert (cfg.store.replica_num, cfg.store.transfer_timeout,
            cfg.store.preferred_segment) == (2, 7.5, "10.0.0.9:50052")


def test_global_segment_size_default_follows_store_nodes(helm):
    def cfg(docs):
        cm = next(iter(by_kind(docs, "ConfigMap").values()))
        return json.loads(cm["data"]["mooncake.json"])

    assert cfg(helm.render())["global_segment_size"] == "4GB"
    assert cfg(helm.render("--set", "storeNodes.enabled=true"))["global_segment_size"] == 0
    explicit = helm.render("--set", "storeNodes.enabled=true",
                           "--set", "deploymentDefaults.globalSegmentSize=1073741824")
    assert cfg(explicit)["global_segment_size"] == 1073741824


def test_master_rendered_with_the_contract_flags(helm):
    docs = helm.render()
    dep = by_kind(docs, "Deployment")[f"{RELEASE}-mooncake-pooled-connector-master"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["mooncake_master"]
    assert c["args"] == [
        "--rpc_port=50051", "--rpc_address=0.0.0.0", "--enable_http_metadata_server=true",
        "--http_metadata_server_host=0.0.0.0", "--http_metadata_server_port=8080",
        "--metrics_host=0.0.0.0", "--metrics_port=9003", "--rpc_enable_tcp_no_delay=true",
        "--client_ttl=10",
    ]
    svc = by_kind(docs, "Service")[f"{RELEASE}-mooncake-pooled-connector-master"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == \
        {"rpc": 50051, "metadata": 8080, "metrics": 9003}


def test_master_image_override(helm):
    docs = helm.render("--set", "master.image.repository=mooncake/master",
                       "--set", "master.image.tag=v0.3.13")
    images = {n: s["containers"][0]["image"] for n, s in pod_specs(docs)}
    assert images[f"{RELEASE}-mooncake-pooled-connector-master"] == "mooncake/master:v0.3.13"
    assert images[f"{RELEASE}-mooncake-pooled-connector-engine"] == f"{IMAGE}:0.1.0"


@pytest.mark.parametrize("metadata", ["", "etcd://etcd.infra:2379", "etcd.infra:2379",
                                      "https://meta.infra/metadata", "P2PHANDSHAKE",
                                      "http://[fd00::1]:8080/metadata"])
def test_external_master_deploys_no_master(helm, metadata):
    """And its metadata server is any the connector takes (etcd ones were refused)."""
    docs = helm.render("--set", "master.external.address=mooncake.infra:50051",
                       "--set", f"master.external.metadataServer={metadata}")
    assert not any("master" in n for n in by_kind(docs, "Deployment"))
    assert not any("master" in n for n in by_kind(docs, "Service"))
    cfg = json.loads(next(iter(by_kind(docs, "ConfigMap").values()))["data"]["mooncake.json"])
    assert cfg["master_server_address"] == "mooncake.infra:50051"
    want = metadata or "http://mooncake.infra:8080/metadata"
    assert cfg["metadata_server"] == want
    assert load_config({**cfg, "local_hostname": "10.1.2.3"}, {}).store.metadata_server == want


@pytest.mark.parametrize("definition", ["size", "storeNodeSize"])
def test_every_size_the_chart_admits_the_connector_reads(definition):
    """The engines' sizes go to the connector (`parse_size`); the store nodes' ones to
    mooncake_client, which reads a subset of them (tests/store/test_store_node_sizes.py)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    (text,) = [a["pattern"] for a in schema["definitions"][definition]["anyOf"]
               if "pattern" in a]
    forms = [f"{n}{sp}{u}" for n in ("4", "1.5") for sp in ("", " ")
             for u in ("", "b", "K", "kb", "KiB", "m", "MB", "Mi", "GiB", "Gi", "tB", "X", "iB")]
    for form in forms:
        try:
            parse_size(form, "x")
            reads = True
        except ConfigError:
            reads = False
        assert not re.match(text, form) or reads, form
        assert re.match(text, form) or not reads or definition == "storeNodeSize", form


def test_engine_local_buffer_size_admits_what_the_connector_takes():
    """An engine's localBufferSize passes the schema exactly when the connector takes it as
    local_buffer_size (at least 1 MB): 0 or 512KB passed, and the engine failed at startup."""
    schema = json.loads((CHART / "values.schema.json").read_text())["definitions"]
    (size,) = [a["pattern"] for a in schema["size"]["anyOf"] if "pattern" in a]
    (least,) = [a["pattern"] for a in schema[HELM_LOCAL_BUFFER]["if"]["not"]["anyOf"]
                if "pattern" in a]
    numbers = ("0", "1", "2", "0.5", "0.99", "1.0", "001", "512", "1023", "1023.9", "1024",
               "001024", "1024.5", "1048575", "1048575.9", "1048576", "1048577", "0.00098",
               "0.0009765625", "0.0009765624", "0.000976", "0.00000095367431640625",
               "0.000000953674", "0.000001", "0.0000009")
    for form in (f"{n}{sp}{u}" for n in numbers for sp in ("", " ")
                 for u in ("", "b", "K", "KiB", "kb", "M", "MB", "mib", "G", "GB", "t", "TiB")):
        try:
            BY_NAME["local_buffer_size"].parse(form, "x")
            takes = True
        except ConfigError:
            takes = False
        assert bool(re.match(size, form) and re.match(least, form)) == takes, form


@pytest.mark.parametrize("metadata", ["http://[fd00::1]:8080/metadata", "http://[::1]/metadata",
                                      "https://[::ffff:10.0.0.1]:443/m", "http://[fd00::1]:8080",
                                      "http://[fd00::1]:65536/metadata", "http://[zz]:80/m",
                                      "http://fd00::1:8080/metadata", "http://[fd00::1/m",
                                      # brackets that hold no IPv6 literal (passed before)
                                      "http://[:]:8080/m", "http://[1:2]:8080/m",
                                      "http://[:::]/m", "http://[1::2::3]/m",
                                      "http://[::1.2.3.999]/m", "http://[1:2:3:4:5:6:7::8:9]/m",
                                      "http://[12345::1]/m",
                                      # and some that do
                                      "http://[1:2:3:4:5:6:7:8]/m", "http://[1::]/m",
                                      "http://[::]:80/m", "http://[1:2:3:4:5:6:1.2.3.4]/m",
                                      "http://[FD00:0:0::a]/m", "http://[fe80::1%25eth0]/m",
                                      "http://[::ffff:255.255.255.255]/m"])
def test_external_metadata_server_pattern_admits_only_what_the_connector_takes(metadata):
    """IPv6 literals in brackets pass as the connector takes them; no path, a port out of
    range or an address not in brackets are refused as before."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    text = schema["properties"]["master"]["properties"]["external"]["properties"][
        "metadataServer"]["pattern"]
    try:
        load_config({"master_server_address": "m:50051", "metadata_server": metadata}, {})
        takes = True
    except ValueError:  # ConfigError, or urllib's for a malformed IPv6 literal
        takes = False
    assert bool(re.match(text, metadata)) == takes, metadata


def test_store_nodes(helm):
    docs = helm.render("-f", str(CI_VALUES))
    dep = by_kind(docs, "Deployment")[f"{RELEASE}-mooncake-pooled-connector-store"]
    assert dep["spec"]["replicas"] == 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    master = f"{RELEASE}-mooncake-pooled-connector-master.llm.svc"
    assert c["command"] == ["mooncake_client"]
    assert c["args"] == [
        f"--master_server_address={master}:50051",
        f"--metadata_server=http://{master}:8080/metadata",
        "--host=$(POD_IP)", "--port=50052", "--protocol=tcp",
        "--global_segment_size=8GB", "--local_buffer_size=16MB",
    ]
    assert env_of(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert not any("store" in n for n in by_kind(helm.render(), "Deployment"))


# ---------------------------------------------------------------- schema messages


SCHEMA_ERROR = "values don't meet the specifications of the schema"


@pytest.mark.parametrize("setting, message", [
    ("deployments[0].recvThreads=0", "at '/deployments/0/recvThreads': minimum: got 0, want 1"),
    ("deployments[0].recvThreads=65",
     "at '/deployments/0/recvThreads': maximum: got 65, want 64"),
    ("deployments[0].recvThreads=four",
     "at '/deployments/0/recvThreads': got string, want integer"),
    ("deployments[0].recvThread=4",
     "at '/deployments/0': additional properties 'recvThread' not allowed"),
    ("deployments[0].protocol=udp", "at '/deployments/0/protocol': value must be one of"),
    ("deployments[0].globalSegmentSize=4XB", "'4XB' does not match pattern"),
    ("deploymentDefaults.localBufferSize=-1", "at '/deploymentDefaults/localBufferSize'"),
    ("deployments[0].extraConfig.load_threads=4",
     "at '/deployments/0/extraConfig': additional properties 'load_threads' not allowed"),
    ("deployments[0].extraConfig.on_master_unreachable=retry",
     "at '/deployments/0/extraConfig/on_master_unreachable': value must be one of"),
    ("hfToken=hf_abc", "at '': additional properties 'hfToken' not allowed"),
    ("monitoring.kind=Probe", "at '/monitoring/kind': value must be one of"),
    ("master.clientTtlSeconds=0", "at '/master/clientTtlSeconds': minimum: got 0, want 1"),
    # mooncake_client reads these as 0 (no memory, no error); the connector refuses Mi forms
    ("storeNodes.globalSegmentSize=64GiB", "at '/storeNodes/globalSegmentSize'"),
    ("storeNodes.localBufferSize=16Mi", "at '/storeNodes/localBufferSize'"),
    ("deployments[0].localBufferSize=512Mi", "at '/deployments/0/localBufferSize'"),
    ("master.external.address=mc:99999", "at '/master/external/address'"),
    ("master.external.metadataServer=http://mc:8080", "at '/master/external/metadataServer'"),
    ("master.external.metadataServer=http://[fd00::1]:8080",
     "at '/master/external/metadataServer'"),
    ("deployments[0].localBufferSize=0",
     "at '/deployments/0/localBufferSize': value must be 'at least 1MB (the connector refuses"),
    ("deploymentDefaults.localBufferSize=512KB",
     "at '/deploymentDefaults/localBufferSize': value must be 'at least 1MB"),
])
def test_schema_rejects_bad_values_with_clear_message(helm, setting, message):
    err = helm.error("--set", setting)
    assert SCHEMA_ERROR in err, err
    assert message in err, err


def test_schema_rejects_bad_values_in_lint_too(helm, tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump({"deployments": [{"name": "a", "model": "m",
                                                  "recvThreads": "four"}]}))
    r = helm.run("lint", "--strict", str(CHART), "-f", str(f), check=False)
    assert r.returncode != 0
    assert "at '/deployments/0/recvThreads': got string, want integer" in r.stdout + r.stderr


@pytest.mark.parametrize("values, message", [
    ({"deployments": [{"name": "a", "model": "m"}, {"name": "a", "model": "other"}]},
     'deployments: name "a" is used twice'),
    ({"deployments": [{"name": "a"}]}, "deployments[a]: model is required"),
    ({"deployments": [{"name": "a", "model": "m",
                       "extraEnv": [{"name": "HF_TOKEN", "value": "hf_x"}]}]},
     "deployments[a]: env HF_TOKEN must come from a Secret"),
])
def test_template_rejects_inconsistent_values(helm, values, message):
    assert message in helm.error(values=values)


# ---------------------------------------------------------------- secure defaults


@VALUE_SETS
def test_secure_defaults(helm, values):
    docs = helm.render(*(["-f", str(values)] if values else []))
    specs = dict(pod_specs(docs))
    assert specs
    for name, spec in specs.items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] == 1000, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["privileged"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            for e in c.get("env", []):
                if e["name"] == "HF_TOKEN_PATH":  # where the mounted Secret file is
                    assert e["value"] == "/etc/hf-token/token", (name, e)
                elif any(w in e["name"] for w in ("TOKEN", "KEY", "SECRET", "PASSWORD")):
                    assert "value" not in e, (name, e)
                    assert "secretKeyRef" in e["valueFrom"], (name, e)
    for sa in by_kind(docs, "ServiceAccount").values():
        assert sa["automountServiceAccountToken"] is False


def test_ipc_lock_only_with_rdma(helm):
    docs = helm.render("-f", str(CI_VALUES))
    for name, c in vllm_containers(docs).items():
        caps = c["securityContext"]["capabilities"]
        limits = c["resources"]["limits"]
        if name == "threads-16":
            assert caps.get("add") == ["IPC_LOCK"]
            assert limits["rdma/ib"] == 1
        else:
            assert "add" not in caps, name
            assert "rdma/ib" not in limits, name
    for name, spec in pod_specs(docs):
        if "threads-16" not in name:
            assert "add" not in spec["containers"][0]["securityContext"]["capabilities"], name
    rdma_store = helm.render("--set", "storeNodes.enabled=true",
                             "--set", "storeNodes.protocol=rdma",
                             "--set", "storeNodes.deviceName=mlx5_1")
    c = by_kind(rdma_store, "Deployment")[f"{RELEASE}-mooncake-pooled-connector-store"]
    c = c["spec"]["template"]["spec"]["containers"][0]
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert "--device_names=mlx5_1" in c["args"]
    # No device named: Mooncake finds the RDMA devices itself (store nodes and engines).
    auto = helm.render("--set", "storeNodes.enabled=true", "--set", "storeNodes.protocol=rdma")
    c = by_kind(auto, "Deployment")[f"{RELEASE}-mooncake-pooled-connector-store"]
    assert "--device_names=" in c["spec"]["template"]["spec"]["containers"][0]["args"]


def test_secrets_only_by_reference(helm):
    docs = helm.render("--set", "secrets.hfToken.name=hf", "--set", "secrets.hfToken.key=tok",
                       "--set", "secrets.apiKey.name=api")
    c = vllm_containers(docs)["engine"]
    env = env_of(c)
    # the HF token is a file huggingface_hub reads (HF_TOKEN_PATH), not an env var
    assert "HF_TOKEN" not in env and env["HF_TOKEN_PATH"]["value"] == "/etc/hf-token/token"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "hf-token")
    assert mount == {"name": "hf-token", "mountPath": "/etc/hf-token", "readOnly": True}
    spec = next(d for d in by_kind(docs, "Deployment").values()
                if "engine" in d["metadata"]["name"])["spec"]["template"]["spec"]
    vol = next(v for v in spec["volumes"] if v["name"] == "hf-token")["secret"]
    assert vol["secretName"] == "hf" and vol["items"] == [{"key": "tok", "path": "token"}]
    assert vol["defaultMode"] == 0o440  # readable through the pod's fsGroup, by nobody else
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "api", "key": "api-key"}
    assert not by_kind(docs, "Secret")
    # unset: no credential env or mount at all
    c = vllm_containers(helm.render())["engine"]
    assert not {"HF_TOKEN", "HF_TOKEN_PATH", "VLLM_API_KEY"} & set(env_of(c))
    assert "hf-token" not in {m["name"] for m in c["volumeMounts"]}


def test_run_as_root_is_possible_when_image_needs_it(helm):
    docs = helm.render("--set", "security.runAsNonRoot=false", "--set", "security.runAsUser=0")
    for _, spec in pod_specs(docs):
        assert spec["securityContext"]["runAsNonRoot"] is False
        assert spec["securityContext"]["runAsUser"] == 0


# ---------------------------------------------------------------- monitoring objects


def test_service_monitors_select_existing_services_and_ports(helm):
    docs = helm.render("-f", str(CI_VALUES))
    monitors = by_kind(docs, "ServiceMonitor")
    assert set(monitors) == {f"{RELEASE}-mooncake-pooled-connector-vllm",
                             f"{RELEASE}-mooncake-pooled-connector-master"}
    services = by_kind(docs, "Service").values()
    for m in monitors.values():
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        sel = m["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if sel.items() <= s["metadata"]["labels"].items()]
        assert matched, m["metadata"]["name"]
        assert m["spec"]["namespaceSelector"]["matchNames"] == ["llm"]
        (ep,) = m["spec"]["endpoints"]
        # the engines' OpenMetrics mount carries the exemplars (tests/e2e checks a live engine)
        want = "/metrics/" if m["metadata"]["name"].endswith("-vllm") else "/metrics"
        assert ep["path"] == want and ep["interval"] == "30s"
        for s in matched:
            assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}
    vllm_ports = {p["port"] for s in services for p in s["spec"]["ports"] if p["name"] == "http"}
    assert vllm_ports == {8000}
    (ep,) = monitors[f"{RELEASE}-mooncake-pooled-connector-master"]["spec"]["endpoints"]
    assert ep["port"] == "metrics"


def test_pod_monitors_select_existing_pods_and_ports(helm):
    docs = helm.render("--set", "monitoring.enabled=true", "--set", "monitoring.kind=PodMonitor")
    monitors = by_kind(docs, "PodMonitor")
    assert len(monitors) == 2 and not by_kind(docs, "ServiceMonitor")
    pods = [d["spec"]["template"] for d in by_kind(docs, "Deployment").values()]
    for m in monitors.values():
        sel = m["spec"]["selector"]["matchLabels"]
        matched = [p for p in pods if sel.items() <= p["metadata"]["labels"].items()]
        assert matched, m["metadata"]["name"]
        (ep,) = m["spec"]["podMetricsEndpoints"]
        assert ep["path"] == ("/metrics/" if m["metadata"]["name"].endswith("-vllm")
                              else "/metrics")
        for p in matched:
            assert ep["port"] in {cp["name"] for c in p["spec"]["containers"]
                                  for cp in c["ports"]}
    assert not by_kind(helm.render(), "ServiceMonitor")  # opt-in


@pytest.fixture()
def chart_with_assets(tmp_path) -> Path:
    """A copy of the chart with a dashboard and an alert rules file, as the sync step adds."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    dash = chart / "dashboards"
    shutil.rmtree(dash, ignore_errors=True)
    dash.mkdir()
    (dash / "pool_overview.json").write_text(json.dumps(
        {"title": "Pool overview", "uid": "mcpool", "panels": [
            {"type": "stat", "targets": [{"expr": "sum(vllm:mooncake_pool_recv_threads)"}]}]},
        indent=2))
    (dash / "alerts.yaml").write_text(yaml.safe_dump({"groups": [{
        "name": "mooncake-pool", "rules": [{
            "alert": "MooncakePoolNoHits",
            "expr": "sum(rate(vllm:external_prefix_cache_hits_total[10m])) == 0",
            "for": "15m", "labels": {"severity": "warning"},
            "annotations": {"summary": "{{ $labels.model_name }} gets no pool hits"}}]}]}))
    return chart


def test_dashboards_and_prometheus_rule_from_chart_files(helm, chart_with_assets):
    docs = helm.render("-f", str(CI_VALUES), chart=chart_with_assets)
    dash = [d for d in by_kind(docs, "ConfigMap").values()
            if d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert len(dash) == 1
    (key, body), = dash[0]["data"].items()
    assert key == "pool_overview.json"
    assert json.loads(body) == json.loads(
        (chart_with_assets / "dashboards" / "pool_overview.json").read_text())
    (rule,) = by_kind(docs, "PrometheusRule").values()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    src = yaml.safe_load((chart_with_assets / "dashboards" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == src["groups"]  # including the unexpanded {{ $labels }}
    for g in rule["spec"]["groups"]:
        assert g["name"] and g["rules"]
        for r in g["rules"]:
            assert r["expr"] and ("alert" in r or "record" in r)
    off = helm.render(chart=chart_with_assets)
    assert not by_kind(off, "PrometheusRule")
    assert not [d for d in by_kind(off, "ConfigMap").values()
                if "grafana_dashboard" in d["metadata"]["labels"]]


def test_chart_renders_without_dashboard_files(helm, tmp_path):
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    shutil.rmtree(chart / "dashboards", ignore_errors=True)
    r = helm.run("install", RELEASE, str(chart), "--dry-run=client", *WITH_IMAGE,
                 "-f", str(CI_VALUES))
    docs = [d for d in yaml.safe_load_all(r.stdout.split("NOTES:")[0].split("MANIFEST:")[-1])
            if d]
    assert not by_kind(docs, "PrometheusRule")
    assert "no dashboards/alerts.yaml" in r.stdout


def test_chart_dashboards_are_the_repo_sources():
    """Helm reads files only inside the chart, so the chart links to dashboards/*.json and
    dashboards/alerts.yaml instead of holding copies that could drift."""
    src = {f.name for f in (ROOT / "dashboards").glob("*.json")} | {"alerts.yaml"}
    chart = CHART / "dashboards"
    assert {f.name for f in chart.iterdir()} == src
    for name in src:
        link = chart / name
        assert link.is_symlink() and link.resolve() == (ROOT / "dashboards" / name).resolve()


def test_rendered_config_is_accepted_by_the_connector(helm, tmp_path):
    """Feed each rendered deployment's extra_config, Mooncake file and env to the connector's
    own config loader."""
    docs = helm.render("-f", str(CI_VALUES))
    cms = by_kind(docs, "ConfigMap")
    for d in by_kind(docs, "Deployment").values():
        spec = d["spec"]["template"]["spec"]
        c = spec["containers"][0]
        if c["name"] != "vllm":
            continue
        vol = next(v for v in spec["volumes"] if v["name"] == "mooncake-config")
        path = tmp_path / f"{d['metadata']['name']}.json"
        path.write_text(cms[vol["configMap"]["name"]]["data"]["mooncake.json"])
        env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
        env.update(MOONCAKE_CONFIG_PATH=str(path), MOONCAKE_LOCAL_HOSTNAME="10.1.2.3")
        kv = json.loads(arg_after(c["args"], "--kv-transfer-config"))
        cfg = load_config(kv.get("kv_connector_extra_config"), env)
        assert cfg.load_threads == int(env["VLLM_MOONCAKE_LOAD_RECV_THREADS"])
        assert cfg.store.local_hostname == "10.1.2.3"
        assert cfg.store.master_server_address.endswith(".llm.svc:50051")
        assert cfg.on_master_unreachable == "degrade"


def test_probes_can_be_dropped(helm):
    c = vllm_containers(helm.render(values={
        "deployments": [{"name": "a", "model": "m", "probes": {"liveness": None}}]}))["a"]
    assert "livenessProbe" not in c and c["readinessProbe"]["httpGet"]["path"] == "/health"


def test_helm_page_documents_every_value():
    """docs/helm.md's values tables name every key of the schema."""
    readme = (ROOT / "docs" / "helm.md").read_text()
    schema = json.loads((CHART / "values.schema.json").read_text())
    missing = [k for k in schema["properties"] if k != "global" and f"`{k}" not in readme]
    missing += [k for k in schema["definitions"]["deployment"]["properties"]
                if f"`{k}" not in readme]
    missing += [k for k in schema["definitions"]["extraConfig"]["properties"]
                if f"`{k}`" not in readme]
    assert not missing, f"document these values in docs/helm.md: {missing}"


def _begins_a_failure(quoted: str, fmt: str) -> bool:
    """Whether `quoted` is the start of a message that printf format `fmt` can produce (each
    %s, %d, %q or %v stands for one or more characters), ending in the format's own text."""
    parts = re.split(r"%[sdqv]", fmt.replace('\\"', '"'))

    def fits(text: str, i: int) -> bool:
        head = parts[i]
        if len(text) <= len(head) or i == len(parts) - 1:
            return head.startswith(text) if len(text) <= len(head) else text == head
        if not text.startswith(head):
            return False
        return any(fits(text[j:], i + 1) for j in range(len(head) + 1, len(text)))

    return fits(quoted, 0)


def test_helm_page_quotes_only_failures_the_templates_have():
    """The template failures docs/helm.md quotes are ones a template can raise: a quoted check
    that was dropped tells operators their values would be refused when they are not."""
    readme = (ROOT / "docs" / "helm.md").read_text()
    sentence = readme.split("They fail with messages such as", 1)[1].split(".\n", 1)[0]
    quoted = re.findall(r"`([^`]+)`", sentence)
    assert len(quoted) >= 3, sentence
    templates = "".join(p.read_text() for p in sorted((CHART / "templates").rglob("*"))
                        if p.is_file())
    formats = re.findall(r'fail \(printf "((?:[^"\\]|\\.)*)"', templates)
    assert any(_begins_a_failure('deployments: name "a" is used twice', f) for f in formats)
    assert not _begins_a_failure("deployments: name", "deployments[%s]: model is required")
    assert not _begins_a_failure("deployments[a]: protocol rdma", "%s: model is required")
    unknown = [q for q in quoted if not any(_begins_a_failure(q, f) for f in formats)]
    assert not unknown, f"docs/helm.md quotes failures no template raises: {unknown}"


def test_helm_page_walkthrough_values_install(helm, tmp_path):
    """The my-values.yaml of docs/helm.md's walkthrough installs (dry run) and validates."""
    readme = (ROOT / "docs" / "helm.md").read_text()
    block = readme.split("`my-values.yaml`, with the values", 1)[1].split("```yaml\n", 1)[1]
    values = tmp_path / "my-values.yaml"
    values.write_text(block.split("```", 1)[0])
    r = helm.run("install", RELEASE, str(CHART), "--dry-run=client", "--namespace", "llm",
                 "-f", str(values))
    assert "STATUS: pending-install" in r.stdout
    manifest = r.stdout.split("MANIFEST:", 1)[1].split("NOTES:", 1)[0]
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(manifest)
    v = kubernetes_validate(rendered)
    assert v.returncode == 0, v.stdout + v.stderr
    assert "Network policies are on" not in r.stdout  # the walkthrough names apiFrom


# ---------------------------------------------------------------- helm test


def preflight_pod(docs: list[dict]) -> dict:
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    return pod


@pytest.mark.parametrize("values", [CI_VALUES, HA_VALUES], ids=["three-deployments", "ha"])
def test_helm_test_runs_the_preflight_with_each_deployments_config(helm, values):
    """One test-hook pod, one doctor container per deployment, each with that deployment's
    --kv-transfer-config, Mooncake ConfigMap and Mooncake environment, as its engine has."""
    docs = helm.render("-f", str(values))
    pod = preflight_pod(docs)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    engines = vllm_containers(docs)
    doctors = {c["name"].removeprefix("doctor-"): c for c in spec["containers"]}
    assert set(doctors) == set(engines)
    volumes = {v["name"]: v for v in spec["volumes"]}
    stores = [d for d in by_kind(docs, "Deployment").values()
              if d["metadata"]["labels"]["app.kubernetes.io/component"] == "store-node"]
    replicas = stores[0]["spec"]["replicas"] if stores else 1  # engines hold the pool
    for name, doc in doctors.items():
        eng = engines[name]
        assert doc["command"] == ["mcpool-doctor"]
        args = doc["args"]
        assert arg_after(args, "--kv-transfer-config") == arg_after(eng["args"],
                                                                     "--kv-transfer-config")
        assert "--master-metrics-port=9003" in args
        assert f"--min-segments={replicas}" in args
        env, eng_env = env_of(doc), env_of(eng)
        for var in ("MOONCAKE_CONFIG_PATH", "MOONCAKE_LOCAL_HOSTNAME",
                    "VLLM_MOONCAKE_LOAD_RECV_THREADS", "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT",
                    "MC_STORE_CLUSTER_ID"):
            assert env.get(var) == eng_env.get(var), (name, var)
        (mount,) = [m for m in doc["volumeMounts"] if m["mountPath"] == "/etc/mooncake"]
        assert volumes[mount["name"]]["configMap"]["name"] == \
            f"{RELEASE}-mooncake-pooled-connector-{name}-mooncake"
        assert doc["securityContext"]["readOnlyRootFilesystem"] is True
    if values == HA_VALUES:
        assert all("MC_STORE_CLUSTER_ID" in env_of(c) for c in doctors.values())


def test_helm_test_can_be_turned_off(helm):
    docs = helm.render("--set", "helmTest.enabled=false")
    assert not [d for d in docs if d["kind"] == "Pod"]
    assert not [n for n in by_kind(docs, "NetworkPolicy") if n.endswith("-preflight")]


def test_runbook_urls_follow_the_published_site(helm, tmp_path):
    """Every alert's runbook_url points at <runbookBaseUrl>runbooks/<AlertName>/; unset, the
    rules are rendered as dashboards/alerts.yaml has them (mkdocs.yml's site_url)."""
    src = yaml.safe_load((ROOT / "dashboards" / "alerts.yaml").read_text())
    (rule,) = by_kind(helm.render("--set", "prometheusRule.enabled=true"),
                      "PrometheusRule").values()
    assert rule["spec"]["groups"] == src["groups"]
    base = "https://runbooks.internal.example/mooncake/"
    (rule,) = by_kind(helm.render("--set", "prometheusRule.enabled=true", "--set",
                                  f"prometheusRule.runbookBaseUrl={base}"),
                      "PrometheusRule").values()
    rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert rules and all(r["annotations"]["runbook_url"] == f"{base}runbooks/{r['alert']}/"
                         for r in rules)
    src_rules = [r for g in src["groups"] for r in g["rules"]]
    for got, want in zip(rules, src_rules, strict=True):  # nothing else changed
        assert {k: v for k, v in got["annotations"].items() if k != "runbook_url"} == \
            {k: v for k, v in want["annotations"].items() if k != "runbook_url"}
        assert got["expr"] == want["expr"]
    err = helm.error("--set", "prometheusRule.runbookBaseUrl=https://no-trailing-slash")
    assert "runbookBaseUrl" in err


# ---------------------------------------------------------------- KV events (docs/kv-events.md)

KV_EVENTS = {"deploymentDefaults": {"kvEvents": {"enabled": True}},
             "networkPolicy": {"kvEventsFrom": [{"podSelector": {"matchLabels": {"app": "epp"}}}]},
             "deployments": [{"name": "pub", "model": "m"},
                             {"name": "quiet", "model": "m", "kvEvents": {"enabled": False}}]}


def test_kv_events_expose_the_endpoint_and_reach_the_connector(helm):
    docs = helm.render(values=KV_EVENTS)
    containers = vllm_containers(docs)
    pub, quiet = containers["pub"], containers["quiet"]
    events = json.loads(arg_after(pub["args"], "--kv-events-config"))
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://*:5557", "topic": "kv@$(MOONCAKE_LOCAL_HOSTNAME)@m"}
    assert "MOONCAKE_LOCAL_HOSTNAME" in env_of(pub)  # the topic's variable is defined
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in pub["ports"]
    assert "--kv-events-config" not in quiet["args"]
    assert all(p["name"] != "kv-events" for p in quiet["ports"])
    services = by_kind(docs, "Service")
    ports = {name: {p["name"]: p for p in s["spec"]["ports"]} for name, s in services.items()}
    assert ports[f"{RELEASE}-mooncake-pooled-connector-pub"]["kv-events"]["port"] == 5557
    assert "kv-events" not in ports[f"{RELEASE}-mooncake-pooled-connector-quiet"]
    # The connector takes the rendered extra_config, with the sweep on the master's metrics port.
    extra = json.loads(arg_after(pub["args"], "--kv-transfer-config"))["kv_connector_extra_config"]
    cfg = load_config({**extra, "master_server_address": "m:50051",
                       "metadata_server": "http://m:8080/metadata"}, {})
    assert (cfg.kv_events, cfg.kv_events_sweep_s) == ("on", 5)
    assert cfg.kv_events_master_http.endswith(".llm.svc:9003")
    assert "kv_events" not in json.loads(arg_after(quiet["args"], "--kv-transfer-config")).get(
        "kv_connector_extra_config", {})
    # Only the router's pods reach the events port.
    vllm_policy = next(p for name, p in by_kind(docs, "NetworkPolicy").items()
                       if name.endswith("-vllm"))
    rules = [r for r in vllm_policy["spec"]["ingress"]
             if {"port": 5557, "protocol": "TCP"} in r["ports"]]
    assert rules == [{"from": KV_EVENTS["networkPolicy"]["kvEventsFrom"],
                      "ports": [{"port": 5557, "protocol": "TCP"}]}]


def test_kv_events_sweep_address_with_ha_masters_or_given(helm):
    """HA masters: the master Service holds the standby too, which answers the sweep's query
    with 503 (half the rounds failed, or all while a kept-alive connection stuck to it): only
    the port is set, and the connector asks the leader etcd names. One given in extraConfig
    is kept (it was overwritten by the Service's)."""
    ha = {**KV_EVENTS, "master": {"ha": {"enabled": True}, "ports": {"metrics": 9100}}}
    c = vllm_containers(helm.render(values=ha))["pub"]
    extra = json.loads(arg_after(c["args"], "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["kv_events_master_http"] == ":9100"
    cfg = load_config({**extra, "master_server_address": "etcd://etcd:2379",
                       "metadata_server": "etcd://etcd:2379"}, {})
    settings = event_settings(cfg, SimpleNamespace(
        enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557",
        replay_endpoint=None))
    assert (settings.sweep_s, settings.sweep_target) == (5, "the HA leader's port 9100")
    given = {**ha, "deploymentDefaults": {"kvEvents": {"enabled": True}, "extraConfig": {
        "kv_events_master_http": "mooncake-leader.llm.svc:9003"}}}
    for values in (given, {**given, "master": {}}):
        c = vllm_containers(helm.render(values=values))["pub"]
        extra = json.loads(arg_after(c["args"], "--kv-transfer-config"))[
            "kv_connector_extra_config"]
        assert extra["kv_events_master_http"] == "mooncake-leader.llm.svc:9003"


def test_kv_events_sweep_with_another_tenant_is_refused(helm):
    values = {"deploymentDefaults": {"kvEvents": {"enabled": True}, "tenantId": "team-a"}}
    msg = helm.error(values=values)
    assert "kvEvents.sweepSeconds" in msg and "team-a" in msg
    values["deploymentDefaults"]["kvEvents"]["sweepSeconds"] = 0
    c = vllm_containers(helm.render(values=values))["engine"]
    extra = json.loads(arg_after(c["args"], "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["kv_events_sweep_s"] == 0 and "kv_events_master_http" not in extra
