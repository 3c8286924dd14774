# Machine profile: 8 x NVIDIA H100 80GB (SXM, NVLink/NVSwitch) per node, InfiniBand. Sourced by
# slurm/pretrain_k3.sh. Layouts below were computed and checked with tools/plan_layout.py (bf16, AdamW,
# distributed optimizer, seq 4096, streaming SiTU, grouped experts; 81,559 MiB per GPU less a 10% margin
# = 71.7 GiB).
K3_GPUS_PER_NODE=8
K3_GPU_MEM_GIB=80
K3_DEFAULT_PRESET=k3-mini
K3_DEFAULT_SAVE_INTERVAL=1000
K3_DEFAULT_CKPT_WRITER=odirect
# FP8 on Hopper: torchao-tensorwise (torchao; works with --cuda-graph-impl local); empty = bf16 (pretrain_k3.sh
# passes --fp8-recipe only when this is set). Measured at hidden 4096 through the trainer: torchao-tensorwise 1.15x
# bf16 (H200, 2026-12-07), torchao-rowwise 0.975x (H100) and 1.03x (H200), TE blockwise 0.93-1.05x (H200, older
# harness); benchmarks/README.md, FP8.
K3_FP8_RECIPE=${K3_FP8_RECIPE:-}                # torchao-tensorwise to enable
K3_EXTRA_ARGS=${K3_EXTRA_ARGS-"--bf16"}

# Layout flags for (preset, nodes), from tools/plan_layout.py --gpu h100:
#   k3-mini, 1 node:  TP1 PP1 EP8 DP8, micro-batch 2: peak 33.5 GiB (micro-batch 4: 58.0 GiB of the 71.7,
#                     77.5 GiB with the reference SiTU op; kept at 2 until measured on an H100)
#   k3-full, 256 nodes (2048 GPUs): TP8 PP4 EP128 DP64 +SP, full recompute, layers per stage 24,24,24,21:
#                     peak 65.6 GiB (stage 1); no layout fits without full recompute at this size.
k3_layout() {  # $1 preset, $2 nodes
  case $1 in
    k3-mini) echo "--expert-model-parallel-size 8 --use-distributed-optimizer --micro-batch-size 2" ;;
    k3-full)
      [[ $2 == 256 ]] || echo "warning: k3-full layout planned for 256 H100 nodes, not $2: run tools/plan_layout.py --preset k3-full --gpu h100 --nodes $2 and set K3_LAYOUT" >&2
      echo "--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 21 --expert-model-parallel-size 128 --use-distributed-optimizer --recompute-granularity full --micro-batch-size 1" ;;
    *) echo "" ;;
  esac
}

# Network (uncomment what fits the cluster; NCCL's defaults are usually right on a well-configured fabric):
# InfiniBand
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7   # the compute HCAs
# export NCCL_SOCKET_IFNAME=eth0             # bootstrap / out-of-band interface
# export NCCL_IB_GID_INDEX=3                 # RoCE v2 (GID index of the RoCE v2 address); not for native IB
# export NCCL_IB_TC=106                      # RoCE: traffic class of the lossless queue
# export NCCL_NET_GDR_LEVEL=PHB              # GPUDirect RDMA when NIC and GPU share a PCIe host bridge
# export NCCL_IB_QPS_PER_CONNECTION=4
# export NCCL_DEBUG=WARN                     # INFO to see the chosen transports
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a hung collective aborts the step (the supervisor restarts it)
# export CUDA_DEVICE_MAX_CONNECTIONS=1       # ordering of TP/SP communication kernels
