r"""Per-head Muon for K3's hidden matrices + AdamW for everything else, one optimizer.

Muon (Moonlight form) for a 2-D hidden matrix W with gradient G::

    M <- mu M + G                         (mu = 0.95)
    D  = G + mu M                         (Nesterov)
    O  = NS5(D / ||D||_F)                 Newton-Schulz quintic (3.4445, -4.7750, 2.0315), 5 steps
    W <- W (1 - lr wd) - lr * 0.2 sqrt(max(rows, cols)) * O        (decoupled weight decay)

Per head: attention projections are orthogonalised per head block, not as one matrix: the rows of head h
(``p.k3_heads = (dim, size)``: blocks of ``size`` along ``dim``; set by the KDA/MLA modules) form one
matrix each, and the 0.2 sqrt(max(rows, cols)) scale uses the block's shape. megatron's expert ``linear_fc1``
(``[w1; w3]``) is two blocks, matching the release's separate w1 and w3.

AdamW (betas 0.9/0.95, bias-corrected, decoupled decay; exactly torch.optim.AdamW's update) takes the
embeddings, lm_head, norms, biases, the fp32 KDA vectors (A_log, dt_bias), convolutions and the AttnRes
pseudo-queries. The router's correction bias is a buffer and never reaches an optimizer.

Parallel: a head never spans tensor-parallel ranks, so per-head blocks are local. A non-head matrix that
is split over TP (FFN columns/rows) is all-gathered over TP along its split dimension, orthogonalised
whole, and sliced back, so the update does not depend on TP. Under DP the gradients are already reduced
(DDP), so every replica takes the same step. (megatron-core's distributed optimizer shards flat buffers
across DP and only supports Adam: Muon runs without it.)
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..parallel.collectives import all_gather

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz5(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonalisation UV^T of G (2-D), in fp32 (fp64 stays fp64)."""
    a, b, c = NS_COEFFS
    X = G.to(torch.float64 if G.dtype == torch.float64 else torch.float32)
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.t()
    X = X / (X.norm() + eps)
    for _ in range(steps):
        A = X @ X.t()
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.t() if transposed else X


def muon_direction(D: torch.Tensor, heads=None, ns_steps: int = 5) -> torch.Tensor:
    """Scaled orthogonalised update for one matrix, per head block when ``heads = (dim, size)``."""
    if heads is None:
        return 0.2 * math.sqrt(max(D.shape)) * newton_schulz5(D, ns_steps)
    dim, size = heads
    blocks = D.split(size, dim=dim)
    return torch.cat([0.2 * math.sqrt(max(b.shape)) * newton_schulz5(b, ns_steps) for b in blocks], dim=dim)


def uses_muon(name: str, p: torch.Tensor) -> bool:
    if p.ndim != 2:
        return False
    return not any(s in name for s in ("embed_tokens", "lm_head", "_res_proj"))


def uses_weight_decay(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and "_res_proj" not in name


def _grad(p):
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


class MuonAdamW(torch.optim.Optimizer):
    """``named_params``: (name, parameter) pairs. ``tp_group``/``tp_size`` for TP-split non-head matrices."""

    def __init__(self, named_params, lr: float, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adam_betas=(0.9, 0.95), adam_eps: float = 1e-8,
                 tp_group=None, tp_size: int = 1):
        named_params = [(n, p) for n, p in named_params if p.requires_grad]
        muon = [p for n, p in named_params if uses_muon(n, p)]
        adam = [p for n, p in named_params if not uses_muon(n, p)]
        self.decay = {id(p): uses_weight_decay(n, p) for n, p in named_params}
        self.names = {id(p): n for n, p in named_params}
        groups = [{"params": muon, "kind": "muon"}, {"params": adam, "kind": "adamw"}]
        super().__init__([g for g in groups if g["params"]],
                         dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                              ns_steps=ns_steps, betas=adam_betas, eps=adam_eps))
        self.tp_group, self.tp_size = tp_group, tp_size

    def _master(self, p):
        st = self.state[p]
        if p.dtype == torch.float32 or p.dtype == torch.float64:
            return p.data
        if "master" not in st:
            st["master"] = p.data.float().clone()
        return st["master"]

    def _full(self, D, p):
        """Gather a TP-split non-head matrix along its split dim (no-op otherwise)."""
        if self.tp_size == 1 or not getattr(p, "tensor_model_parallel", False) or getattr(p, "k3_heads", None):
            return D, None
        parts = [torch.empty_like(D) for _ in range(self.tp_size)]
        all_gather(parts, D.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=p.partition_dim), p.partition_dim

    @torch.no_grad()
    def step(self, clip_coeff: float = 1.0):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                g = _grad(p)
                if g is None:
                    g = torch.zeros_like(p, dtype=torch.float32)
                g = g.float() * clip_coeff if g.dtype != torch.float64 else g * clip_coeff
                w = self._master(p)
                st = self.state[p]
                if self.decay[id(p)] and wd:
                    w.mul_(1 - lr * wd)
                if group["kind"] == "muon":
                    buf = st.setdefault("momentum", torch.zeros_like(g))
                    buf.mul_(group["momentum"]).add_(g)
                    D = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                    Dfull, split = self._full(D, p)
                    O = muon_direction(Dfull, getattr(p, "k3_heads", None), group["ns_steps"])
                    if split is not None:
                        r = dist.get_rank(self.tp_group)
                        O = O.narrow(split, r * D.shape[split], D.shape[split])
                    w.add_(O.to(w.dtype), alpha=-lr)
                else:
                    b1, b2 = group["betas"]
                    st["step"] = st.get("step", 0) + 1
                    m = st.setdefault("exp_avg", torch.zeros_like(g))
                    v = st.setdefault("exp_avg_sq", torch.zeros_like(g))
                    m.lerp_(g, 1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    bc1, bc2 = 1 - b1 ** st["step"], 1 - b2 ** st["step"]
                    denom = (v.sqrt() / math.sqrt(bc2)).add_(group["eps"])
                    w.addcdiv_(m, denom, value=-lr / bc1)
                if w is not p.data:
                    p.data.copy_(w)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    return min(1.0, max_norm / (total_norm + 1e-6)) if max_norm > 0 else 1.0
