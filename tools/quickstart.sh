#!/usr/bin/env bash
# Set up .venv (first run: a few minutes) and run the main job on its embedded default:
# a tiny K3 (k3-tiny) pretraining on CPU on generated data. Extra arguments go to the job.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup_env.sh
exec .venv/bin/python -m megatron_k3.smoke "$@"
