"""Every measured number in README.md and the docs site matches the committed JSON.

The numbers live in `<!-- bench:NAME -->` passages that `bench.claims` renders from
docs/*.json; these tests re-render them and compare, and check that no measurement-looking
number sits outside a passage in the pages the benchmark owns (performance, the full benchmark,
the quick start's demo). Fast: no engine, no store.
"""

from __future__ import annotations

import json
import re

import pytest

from bench import claims

FENCE = re.compile(r"```.*?```", re.S)
# A number with a unit or a ratio mark, as measurements are quoted: 3.72x, 84 %, 25 us, 1.2 GB/s.
MEASURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:x|%|ms|us|µs|GB/s|MiB|GiB|s)"
                     r"(?![\w/])")
# Numbers outside passages that are settings or design constants, not measurements.
SETTINGS = {"0 ms", "5 ms", "10 ms",  # master RTTs the runs were set to
            "15 %", "16 s"}  # auto-tuner constants (connector/worker/autotune.py)
# Where each passage is quoted (the readme-* names are where they were first quoted).
PASSAGES = {
    "docs/quickstart.md": {"readme-demo"},
    "docs/observability.md": {"readme-tracing"},
    "docs/performance.md": {"readme-headlines", "readme-serve", "control-path"},
    "docs/benchmark.md": {"docs-meta", "docs-reading", "docs-auto-focused", "docs-full-output",
                          "docs-serve", "docs-serve-gap", "docs-serve-queued",
                          "docs-serve-queued-short"},
    "docs/disk-tier.md": {"docs-disk-tier"},
    "docs/reliability.md": {"frozen-get", "fault-matrix"},
    "docs/reliability-failover.md": {"failover-timeline", "failover-serve"},
    "docs/layouts.md": {"layouts-table"},
    "docs/development.md": {"suite-times"},
    "docs/kv-events.md": {"router-dynamo"},
}
ALL_PASSAGES = set().union(*PASSAGES.values())
# Settings the failover page quotes outside passages (the probe's intervals), not measurements.
FAILOVER_SETTINGS = {"0.5 s", "0.1 s"}


@pytest.fixture(scope="module")
def runs() -> claims.Runs:
    return claims.Runs()


@pytest.mark.parametrize("path", claims.FILES, ids=lambda p: p.name)
def test_every_passage_matches_the_json(path, runs):
    text = path.read_text()
    for name, body in claims.blocks(text):
        assert body == claims.RENDERERS[name](runs), (
            f"{path.name}: passage {name!r} differs from the committed JSON; run "
            f"`python -m bench.claims` after a benchmark run, never edit the numbers by hand")


def test_the_passages_are_all_there():
    found = {str(p.relative_to(claims.REPO)): [n for n, _ in claims.blocks(p.read_text())]
             for p in claims.FILES}
    assert {p: set(n) for p, n in found.items() if n} == PASSAGES
    names = [n for ns in found.values() for n in ns]
    assert sorted(names) == sorted(ALL_PASSAGES) == sorted(claims.RENDERERS), \
        "each renderer quoted exactly once"


@pytest.mark.parametrize("name", sorted(ALL_PASSAGES))
def test_an_edited_number_is_caught(name, runs):
    """The comparison has teeth: changing any digit of a passage makes it differ."""
    body = claims.RENDERERS[name](runs)
    digit = re.search(r"\d", body)
    assert digit, f"{name}: no number to check"
    i = digit.start()
    edited = body[:i] + str((int(body[i]) + 1) % 10) + body[i + 1:]
    text = f"x <!-- bench:{name} -->{edited}<!-- /bench:{name} --> y"
    assert claims.render(text, runs) != text


def _bench_parts() -> dict[str, str]:
    """The text this benchmark owns: the performance and full benchmark pages, the quick
    start's demo section (other pages quote test bounds and settings, not runs)."""
    docs = claims.DOCS
    quick = (docs / "quickstart.md").read_text()
    demo = quick[quick.index("## Two commands"):quick.index("## Turn it on for an engine")]
    return {"docs/quickstart.md (demo)": demo,
            "docs/performance.md": (docs / "performance.md").read_text(),
            "docs/benchmark.md": (docs / "benchmark.md").read_text()}


@pytest.mark.parametrize("where", list(_bench_parts()))
def test_no_measurement_outside_a_passage(where):
    text = FENCE.sub("", claims.BLOCK.sub("", _bench_parts()[where]))
    loose = [m.group() for m in MEASURE.finditer(text) if m.group() not in SETTINGS]
    assert not loose, f"{where}: numbers outside <!-- bench:... --> passages: {loose}"


def test_no_measurement_outside_a_passage_on_the_failover_page():
    text = FENCE.sub("", claims.BLOCK.sub("", (claims.DOCS / "reliability-failover.md")
                                          .read_text()))
    loose = [m.group() for m in MEASURE.finditer(text) if m.group() not in FAILOVER_SETTINGS]
    assert not loose, f"docs/reliability-failover.md: numbers outside passages: {loose}"


def test_unknown_passage_is_an_error(runs):
    with pytest.raises(KeyError, match="no renderer"):
        claims.render("<!-- bench:nope -->1<!-- /bench:nope -->", runs)


def test_suite_times_table_is_a_whole_recorded_run(tmp_path):
    """The suite-times table shows each recorded part, the time outside them and the whole
    command by its own wall clock, which judges the target; a committed docs/suite-times.json
    must hold every phase of one command and its wall clock (a partial recording would show a
    part as the whole)."""
    committed = claims.Runs().suite_times
    if committed is not None:
        assert sorted(p for p in committed["parts"] if p.startswith("phase")) == [
            "phase 1: unit + store + deploy (xdist)", "phase 1b: unit on vLLM 0.33",
            "phase 2a: e2e timed (serial)", "phase 2b: e2e side by side (2 workers)"], \
            "docs/suite-times.json is not one whole run: record it with RECORD_SUITE_TIMES=1"
        assert "scripts/test.sh" in committed.get("commands", {}), \
            "docs/suite-times.json lacks the command's wall clock: record it with scripts/test.sh"
    part = {"wall_s": 600.0, "tests": 300, "engine_starts": 2, "engine_start_s": 60.0,
            "starts_per_file": {"tests/e2e/test_a.py": 2},
            "seconds_per_file": {"tests/e2e/test_a.py": 90.0, "tests/unit/test_b.py": 20.0,
                                 "tests/unit/test_c.py": 60.0}}
    run = {"commit": "abc1234", "recorded": "2026-01-01 00:00 UTC", "cpus": 2, "cpu_model": "x",
           "parts": {"phase 1: a": part, "phase 2: b": {**part, "wall_s": 300.0}}}
    (tmp_path / "suite-times.json").write_text(json.dumps(run))
    body = claims.suite_times(claims.Runs(tmp_path))
    assert "| **the whole command** (wall clock) | **not recorded** | 600 | 4 | 2.0 min |" in body
    assert "**not judged**" in body  # the phases alone do not judge the whole command
    (tmp_path / "suite-times.json").write_text(json.dumps(
        {**run, "commands": {"scripts/test.sh": {"wall_s": 1830.0}}}))
    body = claims.suite_times(claims.Runs(tmp_path))
    assert "| phase 1: a | 10.0 min | 300 | 2 | 1.0 min |" in body
    assert "| outside the phases (set-up, `ruff`, starting pytest) | 15.5 min | | | |" in body
    assert "| **the whole command** (wall clock) | **30.5 min** | 600 | 4 | 2.0 min |" in body
    assert "within 30 minutes on 2 cores: **missed** (30.5 min by the wall clock" in body
    # Phases side by side (their spans overlap) count once in the time outside them.
    spans = {"phase 1: a": [0.0, 600.0], "phase 2: b": [500.0, 800.0]}
    (tmp_path / "suite-times.json").write_text(json.dumps(
        {**run, "commands": {"scripts/test.sh": {"wall_s": 830.0}},
         "parts": {n: {**p, "span": spans[n]} for n, p in run["parts"].items()}}))
    body = claims.suite_times(claims.Runs(tmp_path))
    assert "| outside the phases (set-up, `ruff`, starting pytest) | 0.5 min | | | |" in body
    # starts and minutes add up over the parts; a file without a start shows from a minute
    assert "| `tests/e2e/test_a.py` | 4 | 3.0 min |" in body
    assert "| `tests/unit/test_c.py` | 0 | 2.0 min |" in body
    assert "test_b.py" not in body
    assert body.index("test_a.py") < body.index("test_c.py")  # slowest first
    assert "No run recorded" in claims.suite_times(claims.Runs(tmp_path / "none"))
