r"""Block Attention Residuals (AttnRes).

Each layer has two mixers (before attention, before the MLP) and the model has a final output mixer. A
mixer takes the completed block snapshots plus the current partial block sum (last) as candidates::

    mix(prefix, blocks, proj, norm):
        V = stack(blocks + [prefix])                      # [N, ..., D]
        K = V_fp32 * rsqrt(mean(V^2) + eps)               # weightless RMS
        s = K . (norm.weight * proj.weight)               # recompute w (.) gamma whenever weights change
        return softmax_N(s) @ V_fp32  (cast back)

    model:  blocks = []; h = embed(tokens)
    layer i:  prefix = h
              x = mix(prefix, blocks, attn_res) if blocks else prefix
              if i % block_size == 0: blocks.append(prefix); prefix = None     # layer 0 snapshots the embedding
              a = attn(input_layernorm(x));  prefix = a if prefix is None else prefix + a
              m = mlp(post_attention_layernorm(mix(prefix, blocks, mlp_res)))
              h = prefix + m                   # what passes between layers is the partial block sum
    final:    h = norm(mix(h, blocks, output_attn_res)); logits = lm_head(h)

Pseudo-queries (``*_res_proj.weight`` [1, D]) start at zero: uniform mixing. Documented special case:
with ``block_size >= num_layers`` only layer 0 snapshots (the embedding), so every mixer chooses between
two candidates, the embedding and the running sum of all layer outputs; at zero queries it returns their
mean ``(emb + sum_outputs) / 2``. ``w (.) gamma`` is never cached here, so a weight update is always seen.
"""
from __future__ import annotations

import torch
from torch import nn

from ..perf import current as current_kernels
from .common import acc_dtype, compile_enabled, fast


def attn_res_impl(cands: list[torch.Tensor]) -> str:
    """Which form ``attn_res_mix`` runs for these candidates: ``triton`` (``attn_res_triton.py``: one pass
    over the candidates in place, no stacked copy) for CUDA tensors when the kernels take them (same shape
    and dtype, contiguous), the default since measured on the H200 (2026-12-03: 1.2-1.3x the compiled form's
    kernel time, the same error against fp64; the k3-mini step 2.4% faster with 9 GiB less peak memory,
    benchmarks/README.md); ``perf.attn_res = compiled`` opts out; else the reference, torch.compile'd on CUDA
    (``compiled``) or eager (``reference``)."""
    if cands[0].is_cuda and current_kernels().attn_res == "triton":
        from .attn_res_triton import supported

        if supported(cands):
            return "triton"
    return "compiled" if compile_enabled(cands[0]) else "reference"


def attn_res_mix(prefix: torch.Tensor, blocks: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Softmax-weighted mix of ``blocks + [prefix]`` (each [..., D]); query and norm_weight are [D].
    On CUDA the reference below compiled (one graph per number of candidates), or the Triton kernels
    (``attn_res_impl``); elsewhere the reference."""
    impl = attn_res_impl(list(blocks) + [prefix])
    if impl == "triton":
        from .attn_res_triton import attn_res_mix_triton

        return attn_res_mix_triton(prefix, list(blocks), query, norm_weight, eps)
    return fast(attn_res_mix_reference, prefix)(prefix, list(blocks), query, norm_weight, eps)


def attn_res_mix_through(prefix: torch.Tensor, blocks: list[torch.Tensor], query: torch.Tensor,
                         norm_weight: torch.Tensor, eps: float, blocks_through: bool = True):
    """``attn_res_mix`` that also hands its candidates on: (out, prefix', blocks'), the same values as prefix and
    blocks. A layer uses prefix' (and blocks') where it would use prefix (blocks) after the mix. On the Triton
    path they are outputs of the mixer's autograd node, so their gradients are added inside its backward kernel
    (``attn_res_triton.AttnResMixFunction``, ``through``); elsewhere they are the inputs themselves."""
    if attn_res_impl(list(blocks) + [prefix]) == "triton":
        from .attn_res_triton import attn_res_mix_through_triton

        return attn_res_mix_through_triton(prefix, list(blocks), query, norm_weight, eps, blocks_through)
    out = fast(attn_res_mix_reference, prefix)(prefix, list(blocks), query, norm_weight, eps)
    return out, prefix, list(blocks)


def attn_res_mix_reference(prefix: torch.Tensor, blocks: list[torch.Tensor], query: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain-PyTorch mix (equations in the module docstring)."""
    ct = acc_dtype(prefix)
    V = torch.stack(list(blocks) + [prefix], dim=0).to(ct)          # [N, ..., D]
    w = norm_weight.to(ct) * query.to(ct)                            # [D]
    # s = K . w with K = V rsqrt(mean(V^2) + eps): the per-row scale taken out of the dot product, and both
    # contractions written as multiply + sum, which torch.compile fuses into reductions over D (as einsums
    # inductor lowered them to fp32 bmm/gemv calls with N-long rows: 1.9x slower fwd+bwd on the H200,
    # benchmarks/README.md; benchmarks/bench_ops.py --parts attn_res times both forms)
    s = torch.rsqrt(V.pow(2).mean(-1) + eps) * (V * w).sum(-1)       # [N, ...]
    p = torch.softmax(s, dim=0)
    return (p.unsqueeze(-1) * V).sum(0).to(prefix.dtype)


class ResProj(nn.Module):
    """Pseudo-query weight [1, D], zero-initialised (official name ``*_res_proj.weight``)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, dim))

    def reset_parameters(self, gen=None):
        with torch.no_grad():
            self.weight.zero_()
