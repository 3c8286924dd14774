r"""Triton kernels of KDA's short convolution (``kda.causal_conv1d`` with ``perf.short_conv = triton``; opt-in
until measured on a GPU: benchmarks/README.md).

Same equations as the ``F.conv1d`` reference in ``kda.py``, in fp32 registers, x [B, T, C] read in place
through its batch and time strides (the q/k/v slices of the fused projection are strided), weight [C, K]::

    forward:   pre_t = sum_j w_j x_(t-K+1+j)   (x_s = 0 for s < 0);   y_t = silu(pre_t)  (or pre_t)
    backward:  dpre_t = dy_t * silu'(pre_t),  silu'(p) = s (1 + p (1 - s)),  s = sigmoid(p)
               dx_t   = sum_i w_(K-1-i) dpre_(t+i)                 (dpre_s = 0 for s >= T)
               dw_j   = sum_(b,t) dpre_t x_(t-K+1+j)               (per-program partials, summed in fp32)

Nothing but x is kept for backward: each backward program recomputes the pre-activations it needs (its
rows and the K-1 after them) from x, so a call reads x and writes y forward, and reads x and dy and writes
dx backward, with no second forward launch (fla's ``causal_conv1d`` runs its forward again inside its
backward: two forward and one backward kernel per call in the k3-mini profile, 0.095 s a step). Bytes per
call at [8, 4096, 1024] bf16: 5 x 64 MiB, ~0.08 ms at the H200's ~4.3 TB/s.

The kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors (tests/model/test_kda.py checks them there
against the fp64 reference).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _short_conv_fwd_kernel(x_ptr, w_ptr, y_ptr, T, C, sxb, sxt, syb, syt,
                           K: tl.constexpr, ACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    cmask = c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for j in tl.static_range(K):
        ts = t - (K - 1) + j
        m = ((ts >= 0) & (ts < T))[:, None] & cmask[None, :]
        xv = tl.load(x_ptr + b * sxb + ts[:, None] * sxt + c[None, :], mask=m, other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0)
        acc += xv * wj[None, :]
    if ACT:
        acc = acc * tl.sigmoid(acc)
    m = (t < T)[:, None] & cmask[None, :]
    tl.store(y_ptr + b * syb + t[:, None] * syt + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _short_conv_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dwp_ptr, T, C, sxb, sxt, sgb, sgt, sdb, sdt,
                           K: tl.constexpr, ACT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_t = tl.program_id(0)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    b = tl.program_id(2).to(tl.int64)
    cmask = c < C
    xb = x_ptr + b * sxb + c[None, :]
    dx = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    partial = (b * tl.num_programs(0) + pid_t) * K  # this program's row of the [B * n_t, K, C] partials
    for i in tl.static_range(K):  # dpre at rows t + i: the K-1 rows after this block are recomputed here
        tt = t + i
        pre = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(K):
            ts = tt - (K - 1) + j
            m = ((ts >= 0) & (ts < T))[:, None] & cmask[None, :]
            pre += tl.load(xb + ts[:, None] * sxt, mask=m, other=0.0).to(tl.float32) * \
                tl.load(w_ptr + c * K + j, mask=cmask, other=0.0)[None, :]
        gm = (tt < T)[:, None] & cmask[None, :]
        dpre = tl.load(dy_ptr + b * sgb + tt[:, None] * sgt + c[None, :], mask=gm, other=0.0).to(tl.float32)
        if ACT:
            s = tl.sigmoid(pre)
            dpre = dpre * s * (1.0 + pre * (1.0 - s))
        dx += dpre * tl.load(w_ptr + c * K + (K - 1 - i), mask=cmask, other=0.0)[None, :]
        if i == 0:  # this block's own rows: their share of dw_j = sum_t dpre_t x_(t-K+1+j)
            for j in tl.static_range(K):
                ts = t - (K - 1) + j
                m = ((ts >= 0) & (ts < T))[:, None] & cmask[None, :]
                xv = tl.load(xb + ts[:, None] * sxt, mask=m, other=0.0).to(tl.float32)
                tl.store(dwp_ptr + (partial + j) * C + c, tl.sum(dpre * xv, axis=0), mask=cmask)
    m = (t < T)[:, None] & cmask[None, :]
    tl.store(dx_ptr + b * sdb + t[:, None] * sdt + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)


def _blocks(C: int):
    """(BLOCK_T, BLOCK_C, num_warps): 32 time steps x up to 128 channels a program, 4 warps: the backward
    keeps three fp32 tiles live (pre-activations, their gradient, dx), 32 registers a thread each."""
    return 32, min(128, triton.next_power_of_2(C)), 4


def supported(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """Whether the kernels take this call: x [B, T, C] in fp32/bf16/fp16 (and weight [C, 1, K] or [C, K])."""
    return (x.dim() == 3 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and (weight is None or (weight.shape[0] == x.shape[-1] and weight.numel() % x.shape[-1] == 0)))


class ShortConvFunction(torch.autograd.Function):
    """y = (silu)(causal depthwise conv(x, weight)); x [B, T, C], weight [C, 1, K] (fp32 math)."""

    @staticmethod
    def forward(ctx, x, weight, activation: bool):
        B, T, C = x.shape
        K = weight.numel() // C
        if x.stride(-1) != 1:
            x = x.contiguous()
        w = weight.reshape(C, K).float().contiguous()
        y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
        bt, bc, nw = _blocks(C)
        grid = (triton.cdiv(T, bt), triton.cdiv(C, bc), B)
        _short_conv_fwd_kernel[grid](x, w, y, T, C, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                                     K=K, ACT=bool(activation), BLOCK_T=bt, BLOCK_C=bc, num_warps=nw)
        ctx.save_for_backward(x, w)
        ctx.activation, ctx.weight_shape, ctx.weight_dtype = bool(activation), weight.shape, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        B, T, C = x.shape
        K = w.shape[1]
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
        bt, bc, nw = _blocks(C)
        grid = (triton.cdiv(T, bt), triton.cdiv(C, bc), B)
        dwp = torch.empty(B * grid[0], K, C, dtype=torch.float32, device=x.device)
        _short_conv_bwd_kernel[grid](x, w, dy, dx, dwp, T, C, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
                                     dx.stride(0), dx.stride(1), K=K, ACT=ctx.activation, BLOCK_T=bt, BLOCK_C=bc,
                                     num_warps=nw)
        dw = dwp.sum(0).t().reshape(ctx.weight_shape).to(ctx.weight_dtype)
        return dx, dw, None


def short_conv_triton(x: torch.Tensor, weight: torch.Tensor, activation: bool = True) -> torch.Tensor:
    """``kda.causal_conv1d`` (no cache) through the kernels above."""
    return ShortConvFunction.apply(x, weight, activation)
