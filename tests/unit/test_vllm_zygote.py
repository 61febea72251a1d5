"""The zygote that forks the tests' `vllm serve` API servers (devkit/vllm_zygote.py): a forked
vLLM command ends as the same command started afresh does (status, output), and a command the
fork would not reproduce is left to be started the usual way: another interpreter, another
import-time environment, a thread in another network namespace."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from devkit.vllm_server import server_pythonpath
from devkit.vllm_zygote import Zygote

VLLM = str(Path(sys.executable).parent / "vllm")
CLONE_NEWNET = 0x40000000
ENV = {**os.environ, "PYTHONPATH": server_pythonpath()}


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(ENV, str(tmp_path_factory.mktemp("zygote") / "zygote.log"))
    yield z
    z.close()
    assert z.proc.returncode == 0  # it exits when its requests end


@pytest.mark.parametrize("args", [["--version"], ["serve", "--no-such-flag"]])
def test_forked_command_ends_as_a_fresh_one(zygote, tmp_path, args):
    fresh = subprocess.run([VLLM, *args], env=ENV, capture_output=True, text=True, timeout=120)
    log = tmp_path / "forked.log"
    proc = zygote.launch([VLLM, *args], ENV, str(tmp_path), str(log))
    assert proc is not None and proc.pid != zygote.proc.pid
    assert proc.wait(timeout=120) == fresh.returncode
    last = (fresh.stdout.strip() or fresh.stderr.strip()).splitlines()[-1]  # its answer
    assert log.read_text().strip().splitlines()[-1] == last
    assert (fresh.returncode == 0) == (args == ["--version"])


def test_commands_a_fork_would_not_reproduce_are_left_alone(zygote, tmp_path):
    log = str(tmp_path / "x.log")
    assert zygote.launch(["/usr/bin/env", "true"], ENV, None, log) is None
    for env in ({**ENV, "PYTHONPATH": "/elsewhere"}, {**ENV, "VLLM_LOGGING_LEVEL": "DEBUG"}):
        assert zygote.launch([VLLM, "--version"], env, None, log) is None
    assert not Path(log).exists()


def test_a_thread_in_another_network_namespace_is_left_alone(zygote, tmp_path):
    """A thread inside a network namespace (devkit/netns.py runs engines so) spawns its
    children there; the zygote's fork would be in the zygote's, so it is not used."""
    box = {}

    def body() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.unshare(CLONE_NEWNET) == 0, os.strerror(ctypes.get_errno())
        box["proc"] = zygote.launch([VLLM, "--version"], ENV, None, str(tmp_path / "x.log"))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert "proc" in box and box["proc"] is None
    assert zygote.fits([VLLM, "--version"], ENV)  # from this thread it would fork


def test_a_forked_engine_forks_its_engine_core(tiny_model):
    """A forked `vllm serve` forks its EngineCore too, not spawning a new interpreter that
    imports vLLM again: neither process was exec'ed, so the environment block the kernel shows
    for each (/proc/<pid>/environ, written at exec) is still the zygote's, without the
    variable given to this engine alone."""
    import psutil

    from devkit.vllm_server import VllmServer

    server = VllmServer(tiny_model, None, env={"ZYGOTE_TEST_ENGINE": "1"}).start()
    try:
        api = psutil.Process(server.proc.pid)
        children = api.children()  # the EngineCore (a TP=1 engine runs its worker inside)
        assert children, "the API server has no EngineCore process"
        for p in (api, *children):
            assert b"ZYGOTE_TEST_ENGINE=" not in Path(f"/proc/{p.pid}/environ").read_bytes(), (
                f"pid {p.pid} was exec'ed: {p.cmdline()}")
        assert server.complete([5] * 40, max_tokens=2)  # and the engine serves
    finally:
        server.stop()
