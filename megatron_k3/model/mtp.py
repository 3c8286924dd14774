r"""Multi-token prediction (MTP) head, DeepSeek-V3 style, with the shared output head.

For depth k = 1..K (sequential), at position t::

    h_k[t] = Layer_k( eh_proj( [ hnorm(h_{k-1}[t]) ; enorm(embed(x[t + k])) ] ) )      # 2D -> D
    logits_k[t] = lm_head( norm_k(h_k[t]) )      predicts x[t + k + 1]  (= labels[t + k])

``h_0`` is the trunk's final representation (after the output AttnRes mix, before the final norm); the
embedding table and ``lm_head`` are the trunk's (shared). ``Layer_k`` is one K3 layer with full (MLA)
attention and the model's FFN kind (MoE when the model has experts), using a standard pre-norm residual:
AttnRes mixes over depth, and a single MTP layer has no depth to mix. The last k positions of depth k
have no target and are masked out of the loss.
Names: ``model.mtp.{k-1}.{enorm, hnorm, eh_proj, norm, layer.*}`` (the release ships no MTP weights).
"""
from __future__ import annotations

import torch
from torch import nn

from .common import Linear, RMSNorm


class MTPModule(nn.Module):
    def __init__(self, cfg, make_layer):
        super().__init__()
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * D, D, cfg.init_std)
        self.layer = make_layer()
        self.norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, h_prev: torch.Tensor, emb_next: torch.Tensor) -> torch.Tensor:
        """h_prev, emb_next [B, T, D] -> h_k [B, T, D] (un-normalised; apply ``self.norm`` before the head)."""
        x = self.eh_proj(torch.cat([self.hnorm(h_prev), self.enorm(emb_next)], dim=-1))
        return self.layer(x, None)[0]


def shift_left(x: torch.Tensor, k: int, fill) -> torch.Tensor:
    """x[:, t] <- x[:, t + k]; the last k positions get ``fill``."""
    out = torch.roll(x, shifts=-k, dims=1)
    out[:, x.shape[1] - k:] = fill
    return out
