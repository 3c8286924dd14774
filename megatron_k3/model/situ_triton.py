r"""Triton kernels of the streaming SiTU-GLU op (imported by ``situ.py`` only for CUDA tensors).

Same equations as ``situ.py``; each program loads a [BLOCK_R, BLOCK_H] tile of g and u (bf16/fp16/fp32,
any row stride, unit column stride: the two halves of one [R, 2H] tensor or two separate tensors),
computes in fp32 registers (g / beta as g * (1 / beta): a multiply, not an IEEE division) and stores the
output tile (forward) or the dg/du tiles (backward), so the op reads its saved input once per pass and needs
no workspace in device memory at all. tanh is libdevice's
(accurate to ~1 ulp), sigmoid Triton's ``tl.sigmoid``. Offsets are int64 (R x 2H may exceed 2^31).

The kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors (how the CPU test checks their indexing,
masking and algebra); the interpreter has no libdevice, so there tanh is (1 - e) / (1 + e), e = exp(-2|x|).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # older Triton
    from triton.language.extra.cuda import libdevice

ELEMS_PER_PROGRAM = 4096

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter has no libdevice: a plain formula
    @triton.jit
    def _tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x >= 0, t, -t)
else:
    @triton.jit
    def _tanh(x):
        return libdevice.tanh(x)


@triton.jit
def _situ_fwd_kernel(g_ptr, u_ptr, o_ptr, R, H, sg, su, so, beta, lbeta, inv_beta, inv_lbeta,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < R) & (cols[None, :] < H)
    g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act = beta * _tanh(g * inv_beta) * tl.sigmoid(g)
    lin = lbeta * _tanh(u * inv_lbeta)
    tl.store(o_ptr + rows[:, None] * so + cols[None, :], (act * lin).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, R, H, sg, su, sdy, sdg, sdu, beta, lbeta, inv_beta,
                     inv_lbeta,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < R) & (cols[None, :] < H)
    g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * sdy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    t = _tanh(g * inv_beta)
    tu = _tanh(u * inv_lbeta)
    dact = s * ((1.0 - t * t) + beta * t * (1.0 - s))
    dg = dy * dact * (lbeta * tu)
    du = dy * (beta * t * s) * (1.0 - tu * tu)
    tl.store(dg_ptr + rows[:, None] * sdg + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + rows[:, None] * sdu + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)


def _tiles(R: int, H: int):
    bh = min(triton.next_power_of_2(H), 1024)
    br = max(1, ELEMS_PER_PROGRAM // bh)
    return br, bh, (triton.cdiv(R, br), triton.cdiv(H, bh))


def _check(*ts):
    for t in ts:
        assert t.dim() == 2 and t.stride(1) == 1, "SiTU kernels take 2-D views with unit column stride"


def situ_fwd(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor, beta: float, linear_beta: float):
    """out[R, H] = situ(g, u) for 2-D views g, u, out."""
    _check(g, u, out)
    R, H = g.shape
    if R == 0 or H == 0:
        return out
    br, bh, grid = _tiles(R, H)
    with _on(g):
        _situ_fwd_kernel[grid](g, u, out, R, H, g.stride(0), u.stride(0), out.stride(0), float(beta),
                               float(linear_beta), 1.0 / beta, 1.0 / linear_beta, BLOCK_R=br, BLOCK_H=bh,
                               num_warps=4)
    return out


def situ_bwd(g, u, dy, dg, du, beta: float, linear_beta: float):
    """dg, du [R, H] of situ(g, u) for the upstream gradient dy (all 2-D views)."""
    _check(g, u, dy, dg, du)
    R, H = g.shape
    if R == 0 or H == 0:
        return dg, du
    br, bh, grid = _tiles(R, H)
    with _on(g):
        _situ_bwd_kernel[grid](g, u, dy, dg, du, R, H, g.stride(0), u.stride(0), dy.stride(0), dg.stride(0),
                               du.stride(0), float(beta), float(linear_beta), 1.0 / beta, 1.0 / linear_beta,
                               BLOCK_R=br, BLOCK_H=bh, num_warps=4)
    return dg, du


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _on(t: torch.Tensor):
    """The tensor's CUDA device as the current one (a no-op context when it already is)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return _null()
