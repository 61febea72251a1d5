"""Every engine test file says whether its assertions depend on time (tests/conftest.py):
scripts/test.sh runs `timed` files alone on the machine and `side_by_side` files two at a
time, so a file that says neither is refused at collection, naming it."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Item:
    nodeid: str
    marks: list[str] = field(default_factory=list)

    def iter_markers(self):
        return (SimpleNamespace(name=name) for name in self.marks)


def declared_marks(path: Path) -> set[str]:
    """The timing marks a module's `pytestmark` names (read, not imported: the collection hook
    enforces the same on the imported module)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                for t in node.targets):
            return {n.attr for n in ast.walk(node.value)
                    if isinstance(n, ast.Attribute) and n.attr in conftest.TIMING_MARKS}
    return set()


def test_every_engine_file_declares_its_timing():
    files = sorted((ROOT / "tests" / "e2e").glob("test_*.py")) + [
        ROOT / "tests" / "deploy" / "test_helm_smoke.py"]
    assert {f.name: declared_marks(f) for f in files if len(declared_marks(f)) != 1} == {}


@pytest.mark.parametrize("marks", [[], ["timed", "side_by_side"]])
def test_an_engine_file_without_exactly_one_timing_mark_is_refused(marks):
    items = [Item("tests/e2e/test_new.py::test_a", marks), Item("tests/unit/test_x.py::test_b"),
             Item("tests/e2e/test_ok.py::test_c", ["timed"])]
    with pytest.raises(pytest.UsageError) as e:
        conftest.pytest_collection_modifyitems(None, items)
    assert str(e.value).startswith("tests/e2e/test_new.py: mark the file with exactly one of")
    assert "test_ok.py" not in str(e.value) and "\n" not in str(e.value)


def test_xdist_workers_order_their_collection_longest_first(monkeypatch):
    """The controller hands out files in its workers' collection order, and a worker's own
    `--dist` option reads "no": the order is the workers' to set, whatever that option says."""
    recorded = conftest.recorded_seconds()
    short, long = min(recorded, key=recorded.get), max(recorded, key=recorded.get)
    config = SimpleNamespace(getoption=lambda name, default=None: "no")
    for worker, want in (("gw0", [long, short]), ("", [short, long])):  # "": not under xdist
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        items = [Item(f"{short}::t", ["timed"]), Item(f"{long}::t", ["timed"])]
        conftest.pytest_collection_modifyitems(config, items)
        assert [i.nodeid.split("::")[0] for i in items] == want, worker


def test_side_by_side_files_go_longest_first():
    """Under `--dist loadfile` the files are handed out longest first by the recorded run, a
    file the record lacks before them, each file's tests kept in their order."""
    recorded = conftest.recorded_seconds()
    by_time = {recorded[f]: f for f in recorded if f.startswith("tests/e2e/")}  # no ties
    known = [by_time[t] for t in sorted(by_time)[:3]]
    items = [Item(f"{f}::t{i}") for f in known for i in range(2)] + [Item("tests/e2e/new.py::t")]
    conftest.longest_files_first(items)
    assert [i.nodeid for i in items] == ["tests/e2e/new.py::t"] + [
        f"{f}::t{i}" for f in reversed(known) for i in range(2)]
