#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, real Mooncake master + store
# node, real vLLM engines, helm, promtool, Prometheus, an OTLP collector. About 15-25 minutes
# on 2 cores; pass pytest arguments to narrow it (e.g. scripts/test.sh -k worker).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
