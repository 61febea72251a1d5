"""A throw-away Prometheus server on loopback (the Debian `prometheus` binary), for the live
dashboard test and for rendering the README screenshots.

    with LocalPrometheus({"vllm": ["127.0.0.1:8000"], "mooncake-master": ["127.0.0.1:9003"]}) as p:
        ...  # p.url, p.query(expr), p.wait_for_targets()

Prometheus 2.x (Debian ships 2.42) asks for OpenMetrics without `escaping=allow-utf-8`, and
prometheus_client >= 0.22 then writes sample names with `:` replaced by `_` (prometheus/
client_python#1177): vLLM's `vllm:foo` arrives as `vllm_foo`. `restore_colons` (default on) adds
the metric relabelling that maps `vllm_*` back to `vllm:*`, which is what Prometheus 3 stores;
production Prometheus 2.x setups need the same rule (see dashboards/README.md).

`exemplars=True` turns on `--enable-feature=exemplar-storage` and scrapes the jobs named in
`metrics_paths` at those paths (vLLM's OpenMetrics-capable mount is `/metrics/`, see README).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from devkit.local_cluster import free_port
from devkit.processes import spawn, stop_process, wait_http

# metric_relabel_configs that undo the client-side `:` -> `_` escaping of vLLM's names.
RESTORE_COLONS = [{"source_labels": ["__name__"], "regex": "vllm_(.+)",
                   "target_label": "__name__", "replacement": "vllm:${1}"}]


class LocalPrometheus:
    """`targets`: job name -> list of host:port, or job -> (list, extra target labels)."""

    def __init__(self, targets: dict, scrape_interval: str = "1s", workdir: str | None = None,
                 restore_colons: bool = True, exemplars: bool = False,
                 metrics_paths: dict[str, str] | None = None):
        self.targets = targets
        self.exemplars = exemplars
        self.metrics_paths = metrics_paths or {}
        self.restore_colons = restore_colons
        self.scrape_interval = scrape_interval
        self.port = free_port()
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="prometheus-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> str:
        jobs = []
        for job, spec in self.targets.items():
            hosts, labels = (spec, {}) if isinstance(spec, list) else spec
            jobs.append({"job_name": job, "scrape_interval": self.scrape_interval,
                         "scrape_timeout": self.scrape_interval,
                         "metrics_path": self.metrics_paths.get(job, "/metrics"),
                         "static_configs": [{"targets": hosts, "labels": labels}],
                         "metric_relabel_configs": RESTORE_COLONS if self.restore_colons else []})
        cfg = {"global": {"scrape_interval": self.scrape_interval,
                          "evaluation_interval": self.scrape_interval},
               "scrape_configs": jobs}
        return json.dumps(cfg, indent=1)  # JSON is valid YAML

    def start(self, timeout: float = 30) -> LocalPrometheus:
        exe = shutil.which("prometheus")
        if not exe:
            raise FileNotFoundError("prometheus not found; apt-get install prometheus "
                                    "(scripts/setup_dashboard_tools.sh)")
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(self._config())
        self.proc = spawn(
            [exe, f"--config.file={cfg}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d",
             "--log.level=warn",
             *(["--enable-feature=exemplar-storage"] if self.exemplars else [])],
            self.workdir / "prometheus.log")
        wait_http(self.url + "/-/ready", self.proc, "prometheus", timeout)
        return self

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait_for_targets(self, timeout: float = 30) -> None:
        """Block until every target has been scraped successfully once."""
        deadline = time.monotonic() + timeout
        active: list = []
        while time.monotonic() < deadline:
            active = self.api("targets")["activeTargets"]
            if active and all(t["health"] == "up" for t in active):
                return
            time.sleep(0.5)
        state = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in active]
        raise TimeoutError(f"targets not up: {state}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
