#!/usr/bin/env bash
# The one-GPU check (bench/README.md, "GPU check"): run from anywhere, with or without the
# project's virtualenv. Where nnscaler is not installed (a lent GPU machine: a bare python
# with torch), the repository and the plugin folders go on PYTHONPATH; check.py then makes
# the plugins' entry points visible. Arguments go to check.py (--help lists them).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
paths="$REPO"
for plugin in "$REPO"/plugins/*/; do paths="$paths:${plugin%/}"; done
export PYTHONPATH="$paths${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
exec "$PY" bench/gpu/check.py "$@"
