"""Start a real `vllm serve` (optionally with the connector) on a free loopback port, and talk
to it. Shared by the tests, the demo and the benchmark.

Engines run in float32 unless told otherwise, and their completions refuse to be compared for
equality unless they ran in float32 (`Completion`): output equality is how the tests tell a
right block from a wrong one, and in bfloat16 it depends on the CPU. The attention backend is
pinned (`attention_backend`) so that the CPU does not choose it either.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.local_cluster import free_port
from devkit.processes import HOST, spawn, stop_process, wait_http
from devkit.vllm_zygote import ForkedProcess, Zygote

BLOCK_SIZE = 32
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
CPU_MLA_BLOCK_SIZE = 16  # what vLLM's CPU MLA backend runs whatever --block-size says
REPO = Path(__file__).resolve().parent.parent
# The one dtype in which greedy outputs may be compared for equality. In bfloat16 the KV of a
# prefix computed alone and inside a batch differ in their last bits on CPUs with AMX-BF16,
# and the tiny random models have near-tied logits, so greedy tokens flip: numerics a test
# cannot tell from a wrong block. float32 leaves no such near-tie within reach.
EXACT_DTYPE = "float32"
# What operators serve in: for benchmarks, which time engines and assert no outputs equal.
SERVING_DTYPE = "bfloat16"
# Attention backends that serve every model kind in EXACT_DTYPE on every x86 CPU. Unpinned,
# vLLM's CPU platform gives an MLA model AMX_MLA where the CPU has AMX tiles (it takes bfloat16
# weights only: a float32 engine dies loading its weights, "expect weight to be bfloat16 ...")
# and CPU_MLA elsewhere (vllm/platforms/cpu.py, get_attn_backend_cls); other models get
# CPU_ATTN on every x86 CPU. Pinned, an engine runs the same kernels on every CPU kind.
MLA_BACKEND = "CPU_MLA"
ATTN_BACKEND = "CPU_ATTN"


# Whether TP=1 engines run their worker inside the engine-core process (vLLM's "uni" executor,
# VLLM_ENABLE_V1_MULTIPROCESSING=0) instead of a worker process of its own ("mp", what vLLM
# picks on CPU): one process fewer to spawn and import torch and vLLM in at every start. The
# tests set it (tests/conftest.py); benchmarks keep vLLM's default so their numbers compare.
IN_PROCESS_TP1 = False
# Whether `vllm serve` API servers are forked from a process that imported vLLM once
# (devkit/vllm_zygote.py) instead of started afresh, saving their ~10 s of imports at every
# start; the EngineCore and its workers start as always. The tests set it (tests/conftest.py);
# benchmarks keep real starts.
FORK_API_SERVERS = False
_zygote: Zygote | None = None
_zygote_lock = threading.Lock()  # engines started together ask for it from several threads
# Called as listener(server, seconds) after every start that served, whether or not it did:
# the suite counts engine starts per test file with it (tests/suite_times.py).
START_LISTENERS: list[Callable[[VllmServer, float], None]] = []


def forked(argv: list[str], env: dict[str, str], cwd: str | Path | None, log_path: str
           ) -> ForkedProcess | None:
    """`argv` forked from this process's zygote (FORK_API_SERVERS), or None: not on, or the
    fork would not be the process `argv` starts (then spawn it)."""
    if not FORK_API_SERVERS:
        return None
    return _the_zygote().launch(argv, env, cwd, log_path)


def prestart_zygote() -> None:
    """Start this process's zygote in the background (FORK_API_SERVERS), so that its imports
    overlap what a test sets up before its first engine; that engine's start waits for it."""
    if FORK_API_SERVERS:
        threading.Thread(target=_the_zygote, name="vllm-zygote-start", daemon=True).start()


def _the_zygote() -> Zygote:
    """This process's zygote, started on first use (a failed start is tried again then)."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            base = {**os.environ, **SERVER_ENV, "PYTHONPATH": server_pythonpath()}
            _zygote = Zygote(base, _new_log_file())
        return _zygote


def server_pythonpath() -> str:
    return f"{REPO}:{os.environ.get('PYTHONPATH', '')}"


class InexactComparison(TypeError):
    """Completions of an engine not in float32 were compared for equality."""


class Completion(list):
    """Greedy token ids from one engine, tagged with that engine's dtype.

    Equality is the suite's exactness check, so `==` and `!=` between completions (and so
    between lists of them) raise InexactComparison unless every engine involved ran in
    EXACT_DTYPE: a test cannot assert identical outputs of a bfloat16 engine, whatever it
    writes.
    """

    __slots__ = ("dtype",)

    def __init__(self, tokens: list[int], dtype: str) -> None:
        super().__init__(tokens)
        self.dtype = dtype

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, list):
            return NotImplemented
        for side in (self, other):
            if isinstance(side, Completion) and side.dtype != EXACT_DTYPE:
                raise InexactComparison(
                    f"outputs of a {side.dtype} engine compared for equality: greedy tokens in "
                    f"{side.dtype} depend on the CPU's kernels (near-ties flip); run engines "
                    f"whose outputs are compared with dtype={EXACT_DTYPE!r}")
        return list.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq


def uses_mla(model: str) -> bool:
    """Whether a local model directory declares multi-head latent attention (DeepSeek's
    `kv_lora_rank`, which vLLM's `ModelConfig.use_mla` reads); a hub name is not a test model."""
    config = Path(model) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("kv_lora_rank"))


def engine_block_size(model: str) -> int:
    """The block size an engine of `model` runs: BLOCK_SIZE, but 16 for MLA, where vLLM's CPU
    MLA backend overrides --block-size ("CPU MLA backend requires block_size=16")."""
    return CPU_MLA_BLOCK_SIZE if uses_mla(model) else BLOCK_SIZE


def attention_backend(model: str) -> str:
    """The backend an engine of `model` is pinned to (`--attention-backend`)."""
    return MLA_BACKEND if uses_mla(model) else ATTN_BACKEND


def cpu_backend_choice(use_mla: bool, pinned: str | None) -> str:
    """The backend vLLM's CPU platform gives a model on this CPU with `pinned` requested (None:
    vLLM's own choice): what an engine started here will run."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    selected = AttentionBackendEnum[pinned] if pinned else None
    cfg = AttentionSelectorConfig(head_size=576 if use_mla else 64, dtype=None,
                                  kv_cache_dtype=None, block_size=None, use_mla=use_mla)
    path = CpuPlatform.get_attn_backend_cls(selected, cfg)
    return next(b.name for b in AttentionBackendEnum if b.value == path)


def backend_problem(backend: str, dtype: str, use_mla: bool) -> str | None:
    """Why `backend` cannot serve a model of this kind in `dtype`, in one line naming the
    backend and its constraint (None: it can), so an engine that would not start on a CPU kind
    fails its check with the cause."""
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cls = AttentionBackendEnum[backend].get_class()
    if cls.is_mla() != use_mla:
        return (f"attention backend {backend} is {'an' if cls.is_mla() else 'not an'} MLA "
                f"backend, for a model {'with' if use_mla else 'without'} MLA")
    if not cls.supports_dtype(getattr(torch, dtype)):
        return (f"attention backend {backend} takes {[str(d) for d in cls.supported_dtypes]} "
                f"weights, not {dtype}: pin one that does (devkit.vllm_server.attention_backend)")
    return None


def connector_kv_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "PooledMooncakeStoreConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
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
    dtype: str = EXACT_DTYPE  # benchmarks that compare no outputs may run bfloat16
    proc: subprocess.Popen | None = None
    cwd: Path = REPO  # where vllm serve runs (outside the checkout to test an installed wheel)
    in_process: bool = field(default_factory=lambda: IN_PROCESS_TP1)  # see IN_PROCESS_TP1

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            str(Path(sys.executable).parent / "vllm"), "serve", self.model,
            "--host", HOST, "--port", str(self.port), "--block-size", str(BLOCK_SIZE),
            "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
            "--max-num-seqs", "32", "--seed", "0", "--enforce-eager",
            "--attention-backend", attention_backend(self.model), *self.extra_args,
        ]
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_config)]
        return cmd

    @property
    def tp_size(self) -> int:
        args = list(self.extra_args)
        for flag in ("--tensor-parallel-size", "-tp"):
            if flag in args:
                return int(args[args.index(flag) + 1])
        return 1

    def start(self, timeout: float = 240.0) -> VllmServer:
        env = {**os.environ, **SERVER_ENV, "PYTHONPATH": server_pythonpath(), **self.env}
        if self.in_process and self.tp_size == 1:
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        began = time.monotonic()
        self.proc = forked(self.command(), env, self.cwd, self.log_path) \
            or spawn(self.command(), self.log_path, env=env, cwd=self.cwd)
        try:
            wait_http(self.url + "/health", self.proc, "vllm serve", timeout)
            refused = self.backend_refusal()
            if refused:
                raise RuntimeError(f"vllm serve did not run the pinned attention backend: "
                                   f"{refused}")
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            raise RuntimeError(f"{e}:\n{self.log_tail()}") from None
        finally:
            for listener in START_LISTENERS:
                listener(self, time.monotonic() - began)
        return self

    def backend_refusal(self) -> str | None:
        """vLLM's line saying it refused the requested attention backend ("Cannot use X backend
        on CPU."), if it logged one: it then ran another, chosen by the CPU."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return None
        return next((line.strip() for line in text.splitlines() if "Cannot use " in line
                     and " backend on " in line), None)

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

    def _greedy(self, prompt_ids: list[int], max_tokens: int, cache_salt: str | None
                ) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True, "ignore_eos": True}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return body

    def complete(self, prompt_ids: list[int], max_tokens: int = 8,
                 cache_salt: str | None = None) -> Completion:
        """Greedy completion of a token-id prompt; returns the generated token ids. A
        `cache_salt` (vLLM's per-request field) changes every block hash of the request: no
        local prefix-cache or store block of another salt matches it."""
        out = self.post("/v1/completions", self._greedy(prompt_ids, max_tokens, cache_salt))
        return Completion(out["choices"][0]["token_ids"], self.dtype)

    def logprobs(self, prompt_ids: list[int], max_tokens: int = 8,
                 cache_salt: str | None = None) -> tuple[Completion, list[float]]:
        """A greedy completion and each generated token's log-probability: finer than the
        tokens, so KV that is wrong but not enough to move a greedy token still shows."""
        body = {**self._greedy(prompt_ids, max_tokens, cache_salt), "logprobs": 1}
        choice = self.post("/v1/completions", body)["choices"][0]
        return (Completion(choice["token_ids"], self.dtype),
                [float(x) for x in choice["logprobs"]["token_logprobs"]])

    def reset_prefix_cache(self, wait_s: float = 60.0) -> bool:
        """Drop vLLM's local prefix cache. vLLM refuses while any block is held, and the
        connector holds a finished request's blocks until their saves are stored, so this
        retries until it succeeds (then every save so far is in the store) and raises
        TimeoutError after `wait_s`. With wait_s=0: one attempt; returns whether it worked."""
        deadline = time.monotonic() + wait_s
        while not self.post("/reset_prefix_cache")["success"]:
            if wait_s <= 0:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve refused to reset its prefix cache for {wait_s} s "
                                   f"(blocks still held):\n{self.log_tail(20)}")
            time.sleep(0.1)
        return True

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def stop(self) -> None:
        stop_process(self.proc)


def start_together(servers: list[VllmServer], timeout: float = 240.0) -> list[VllmServer]:
    """Start `servers` at the same time, each from a thread of its own, and return them once
    every one serves. A start is mostly one process importing vLLM on one core, so on a
    2-core host two starts together take little longer than one. If a start fails, the others
    are stopped and the first failure is raised."""
    errors: list[BaseException] = []

    def start(server: VllmServer) -> None:
        try:
            server.start(timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]
    return servers
