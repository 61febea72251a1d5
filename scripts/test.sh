#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, real Mooncake master + store
# node, real vLLM engines, helm, promtool, Prometheus, an OTLP collector (its tiers and their
# durations: docs/development.md). Every skipped test is printed with its reason, and a skip not
# in the allowed-skips list of docs/development.md fails the run.
#
#   scripts/test.sh           everything, in phases:
#                             1. the unit, store and deploy tiers (but the helm smoke test) on
#                                pytest-xdist workers: no engine, and mostly waiting on processes;
#                                1b. beside it, the unit tier on vLLM 0.33's sources
#                             2. the e2e tier and the helm smoke test, whose files each declare
#                                (tests/conftest.py) whether their assertions depend on time:
#                                2a. `timed` files serially, alone on the machine;
#                                2b. `side_by_side` files on two workers, a file at a time each
#   scripts/test.sh --fast    the unit and store tiers only (no engine): the inner loop
#   scripts/test.sh -k worker pytest options apply to every phase (a phase they leave empty is
#                             no failure); naming tests or folders runs just those, serially
#
# RECORD_SUITE_TIMES=1 scripts/test.sh writes each phase's time, tests and engine starts into
# docs/suite-times.json (tests/suite_times.py), the table of docs/development.md.
set -euo pipefail
began=$(date +%s.%N)  # the command's wall clock, set-up included (RECORD_SUITE_TIMES)
cd "$(dirname "$0")/.."

fast=0 named=0 args=()
takes_value='^(-k|-m|-p|-n|-o|-c|-W|--deselect|--ignore|--timeout|--maxfail|--rootdir|--durations|--dist)$'
expect_value=0
for a in "$@"; do
  if [[ $a == --fast ]]; then fast=1; continue; fi
  args+=("$a")
  if (( expect_value )); then expect_value=0
  elif [[ $a =~ $takes_value ]]; then expect_value=1
  elif [[ $a != -* ]]; then named=1
  fi
done

scripts/setup.sh
.venv/bin/ruff check .

PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider -p tests.skip_policy -p tests.suite_times)
# Processes waiting on masters and store nodes, not computing: 4 on 2 cores. A file at a time
# each, longest first (tests/conftest.py): a module's fixtures are set up once (spread test by
# test, a worker tore a module's fixtures down between two of its tests and set them up again,
# an HA client's close waiting 30 s each time).
WORKERS=(-n 4 --dist loadfile --no-loadscope-reorder)
SMOKE=tests/deploy/test_helm_smoke.py

# One phase: pytest with RECORD_SUITE_TIMES naming the part; "no tests ran" (5) is no failure
# when options such as -k leave a phase empty.
phase() {
  local part=$1; shift
  local rc=0
  RECORD_SUITE_TIMES=${RECORD_SUITE_TIMES:+$part} "${PYTEST[@]}" "$@" || rc=$?
  if (( rc == 5 )); then echo "($part: no test selected)"; return 0; fi
  return $rc
}

if (( named )); then  # the tests asked for, as one serial run
  exec "${PYTEST[@]}" "${args[@]}"
fi

# With RECORD_SUITE_TIMES, the command's own wall clock beside its parts.
record_command() {
  if [[ -n ${RECORD_SUITE_TIMES:-} ]]; then
    .venv/bin/python -m tests.suite_times "$1" "$began" "$2"
  fi
}

if (( fast )); then
  phase "fast: unit + store" "${WORKERS[@]}" tests/unit tests/store ${args[@]+"${args[@]}"}
  record_command "scripts/test.sh --fast" docs/suite-times.json
  exit 0
fi

if [[ -n ${RECORD_SUITE_TIMES:-} && -z ${SUITE_TIMES_PARTS:-} ]]; then
  export SUITE_TIMES_PARTS=$PWD/.suite-times.partial.json  # docs/ only once all phases passed
  rm -f "$SUITE_TIMES_PARTS"
fi
# Phase 1b, the unit tier once more against vLLM 0.33's sources (the version the image ships),
# runs beside phase 1, whose workers mostly wait (about half of the two cores is idle): one
# process computing; its output follows phase 1's.
log_1b=$(mktemp)
RECORD_SUITE_TIMES=${RECORD_SUITE_TIMES:+"phase 1b: unit on vLLM 0.33"} scripts/unit_033.sh -q \
  -p tests.suite_times ${args[@]+"${args[@]}"} >"$log_1b" 2>&1 &
pid_1b=$!
rc_1=0 rc_1b=0
phase "phase 1: unit + store + deploy (xdist)" "${WORKERS[@]}" tests/unit tests/store \
  tests/deploy --ignore "$SMOKE" ${args[@]+"${args[@]}"} || rc_1=$?
wait "$pid_1b" || rc_1b=$?
echo "---- phase 1b: unit on vLLM 0.33 (ran beside phase 1) ----"
cat "$log_1b"
rm -f "$log_1b"
if (( rc_1b == 5 )); then rc_1b=0; fi  # options such as -k left it empty
if (( rc_1 || rc_1b )); then exit 1; fi
# Phase 2b runs whether or not 2a passed, so that one failed run names every e2e failure.
rc_2a=0 rc_2b=0
phase "phase 2a: e2e timed (serial)" -m timed tests/e2e "$SMOKE" ${args[@]+"${args[@]}"} \
  || rc_2a=$?
phase "phase 2b: e2e side by side (2 workers)" -n 2 --dist loadfile \
  --no-loadscope-reorder \
  -m side_by_side tests/e2e "$SMOKE" ${args[@]+"${args[@]}"} || rc_2b=$?
if (( rc_2a || rc_2b )); then
  echo "phase 2a exit $rc_2a, phase 2b exit $rc_2b"
  exit 1
fi
if [[ -n ${SUITE_TIMES_PARTS:-} ]]; then
  record_command "scripts/test.sh" "$SUITE_TIMES_PARTS"
  mv "$SUITE_TIMES_PARTS" docs/suite-times.json
  echo "docs/suite-times.json: this run's times; python -m bench.claims renders them"
fi
