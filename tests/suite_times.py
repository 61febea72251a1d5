"""The suite's time, measured: engine starts per test file and, with RECORD_SUITE_TIMES=<part>,
one part's figures in docs/suite-times.json.

`scripts/test.sh` loads this plugin (`-p tests.suite_times`) in every phase. Each `vllm serve`
start (`devkit.vllm_server.START_LISTENERS`) is counted against the test file running then, with
its seconds from launch to serving; under pytest-xdist each worker counts its own and hands
them to the controller at its end. The terminal summary prints the starts per file. With
RECORD_SUITE_TIMES set, the run writes its part (wall time, tests, engine starts and seconds,
starts per file) into docs/suite-times.json beside the other parts, which `bench.claims`
renders into the table of docs/development.md: the table's figures are a real run's. The
command's own wall clock, from its first line (set-up included) to its last, is written by
`scripts/test.sh` itself (`python -m tests.suite_times COMMAND BEGAN PATH`): the whole
command is judged by it, not by the sum of its phases.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import pytest

from devkit import vllm_server
from devkit.provenance import git_commit

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "suite-times.json"
# Where a run writes its parts: scripts/test.sh points this at a scratch file and moves it to
# OUT once every phase passed, so the claims tests of a later phase never see half a run.
PARTS = Path(os.environ.get("SUITE_TIMES_PARTS", OUT))
ENV = "RECORD_SUITE_TIMES"


@contextmanager
def _updating(path: Path) -> Iterator[dict]:
    """The JSON at `path` (or a new one), written back at the end; under a lock, since phases
    that run side by side (1 and 1b) each write their part."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        data = json.loads(text) if text.strip() else {"parts": {}}
        yield data
        f.seek(0)
        f.truncate()
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def merge_part(path: Path, part: str, figures: dict, meta: dict) -> dict:
    """The JSON at `path` with `part` replaced by `figures` (other parts kept)."""
    with _updating(path) as data:
        data.update(meta)
        data["parts"][part] = figures
    return data


class SuiteTimes:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.began = time.monotonic()
        self.began_at = time.time()  # the span, to tell phases that ran side by side
        self.current = "(outside a test)"
        self.starts: dict[str, list[float]] = {}  # test file -> seconds of each start
        self.seconds: dict[str, float] = {}  # test file -> its tests' setup, call, teardown
        self.tests = 0
        vllm_server.START_LISTENERS.append(self.on_start)

    def on_start(self, server: vllm_server.VllmServer, seconds: float) -> None:
        self.starts.setdefault(self.current, []).append(round(seconds, 1))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        self.current = item.nodeid.split("::", 1)[0]  # session fixtures count where first used

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Under pytest-xdist the controller sees every worker's reports: its seconds per file
        add up the workers running side by side."""
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.tests += 1
        file = report.nodeid.split("::", 1)[0]
        self.seconds[file] = self.seconds.get(file, 0.0) + report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: the controller adds it up
            workeroutput["engine_starts"] = json.dumps(self.starts)

    @pytest.hookimpl(optionalhook=True)  # pytest-xdist's
    def pytest_testnodedown(self, node, error) -> None:
        for file, secs in json.loads(node.workeroutput.get("engine_starts", "{}")).items():
            self.starts.setdefault(file, []).extend(secs)

    def figures(self) -> dict:
        every = [s for secs in self.starts.values() for s in secs]
        return {"wall_s": round(time.monotonic() - self.began, 1), "tests": self.tests,
                "span": [round(self.began_at, 1), round(time.time(), 1)],
                "engine_starts": len(every), "engine_start_s": round(sum(every), 1),
                "starts_per_file": {f: len(s) for f, s in sorted(self.starts.items())},
                "seconds_per_file": {f: round(s, 1) for f, s in sorted(self.seconds.items())}}

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if getattr(self.config, "workeroutput", None) is not None:
            return
        f = self.figures()
        if f["engine_starts"]:
            tr = terminalreporter
            tr.section("engine starts")
            for file, secs in sorted(self.starts.items()):
                tr.line(f"{len(secs):3d} starts, {sum(secs):6.1f} s  {file}")
            tr.line(f"{f['engine_starts']:3d} starts, {f['engine_start_s']:6.1f} s  in all")
        part = os.environ.get(ENV)
        if part:
            merge_part(PARTS, part, f, run_meta())
            terminalreporter.line(f"{ENV}: part {part!r} written to {PARTS}")


def run_meta() -> dict:
    """What the figures were measured on."""
    commit = git_commit()
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"commit": commit, "cpus": os.cpu_count(), "cpu_model": model,
            "recorded": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def merge_command(path: Path, command: str, began: float) -> dict:
    """The JSON at `path` with `command`'s wall clock from `began` (epoch seconds) to now."""
    with _updating(path) as data:
        data.setdefault("commands", {})[command] = {"wall_s": round(time.time() - began, 1)}
    return data


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SuiteTimes(config), "suite-times")


if __name__ == "__main__":  # scripts/test.sh, at its end: COMMAND BEGAN PATH
    import sys

    name, began, out = sys.argv[1:]
    print(f"{name}: {merge_command(Path(out), name, float(began))['commands'][name]['wall_s']}"
          f" s, written to {out}")
