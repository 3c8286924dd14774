r"""Gated NoPE Multi-head Latent Attention (the full-attention layers of K3).

    q = q_b_proj(q_a_layernorm(q_a_proj x))                       # D -> q_lora_rank -> H*(nope + rope)
        (Kimi Linear: q = q_proj x, no q low rank)
    c, k_rot = split(kv_a_proj_with_mqa x, [kv_lora_rank, rope])
    kv = kv_b_proj(kv_a_layernorm c)                               # kv_lora_rank -> H*(nope + v)
    k = [k_nope_h ; k_rot shared across heads];  q = [q_nope ; q_rot]    # NO RoPE anywhere (mla_use_nope)
    attn = causal softmax(q k^T * (nope + rope)^-1/2) v
    out = o_proj( attn * sigmoid(g_proj x) )                       # g_proj: D -> H*v (K3 output gate)

``q_a_layernorm``/``kv_a_layernorm`` use eps 1e-6. The attention core is PyTorch SDPA (cuDNN's kernel on
the H200 for contiguous inputs, the math kernel on CPU); the same module is the reference on both.
``perf.sdpa_backend = cudnn`` puts cuDNN's kernel first in SDPA's choice on CUDA (``sdpa_backends``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..perf import current as current_kernels

from .common import Linear, RMSNorm, fast, scaled_init_std, sigmoid_gate


SDPA_BACKEND_CHOICES = ("auto", "cudnn")


def sdpa_backends(cuda: bool, choice: str | None = None):
    """SDPA kernels in priority order for ``causal_attention`` (on a CUDA device if ``cuda``), or None for
    torch's own order.

    ``choice`` (default: ``perf.current().sdpa_backend``): ``auto`` leaves the choice to torch; ``cudnn``
    puts cuDNN's kernel first on CUDA, then flash, memory-efficient and math. Why: with Transformer Engine
    imported, the H200 machine loaded a system cuDNN 9.14 beside torch's 9.19, torch's default order then put
    the memory-efficient kernel first (13.8 ms fwd+bwd at k3-mini's MLA shape) although cuDNN's, forced, still
    ran (3.6 ms; ``benchmarks/results/gpu_check_sdpa_cudnn_path_attempt_h200_2026-12-03.json``). Whether it matches the
    other kernels there is what ``benchmarks/gpu_check.py --only sdpa`` compares (``vs_efficient``)."""
    if choice is None:
        choice = current_kernels().sdpa_backend
    if choice not in SDPA_BACKEND_CHOICES:
        raise ValueError(f"sdpa_backend={choice!r}: expected one of {', '.join(SDPA_BACKEND_CHOICES)}")
    if choice == "auto" or not cuda:
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q,k [B,T,H,Dk], v [B,T,H,Dv] -> [B,T,H,Dv], causal softmax attention. On CUDA the inputs are made
    contiguous [B,H,T,D] first. Uncopied (v a strided slice of the kv projection, q and k transposed views)
    SDPA ran its memory-efficient kernel inside the model on the H200 (7.2 ms fwd+bwd at k3-mini's shape in
    isolation), while contiguous inputs of the same shapes run cuDNN's (1.9 ms; ``benchmarks/bench_ops.py --parts
    attention``, 2026-12-01). The copies move ~130 MB per layer forward at that shape."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if q.is_cuda:
        q, k, v = (t.contiguous() for t in (q, k, v))
    backends = sdpa_backends(q.is_cuda)
    if backends is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backends, set_priority=True):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return o.transpose(1, 2)


def heads_first_qkv(q: torch.Tensor, kv: torch.Tensor, k_rot: torch.Tensor, nope: int):
    """q [B,T,H,qk], kv [B,T,H,nope+v] (k_nope | v per head), k_rot [B,T,rope] shared by the heads ->
    q, k = [k_nope, k_rot], v as [B,T,H,*] views of contiguous [B,H,T,*] tensors: the layout SDPA's fast
    kernels take (``causal_attention``: its transpose then needs no copy). Compiled on CUDA, the head
    concatenation and the three transposes are one pass forward, and backward writes d kv in one piece
    (eager, the cat and the split's backward cat ran as slow strided copies: 2 x 124 us per MLA layer and
    micro-batch of 4 x 4096 on an H100, ``benchmarks/README.md``). Exact copies: the values are unchanged."""
    B, T, H, _ = kv.shape
    k_nope, v = kv.split([nope, kv.shape[-1] - nope], dim=-1)
    k = torch.cat([k_nope, k_rot.unsqueeze(2).expand(B, T, H, k_rot.shape[-1])], dim=-1)
    return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))


class GatedMLA(nn.Module):
    """MLA with the official names (``layers.{i}.self_attn.*``)."""

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        self.cfg = cfg
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.vdim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        std, out_std = cfg.init_std, scaled_init_std(cfg.init_std, cfg.num_hidden_layers)
        qk = self.nope + self.rope
        if cfg.q_lora_rank is not None:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, std)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * qk, std)
        else:
            self.q_proj = Linear(D, H * qk, std)
        self.kv_a_proj_with_mqa = Linear(D, cfg.kv_lora_rank + self.rope, std)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (self.nope + self.vdim), std)
        self.o_proj = Linear(H * self.vdim, D, out_std)
        if cfg.mla_use_output_gate:
            self.g_proj = Linear(D, H * self.vdim, std)
            self.g_proj.weight.k3_heads = (0, self.vdim)
        # head layout of the per-head matrices (per-head Muon, TP sharding)
        (self.q_b_proj if cfg.q_lora_rank is not None else self.q_proj).weight.k3_heads = (0, qk)
        self.kv_b_proj.weight.k3_heads = (0, self.nope + self.vdim)
        self.o_proj.weight.k3_heads = (1, self.vdim)

    def project_qkv(self, x: torch.Tensor):
        B, T, _ = x.shape
        H = self.num_heads
        if self.cfg.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, H, self.nope + self.rope)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.cfg.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, T, H, self.nope + self.vdim)
        return fast(heads_first_qkv, kv)(q, kv, k_rot, self.nope)

    def attend(self, q, k, v):
        """Causal softmax attention over the full sequence: [B, T, h, *] -> [B, T, h, v_head_dim]."""
        return causal_attention(q, k, v, scale=(self.nope + self.rope) ** -0.5)

    def gated(self, o, x):
        """The output gate (when the config has one): o [B, T, H, v] -> [B, T, H v]; x the layer input."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, -1)
        if self.cfg.mla_use_output_gate:
            o = fast(sigmoid_gate, o)(o, self.g_proj(x), x.dtype)
        return o

    def output(self, o, x):
        """Output gate and projection; o [B, T, H, v], x the layer input (for the gate)."""
        return self.o_proj(self.gated(o, x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        return self.output(self.attend(q, k, v), x)
