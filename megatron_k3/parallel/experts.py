"""Routed experts as two grouped GEMMs: megatron's ``SequentialMLP`` (same parameters, same names, same
checkpoint pieces) with a forward that does not loop over experts.

For the tokens already permuted by the dispatcher into expert order, with ``n_e`` tokens for local expert
``e`` and ``offs = cumsum(n)``::

    H   = grouped_mm(X, W1ᵀ, offs)          # [T, 2F]: row block e uses W1[e] = [w1_e; w3_e]
    A   = act(H) * p                         # SiTU-GLU (the streaming op) times the routing prob
    Y   = grouped_mm(A, W2ᵀ, offs)          # [T, L]

``torch._grouped_mm`` runs the E GEMMs as one kernel (CUTLASS on Hopper) and takes the group boundaries
from a device tensor, so neither a Python loop of 3 x E GEMMs nor ``tokens_per_expert.tolist()`` (a
host sync) is needed. The per-expert weights are stacked inside the op's forward and again in its
backward (``megatron_k3.model.moe.grouped_linear``), so no stacked copy is kept for backward; the
parameters stay one per expert, so DDP, the optimizers, the checkpoint adapter and Muon's per-matrix view
are unchanged. Under megatron's DDP (``runtime.wrap_ddp``) the E weight gradients of a projection are added
to the experts' ``main_grad`` buffers by one kernel through a strided view (``stacked_main_grad``) instead of
E gradients and E adds by DDP's hooks. Falls back to the loop when the grouped
kernel cannot be used (dtype other than fp32/bf16/fp16, or a row stride that is not a multiple of 16 bytes).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP

from ..model.common import fast
from ..model.moe import grouped_linear


def grouped_ok(x: torch.Tensor, widths) -> bool:
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all((w * x.element_size()) % 16 == 0 for w in widths)


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` whose forward is two grouped GEMMs (see the module docstring)."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        experts = self.local_experts
        fc1 = [e.linear_fc1.weight for e in experts]
        fc2 = [e.linear_fc2.weight for e in experts]
        # under FP8 the experts stay bf16 grouped GEMMs (megatron_k3/parallel/precision.py)
        if (self.config.moe_apply_probs_on_input or experts[0].linear_fc1.bias is not None
                or not grouped_ok(x, (fc1[0].shape[1], fc1[0].shape[0], fc2[0].shape[1], fc2[0].shape[0]))):
            return super().forward(x, tokens_per_expert, permuted_probs)
        if not torch.is_tensor(tokens_per_expert):
            tokens_per_expert = torch.tensor(tokens_per_expert)
        offs = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int64), 0).to(torch.int32)
        h = grouped_linear(x, fc1, offs)  # [T, 2F]
        h = experts[0].activation_func(h)
        h = fast(scale_rows, h)(h, permuted_probs, x.dtype)
        return grouped_linear(h, fc2, offs), None


def scale_rows(h: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``h * p`` per row (the routing probability, fp32) cast to ``dtype``; compiled on CUDA (one kernel each
    way instead of a mixed-dtype multiply into an fp32 copy and a cast)."""
    return (h * p.unsqueeze(-1)).to(dtype)
