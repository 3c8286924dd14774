# Machine profile: 8 x NVIDIA B300 (Blackwell Ultra, 288 GB HBM3e) per node, NVLink 5, InfiniBand/RoCE
# (ConnectX-8). Sourced by slurm/pretrain_k3.sh. Layouts below were computed and checked with
# tools/plan_layout.py (bf16, AdamW, distributed optimizer, seq 4096, streaming SiTU, grouped experts;
# 288e9 bytes per GPU, the datasheet figure (not yet measured), less a 10% margin = 241.4 GiB).
K3_GPUS_PER_NODE=8
K3_GPU_MEM_GIB=268
K3_DEFAULT_PRESET=k3-mini
K3_DEFAULT_SAVE_INTERVAL=1000
K3_DEFAULT_CKPT_WRITER=odirect
# FP8 on Blackwell: MXFP8 (Transformer Engine); empty = bf16 (pretrain_k3.sh passes --fp8-recipe only
# when this is set). Not yet run on a Blackwell GPU.
K3_FP8_RECIPE=${K3_FP8_RECIPE:-}                # mxfp8 to enable
K3_EXTRA_ARGS=${K3_EXTRA_ARGS-"--bf16"}

# Layout flags for (preset, nodes), from tools/plan_layout.py --gpu b300:
#   k3-mini, 1 node:  TP1 PP1 EP8 DP8, micro-batch 8: peak 107.0 GiB (reference SiTU op: 145.9 GiB)
#   k3-full, 64 nodes (512 GPUs): TP8 PP4 EP128 DP16 +SP, no recompute, layers per stage 24,24,24,21:
#                     peak 185.0 GiB (stage 0: 4 micro-batches in flight). The planner's own pick at 64
#                     nodes, TP8 PP2 (237.3 GiB), leaves 4 GiB of the 241.4: PP4 is kept for the margin.
#                     32 nodes (TP8 PP2 EP128) do not fit without recompute (300 GiB).
k3_layout() {  # $1 preset, $2 nodes
  case $1 in
    k3-mini) echo "--expert-model-parallel-size 8 --use-distributed-optimizer --micro-batch-size 8" ;;
    k3-full)
      [[ $2 == 64 ]] || echo "warning: k3-full layout planned for 64 B300 nodes, not $2: run tools/plan_layout.py --preset k3-full --gpu b300 --nodes $2 and set K3_LAYOUT" >&2
      echo "--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 4 --decoder-last-pipeline-num-layers 21 --expert-model-parallel-size 128 --use-distributed-optimizer --micro-batch-size 1" ;;
    *) echo "" ;;
  esac
}

# Network (uncomment what fits the cluster):
# export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7
# export NCCL_SOCKET_IFNAME=eth0
# export NCCL_IB_GID_INDEX=3                 # RoCE v2 only
# export NCCL_IB_TC=106                      # RoCE: lossless traffic class
# export NCCL_NET_GDR_LEVEL=PHB
# export NCCL_DEBUG=WARN
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# export CUDA_DEVICE_MAX_CONNECTIONS=1
