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
exec .venv/bin/python -m pytest -p no:cacheprovider -p tests.skip_policy tests/unit "$@"
