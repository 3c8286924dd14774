# Machine profile: 8 x NVIDIA H200 (141 GB HBM3e) per node: the GPU of the committed k3-mini benchmark.
# Sourced by slurm/pretrain_k3.sh. Layouts computed and checked with tools/plan_layout.py (bf16, AdamW,
# distributed optimizer, seq 4096, streaming SiTU, grouped experts; 143,771 MiB per GPU (nvidia-smi on
# the lent H200) less a 10% margin = 126.4 GiB).
K3_GPUS_PER_NODE=8
K3_GPU_MEM_GIB=140
K3_DEFAULT_PRESET=k3-mini
K3_DEFAULT_SAVE_INTERVAL=1000
K3_DEFAULT_CKPT_WRITER=odirect
# FP8 on Hopper: torchao-tensorwise (1.15x bf16 tokens/s, loss after 200 steps +0.01%, hidden 4096, layer graphs,
# this GPU, 2026-12-07; benchmarks/README.md, FP8); empty = bf16 (pretrain_k3.sh passes --fp8-recipe only when set)
K3_FP8_RECIPE=${K3_FP8_RECIPE:-}                # torchao-tensorwise to enable
K3_EXTRA_ARGS=${K3_EXTRA_ARGS-"--bf16"}

# k3-mini, 1 node: TP1 PP1 EP8 DP8, micro-batch 4: peak 58.0 GiB (the 1-GPU benchmark setting with the
# current code: planned 73.8 GiB, measured 56.4 GiB: the planner models the eager path, see slurm/README.md)
# k3-full: not planned for H200 (see tools/plan_layout.py --preset k3-full --gpu h200 --nodes N)
k3_layout() {  # $1 preset, $2 nodes
  case $1 in
    k3-mini) echo "--expert-model-parallel-size 8 --use-distributed-optimizer --micro-batch-size 4" ;;
    *) echo "" ;;
  esac
}
# Network: see h100.sh
