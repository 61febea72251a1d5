#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, real Mooncake master + store
# node, real vLLM engines, helm, promtool, Prometheus, an OTLP collector (its duration:
# docs/development.md); pass pytest arguments to narrow it (e.g. scripts/test.sh -k worker). Every
# skipped test is printed with its reason, and a skip not in the allowed-skips list of
# docs/development.md fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
# The unit tier once more against vLLM 0.33's sources, the version the image ships (~25 s).
scripts/unit_033.sh -q
exec .venv/bin/python -m pytest -p no:cacheprovider -p tests.skip_policy "$@"
