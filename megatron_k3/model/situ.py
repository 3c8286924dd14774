"""SiTU-GLU: the bounded gated activation of every K3 FFN.

    act(g) = beta * tanh(g / beta) * sigmoid(g)                 (beta = 4)
    lin(u) = beta_l * tanh(u / beta_l)                           (beta_l = 25)
    h      = act(g) * lin(u)          computed in fp32, cast back; |h| <= beta * beta_l = 100

``x = [g ; u]`` is the concatenated output of the FFN's first projection (gate half first), as in the
field report's ``situ_and_mul``. Kimi Linear (the predecessor) uses ``silu(g) * u`` instead.

This file holds the plain-PyTorch reference (``situ_glu``); the memory-saving streaming op (saves only the
bf16 input and recomputes tanh/sigmoid in backward) is built on top of it and pinned to it by tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def situ_gate(g: torch.Tensor, beta: float = 4.0) -> torch.Tensor:
    """beta * tanh(g / beta) * sigmoid(g)  (bounded by beta in magnitude)."""
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)


def situ_linear(u: torch.Tensor, linear_beta: float = 25.0) -> torch.Tensor:
    """beta_l * tanh(u / beta_l)  (bounded by beta_l in magnitude)."""
    return linear_beta * torch.tanh(u / linear_beta)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU on separate gate/up halves, in fp32 (fp64 stays fp64), cast back to the input dtype."""
    ct = torch.float64 if g.dtype == torch.float64 else torch.float32
    out = situ_gate(g.to(ct), beta) * situ_linear(u.to(ct), linear_beta)
    return out.to(g.dtype)


def situ_glu(x: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU-GLU on a concatenated [..., 2H] input (gate half first) -> [..., H]."""
    g, u = torch.chunk(x, 2, dim=-1)
    return situ(g, u, beta, linear_beta)


def silu_glu(x: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's SwiGLU on a concatenated [..., 2H] input (gate half first)."""
    g, u = torch.chunk(x, 2, dim=-1)
    return F.silu(g) * u


def glu_activation(g: torch.Tensor, u: torch.Tensor, hidden_act: str, beta: float = 4.0,
                   linear_beta: float = 25.0) -> torch.Tensor:
    """The FFN activation selected by ``hidden_act`` on separate gate/up halves."""
    if hidden_act == "situ":
        return situ(g, u, beta, linear_beta)
    if hidden_act == "silu":
        return F.silu(g) * u
    raise ValueError(f"unknown hidden_act {hidden_act!r}")
