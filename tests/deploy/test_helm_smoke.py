"""Rendered-to-local smoke test of the Helm chart.

Render the chart, take the Mooncake master container and one vLLM container (command, args, env,
ConfigMap volumes) from the rendered YAML and run them as local processes, replacing only what a
pod gets from Kubernetes:

- the image: `mooncake_master` and `vllm` come from the virtualenv's bin directory;
- container ports: remapped to free loopback ports (and 0.0.0.0 binds to 127.0.0.1);
- Service DNS names (`<svc>`, `<svc>.<ns>`, `<svc>.<ns>.svc[.cluster.local]`) plus Service
  ports: rewritten to 127.0.0.1 and the local port of the Service's target container port;
- volumes: ConfigMap contents are written to a temp dir, other volumes become temp dirs, and
  paths under a mountPath (MOONCAKE_CONFIG_PATH, HOME, HF_HOME, ...) point there;
- downward API `status.podIP`: 127.0.0.1;
- a console script of this package (the helm test pod's `mcpool-doctor`): the function its
  `[project.scripts]` entry names, run by this interpreter.

Then show that vLLM starts with the connector and the rendered thread count, that a long
prompt sent twice, with `POST /reset_prefix_cache` in between, is served from the store, and
that the `helm test` pod's preflight passes every check against the running master and engine.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from devkit.local_cluster import free_port
from devkit.processes import spawn, stop_process, wait_http, wait_port

pytestmark = pytest.mark.side_by_side

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "mooncake-pooled-connector"
HELM = ROOT / "bin" / "helm"
VENV_BIN = Path(sys.executable).parent
RELEASE, NAMESPACE = "smoke", "llm"
LOCAL = "127.0.0.1"
THREADS = 3  # not the default (1), so the gauge proves the rendered value reached the connector
PROMPT_TOKENS = 640  # 20 blocks of 32


# ---------------------------------------------------------------- rendering


def _kubeconfig(tmp: Path) -> Path:
    path = tmp / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "none",
        "clusters": [{"name": "none", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "none", "user": {"token": "dummy"}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "none"}}],
    }))
    return path


def render_chart(values: dict, tmp: Path) -> list[dict]:
    if not HELM.exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "setup_helm.sh")], cwd=ROOT, check=False,
                       capture_output=True, timeout=600)
    if not HELM.exists():
        pytest.fail("./bin/helm missing and scripts/setup_helm.sh could not install it")
    vfile = tmp / "smoke-values.yaml"
    vfile.write_text(yaml.safe_dump(values))
    env = {**os.environ, "KUBECONFIG": str(_kubeconfig(tmp)),
           "HELM_CACHE_HOME": str(tmp / "hc"), "HELM_CONFIG_HOME": str(tmp / "hf"),
           "HELM_DATA_HOME": str(tmp / "hd")}
    r = subprocess.run([str(HELM), "template", RELEASE, str(CHART), "-n", NAMESPACE,
                        "-f", str(vfile)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (tmp / "rendered.yaml").write_text(r.stdout)
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@dataclass
class LocalCluster:
    """Maps rendered Kubernetes names, ports and volumes onto this machine."""

    docs: list[dict]
    workdir: Path
    # container port -> local port, per workload name
    ports: dict[str, dict[int, int]] = field(default_factory=dict)
    # service port -> local port, per service host variant
    services: dict[str, dict[int, int]] = field(default_factory=dict)

    def __post_init__(self):
        for name, tpl in self.workloads().items():
            self.ports[name] = {p["containerPort"]: free_port()
                                for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
        for svc in self.kind("Service"):
            target = self._workload_for(svc["spec"]["selector"])
            if target is None:
                continue
            name, tpl = target
            named = {p["name"]: p["containerPort"] for c in tpl["spec"]["containers"]
                     for p in c.get("ports", [])}
            mapping = {}
            for p in svc["spec"]["ports"]:
                tp = p.get("targetPort", p["port"])
                container_port = named[tp] if isinstance(tp, str) else tp
                mapping[p["port"]] = self.ports[name][container_port]
            n, ns = svc["metadata"]["name"], NAMESPACE
            for host in (n, f"{n}.{ns}", f"{n}.{ns}.svc", f"{n}.{ns}.svc.cluster.local"):
                self.services[host] = mapping

    def kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def workloads(self) -> dict[str, dict]:
        """Pod templates of the Deployments, and the bare Pods (the helm test hook)."""
        pods = {d["metadata"]["name"]: d["spec"]["template"] for d in self.kind("Deployment")}
        return pods | {d["metadata"]["name"]: d for d in self.kind("Pod")}

    def _workload_for(self, selector: dict):
        for name, tpl in self.workloads().items():
            if selector.items() <= tpl["metadata"]["labels"].items():
                return name, tpl
        return None

    def component(self, component: str) -> tuple[str, dict]:
        (found,) = [(n, t) for n, t in self.workloads().items()
                    if t["metadata"]["labels"]["app.kubernetes.io/component"] == component]
        return found

    def rewrite_hosts(self, text: str) -> str:
        """Service DNS name (+ service port) -> 127.0.0.1 (+ local port)."""
        for host in sorted(self.services, key=len, reverse=True):
            mapping = self.services[host]
            text = re.sub(rf"(?<![\w.-]){re.escape(host)}:(\d+)",
                          lambda m, mp=mapping: f"{LOCAL}:{mp[int(m.group(1))]}", text)
            text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w.-])", LOCAL, text)
        return text

    def process(self, workload: str, container_name: str) -> LocalProcess:
        """The command line, env and files of one rendered container, localized."""
        tpl = self.workloads()[workload]
        c = next(c for c in tpl["spec"]["containers"] if c["name"] == container_name)
        ports = self.ports[workload]
        base = self.workdir / workload
        mounts: dict[str, Path] = {}
        volumes = {v["name"]: v for v in tpl["spec"].get("volumes", [])}
        for vm in c.get("volumeMounts", []):
            vol = volumes[vm["name"]]
            if vm["mountPath"] == "/dev/shm":
                continue  # the host's /dev/shm serves the same purpose
            local = base / vm["name"]
            local.mkdir(parents=True, exist_ok=True)
            if "configMap" in vol:
                (cm,) = [d for d in self.kind("ConfigMap")
                         if d["metadata"]["name"] == vol["configMap"]["name"]]
                for key, content in cm["data"].items():
                    (local / key).write_text(self.rewrite_hosts(content))
            mounts[vm["mountPath"]] = local

        def localize(value: str) -> str:
            value = self.rewrite_hosts(value)
            for mount in sorted(mounts, key=len, reverse=True):
                if value == mount or value.startswith(mount + "/"):
                    return str(mounts[mount]) + value[len(mount):]
            return value

        args = [localize(a) for a in c.get("args", [])]
        out_args: list[str] = []
        for i, a in enumerate(args):
            m = re.fullmatch(r"(--[\w-]*port[\w-]*)=(\d+)", a)
            if m and int(m.group(2)) in ports:
                a = f"{m.group(1)}={ports[int(m.group(2))]}"
            elif i > 0 and "port" in args[i - 1] and a.isdigit() and int(a) in ports:
                a = str(ports[int(a)])
            out_args.append(a.replace("0.0.0.0", LOCAL))
        env: dict[str, str] = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = localize(e["value"])
            elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
                env[e["name"]] = LOCAL
            else:
                raise AssertionError(f"smoke test cannot provide env {e}")
        exe, *rest = c["command"]
        scripts = console_scripts()
        if exe in scripts:  # our console script: the function it names
            module, func = scripts[exe].split(":")
            command = [sys.executable, "-c",
                       f"import sys; from {module} import {func}; sys.exit({func}())", *rest]
        else:
            command = [str(VENV_BIN / exe), *rest]
        return LocalProcess(command + out_args, env, base, ports)


def console_scripts() -> dict[str, str]:
    """pyproject's [project.scripts]: command -> "module:function"."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1]
    section = section.split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', section, re.M))


@dataclass
class LocalProcess:
    argv: list[str]
    env: dict[str, str]
    workdir: Path
    ports: dict[int, int]
    proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "container.log"

    def start(self, extra_argv: tuple[str, ...] = ()) -> LocalProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                           os.environ.get("PYTHONPATH")]))}
        self.proc = spawn([*self.argv, *extra_argv], self.log, env=env, cwd=ROOT)
        return self

    def tail(self, n: int = 80) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_port(self, port: int, timeout: float) -> None:
        try:
            wait_port(port, self.proc, self.argv[0], timeout)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}:\n{self.tail()}") from None

    def wait_http(self, url: str, timeout: float) -> None:
        try:
            wait_http(url, self.proc, self.argv[0], timeout)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}:\n{self.tail()}") from None

    def stop(self) -> None:
        stop_process(self.proc)

    def run(self, timeout: float) -> subprocess.CompletedProcess:
        """Run to completion (a test pod's container), as `start` would run it."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "PYTHONPATH": str(ROOT)}
        return subprocess.run(self.argv, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)


# ---------------------------------------------------------------- HTTP and metrics


def http_post(url: str, body: dict | None = None, timeout: float = 300):
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def metric_samples(url: str, name: str) -> list[float]:
    """Values of every sample of family `name` (any labels) on a /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


# ---------------------------------------------------------------- the test


def smoke_values(model_dir: Path) -> dict:
    """Chart values for a CPU-sized deployment; everything the processes get comes from these."""
    return {
        "image": {"repository": "local"},  # required; the processes run from .venv/bin
        "deployments": [{
            "name": "smoke",
            "model": str(model_dir),
            "blockSize": 32,  # the CPU backend needs a multiple of 32
            "recvThreads": THREADS,
            "globalSegmentSize": "256MB",  # this engine holds the pool (no store nodes)
            "localBufferSize": "64MB",
            "extraArgs": ["--max-model-len", "2048", "--dtype", "bfloat16",
                          "--max-num-seqs", "8", "--seed", "0"],
            "extraEnv": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
                         {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],
        }],
    }


@pytest.mark.timeout(900)
def test_rendered_chart_runs_locally_and_serves_a_store_hit(tmp_path):
    for exe in ("vllm", "mooncake_master"):
        if not (VENV_BIN / exe).exists():
            pytest.fail(f"{exe} not installed in {VENV_BIN}; run scripts/setup.sh")
    from devkit.tiny_model import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path / "tiny-llama")
    docs = render_chart(smoke_values(model_dir), tmp_path)
    cluster = LocalCluster(docs, tmp_path / "pods")

    master_name, _ = cluster.component("master")
    vllm_name, _ = cluster.component("vllm")
    master = cluster.process(master_name, "master")
    engine = cluster.process(vllm_name, "vllm")

    # What the rendered containers say, before anything runs.
    assert engine.env["VLLM_MOONCAKE_LOAD_RECV_THREADS"] == str(THREADS)
    cfg = json.loads(Path(engine.env["MOONCAKE_CONFIG_PATH"]).read_text())
    rpc, http, metrics = (master.ports[p] for p in (50051, 8080, 9003))
    assert cfg["master_server_address"] == f"{LOCAL}:{rpc}"
    assert cfg["metadata_server"] == f"http://{LOCAL}:{http}/metadata"
    assert engine.env["MOONCAKE_LOCAL_HOSTNAME"] == LOCAL
    kv = json.loads(engine.argv[engine.argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "PooledMooncakeStoreConnector"
    vllm_port = engine.ports[8000]
    assert engine.argv[engine.argv.index("--port") + 1] == str(vllm_port)

    try:
        master.start()
        master.wait_port(rpc, 30)
        master.wait_port(http, 30)
        # vLLM binds 0.0.0.0 by default; keep the local run on loopback.
        engine.start(extra_argv=("--host", LOCAL))
        base = f"http://{LOCAL}:{vllm_port}"
        engine.wait_http(base + "/health", 600)

        rng = random.Random(7)
        prompt = [rng.randrange(10, 1000) for _ in range(PROMPT_TOKENS)]
        body = {"model": str(model_dir), "prompt": prompt, "max_tokens": 4,
                "temperature": 0.0, "ignore_eos": True}
        http_post(base + "/v1/completions", body)
        hits = 0.0
        for _ in range(10):  # saves are asynchronous: retry until the blocks are in the store
            http_post(base + "/reset_prefix_cache")
            http_post(base + "/v1/completions", body)
            hits = sum(metric_samples(base + "/metrics",
                                      "vllm:external_prefix_cache_hits_total"))
            if hits > 0:
                break
            time.sleep(1)
        assert hits > 0, f"no external prefix-cache hit:\n{engine.tail()}"
        # The connector's gauges are exported from the stats of engine steps, so read them now.
        recv: list[float] = []
        for _ in range(20):
            recv = metric_samples(base + "/metrics", "vllm:mooncake_pool_recv_threads")
            if recv:
                break
            time.sleep(0.5)
        assert recv and all(v == THREADS for v in recv), (recv, engine.tail())
        # the master saw the engine's segment and the stored keys
        master_metrics = f"http://{LOCAL}:{metrics}/metrics"
        assert sum(metric_samples(master_metrics, "master_total_capacity_bytes")) > 0

        # `helm test`: the rendered preflight container against the running release. The
        # master's metrics port is a bare number in its arguments, so map it here.
        preflight_name, _ = cluster.component("preflight")
        doctor = cluster.process(preflight_name, "doctor-smoke")
        assert "--master-metrics-port=9003" in doctor.argv
        doctor.argv = [a.replace("--master-metrics-port=9003", f"--master-metrics-port={metrics}")
                       for a in doctor.argv]
        r = doctor.run(timeout=180)
        lines = r.stdout.splitlines()
        assert r.returncode == 0, r.stdout + r.stderr[-3000:]
        assert [ln.split()[0] for ln in lines] == ["PASS"] * 5, r.stdout
        assert f"Mooncake master {LOCAL}:{rpc}" in r.stdout
        assert "1 mounted" in r.stdout and "put, get and remove" in r.stdout
    finally:
        engine.stop()
        master.stop()
