#!/usr/bin/env bash
# The main job from a fresh clone: creates .venv, installs kvbudget with the simulator extra,
# then runs the policy comparison on the built-in workload (every policy, one table).
# Extra arguments go to `kvbudget simulate`, e.g. `bash scripts/simulate.sh --json out.json`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[sim]' 2>&1 | grep -v '^WARNING: Location' || true
exec .venv/bin/kvbudget simulate "$@"
