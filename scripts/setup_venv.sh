#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install nnscaler, its
# test dependencies and every plugin package under plugins/ in editable mode.
# Usage: bash scripts/setup_venv.sh     (VENV=path overrides the location)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch 2.13.0 CPU build (taken from local disk where available); pyproject keeps torch>=2.4.
$VENV/bin/python -c "import torch" 2>/dev/null || $PIP install "torch==2.13.0"
args=(-e ".[test]")
for p in plugins/*/; do
  [ -f "$p/pyproject.toml" ] && args+=(-e "$p")
done
$PIP install "${args[@]}"
