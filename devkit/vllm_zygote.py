"""Start `vllm serve` API servers by forking a process that has already imported vLLM.

Most of an engine start on the 2-core test host was imports: the API server importing vLLM
(torch, transformers, vLLM's config and entrypoint modules) before it parses its arguments,
then its EngineCore, a process vLLM's CPU platform spawns, importing vLLM again. This module
keeps one process per test process (the zygote) that has made those imports once. For each
engine it forks, and the child does what a fresh `vllm serve` would: its own session, stdout
and stderr appended to the log, the engine's working directory and environment, `sys.argv` as
the command line, then vLLM's CLI `main()`; at its end the exit handlers run, as at interpreter
exit, and the child exits with main's status. (What vLLM prints while it is imported goes to
the zygote's log, once.) The child forks its EngineCore in turn (`_fork_engine_cores`), as
vLLM does where no platform asks for spawn. Everything after the imports (argument parsing,
config, the EngineCore and its workers, the connector) is vLLM's own code in a process of its
own.

What a fork cannot change is fixed when the zygote starts: `sys.path` (PYTHONPATH), the
interpreter's flags and hash seed, and what vLLM and torch read at import (logging settings,
library paths, thread settings). An engine whose environment differs from the zygote's in any
of those (`IMPORT_TIME_ENV`) is started the usual way (`Zygote.launch` returns None), as is
any command other than this interpreter's `vllm` CLI, and one started from a thread in other
namespaces or on other CPUs than the zygote's (a spawned child would take those of the
thread).

Protocol: one JSON line per request on the zygote's stdin, one JSON line answer on the
protocol descriptor given at start; requests are `launch` (argv, env, cwd, log: the child's
pid) and `status` (pid: its exit status once it has exited, else null). The zygote reaps its
children, so exit statuses are known only through it (`ForkedProcess`); it exits when its stdin
closes.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# What the zygote imports before forking: vLLM's CLI and everything `vllm serve` imports
# before it parses its arguments (measured with PYTHONPROFILEIMPORTTIME).
PRELOAD = (
    "vllm.entrypoints.cli.main", "vllm.entrypoints.cli.benchmark.main",
    "vllm.entrypoints.cli.collect_env", "vllm.entrypoints.cli.download_kernels",
    "vllm.entrypoints.cli.launch", "vllm.entrypoints.cli.openai",
    "vllm.entrypoints.cli.preload", "vllm.entrypoints.cli.run_batch",
    "vllm.entrypoints.cli.serve", "vllm.entrypoints.cli.snapshot",
    "vllm.entrypoints.openai.api_server", "vllm.v1.engine.async_llm",
)
# Variables read when the interpreter starts or while those modules are imported: an engine
# whose value differs from the zygote's is started the usual way.
IMPORT_TIME_ENV = ("PYTHON", "LD_", "VLLM_LOGGING", "VLLM_CONFIGURE_LOGGING", "NO_COLOR",
                   "FORCE_COLOR", "TORCH", "OMP_", "KMP_", "MKL_", "TRANSFORMERS", "HF_",
                   "VLLM_ENABLE_CUDA_COMPATIBILITY", "VLLM_CUDA_COMPATIBILITY_PATH")


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _placement(task: str) -> tuple:
    """What a child takes from the thread that starts it, beside its environment: the
    namespaces (`/proc/<task>/ns`) and the CPUs it may run on."""
    ns = Path(f"/proc/{task}/ns")
    pid = 0 if task == "thread-self" else int(task)
    return (tuple(sorted((p.name, os.readlink(p)) for p in ns.iterdir())),
            tuple(sorted(os.sched_getaffinity(pid))))


# ---- the zygote process ------------------------------------------------------------------
def _child(argv: list[str], env: dict[str, str], cwd: str | None, log: str,
           import_env: dict[str, str], channel: int) -> None:
    """In the forked child: become the `vllm serve` process the request describes; never
    returns."""
    code = 1
    try:
        os.close(channel)
        os.setsid()
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the zygote's requests
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        if cwd:
            os.chdir(cwd)
        os.environ.clear()
        # What the imports set in the zygote's environment (vllm.env_override), unless the
        # engine's environment says otherwise: as in a process that imported them itself.
        os.environ.update({**import_env, **env})
        sys.argv = list(argv)
        _fork_engine_cores()
        from vllm.entrypoints.cli.main import main

        result = main()
        code = 0 if result is None else int(result)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as an uncaught exception would be
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what interpreter exit runs (multiprocessing, logging)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _fork_engine_cores() -> None:
    """The EngineCore of this API server forked from it, as vLLM starts it by default where no
    platform asks for spawn (its GPU hosts), instead of spawned as its CPU platform asks: it
    inherits the imports instead of making them again (most of a TP=1 start here). Only
    the EngineCore: a TP>1 engine's workers are still spawned, since each reads the OpenMP
    binding vLLM sets for its rank when it imports torch."""
    import multiprocessing

    import vllm.v1.engine.utils as engine_utils

    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")


def _serve() -> None:
    """The zygote: import vLLM, then answer requests on stdin until it closes."""
    import importlib

    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    import_env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    answers = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    exited: dict[int, int] = {}

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            exited[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) \
                else os.WEXITSTATUS(status)

    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        reap()
        if req["op"] == "launch":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req["argv"], req["env"], req["cwd"], req["log"], import_env,
                       answers.fileno())
            answers.write(json.dumps({"pid": pid}) + "\n")
        else:
            answers.write(json.dumps({"returncode": exited.get(req["pid"])}) + "\n")


# ---- the test process's side -------------------------------------------------------------
class ForkedProcess:
    """A zygote's child, with the part of `subprocess.Popen` that the devkit uses: `pid`,
    `poll()`, `wait()` and `returncode` (negative: killed by that signal)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"vllm serve (pid {self.pid})", timeout)
            time.sleep(0.05)
        return self.returncode


class Zygote:
    """The zygote of this process, started on first use with `env` (the environment every
    engine shares); `launch` forks a `vllm serve` from it."""

    def __init__(self, env: dict[str, str], log_path: str) -> None:
        self.env, self.log_path = env, log_path
        self._lock = threading.Lock()
        read_fd, write_fd = os.pipe()
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "devkit.vllm_zygote", str(write_fd)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                pass_fds=(write_fd,), start_new_session=True, text=True)
        os.close(write_fd)
        self._answers = os.fdopen(read_fd, "r")
        atexit.register(self.close)
        self._ask(None)  # its imports are done

    def _ask(self, req: dict | None) -> dict:
        with self._lock:
            if req is not None:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            line = self._answers.readline()
        if not line:
            tail = Path(self.log_path).read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(f"the vLLM zygote exited (status {self.proc.wait()}):\n"
                               + "\n".join(tail))
        return json.loads(line)

    def fits(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether a fork of this zygote is the process `argv` in `env` would start from the
        calling thread: the same command and import-time environment, and the thread's
        namespaces (a test's thread inside a network namespace: devkit/netns.py) and CPUs."""
        return (argv[:1] == [str(Path(sys.executable).parent / "vllm")]
                and _import_time_env(env) == _import_time_env(self.env)
                and _placement("thread-self") == _placement(str(self.proc.pid)))

    def launch(self, argv: list[str], env: dict[str, str], cwd: str | None, log_path: str
               ) -> ForkedProcess | None:
        """The forked vLLM command (`vllm serve ...`), or None where a fork would not be the
        process `argv` starts."""
        if not self.fits(argv, env) or self.proc.poll() is not None:
            return None
        pid = self._ask({"op": "launch", "argv": argv, "env": env,
                         "cwd": str(cwd) if cwd else None, "log": str(log_path)})["pid"]
        return ForkedProcess(self, pid)

    def status(self, pid: int) -> int | None:
        return self._ask({"op": "status", "pid": pid})["returncode"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


if __name__ == "__main__":
    _serve()
