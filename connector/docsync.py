"""Generated blocks in the docs pages: the text between `<!-- NAME:start -->` and
`<!-- NAME:end -->` is written by code (the metric and config catalogues), so docs cannot
drift from the source of truth; the test suite runs the same function with `check`."""

from __future__ import annotations


def sync_block(path: str, name: str, body: str, check: bool = False) -> bool:
    """Put `body` between the file's NAME markers; with check, only compare. True if in sync."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    new = f"{head}{start}\n{body}\n{end}{tail}"
    if new != text and not check:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new == text
