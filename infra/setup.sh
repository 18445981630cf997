#!/usr/bin/env bash
# Create ./.venv and install foveate into it (CPU torch pinned; see README).
#   bash infra/setup.sh          # runtime
#   bash infra/setup.sh --test   # runtime + test extras
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# A pinned CPU torch first: an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
.venv/bin/python -m pip install -q -e ".${extra}"
echo "foveate installed in $(pwd)/.venv"
