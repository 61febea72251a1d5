"""A skip is a failure unless the docs allow it, with its reason.

`scripts/test.sh` (and so CI) loads this plugin (`-p tests.skip_policy`). At the end of the run
it lists every skipped test with its reason, and it fails the run on any skip that the list in
`docs/development.md` (the test section the README points to) does not name: a test that does
not run where CI runs proves nothing, and a skip in a summary nobody reads hides that.

The list is the fenced block after the `<!-- allowed-skips -->` line: one `node id | reason`
line per allowed skip (`#` starts a comment). A node id without a `[...]` parameter part allows
every parametrization of that test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "development.md"
MARKER = "<!-- allowed-skips -->"


def allowed_skips(text: str) -> dict[str, str]:
    """node id -> reason, from the fenced block after MARKER in `text` (a Markdown page)."""
    if MARKER not in text:
        raise ValueError(f"no {MARKER} line followed by the fenced list of allowed skips")
    lines = text.split(MARKER, 1)[1].lstrip("\n").splitlines()
    if not lines or not lines[0].startswith("```"):
        raise ValueError(f"{MARKER} must be followed by a fenced block")
    out: dict[str, str] = {}
    for line in lines[1:]:
        line = line.strip()
        if line.startswith("```"):
            return out
        if not line or line.startswith("#"):
            continue
        node, _, reason = (part.strip() for part in line.partition("|"))
        if not node or not reason:
            raise ValueError(f"allowed skips: {line!r} is not 'node id | reason'")
        out[node] = reason
    raise ValueError(f"the fenced block after {MARKER} is not closed")


def is_listed(node: str, allowed: dict[str, str]) -> bool:
    return node in allowed or node.split("[", 1)[0] in allowed


class SkipPolicy:
    def __init__(self, allowed: dict[str, str]) -> None:
        self.allowed = allowed
        self.skipped: list[tuple[str, str]] = []  # (node id, reason)

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            self.skipped.append((report.nodeid, reason.removeprefix("Skipped: ")))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)  # a module-level skip

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def unlisted(self) -> list[tuple[str, str]]:
        return [(n, r) for n, r in self.skipped if not is_listed(n, self.allowed)]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unlisted() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.skipped:
            return
        tr = terminalreporter
        tr.section("skipped tests")
        for node, reason in self.skipped:
            verdict = "allowed" if is_listed(node, self.allowed) else "NOT ALLOWED"
            tr.line(f"{verdict:<12}{node}: {reason}")
        if self.unlisted():
            tr.line(f"{len(self.unlisted())} skip(s) not in the allowed-skips list of "
                    "docs/development.md: the run fails (make the test run here, or list it "
                    "with its reason)",
                    red=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--allowed-skips", default=str(DOC),
                     help="the Markdown page whose allowed-skips list applies")


def pytest_configure(config: pytest.Config) -> None:
    text = Path(config.getoption("--allowed-skips")).read_text()
    config.pluginmanager.register(SkipPolicy(allowed_skips(text)), "skip-policy")
