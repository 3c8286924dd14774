#!/usr/bin/env bash
# Set up .venv (first run: a few minutes) and run the main job on its embedded default: k3-tiny
# pretraining on CPU on the embedded English corpus (configs/k3-tiny-cpu.yaml). Extra arguments go to
# the trainer (e.g. --train-iters 50 --run-dir runs/try).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup_env.sh
exec .venv/bin/python launchers/pretrain_k3.py --config configs/k3-tiny-cpu.yaml "$@"
