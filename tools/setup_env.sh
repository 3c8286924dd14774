#!/usr/bin/env bash
# Create (or reuse) the project virtual environment at .venv/ and install the pinned requirements
# plus this package in editable mode. Idempotent: a second run only re-checks the pins.
#   bash tools/setup_env.sh [--dev]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

find_python() {
  if [[ -n "${K3_PYTHON:-}" ]]; then echo "$K3_PYTHON"; return; fi
  local c
  for c in "$HOME"/.pyenv/versions/3.12.*/bin/python3 "$(command -v python3.12 || true)"; do
    if [[ -n "$c" && -x "$c" ]]; then echo "$c"; return; fi
  done
  if command -v python3 >/dev/null && python3 -c 'import sys; sys.exit(0 if sys.version_info[:2]>=(3,12) else 1)'; then
    command -v python3; return
  fi
  echo "error: Python >= 3.12 not found (megatron-core 0.19.2 needs it); set K3_PYTHON=/path/to/python3.12" >&2
  exit 1
}

REQ=requirements.txt
[[ "${1:-}" == "--dev" ]] && REQ=requirements-dev.txt
STAMP=".venv/.installed-$(cat requirements.txt requirements-dev.txt setup.py | sha256sum | cut -c1-16)-$(basename $REQ .txt)"

if [[ ! -x .venv/bin/python ]]; then
  PY="$(find_python)"
  echo "[setup] creating .venv with $PY"
  "$PY" -m venv .venv
fi
# Free space where .venv and pip's temporary files go, in GiB (the dev install is ~7 GiB: torch's wheel pulls
# its CUDA libraries even on a CPU machine). A full disk otherwise shows up only as pip's "[Errno 28]".
free_gib() { df -Pk "$1" 2>/dev/null | awk 'NR==2 {printf "%.1f", $4/1048576}'; }
NEED_GIB=8
PIP_TMP="${TMPDIR:-/tmp}"
if [[ ! -f "$STAMP" ]]; then
  echo "[setup] installing $REQ into .venv (first time: a few minutes, torch is large)"
  for d in "$ROOT" "$PIP_TMP"; do
    # one warning per disk: skip the temporary folder when it is on the same file system as the checkout
    [[ "$d" != "$ROOT" && "$(stat -c %d "$d" 2>/dev/null)" == "$(stat -c %d "$ROOT")" ]] && continue
    f="$(free_gib "$d")"
    if [[ -n "$f" ]] && awk -v f="$f" -v n="$NEED_GIB" 'BEGIN {exit !(f < n)}'; then
      echo "[setup] warning: $f GiB free under $d; the install needs about $NEED_GIB GiB (.venv ~7 GiB plus pip's" \
           "temporary files). Free space there or set TMPDIR to a larger disk if pip fails with 'No space left'." >&2
    fi
  done
  pip_install() {
    .venv/bin/python -m pip install --quiet "$@" || {
      echo "error: 'pip install $*' failed (above). Free space: $(free_gib "$ROOT") GiB under $ROOT," \
           "$(free_gib "$PIP_TMP") GiB under $PIP_TMP; rerun this script after fixing the cause" \
           "(nothing is marked installed until every step passes)." >&2
      exit 1
    }
  }
  pip_install --upgrade pip
  pip_install -r "$REQ"
  pip_install --no-deps --no-build-isolation -e .
  touch "$STAMP"
fi
echo "[setup] .venv ready: $(.venv/bin/python -c 'import torch,sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
