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
if [[ ! -f "$STAMP" ]]; then
  echo "[setup] installing $REQ into .venv (first time: a few minutes, torch is large)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r "$REQ"
  .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
  touch "$STAMP"
fi
echo "[setup] .venv ready: $(.venv/bin/python -c 'import torch,sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
