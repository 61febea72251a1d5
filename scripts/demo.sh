#!/usr/bin/env bash
# Set up (idempotent) and run the demo: local Mooncake master + store node, vllm serve with the
# connector on a tiny locally made model, a workload that hits the store, and a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m devkit.demo "$@"
