"""Every benchmark number in README.md and docs/benchmark.md matches the committed JSON.

The numbers live in `<!-- bench:NAME -->` passages that `bench.claims` renders from
docs/*.json; these tests re-render them and compare, and check that no measurement-looking
number sits outside a passage in the benchmark parts of the two files. Fast: no engine, no store.
"""

from __future__ import annotations

import re

import pytest

from bench import claims

FENCE = re.compile(r"```.*?```", re.S)
# A number with a unit or a ratio mark, as measurements are quoted: 3.72x, 84 %, 25 us, 1.2 GB/s.
MEASURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:x|%|ms|us|µs|GB/s|MiB|GiB|s)"
                     r"(?![\w/])")
# Numbers outside passages that are settings or design constants, not measurements.
SETTINGS = {"0 ms", "5 ms", "10 ms",  # master RTTs the runs were set to
            "15 %", "16 s"}  # auto-tuner constants (connector/autotune.py)
README_PASSAGES = {"readme-demo", "readme-tracing", "readme-headlines", "readme-serve"}
DOCS_PASSAGES = {"docs-meta", "docs-reading", "docs-auto-focused", "docs-full-output",
                 "docs-serve"}
LAYOUTS_PASSAGES = {"layouts-table"}


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
    readme = {n for n, _ in claims.blocks(claims.FILES[0].read_text())}
    docs = {n for n, _ in claims.blocks(claims.FILES[1].read_text())}
    assert readme == README_PASSAGES and docs == DOCS_PASSAGES
    layouts = {n for n, _ in claims.blocks(claims.FILES[2].read_text())}
    assert layouts == LAYOUTS_PASSAGES


@pytest.mark.parametrize("name", sorted(README_PASSAGES | DOCS_PASSAGES | LAYOUTS_PASSAGES))
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
    """The text this benchmark owns: all of docs/benchmark.md, the README's demo and bench
    sections (other README sections quote test bounds and settings, not runs)."""
    readme = claims.FILES[0].read_text()
    demo = readme[readme.index("## Two commands"):readme.index("## Using it with vLLM")]
    bench = readme[readme.index("- `bench/`:"):readme.index("## Development")]
    return {"README.md (demo)": demo, "README.md (bench)": bench,
            "docs/benchmark.md": claims.FILES[1].read_text()}


@pytest.mark.parametrize("where", list(_bench_parts()))
def test_no_measurement_outside_a_passage(where):
    text = FENCE.sub("", claims.BLOCK.sub("", _bench_parts()[where]))
    loose = [m.group() for m in MEASURE.finditer(text) if m.group() not in SETTINGS]
    assert not loose, f"{where}: numbers outside <!-- bench:... --> passages: {loose}"


def test_unknown_passage_is_an_error(runs):
    with pytest.raises(KeyError, match="no renderer"):
        claims.render("<!-- bench:nope -->1<!-- /bench:nope -->", runs)
