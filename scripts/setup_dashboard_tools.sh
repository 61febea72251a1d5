#!/usr/bin/env bash
# Tools the dashboard and alert-rule tests need, on top of scripts/setup.sh:
#   - grafana-foundation-sdk, pinned to the Grafana 11.6 flavour (a plain install picks 10.1:
#     the package uses its build timestamp as a PEP 440 epoch), into the project venv;
#   - typescript 5 and @grafana/schema ~11.6 into dashboards/tscheck/node_modules, from the
#     committed package-lock.json, for the `tsc --strict` check of the dashboard JSON;
#   - promtool / prometheus from Debian's `prometheus` package, and Node.js + npm from Debian's
#     `nodejs` and `npm` when no npm is on PATH (setup.sh installs both too).
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
SDK_PIN='grafana-foundation-sdk==1769699379!11.6.0'

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  echo "setup-dashboards: apt-get install prometheus"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

if [ ! -x "$PY" ]; then
  echo "setup-dashboards: $PY missing; run scripts/setup.sh first" >&2
  exit 1
fi
if [ "$("$PY" -m pip show grafana-foundation-sdk 2>/dev/null | sed -n 's/^Version: //p')" != "1769699379!11.6.0" ]; then
  echo "setup-dashboards: pip install $SDK_PIN"
  "$PY" -m pip install -q "$SDK_PIN"
fi
"$PY" -m pip show matplotlib >/dev/null 2>&1 || "$PY" -m pip install -q matplotlib

if ! command -v npm >/dev/null 2>&1; then
  echo "setup-dashboards: apt-get install nodejs npm"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
TS=dashboards/tscheck
if [ ! -x "$TS/node_modules/.bin/tsc" ] || [ ! -d "$TS/node_modules/@grafana/schema" ] \
   || [ "$TS/package-lock.json" -nt "$TS/node_modules/.package-lock.json" ]; then
  echo "setup-dashboards: npm ci in $TS"
  if [ -f "$TS/package-lock.json" ]; then
    (cd "$TS" && npm ci --no-audit --no-fund --silent)
  else
    (cd "$TS" && npm install --no-audit --no-fund --silent --save-exact=false \
      typescript@5 @grafana/schema@~11.6.0)
  fi
fi
echo "setup-dashboards: ok, $("$TS/node_modules/.bin/tsc" --version)," \
  "$("$PY" -c 'import importlib.metadata as m; print("grafana-foundation-sdk", m.version("grafana-foundation-sdk"))')," \
  "$(promtool --version 2>&1 | head -1)"
