#!/usr/bin/env bash
# The project's main job (README.md "Main job"): see examples/main_job.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python examples/main_job.py "$@"
