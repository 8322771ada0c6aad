#!/usr/bin/env bash
# The project's test command (README.md "Run the tests"); .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test,docs
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
