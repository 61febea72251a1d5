"""Helpers for the Helm chart tests: the real helm binary (./bin/helm, installed by
scripts/setup_helm.sh when missing) run with no cluster, and small accessors for rendered objects.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "mooncake-pooled-connector"
CI_VALUES = CHART / "ci" / "three-deployments-values.yaml"
HA_VALUES = CHART / "ci" / "ha-values.yaml"
IMAGE = "registry.example.com/ml/vllm-mooncake-pooled-connector"
# Every render names the image (the chart refuses to render without one); -f and --set after it
# override it.
WITH_IMAGE = ("--set", f"image.repository={IMAGE}")
HELM = ROOT / "bin" / "helm"
VENV_BIN = Path(sys.executable).parent
KUBE_VERSION = "1.30.0"
RELEASE = "pool"
PREFIX = f"{RELEASE}-mooncake-pooled-connector"  # resource names: <PREFIX>-<component>
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def helm_env(tmp: Path) -> dict[str, str]:
    """Environment for helm with no cluster: an explicit dummy kubeconfig (helm would otherwise
    talk to localhost:8080, where a local mooncake_master may be listening) and private dirs."""
    kubeconfig = tmp / "kubeconfig"
    if not kubeconfig.exists():
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "none",
            "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:1"}}],
            "users": [{"name": "none", "user": {"token": "dummy"}}],
            "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
        }))
        kubeconfig.chmod(0o600)
    env = dict(os.environ)
    env.update(
        KUBECONFIG=str(kubeconfig),
        HELM_CACHE_HOME=str(tmp / "helm-cache"),
        HELM_CONFIG_HOME=str(tmp / "helm-config"),
        HELM_DATA_HOME=str(tmp / "helm-data"),
    )
    env.pop("HELM_DRIVER", None)
    return env


def ensure_helm() -> Path:
    """./bin/helm, installed by scripts/setup_helm.sh if missing."""
    if not HELM.exists():
        r = subprocess.run(["bash", str(ROOT / "scripts" / "setup_helm.sh")], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or not HELM.exists():
            pytest.fail(f"./bin/helm is missing and scripts/setup_helm.sh failed "
                        f"(rc {r.returncode}):\n{r.stdout}\n{r.stderr}")
    return HELM


class Helm:
    def __init__(self, binary: Path, tmp: Path):
        self.binary, self.env, self.tmp = binary, helm_env(tmp), tmp

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([str(self.binary), *args], env=self.env, capture_output=True,
                           text=True, timeout=120)
        if check and r.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed (rc {r.returncode}):\n"
                                 f"{r.stdout}\n{r.stderr}")
        return r

    def template(self, *values_args: str, chart: Path = CHART, values: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
        args = ["template", RELEASE, str(chart), "--namespace", "llm",
                "--kube-version", KUBE_VERSION, *WITH_IMAGE, *values_args]
        if values is not None:
            f = self.tmp / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
            f.write_text(yaml.safe_dump(values))
            args += ["-f", str(f)]
        return self.run(*args, check=check)

    def render(self, *values_args: str, **kw) -> list[dict]:
        out = self.template(*values_args, **kw).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    def error(self, *values_args: str, **kw) -> str:
        r = self.template(*values_args, check=False, **kw)
        assert r.returncode != 0, f"helm template unexpectedly succeeded:\n{r.stdout[:2000]}"
        return r.stderr


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def vllm_containers(docs: list[dict]) -> dict[str, dict]:
    """deployment entry name -> its vllm container."""
    out = {}
    for d in by_kind(docs, "Deployment").values():
        labels = d["spec"]["template"]["metadata"]["labels"]
        if labels.get("app.kubernetes.io/component") == "vllm":
            name = labels["mooncake-pooled-connector/deployment"]
            out[name] = next(c for c in d["spec"]["template"]["spec"]["containers"]
                             if c["name"] == "vllm")
    return out


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def arg_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def pod_specs(docs: list[dict]):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            yield d["metadata"]["name"], d["spec"]["template"]["spec"]


def kubernetes_validate(path: Path) -> subprocess.CompletedProcess:
    exe = VENV_BIN / "kubernetes-validate"
    if not exe.exists():
        exe = shutil.which("kubernetes-validate")
        if not exe:
            pytest.fail("kubernetes-validate not installed; run scripts/setup_helm.sh")
    return subprocess.run([str(exe), "--strict", "-k", KUBE_VERSION, str(path)],
                          capture_output=True, text=True, timeout=120)


def engine_scrape_path(tmp: Path) -> str:
    """The path the chart's monitors scrape the vLLM engines at (ServiceMonitor and PodMonitor
    agree, or this fails)."""
    helm = Helm(ensure_helm(), tmp)
    paths = set()
    for kind, endpoints in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        docs = helm.render("--set", "monitoring.enabled=true", "--set", f"monitoring.kind={kind}")
        (mon,) = [d for name, d in by_kind(docs, kind).items() if name.endswith("-vllm")]
        paths |= {ep["path"] for ep in mon["spec"][endpoints]}
    (path,) = paths
    return path
