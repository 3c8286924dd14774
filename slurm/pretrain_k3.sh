#!/bin/bash
# K3 pretraining under Slurm: one supervised srun step, resumable, requeued before the time limit.
#
#   mkdir -p runs/slurm                                   # once: Slurm does not create the --output directory
#   sbatch slurm/pretrain_k3.sh [trainer flags...]        # from the repository root (K3_HOME)
#   K3_PROFILE=b300 K3_PRESET=k3-full sbatch --nodes=64 slurm/pretrain_k3.sh --data-path /data/store.zarr ...
#
# The #SBATCH lines are defaults for 8-GPU nodes; sbatch command-line options override them (e.g.
# --nodes=16, --time=...). On a cluster without GPUs (the CPU test) pass --gpus-per-node=0 (Slurm 22.05
# accepts 0; --gres=none is refused as an invalid gres spec) and --ntasks-per-node=N.
#
# Environment (all optional):
#   K3_HOME          repository root (default: the submit directory)
#   K3_PROFILE       machine profile slurm/profiles/$K3_PROFILE.sh: h100 | h200 | b300 | cpu (default h100)
#   K3_PRESET        model preset (default: the profile's); K3_CONFIG: a YAML/TOML config instead/as well
#   K3_LAYOUT        parallel-layout flags (default: the profile's layout for the preset and node count,
#                    computed with tools/plan_layout.py)
#   K3_RUN_DIR       run directory (default runs/$SLURM_JOB_NAME-$SLURM_JOB_ID: stable across requeues)
#   K3_SAVE          checkpoint directory (default $K3_RUN_DIR/ckpt); always passed as --save and --load, so
#                    a requeued or resubmitted job resumes from its latest checkpoint
#   K3_SAVE_INTERVAL steps between checkpoints (profile default); K3_CKPT_WRITER odirect|buffered
#   K3_KERNEL_CACHE  compiler cache shared by the jobs (default $K3_HOME/runs/kernel_cache; on shared storage,
#                    a job on fresh nodes reuses the Triton kernels and autotune results of the jobs before it)
#   K3_LAUNCH        srun (default: one task per GPU, ranks from SLURM_PROCID) | torchrun (one srun task per
#                    node running torchrun with the c10d rendezvous on the first node)
#   K3_MAX_FAILURES  supervisor: give up after N consecutive failures without checkpoint progress (default 3)
#   K3_BACKOFF       supervisor: seconds between restarts (default 30)
#   K3_PYTHON        interpreter (default $K3_HOME/.venv/bin/python, else python3)
#   NCCL_*           network settings: see the commented block in slurm/profiles/*.sh
#
# Design: the supervisor (launchers/supervisor.py) replaces this shell (exec) and wraps the whole srun
# step. It receives Slurm's --signal=B:USR1@300 warning and SIGTERM and forwards them to srun, which
# forwards them to every task; the trainer (--exit-signal-handler) finishes its step, saves and exits 3;
# on USR1 or exit 3 the supervisor runs `scontrol requeue $SLURM_JOB_ID`, and the requeued job (same id,
# same run dir, log appended) resumes with --load. A crash of the step is restarted (same allocation)
# while checkpoints advance; after K3_MAX_FAILURES failures without progress the job fails.
# --kill-on-bad-exit=1 ends the step when any rank fails (no rank waits in a collective for a dead peer);
# after a save-and-exit it can only cut short other ranks' teardown: the checkpoint save ends with a
# barrier after latest_checkpointed_iteration.txt is switched.
#
#SBATCH --job-name=k3-pretrain
#SBATCH --nodes=2
#SBATCH --gpus-per-node=8
#SBATCH --ntasks-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=runs/slurm/%x-%j.out

set -euo pipefail

K3_HOME=${K3_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$K3_HOME"
[[ -f launchers/pretrain_k3.py ]] || { echo "error: K3_HOME=$K3_HOME is not the megatron-k3 repository (submit from its root or set K3_HOME)" >&2; exit 2; }
[[ -n ${SLURM_JOB_ID:-} ]] || { echo "error: run this through sbatch (no SLURM_JOB_ID)" >&2; exit 2; }

K3_PROFILE=${K3_PROFILE:-h100}
PROFILE_FILE=slurm/profiles/$K3_PROFILE.sh
[[ -f $PROFILE_FILE ]] || { echo "error: K3_PROFILE=$K3_PROFILE: no $PROFILE_FILE (have: $(ls slurm/profiles | sed 's/\.sh$//' | tr '\n' ' '))" >&2; exit 2; }
# shellcheck source=/dev/null
source "$PROFILE_FILE"

if [[ -z ${K3_PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then K3_PYTHON=$K3_HOME/.venv/bin/python; else K3_PYTHON=python3; fi
fi
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
NPROC_PER_NODE=${SLURM_NTASKS_PER_NODE:-$K3_GPUS_PER_NODE}
NPROC_PER_NODE=${NPROC_PER_NODE%%(*}                 # "8(x2)" -> "8"
WORLD=$((NNODES * NPROC_PER_NODE))

K3_PRESET=${K3_PRESET:-${K3_DEFAULT_PRESET:-}}
if [[ -z ${K3_LAYOUT+x} ]]; then
  K3_LAYOUT=$(k3_layout "$K3_PRESET" "$NNODES")    # the profile's planner-checked layout
fi
K3_RUN_DIR=${K3_RUN_DIR:-runs/${SLURM_JOB_NAME:-k3}-$SLURM_JOB_ID}
K3_SAVE=${K3_SAVE:-$K3_RUN_DIR/ckpt}
K3_SAVE_INTERVAL=${K3_SAVE_INTERVAL:-${K3_DEFAULT_SAVE_INTERVAL:-1000}}
K3_CKPT_WRITER=${K3_CKPT_WRITER:-${K3_DEFAULT_CKPT_WRITER:-odirect}}
K3_LAUNCH=${K3_LAUNCH:-srun}
mkdir -p "$K3_RUN_DIR" "$K3_SAVE"

ARGS=()
[[ -n ${K3_CONFIG:-} ]] && ARGS+=(--config "$K3_CONFIG")
[[ -n $K3_PRESET ]] && ARGS+=(--preset "$K3_PRESET")
# shellcheck disable=SC2206
[[ -n $K3_LAYOUT ]] && ARGS+=($K3_LAYOUT)
# shellcheck disable=SC2206
[[ -n ${K3_EXTRA_ARGS:-} ]] && ARGS+=($K3_EXTRA_ARGS)   # the profile's precision/optimizer defaults
[[ -n ${K3_FP8_RECIPE:-} ]] && ARGS+=(--fp8-recipe "$K3_FP8_RECIPE")
# the compiler cache outlives the job (shared storage: the next job on fresh nodes skips the first-step autotuning)
K3_KERNEL_CACHE=${K3_KERNEL_CACHE:-$K3_HOME/runs/kernel_cache}
ARGS+=(--run-dir "$K3_RUN_DIR" --save "$K3_SAVE" --load "$K3_SAVE" --save-interval "$K3_SAVE_INTERVAL"
       --ckpt-writer "$K3_CKPT_WRITER" --exit-signal-handler --kernel-cache-dir "$K3_KERNEL_CACHE")
ARGS+=("$@")                                         # the user's flags come last and win (argparse)

# check every flag, the layout for this job's world size, the data and the checkpoint directory on the batch
# host before any rank starts: bad input is one line and exit 2 here, not a failure on every node
"$K3_PYTHON" -u launchers/pretrain_k3.py --validate-only --world-size "$WORLD" "${ARGS[@]}" >/dev/null || exit $?

# rendezvous: the first host of the job, a port derived from the job id (and the requeue count, so a
# requeued job never meets a socket of its previous run)
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((20000 + (SLURM_JOB_ID * 7 + ${SLURM_RESTART_COUNT:-0}) % 20000))
export MASTER_ADDR MASTER_PORT

case $K3_LAUNCH in
  srun)
    STEP=(srun --kill-on-bad-exit=1 --ntasks="$WORLD" --ntasks-per-node="$NPROC_PER_NODE"
          "$K3_PYTHON" -u launchers/pretrain_k3.py "${ARGS[@]}") ;;
  torchrun)
    # torchrun handles SIGTERM/SIGINT/SIGHUP/SIGQUIT by default; add SIGUSR1 so the time-limit warning
    # reaches the workers (it re-sends the signal and waits 30 s before SIGKILL, then exits 1)
    STEP=(srun --kill-on-bad-exit=1 --ntasks="$NNODES" --ntasks-per-node=1
          env TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
          "$K3_PYTHON" -u -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE"
          --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"
          launchers/pretrain_k3.py "${ARGS[@]}") ;;
  *) echo "error: K3_LAUNCH=$K3_LAUNCH (use srun or torchrun)" >&2; exit 2 ;;
esac

echo "[pretrain_k3.sh] job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $NNODES node(s) x $NPROC_PER_NODE" \
     "= $WORLD ranks ($SLURM_JOB_NODELIST), profile $K3_PROFILE, launch $K3_LAUNCH," \
     "master $MASTER_ADDR:$MASTER_PORT, run dir $K3_RUN_DIR, checkpoints $K3_SAVE"
exec "$K3_PYTHON" -u launchers/supervisor.py --max-failures "${K3_MAX_FAILURES:-3}" --backoff "${K3_BACKOFF:-30}" \
     --save "$K3_SAVE" -- "${STEP[@]}"
