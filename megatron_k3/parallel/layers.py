"""K3 layers as megatron-core modules: tensor, sequence, context and expert parallel.

The math is the golden model's (``megatron_k3.model``): each parallel module here *is* the golden module
built at its shard's size (a tensor-parallel rank holds ``heads / TP`` whole heads, ``width / TP`` FFN
columns), with the parameter names of the release, plus the communication of ``comm.py`` around the math.
Hidden states are sequence-first ``[S_local, B, D]`` (megatron's convention).

Parameter kinds, marked for megatron's DDP, grad-norm and checkpointing:
- sharded over TP (``tensor_model_parallel=True``, ``partition_dim``): head-/column-split weights;
- TP-partial (``k3_tp_partial=True``): replicated weights that feed only this rank's heads (KDA's
  ``f_a_proj``/``o_norm``, MLA's low-rank down projections and their norms); their gradients are summed
  over TP by ``finalize_k3_grads``;
- per-token replicated (norms, AttnRes, latent projections, router): under sequence parallelism each rank
  sees a sequence shard, so they carry ``sequence_parallel=True`` and megatron sums them over TP;
- experts (``allreduce=False``): reduced over the expert-data-parallel group.

Stable LatentMoE runs on megatron's ``MoELayer`` (sigmoid ``TopKRouter`` with expert bias, all-to-all
dispatcher, ``SequentialMLP`` experts with the SiTU-GLU activation module); megatron's latent projections
require Transformer Engine and have no norm, so this layer adds its own down/up projections and the latent
RMSNorm around dispatch and combine. Shared experts are a tensor-parallel SiTU-GLU MLP beside it.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model.kda import KimiDeltaAttention
from ..model.k3 import K3DecoderLayer
from ..model.mla import GatedMLA
from ..model.moe import MLP
from ..model.common import (Linear, RMSNorm, compile_enabled, compiled, fast, rms_norm_batch_first,
                            rms_norm_gate_seq_first, sigmoid_gate_seq_first)
from ..model.situ import glu_activation_stream, silu_glu, situ_glu_stream
from .comm import ParallelCtx, cp_head_slice, cp_heads_to_seq, cp_seq_to_heads, tp_enter, tp_exit


def local_config(cfg, tp: int):
    """The golden config at one tensor-parallel shard's size (no validation: it is not a model of its own)."""
    return dataclasses.replace(
        cfg, kda_num_heads=cfg.kda_num_heads // tp, num_attention_heads=cfg.num_attention_heads // tp,
        intermediate_size=cfg.intermediate_size // tp)


def mark_tp(p: nn.Parameter, dim: int, stride: int = 1):
    set_tensor_model_parallel_attributes(p, True, dim, stride)


def mark_tp_partial(p: nn.Parameter):
    p.k3_tp_partial = True


def mark_replicated(module: nn.Module, ctx: ParallelCtx):
    """Per-token replicated parameters: summed over TP by megatron when sequence parallel is on."""
    for p in module.parameters(recurse=False):
        p.sequence_parallel = ctx.sp


def _seq_first(t):
    return t.transpose(0, 1)


def _batch_first(x):
    """[S, B, D] -> [B, S, D] as one contiguous copy. The token mixers' projections all read it: on the
    transposed view each ``F.linear`` would copy its input itself (a strided copy in forward and more in
    backward, per projection: 6 projections in KDA), and keep its own copy for backward. Likewise the
    output projection runs on the sequence-first copy of its input, so its output needs no transpose."""
    return x.transpose(0, 1).contiguous()


def recomputed(fn, *args, enabled: bool = False):
    """``fn(*args)``, its activations recomputed in backward when ``enabled`` (selective recompute). The
    recomputed cores draw no random numbers (K3 has no dropout), so the RNG state is not saved and restored
    (reading the CUDA generator's state is also not allowed while a CUDA graph is captured: ``graphs.py``)."""
    if enabled and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


def fused_linears(x: torch.Tensor, mods) -> list[torch.Tensor]:
    """``[m(x) for m in mods]`` for bias-free ``Linear`` modules as one GEMM on the concatenated weights
    (megatron's fused QKV, keeping the release's separate parameters): x is read once, its gradient is one
    GEMM instead of one per projection plus the additions of autograd, and the narrow projections (KDA's
    beta: H outputs) do not run as GEMMs of their own. The outputs are column slices of one tensor. The
    modules must share one class whose GEMM can be fused (``Linear``; torchao's ``Float8Linear`` of one recipe,
    whose scales then span the concatenated weight and output gradient: the same recipe, not the bits of six
    separate FP8 GEMMs); others (Transformer Engine's under FP8: ``precision.py``), or a mix, run one by one."""
    kind = type(mods[0])
    if not (issubclass(kind, Linear) and kind.fusable and all(type(m) is kind for m in mods)
            and len({getattr(m, "fp8_recipe", None) for m in mods}) == 1):
        return [m(x) for m in mods]
    y = mods[0].gemm(x, torch.cat([m.weight for m in mods]))
    return list(SplitColumns.apply(y, [m.weight.shape[0] for m in mods]))


def _cat_columns(*parts):
    return torch.cat(parts, dim=-1)


class SplitColumns(torch.autograd.Function):
    """``y.split(sizes, dim=-1)`` whose backward concatenates the pieces' gradients into d y with one compiled
    kernel on CUDA. Autograd's own split backward is aten's cat, which took the slow strided path at KDA's fused
    projection (six gradients into [B, T, 4232], 214 us per layer and micro-batch of 4 x 4096 on an H100,
    1.3 TB/s; ``benchmarks/README.md``). The same values either way (a concatenation is a copy)."""

    @staticmethod
    def forward(ctx, y, sizes):
        return tuple(y.split(sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        cat = compiled(_cat_columns) if compile_enabled(grads[0], grad_only=False) else _cat_columns
        return cat(*grads), None


# ---------------------------------------------------------------------------------------------------------
class ParallelKDA(KimiDeltaAttention):
    """KDA on ``H / TP`` heads per rank; CP by head-wise all-to-all."""

    def __init__(self, cfg, ctx: ParallelCtx, layer_idx: int = 0, recompute: bool = False):
        super().__init__(local_config(cfg, ctx.tp), layer_idx)
        self.ctx, self.recompute = ctx, recompute
        for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "b_proj", "q_conv1d", "k_conv1d", "v_conv1d"):
            mark_tp(getattr(self, name).weight, 0)
        mark_tp(self.A_log, 0)
        mark_tp(self.dt_bias, 0)
        if cfg.use_full_rank_gate:
            mark_tp(self.g_proj.weight, 0)
        else:
            mark_tp(self.g_b_proj.weight, 0)
            mark_tp_partial(self.g_a_proj.weight)
        mark_tp(self.o_proj.weight, 1)
        mark_tp_partial(self.f_a_proj.weight)
        mark_tp_partial(self.o_norm.weight)

    def project(self, x):
        """The golden ``project`` with the six projections of x as one GEMM (``fused_linears``)."""
        B, T, _ = x.shape
        H, d = self.num_heads, self.head_dim
        full = self.cfg.use_full_rank_gate
        q, k, v, fa, blogit, g = fused_linears(x, [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                                                   self.g_proj if full else self.g_a_proj])
        gate = g if full else self.g_b_proj(g)
        return (q.view(B, T, H, d), k.view(B, T, H, d), v.view(B, T, H, d), self.f_b_proj(fa).view(B, T, H, d),
                blogit, gate.view(B, T, H, d))

    def forward(self, x, batch_first: bool = False):  # x [s, B, D]; [B, s, D] when batch_first
        ctx = self.ctx
        xb = tp_enter(x, ctx) if batch_first else _batch_first(tp_enter(x, ctx))   # [B, S_cp, D]
        q, k, v, graw, blogit, gate = self.project(xb)
        heads = None
        if ctx.cp > 1:
            q, k, v, graw, blogit = (_seq_first(cp_seq_to_heads(_seq_first(t), ctx)) for t in (q, k, v, graw, blogit))
            heads = cp_head_slice(self.num_heads, ctx)
        # the core without its output norm, which runs in one kernel with the gate below
        o, _ = recomputed(functools.partial(self.mix, normalize=False), q, k, v, graw, blogit, heads,
                          enabled=self.recompute)
        if ctx.cp > 1:
            o = _seq_first(cp_heads_to_seq(_seq_first(o), ctx))
        o = fast(rms_norm_gate_seq_first, o)(o, self.o_norm.weight, self.o_norm.eps, gate, xb.dtype)  # [S_cp, B, H_tp d]
        return tp_exit(self.o_proj(o), ctx)                                # partial sum over TP


class ParallelMLA(GatedMLA):
    """Gated NoPE MLA on ``H / TP`` heads per rank; CP by head-wise all-to-all."""

    def __init__(self, cfg, ctx: ParallelCtx, layer_idx: int = 0, recompute: bool = False):
        super().__init__(local_config(cfg, ctx.tp), layer_idx)
        self.ctx, self.recompute = ctx, recompute
        if cfg.q_lora_rank is not None:
            mark_tp(self.q_b_proj.weight, 0)
            for p in (self.q_a_proj.weight, self.q_a_layernorm.weight):
                mark_tp_partial(p)
        else:
            mark_tp(self.q_proj.weight, 0)
        mark_tp(self.kv_b_proj.weight, 0)
        for p in (self.kv_a_proj_with_mqa.weight, self.kv_a_layernorm.weight):
            mark_tp_partial(p)
        mark_tp(self.o_proj.weight, 1)
        if cfg.mla_use_output_gate:
            mark_tp(self.g_proj.weight, 0)

    def forward(self, x, batch_first: bool = False):  # x [s, B, D]; [B, s, D] when batch_first
        ctx = self.ctx
        xb = tp_enter(x, ctx) if batch_first else _batch_first(tp_enter(x, ctx))   # [B, S_cp, D]
        q, k, v = self.project_qkv(xb)                                     # [B, S_cp, H_tp, *]
        if ctx.cp > 1:
            q, k, v = (_seq_first(cp_seq_to_heads(_seq_first(t), ctx)) for t in (q, k, v))
        o = recomputed(self.attend, q, k, v, enabled=self.recompute)
        if ctx.cp > 1:
            o = _seq_first(cp_heads_to_seq(_seq_first(o), ctx))
        if self.cfg.mla_use_output_gate:                                   # [S_cp, B, H_tp v]
            o = fast(sigmoid_gate_seq_first, o)(o, self.g_proj(xb), xb.dtype)
        else:
            o = _seq_first(o.reshape(*o.shape[:2], -1)).contiguous()
        return tp_exit(self.o_proj(o), ctx)


class ParallelMLP(MLP):
    """SiTU-GLU MLP (dense layers and shared experts) with ``width / TP`` columns per rank."""

    def __init__(self, cfg, ctx: ParallelCtx, hidden: int, width: int, recompute: bool = False):
        super().__init__(cfg, hidden, width // ctx.tp)
        self.ctx, self.recompute = ctx, recompute
        mark_tp(self.gate_proj.weight, 0)
        mark_tp(self.up_proj.weight, 0)
        mark_tp(self.down_proj.weight, 1)

    def forward(self, x):
        x = tp_enter(x, self.ctx)
        c = self.cfg
        h = recomputed(glu_activation_stream, self.gate_proj(x), self.up_proj(x), c.hidden_act,
                       c.activation_situ_beta, c.activation_situ_linear_beta, enabled=self.recompute)
        return tp_exit(self.down_proj(h), self.ctx)


# ---------------------------------------------------------------------------------------------------------
class GLUActivation(nn.Module):
    """The expert activation on megatron's fc1 output [.., 2F] = [gate; up] (gate half first); SiTU-GLU
    through the streaming op (``situ_glu_stream``: saves only the bf16 input)."""

    def __init__(self, *, config=None, hidden_act: str = "situ", beta: float = 4.0, linear_beta: float = 25.0,
                 recompute: bool = False):
        super().__init__()
        self.hidden_act, self.beta, self.linear_beta, self.recompute = hidden_act, beta, linear_beta, recompute

    def _act(self, x):
        if self.hidden_act == "situ":
            return situ_glu_stream(x, self.beta, self.linear_beta)
        return silu_glu(x)

    def forward(self, x):
        return recomputed(self._act, x, enabled=self.recompute)


class RouterLogits(torch.autograd.Function):
    """fp32 router logits ``x @ W^T`` from bf16 ``x`` [..., D] and ``W`` [E, D], as megatron's
    ``router_gating_linear`` computes them when Transformer Engine is installed: forward one bf16 GEMM that
    accumulates and writes fp32 (``torch.mm(..., out_dtype=float32)`` on CUDA; each product of two bf16 values is
    exact in fp32, so this is the fp32 GEMM's math in another summation order); backward megatron's fp32 GEMMs.
    Without TE megatron instead casts x to fp32 and runs fp32 GEMMs forward too: per k3-mini step of 8 x 4 x 4096
    tokens on an H100 that was 10 ms of casts and 5 ms of fp32 GEMM forward (2026-12-07). Off CUDA the forward
    is the fp32 GEMM itself (``mm`` has no ``out_dtype`` there)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        if x.is_cuda:
            y = torch.mm(x2, w.t(), out_dtype=torch.float32)
        else:
            y = torch.mm(x2.float(), w.float().t())
        return y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):  # megatron's RouterGatingLinearFunction.backward without TE (fp32 GEMMs)
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1]).float()
        gx = torch.mm(g2, w.float()).to(x.dtype).view_as(x)
        gw = torch.mm(g2.t(), x.reshape(-1, x.shape[-1]).float()).to(w.dtype)
        return gx, gw


_MM_OUT_DTYPE: dict = {}


def mm_out_dtype_works(device: torch.device) -> bool:
    """Whether ``torch.mm(bf16, bf16, out_dtype=float32)`` runs on ``device`` (CUDA, torch >= 2.9); asked once."""
    key = str(device)
    if key not in _MM_OUT_DTYPE:
        try:
            a = torch.ones(2, 8, device=device, dtype=torch.bfloat16)
            _MM_OUT_DTYPE[key] = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_DTYPE[key] = False
    return _MM_OUT_DTYPE[key]


class K3Router(TopKRouter):
    """megatron's sigmoid top-k router (bias in selection only), plus K3's balancing statistics.

    Expert counts accumulate over every micro-batch of a step (megatron all-reduces them over TP x DP x CP
    before its sign update in ``finalize_model_grads``); counting runs without torch.compile (20 s per
    process on CPU). With ``k3_balancing = "quantile"`` each training forward also adds this micro-batch's
    Quantile-Balancing shift (``megatron_k3.parallel.balancing``) to a running sum applied once per step."""

    k3_balancing = "sign"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        E = self.config.num_moe_experts
        self.register_buffer("k3_qb_sum", torch.zeros(E, dtype=torch.float64), persistent=False)
        self.register_buffer("k3_qb_count", torch.zeros((), dtype=torch.float64), persistent=False)

    def gating(self, input):
        """megatron's gating; on CUDA with bf16 input and weight, no bias and fp32 router logits, through
        ``RouterLogits`` (megatron's forward with TE) instead of megatron's fallback without TE."""
        w = self.weight
        if (input.is_cuda and input.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and self.bias is None
                and self.config.moe_router_dtype == "fp32" and mm_out_dtype_works(input.device)):
            return RouterLogits.apply(input, w)
        return super().gating(input)

    def routing(self, logits, padding_mask=None):
        if self.k3_balancing == "quantile" and self.training and torch.is_grad_enabled():
            from .balancing import quantile_shift

            with torch.no_grad():
                scores = torch.sigmoid(logits.reshape(-1, self.config.num_moe_experts).float())
                self.k3_qb_sum += quantile_shift(scores, self.expert_bias, self.topk).double()
                self.k3_qb_count += 1
        return super().routing(logits, padding_mask=padding_mask)

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & (~padding_mask)
                self.local_tokens_per_expert += routing_map.sum(dim=0)


def _build_experts(num_local_experts, config, *, pg_collection=None, name=None, expert_config=None,
                   submodules=None):
    from .experts import GroupedExperts

    return GroupedExperts(num_local_experts, expert_config, submodules=submodules, pg_collection=pg_collection,
                          name=name)


class ParallelLatentMoE(MoELayer):
    """Stable LatentMoE on megatron's MoELayer (``block_sparse_moe``)."""

    def __init__(self, cfg, ctx: ParallelCtx, tconfig, layer_number: int | None = None, recompute: bool = False):
        act = functools.partial(GLUActivation, hidden_act=cfg.hidden_act, beta=cfg.activation_situ_beta,
                                linear_beta=cfg.activation_situ_linear_beta, recompute=recompute)
        mlp_sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear, activation_func=act)
        # megatron's MoE under TP needs sequence-sharded tokens; without SP this layer shards them itself.
        self_sp = ctx.tp > 1 and not ctx.sp
        if self_sp:
            tconfig = dataclasses.replace(tconfig, sequence_parallel=True)
        expert_config = dataclasses.replace(tconfig, moe_latent_size=cfg.routed_expert_hidden_size)
        experts = functools.partial(_build_experts, expert_config=expert_config, submodules=mlp_sub)
        super().__init__(tconfig, MoESubmodules(experts=experts, router=K3Router), layer_number=layer_number)
        self.k3cfg, self.ctx, self.self_sp = cfg, ctx, self_sp
        if type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher:  # sync-free when EP x TP = 1
            from ..patches.local_dispatcher import LocalAlltoAllDispatcher

            LocalAlltoAllDispatcher.adopt(self.token_dispatcher)
        self.latent = cfg.routed_expert_hidden_size is not None
        D, L = cfg.hidden_size, cfg.expert_width
        if self.latent:
            from ..model.common import scaled_init_std

            self.routed_expert_down_proj = Linear(D, L, cfg.init_std)
            if cfg.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps)
            self.routed_expert_up_proj = Linear(L, D, scaled_init_std(cfg.init_std, cfg.num_hidden_layers))
            for m in (self.routed_expert_down_proj, self.routed_expert_up_proj, getattr(self, "routed_expert_norm", None)):
                if m is not None:
                    mark_replicated(m, ctx)
        for expert in self.experts.local_experts:  # [w1; w3]: two blocks for per-head Muon (= the release's w1, w3)
            expert.linear_fc1.weight.k3_heads = (0, cfg.moe_intermediate_size)
        if self_sp:  # per-token params on a sequence shard, but the model is not SP: sum their grads ourselves
            for p in [self.router.weight] + [p for n, p in self.named_parameters() if n.startswith("routed_expert_")]:
                mark_tp_partial(p)
        if cfg.num_shared_experts > 0:
            self.shared_experts = ParallelMLP(cfg, ctx, D, cfg.num_shared_experts * cfg.moe_intermediate_size,
                                              recompute=recompute)

    def preprocess(self, hidden_states, probs, routing_map):
        if self.latent:  # routing already ran on the full-width x; dispatch carries latent tokens
            hidden_states = self.routed_expert_down_proj(hidden_states)
        return self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)

    def postprocess(self, output, shared_expert_output):
        out = self.token_dispatcher.combine_postprocess(output)
        if self.latent:
            if self.k3cfg.latent_moe_use_norm:
                out = self.routed_expert_norm(out)
            out = self.routed_expert_up_proj(out)
        return out

    def forward(self, x):
        if self.self_sp:
            xs = mappings.scatter_to_sequence_parallel_region(x, self.ctx.tp_group)
            out = mappings.gather_from_sequence_parallel_region(super().forward(xs)[0], False, self.ctx.tp_group)
        else:
            out, _ = super().forward(x)
        if self.k3cfg.num_shared_experts > 0:
            out = out + self.shared_experts(x)
        return out


# ---------------------------------------------------------------------------------------------------------
class BatchFirstRMSNorm(RMSNorm):
    """The decoder layer's input norm (same weight, same name) writing its output batch-first: [S, B, D] ->
    [B, S, D], the token mixer's layout (``rms_norm_batch_first``: on CUDA one kernel forward and one backward
    instead of the norm and a strided copy)."""

    def forward(self, x):
        return fast(rms_norm_batch_first, x)(x, self.weight, self.eps)


class ParallelK3Layer(K3DecoderLayer):
    """The golden decoder layer (norms, Attention Residuals, residual stream) with parallel mixers/FFNs."""

    def __init__(self, cfg, ctx: ParallelCtx, tconfig, layer_idx: int, kind=None, moe=None, attn_res=None,
                 recompute: str = "none"):
        # read by the factories below while the golden constructor runs
        self._build = (ctx, tconfig, recompute == "selective")
        super().__init__(cfg, layer_idx, kind=kind, moe=moe, attn_res=attn_res)
        del self._build
        for name in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm",
                     "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj"):
            if hasattr(self, name):
                mark_replicated(getattr(self, name), ctx)

    def token_mixer(self, x):
        """The golden ``self_attn(input_layernorm(x))``; with a ``BatchFirstRMSNorm`` the norm's output is
        already the mixer's batch-first input."""
        norm = self.input_layernorm
        return self.self_attn(norm(x), batch_first=isinstance(norm, BatchFirstRMSNorm))

    def make_input_layernorm(self, cfg):
        ctx, _, _ = self._build
        # under sequence parallelism the gather before the mixer needs the sequence-first layout
        cls = RMSNorm if ctx.sp else BatchFirstRMSNorm
        return cls(cfg.hidden_size, cfg.rms_norm_eps)

    # the golden constructor asks these factories for its mixers and FFNs
    def make_attention(self, cfg, layer_idx):
        ctx, _, sel = self._build
        cls = ParallelKDA if self.kind == "kda" else ParallelMLA
        return cls(cfg, ctx, layer_idx, recompute=sel)

    def make_moe(self, cfg):
        ctx, tconfig, sel = self._build
        return ParallelLatentMoE(cfg, ctx, tconfig, layer_number=self.layer_idx + 1, recompute=sel)

    def make_mlp(self, cfg):
        ctx, _, sel = self._build
        return ParallelMLP(cfg, ctx, cfg.hidden_size, cfg.intermediate_size, recompute=sel)
