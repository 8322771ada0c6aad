#!/usr/bin/env bash
# The project's main job (README.md "Main job"): a small GPT trained with tensor
# parallelism on 2 processes (CPU/gloo, or one GPU each where present), compared with the
# single-device loss. See examples/main_job.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --nproc_per_node 2 examples/main_job.py "$@"
