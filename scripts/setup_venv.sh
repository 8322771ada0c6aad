#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install nnscaler and
# every plugin package under plugins/ in editable mode, with the extras given:
#
#   bash scripts/setup_venv.sh              # what the main job needs: nnscaler + plugins
#   bash scripts/setup_venv.sh test,docs    # and the test and docs extras (scripts/test.sh)
#
# A fresh machine gets everything from scratch (torch first). Afterwards the install runs
# again only when something it depends on changed: a stamp file per extras set in the
# venv holds a hash of every pyproject.toml and of this script. Editable installs see code
# changes without reinstalling. The main job and the tests share one venv: an extras set
# is satisfied by a stamp of any superset (tests installed -> the main job installs
# nothing), and installing fewer extras never removes the others.
# VENV=path overrides the location, PYTHON the interpreter that creates it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
EXTRAS=${1:-}
STAMPS="$VENV/.nnscaler-installed"

pyprojects=(pyproject.toml)
for p in plugins/*/pyproject.toml; do
  [ -f "$p" ] && pyprojects+=("$p")
done
hash=$(sha256sum "${pyprojects[@]}" scripts/setup_venv.sh | sha256sum | cut -d' ' -f1)

# extras as a sorted, comma-separated list ("" = none), and the stamp that records it
wanted=$(tr ',' '\n' <<<"$EXTRAS" | sed '/^$/d' | sort -u | paste -sd, -)

satisfied() {  # a current stamp whose extras include every wanted one?
  local stamp have missing e
  [ -x "$VENV/bin/python" ] || return 1
  for stamp in "$STAMPS"/*; do
    [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ] || continue
    have=",$(basename "$stamp" | sed 's/^extras-//'),"
    missing=0
    for e in ${wanted//,/ }; do
      [[ "$have" == *",$e,"* ]] || missing=1
    done
    [ "$missing" = 0 ] && return 0
  done
  return 1
}

if satisfied; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  rm -rf "$STAMPS"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# torch 2.13.0 CPU build (taken from local disk where available); pyproject keeps torch>=2.4.
$VENV/bin/python -c "import torch" 2>/dev/null || $PIP install "torch==2.13.0"
root="."
[ -n "$wanted" ] && root=".[$wanted]"
args=(-e "$root")
for p in plugins/*/; do
  [ -f "$p/pyproject.toml" ] && args+=(-e "$p")
done
$PIP install "${args[@]}"

mkdir -p "$STAMPS"
find "$STAMPS" -type f ! -exec grep -qx "$hash" {} \; -delete  # stale stamps go
echo "$hash" > "$STAMPS/extras-$wanted"
