# Machine profile: CPU-only nodes (the local test cluster of tools/slurm_local.sh). Sourced by
# slurm/pretrain_k3.sh. gloo instead of NCCL (megatron_k3/compat.py picks it when CUDA is absent), no GPUs:
# submit with `sbatch --gpus-per-node=0 --ntasks-per-node=N ...` to override the script's GPU defaults.
K3_GPUS_PER_NODE=1                              # processes per node if --ntasks-per-node is not given
K3_GPU_MEM_GIB=0
K3_DEFAULT_PRESET=                              # the model comes from the config file
K3_CONFIG=${K3_CONFIG-configs/k3-tiny-cpu.yaml} # k3-tiny on the embedded corpus
K3_DEFAULT_SAVE_INTERVAL=10
K3_DEFAULT_CKPT_WRITER=buffered
K3_FP8_RECIPE=${K3_FP8_RECIPE:-}                # no FP8 on CPU
K3_EXTRA_ARGS=${K3_EXTRA_ARGS-}

# layout flags for (preset, nodes): plain data parallelism over all ranks
k3_layout() { echo ""; }
