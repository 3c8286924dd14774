r"""Triton kernels of the Attention-Residual mixer (``attn_res.py``; used for CUDA tensors when
the kernels take them, the default since measured on the H200; ``perf.attn_res = compiled`` opts out:
benchmarks/README.md).

Same equations as ``attn_res_mix_reference``, computed in fp32 registers, candidates V_0..V_{N-1} read in place
(no stacked copy; they reach the kernel as a tuple of pointers, so each candidate count N compiles once).
Per row (token) of the [R, D] candidates, with w = norm_weight * query:

    forward (one pass, online softmax):
        for n:  v = V_n;  r_n = rsqrt(mean(v^2) + eps);  s_n = r_n (v . w)
                m' = max(m, s_n);  acc = acc e^(m - m') + e^(s_n - m') v;  l = l e^(m - m') + e^(s_n - m');  m = m'
        out = acc / l;  saved: s [N, R] and lse = m + log l [R] (fp32)
    backward (g = dL/d out; two passes over the candidates, the second can hit L2):
        p_n = e^(s_n - lse);  c = sum_n p_n (g . V_n)
        dV_n = p_n g + ds_n (r_n w - (V_n . w) r_n^3 V_n / D),  ds_n = p_n (g . V_n - c)
        dw = sum_rows sum_n ds_n r_n V_n   (per-program partials [P, D], summed afterwards)

Handed-on candidates (``through``): the mixer's node can also return some of its candidates unchanged; the layer
then uses those outputs (the residual's prefix, the blocks the layer's second mixer reads), so the gradients of
those uses come back into this node and the backward kernel adds them to dV_n as it writes it (one read more
per candidate) instead of autograd adding two gradients of one tensor in a kernel of its own (read two, write
one: k3-mini ran 2,512 such bf16 adds a step on an H100, 85 ms; ``benchmarks/README.md``).

Bytes per call: forward reads the N candidates and writes out; backward reads g and the candidates (twice, the
second read can hit L2) and writes N gradients. The torch.compile'd reference reaches ~1/12-1/20 of this
floor on the H200 (``benchmarks/bench_ops.py --parts attn_res``).

The kernels also run under ``TRITON_INTERPRET=1`` on CPU tensors (tests/model/test_attn_res.py checks the algebra,
masking and the candidate tuple there).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attn_res_fwd_kernel(cands, w_ptr, out_ptr, s_ptr, lse_ptr, R, D, eps,
                         N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    rmask, cmask = rows < R, cols < D
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * D + cols[None, :]
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for n in tl.static_range(N):
        v = tl.load(cands[n] + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        s = r * tl.sum(v * w[None, :], axis=1)
        tl.store(s_ptr + n * R + rows, s, mask=rmask)
        m_new = tl.maximum(m, s)
        a = tl.exp(m - m_new)
        e = tl.exp(s - m_new)
        acc = acc * a[:, None] + e[:, None] * v
        denom = denom * a + e
        m = m_new
    tl.store(out_ptr + offs, (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + rows, m + tl.log(denom), mask=rmask)


@triton.jit
def _attn_res_bwd_kernel(cands, dcands, accs, g_ptr, w_ptr, s_ptr, lse_ptr, dw_ptr, R, D, eps, n_blocks,
                         N: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0)
    dw = tl.zeros([BLOCK_D], tl.float32)
    for rb in range(pid, n_blocks, tl.num_programs(0)):
        rows = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        rmask = rows < R
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * D + cols[None, :]
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
        c = tl.zeros([BLOCK_R], tl.float32)
        for n in tl.static_range(N):
            v = tl.load(cands[n] + offs, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(tl.load(s_ptr + n * R + rows, mask=rmask, other=0.0) - lse)
            c += p * tl.sum(g * v, axis=1)
        for n in tl.static_range(N):
            v = tl.load(cands[n] + offs, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(tl.load(s_ptr + n * R + rows, mask=rmask, other=0.0) - lse)
            ds = p * (tl.sum(g * v, axis=1) - c)
            r = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
            dot = tl.sum(v * w[None, :], axis=1)
            dv = p[:, None] * g + ds[:, None] * (r[:, None] * w[None, :] - (dot * r * r * r / D)[:, None] * v)
            if (ACC >> n) & 1:  # the gradient of candidate n handed on (``through``) arrives here: add it
                dv += tl.load(accs[n] + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dcands[n] + offs, dv.to(dcands[n].dtype.element_ty), mask=mask)
            dw += tl.sum((ds * r)[:, None] * v, axis=0)
    tl.store(dw_ptr + pid * D + cols, dw, mask=cmask)


def _blocks(D: int):
    """(BLOCK_R, BLOCK_D, num_warps): all D columns of a row in one tile, ~4096 elements a tile."""
    block_d = triton.next_power_of_2(D)
    block_r = max(1, 4096 // block_d)
    return block_r, block_d, 4 if block_r * block_d <= 4096 else 8


def supported(cands) -> bool:
    """Whether the kernels take these candidates: same shape and dtype (fp32/bf16/fp16), contiguous, one device."""
    c0 = cands[0]
    return (c0.dtype in (torch.float32, torch.bfloat16, torch.float16) and c0.dim() >= 1
            and all(c.shape == c0.shape and c.dtype == c0.dtype and c.device == c0.device and c.is_contiguous()
                    for c in cands))


class AttnResMixFunction(torch.autograd.Function):
    """out = mix(cands) with w = norm_weight * query given as one fp32 [D] tensor (its gradient is returned;
    autograd carries it to the query and the norm weight). ``through``: indices of candidates this node also
    returns, unchanged (views), after ``out``; the gradients that their later uses send back arrive in this
    node's backward and the kernel adds them to the candidates' own gradients (``ACC``), instead of autograd
    adding the two gradients of the same tensor with a kernel of its own."""

    @staticmethod
    def forward(ctx, w, eps, through, *cands):
        ctx.through = tuple(through)
        ctx.set_materialize_grads(False)  # a handed-on candidate nobody used sends no gradient (None)
        D = cands[0].shape[-1]
        R = cands[0].numel() // D
        N = len(cands)
        out = torch.empty_like(cands[-1])
        s = torch.empty(N, R, dtype=torch.float32, device=out.device)
        lse = torch.empty(R, dtype=torch.float32, device=out.device)
        br, bd, nw = _blocks(D)
        w = w.contiguous()
        _attn_res_fwd_kernel[(triton.cdiv(R, br),)](tuple(cands), w, out, s, lse, R, D, eps, N=N, BLOCK_R=br,
                                                    BLOCK_D=bd, num_warps=nw)
        ctx.save_for_backward(w, s, lse, *cands)
        ctx.eps = eps
        if not ctx.through:
            return out
        return (out,) + tuple(cands[i].view_as(cands[i]) for i in ctx.through)

    @staticmethod
    def backward(ctx, g, *g_through):
        w, s, lse, *cands = ctx.saved_tensors
        if g is None:
            g = torch.zeros_like(cands[-1])
        D = cands[0].shape[-1]
        R = cands[0].numel() // D
        br, bd, nw = _blocks(D)
        n_blocks = triton.cdiv(R, br)
        sms = torch.cuda.get_device_properties(g.device).multi_processor_count if g.is_cuda else 2
        programs = max(1, min(n_blocks, 4 * sms))
        dcands = [torch.empty_like(c) for c in cands]
        accs, mask = list(dcands), 0  # dcands stand in where nothing is added (never read: ACC's bit is 0)
        for i, gi in zip(ctx.through, g_through):
            if gi is not None:
                accs[i], mask = gi.contiguous(), mask | (1 << i)
        dw = torch.empty(programs, D, dtype=torch.float32, device=g.device)
        _attn_res_bwd_kernel[(programs,)](tuple(cands), tuple(dcands), tuple(accs), g.contiguous(), w, s, lse, dw, R,
                                          D, ctx.eps, n_blocks, N=len(cands), ACC=mask, BLOCK_R=br, BLOCK_D=bd,
                                          num_warps=nw)
        return (dw.sum(0), None, None, *dcands)


def attn_res_mix_triton(prefix: torch.Tensor, blocks: list[torch.Tensor], query: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``attn_res_mix_reference`` through the kernels above (``supported`` must hold for blocks + [prefix])."""
    w = norm_weight.float() * query.float()
    return AttnResMixFunction.apply(w, float(eps), (), *blocks, prefix)


def attn_res_mix_through_triton(prefix: torch.Tensor, blocks: list[torch.Tensor], query: torch.Tensor,
                                norm_weight: torch.Tensor, eps: float, blocks_through: bool = True):
    """``attn_res.attn_res_mix_through`` through the kernels: (out, prefix', blocks') with prefix' (and, with
    ``blocks_through``, blocks') outputs of the mixer's node (``AttnResMixFunction``'s ``through``)."""
    w = norm_weight.float() * query.float()
    n = len(blocks)
    through = (tuple(range(n)) if blocks_through else ()) + (n,)
    out, *handed = AttnResMixFunction.apply(w, float(eps), through, *blocks, prefix)
    return out, handed[-1], (handed[:-1] if blocks_through else list(blocks))
