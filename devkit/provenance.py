"""Which code a recorded JSON came from: every recorder (benchmarks, the suite's times, the HA
timeline) names its checkout the same way."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The checkout's short commit, with '+dirty' for uncommitted changes to tracked files
    ('?' where git cannot tell)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "?"
