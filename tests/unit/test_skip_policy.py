"""The skip policy `scripts/test.sh` applies: a skip that `docs/development.md` does not list
fails the run, and every skip is printed with its reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skip_policy import DOC, MARKER, allowed_skips

ROOT = Path(__file__).resolve().parents[2]
LIST = f"{MARKER}\n```text\n# node id | reason\n{{}}```\n"


def test_the_docs_list_parses_and_names_existing_tests():
    for node, reason in allowed_skips(DOC.read_text()).items():
        assert reason and (ROOT / node.split("::", 1)[0]).is_file(), node


@pytest.mark.parametrize("text, error", [
    ("no list here", "no <!-- allowed-skips -->"),
    (f"{MARKER}\nprose\n", "must be followed by a fenced block"),
    (LIST.format("tests/x.py::test_a\n"), "is not 'node id | reason'"),
    (LIST.format("tests/x.py::test_a | \n"), "is not 'node id | reason'"),
    (f"{MARKER}\n```text\ntests/x.py::a | why\n", "is not closed"),
])
def test_a_malformed_list_is_refused(text, error):
    with pytest.raises(ValueError, match=error):
        allowed_skips(text)


def run_pytest(tmp_path: Path, listed: str) -> subprocess.CompletedProcess:
    # A throwaway module whose skips are what the policy judges: it runs in its own pytest
    # under tmp_path, never in this suite, and the tests below assert the run's verdict.
    (tmp_path / "test_s.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    pass\n\n"
        "@pytest.mark.parametrize('p', [1, 2])\n"
        "def test_skips(p):\n    pytest.skip('no widget here')\n")
    (tmp_path / "dev.md").write_text("# development\n\n" + LIST.format(listed))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.skip_policy",
         "--allowed-skips", str(tmp_path / "dev.md"), "-q", "test_s.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_an_unlisted_skip_fails_the_run_and_is_printed(tmp_path):
    r = run_pytest(tmp_path, "test_s.py::test_other | another test\n")
    assert r.returncode == 1, r.stdout
    assert "NOT ALLOWED test_s.py::test_skips[1]: no widget here" in r.stdout
    assert "2 skip(s) not in the allowed-skips list" in r.stdout


def test_a_listed_skip_passes_and_is_printed(tmp_path):
    r = run_pytest(tmp_path, "test_s.py::test_skips | no widget on CI machines\n")
    assert r.returncode == 0, r.stdout
    assert "allowed     test_s.py::test_skips[2]: no widget here" in r.stdout
