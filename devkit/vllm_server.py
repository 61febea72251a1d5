"""Start a real `vllm serve` (optionally with the connector) on a free loopback port, and talk
to it. Shared by the tests, the demo and the benchmark.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.local_cluster import free_port
from devkit.processes import HOST, spawn, stop_process, wait_http

BLOCK_SIZE = 32
REPO = Path(__file__).resolve().parent.parent


def connector_kv_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "PooledMooncakeStoreConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value, for every sample in a Prometheus exposition."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of every sample of `name` whose labels include `labels`."""
    total = 0.0
    for key, v in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total


def _new_log_file() -> str:
    """A fresh log file of our own: mkstemp creates it (mode 0600), so no other process can
    take the name between choosing and opening it, as it could with mktemp."""
    fd, path = tempfile.mkstemp(prefix="vllm-", suffix=".log")
    os.close(fd)
    return path


@dataclass
class VllmServer:
    model: str
    kv_config: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    log_path: str = field(default_factory=_new_log_file)
    max_model_len: int = 2048
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            str(Path(sys.executable).parent / "vllm"), "serve", self.model,
            "--host", HOST, "--port", str(self.port), "--block-size", str(BLOCK_SIZE),
            "--max-model-len", str(self.max_model_len), "--dtype", "bfloat16",
            "--max-num-seqs", "32", "--seed", "0", "--enforce-eager", *self.extra_args,
        ]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return cmd

    def start(self, timeout: float = 240.0) -> VllmServer:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}", **self.env}
        self.proc = spawn(self.command(), self.log_path, env=env, cwd=REPO)
        try:
            wait_http(self.url + "/health", self.proc, "vllm serve", timeout)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.log_tail()}") from None
        return self

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        return json.loads(raw) if raw else None

    def complete(self, prompt_ids: list[int], max_tokens: int = 8) -> list[int]:
        """Greedy completion of a token-id prompt; returns the generated token ids."""
        out = self.post("/v1/completions", {
            "model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
            "temperature": 0.0, "return_token_ids": True, "ignore_eos": True,
        })
        return out["choices"][0]["token_ids"]

    def reset_prefix_cache(self) -> None:
        self.post("/reset_prefix_cache")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def stop(self) -> None:
        stop_process(self.proc)
