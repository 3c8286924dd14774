"""The one place where a K3 config + parallel layout become megatron-core settings.

``build_transformer_config`` decides parallel layout, precision and pipeline/communication policy from
(K3Config, ParallelLayout, dtype); the layers only read the resulting ``TransformerConfig`` (for megatron's
MoE machinery and schedules) and a ``ParallelCtx``. Nothing here depends on launchers, data or checkpoints.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import K3Config
from .layout import ParallelLayout


def build_transformer_config(cfg: K3Config, layout: ParallelLayout, params_dtype: torch.dtype = torch.float32,
                             **overrides) -> TransformerConfig:
    moe = cfg.num_experts > 0
    kw = dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.intermediate_size,
        kv_channels=cfg.v_head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        add_bias_linear=False,
        gated_linear_unit=True,
        # The expert activation is a module (SiTU-GLU, megatron_k3.parallel.layers.GLUActivation) applied to
        # the whole [gate; up] fc1 output; activation_func must still name a stock function to pass checks.
        activation_func=F.silu,
        use_te_activation_func=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # parallel layout
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=layout.sequence_parallel and layout.tp > 1,
        # precision
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # weights come from the golden model / checkpoints (megatron's initialisers are not used)
        use_cpu_initialization=True,
        perform_initialization=False,
        # loss: sum over tokens / tokens in the global batch (pad tokens excluded)
        calculate_per_token_loss=True,
        # pipeline: the AttnRes stack travels with the hidden state, so shapes differ per boundary
        variable_seq_lengths=layout.pp > 1,
        batch_p2p_comm=layout.vpp == 1,
        overlap_p2p_comm=layout.vpp > 1,  # batched sends to the same peer mismatch under VPP (measured)
        deallocate_pipeline_outputs=False,
    )
    if not moe:
        overrides.pop("moe_router_bias_update_rate", None)
    if moe:
        kw.update(
            num_moe_experts=cfg.num_experts,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_router_topk=cfg.num_experts_per_token,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,  # the K3 trainer owns the balancing update (zero-centred)
            moe_router_dtype="fp32",
            moe_router_topk_scaling_factor=(cfg.routed_scaling_factor if cfg.routed_scaling_factor != 1.0 else None),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
        )
    kw.update(overrides)
    return TransformerConfig(**kw)
