"""Build the connector's wheel and install it into a directory of its own, as an operator
installs it (`pip install mooncake-pooled-connector`), without touching the virtualenv.

    site = install_wheel(tmp_dir)
    # vllm serve with PYTHONPATH=site: vLLM finds the `vllm.general_plugins` entry point in the
    # installed wheel's metadata and registers the connector by name in every process.

The build runs on a copy of the package sources, so the checkout gets no build/ or egg-info.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "connector")


def build_wheel(dest: Path) -> Path:
    """The wheel built from this checkout's sources, in `dest`."""
    src = dest / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(dest / "dist"), str(src)], check=True)
    return next((dest / "dist").glob("*.whl"))


def install_wheel(dest: Path) -> Path:
    """Build the wheel and install it (no dependencies: the virtualenv has them) into
    `dest/site`; returns that directory, for PYTHONPATH."""
    wheel = build_wheel(dest)
    site = dest / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True)
    return site


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/wheel")
    print(install_wheel(out.resolve()))
