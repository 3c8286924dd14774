r"""Triton kernel of the LM head's cross-entropy chunk: ``k3.ce_sum_and_grad`` (the loss sum of a [n, V] logits
chunk and its gradient, formed in the forward pass by ``linear_cross_entropy``) in two passes over each row.

Per row (token) x [V], target t (``ignore_index``: the row is left out), in fp32 registers::

    pass 1 (online log-sum-exp, per lane, combined at the end):
        for each tile of the row:  m' = max(m, x);  s = s e^(m - m') + e^(x - m');  m = m'
        lse = M + log sum_lanes s e^(m - M),  M = max_lanes m
    pass 2:  d x = (e^(x - lse) - onehot(t)) * valid    (written in the logits' dtype)
    loss row = (lse - x[t]) * valid;  loss = sum of the rows

Bytes per row: the logits are read twice and the gradient written once. The torch.compile'd
``ce_sum_and_grad`` (the ``compiled`` choice) runs one fused kernel that reads each row three times (the row
max, the sum of exponentials, the gradient): at k3-mini (4096 x 163840 bf16 a chunk, 1.34 GB) it took 1.85 ms
a chunk on an H100, the three reads and one write at ~2.9 TB/s (``benchmarks/README.md``;
``benchmarks/bench_ops.py --parts ce_chunk`` times both forms).

The kernel also runs under ``TRITON_INTERPRET=1`` on CPU tensors (tests/model/test_model.py pins it to the
plain-PyTorch ``ce_sum_and_grad``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the logits dtypes the kernel takes


@triton.jit
def _ce_sum_grad_kernel(x_ptr, t_ptr, g_ptr, loss_ptr, V, stride_x, stride_g, ignore_index,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    g_row = g_ptr + row * stride_g
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    t = tl.where(valid, t, 0)
    cols = tl.arange(0, BLOCK)
    neg_inf = float("-inf")
    m = tl.full([BLOCK], neg_inf, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(x_row + c, mask=c < V, other=neg_inf).to(tl.float32)
        m_new = tl.maximum(m, x)
        live = m_new != neg_inf  # a lane that has seen only padding keeps s = 0 (no exp(-inf + inf))
        s = tl.where(live, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(tl.where(m != neg_inf, s * tl.exp(m - big), 0.0), axis=0))
    scale = tl.where(valid, 1.0, 0.0)
    for start in range(0, V, BLOCK):
        c = start + cols
        x = tl.load(x_row + c, mask=c < V, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(c == t, 1.0, 0.0)) * scale
        tl.store(g_row + c, g.to(g_ptr.dtype.element_ty), mask=c < V)
    xt = tl.load(x_row + t).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - xt, 0.0))


def supported(logits: torch.Tensor, targets: torch.Tensor) -> bool:
    """Whether the kernel takes this chunk: [n, V] fp32/bf16/fp16 logits with unit column stride, [n] targets."""
    return (logits.dim() == 2 and logits.dtype in DTYPES
            and logits.stride(-1) == 1 and targets.shape == logits.shape[:1] and logits.device == targets.device)


def ce_sum_and_grad_triton(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    """``k3.ce_sum_and_grad`` through the kernel above: (fp32 loss sum, d loss / d logits in the logits' dtype)."""
    n, V = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    rows = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _ce_sum_grad_kernel[(n,)](logits, targets.contiguous(), grad, rows, V, logits.stride(0), grad.stride(0),
                                  ignore_index, BLOCK=BLOCK_V, num_warps=8)
    return rows.sum(), grad
