r"""Aux-loss-free MoE load balancing on K3's ``e_score_correction_bias`` (selection: ``sigmoid(x W^T) + b``).

Two updates, both applied once per optimizer step from the statistics of *all* micro-batches of the step
and all data-parallel ranks, and both keep ``mean(b) = 0`` (top-k is invariant to a common shift, so the
mean carries no routing information and only drifts):

* ``sign`` (DeepSeek style, done right): counts summed over micro-batches and DP ranks,
  ``delta = -gamma * sign(counts - mean(counts))``, ``delta -= mean(delta)``. megatron-core's router
  accumulates the counts and applies ``gamma * sign(mean - counts)``; ``finalize_k3_grads`` re-centres.
* ``quantile`` (K3's Quantile Balancing, inferred form; ``quantile_shift``/``quantile_update``): with
  biased scores ``s + b`` and the target load ``q = tokens * k / experts``, expert e's margin on token t is
  ``m_te = s_te + b_e - theta_te`` where ``theta_te`` is the k-th largest biased score among the *other*
  experts (token t picks e iff ``m_te > 0``): the (k+1)-th largest overall if e is in t's top-k, else the
  k-th. Each expert moves its bias by ``c_e`` = the midpoint of the q-th and (q+1)-th largest margins of
  its column (the spec says the (q+1)-th; the midpoint avoids a tie), so that, taken alone, exactly q tokens
  would pick it. (The spec's form uses the (k+1)-th largest overall for every
  expert; that is the same threshold for selected experts but puts a zero margin on each token's
  (k+1)-th expert, which stalls under-loaded experts.) ``c`` is computed per micro-batch on local tokens, averaged over the
  step's micro-batches and DP ranks, then ``b <- b - c`` and re-centred. (megatron-core 0.19.2's
  ``quantile_balancing`` works on raw logits with its own ``qb_beta``, a different selection space than
  K3's sigmoid-plus-bias, so K3 keeps its own.)
"""
from __future__ import annotations

import torch


def sign_update(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """The zero-centred sign update (returns the new bias)."""
    delta = -rate * torch.sign(counts.to(bias.dtype) - counts.to(bias.dtype).mean())
    return bias + (delta - delta.mean())


def quantile_shift(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """``c`` [E] for one batch of sigmoid scores [T, E] (see the module docstring)."""
    T, E = scores.shape
    biased = scores.float() + bias.float()
    top = biased.topk(k + 1, dim=1).values
    vk, vk1 = top[:, k - 1:k], top[:, k:k + 1]                # k-th and (k+1)-th largest biased scores
    theta = torch.where(biased >= vk, vk1, vk)                # k-th largest among the other experts
    margins = biased - theta
    q = max(1, min(T - 1, (T * k) // E))
    m = margins.topk(q + 1, dim=0).values                     # per expert: the q+1 largest margins
    return 0.5 * (m[-2] + m[-1])                               # between the q-th and the (q+1)-th


def quantile_update(bias: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    new = bias - shift.to(bias.dtype)
    return new - new.mean()
