"""Child processes for the dev kit: start in their own session, wait until they serve, freeze
and resume them (SIGSTOP, SIGCONT), stop the whole process group (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HOST = "127.0.0.1"


def spawn(argv: list[str], log_path: str | Path, env: dict | None = None,
          cwd: str | Path | None = None) -> subprocess.Popen:
    """Start argv in a new session with stdout and stderr appended to log_path."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            with socket.create_connection((HOST, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not open port {port} within {timeout}s")


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float) -> None:
    """Block until GET url answers 200; raise if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    raise TimeoutError(f"{what}: {url} not ready within {timeout}s")


def stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def _all_stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (state T), as /proc shows it."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:  # a thread exited meanwhile: look again
        return False
    return all(s in ("T", "t") for s in states)


def freeze(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGSTOP the process group (a frozen peer: its sockets stay open, nothing answers), and
    return once /proc shows every thread stopped. killpg returns when the signal is queued, and
    each thread stops when the kernel next runs it: before that, a request sent to the peer may
    still be answered (seen here: a store node served a get after its kill had returned)."""
    os.killpg(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_stopped(proc.pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {proc.pid} did not stop within {timeout}s")
        time.sleep(0.001)


def thaw(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGCONT)


@contextmanager
def frozen(proc: subprocess.Popen) -> Iterator[None]:
    """The process group is frozen inside the block (see `freeze`), and resumed after it."""
    freeze(proc)
    try:
        yield
    finally:
        thaw(proc)
